#include "collectives/gloo/gloo_process_group.h"

#include <fmt/format.h>
#include <gloo/allgather.h>
#include <gloo/allgatherv.h>
#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/common/error.h>
#include <gloo/math.h>
#include <gloo/rendezvous/context.h>

#include <atomic>
#include <cstring>
#include <functional>
#include <limits>
#include <thread>

#include "collectives/collective_progress.h"
#include "collectives/gloo/gloo_device.h"
#include "collectives/gloo/gloo_store_adapter.h"
#include "collectives/gloo/operation_queue.h"
#include "collectives/half_math.h"
#include "core/env.h"
#include "core/error.h"

namespace mtrain {
namespace {

using ReduceFn = void (*)(void*, const void*, const void*, size_t);

template <class T>
ReduceFn gloo_reduce_fn(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum:
    case ReduceOp::Avg: return static_cast<ReduceFn>(&gloo::sum<T>);
    case ReduceOp::Max: return static_cast<ReduceFn>(&gloo::max<T>);
    case ReduceOp::Min: return static_cast<ReduceFn>(&gloo::min<T>);
  }
  return nullptr;
}

// 16-bit floats reduce through collectives/half_math (Note [Half-precision
// reductions]), shared with the MPI backend so both round alike.
ReduceFn reduce_fn(DType dtype, ReduceOp op) {
  switch (dtype) {
    case DType::Float32: return gloo_reduce_fn<float>(op);
    case DType::Int64: return gloo_reduce_fn<int64_t>(op);
    case DType::Float16:
    case DType::BFloat16: return half::reduce_fn(dtype, op);
    default: return nullptr;
  }
}

// Avg = sum, then divide by the group size in the tensor's own precision.
void divide_in_place(const Tensor& t, int divisor) {
  if (half::is_half_dtype(t.dtype())) {
    half::divide_in_place(t, divisor);
    return;
  }
  if (t.dtype() != DType::Float32) {
    throw InternalError(fmt::format("avg reached the division for {}", dtype_name(t.dtype())));
  }
  float* p = t.data<float>();
  for (int64_t i = 0; i < t.numel(); ++i) p[i] /= static_cast<float>(divisor);
}

// Timed-out gloo waits say "Timed out waiting <n>ms for ..." (tcp/pair.cc, unbound_buffer.cc);
// the older per-connection buffers "Read timeout" / "Write timeout" (tcp/buffer.cc).
bool is_gloo_timeout(const std::exception& e) {
  return std::strstr(e.what(), "Timed out") != nullptr || std::strstr(e.what(), "Read timeout") != nullptr ||
         std::strstr(e.what(), "Write timeout") != nullptr ||
         dynamic_cast<const TimeoutError*>(&e) != nullptr;
}

// How much longer than the group's timeout a waiter gives an operation to report its
// own failure (GlooWork::wait).
constexpr Millis kDiagnosisGrace{30'000};

std::string format_duration(Millis t) {
  if (t.count() % 1000 == 0) return fmt::format("{} s", t.count() / 1000);
  return fmt::format("{} ms", t.count());
}

// A Work whose waiter runs the operation itself when it is next in line and nothing is
// running (Note [Running an operation on the waiting thread]).
class GlooWork final : public Work {
 public:
  GlooWork(OpType op, uint64_t seq, std::vector<Tensor> keep_alive,
           std::shared_ptr<OperationQueue> queue, Millis group_timeout)
      : Work(op, seq, std::move(keep_alive)), queue_(std::move(queue)), group_timeout_(group_timeout) {}

  void wait() override {
    queue_->run_if_next(this);
    Work::wait();
  }

  void wait(Millis timeout) override {
    // Once started, the operation returns only when done or at the group's timeout;
    // a caller willing to wait less leaves it to the communication thread.
    if (timeout < group_timeout_) return Work::wait(timeout);
    queue_->run_if_next(this);
    // A caller willing to wait the group's timeout gets the operation's own outcome: the
    // operation may have started just before this call (the one before it ended), and
    // its timeout error, which names the ranks that never arrived, comes a few store
    // round trips after its deadline. A bare "did not complete within" from a
    // deadline of our own would beat it and lose that diagnosis; kDiagnosisGrace only
    // guards against an operation that never reports at all.
    Work::wait(timeout + kDiagnosisGrace);
  }

 private:
  const std::shared_ptr<OperationQueue> queue_;
  const Millis group_timeout_;
};

// Note [Connected on every rank]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// connectFullMesh can return on one rank while a peer is still completing its side of
// their connection. A group that this rank then destroys at once (a short-lived group,
// or a rank that fails right after creating it) closes the socket under that peer, whose
// connect then fails with a closed connection instead of succeeding. So creation ends
// with a barrier: a rank passes it only once every peer has sent its part, which each
// does only after its own connect returned, so no rank leaves the constructor before
// every rank is connected. Its tag has the high bit set, outside the operations' tags
// (sequence numbers masked to 31 bits), so it never pairs with an operation.
constexpr uint32_t kConnectedTag = 0x80000000u;

// Note [Gloo backend]
// ~~~~~~~~~~~~~~~~~~~
// One gloo::rendezvous::Context per group, connected as a full mesh through the store it is given
// (already scoped to the job attempt: see connect_store_from_env) under "gloo/<group name>/<n>",
// n = the number of groups this process created before (every rank creates its groups in the same
// order, so the counters agree). Operations run one at a time in issue order, on the group's
// communication thread or on the thread waiting for them (Note [Running an operation on the
// waiting thread] in operation_queue.cpp), through the library's algorithms: gloo::allreduce (ring
// / bcube chosen by gloo), gloo::broadcast, gloo::allgather(v), gloo::barrier and
// gloo::ReduceScatterHalvingDoubling (in place, on a scratch copy of the input). After an
// operation fails the context is in an unknown state (a half-finished exchange), so every later
// operation of the group fails at once with the first error.
class GlooProcessGroup final : public ProcessGroup {
 public:
  GlooProcessGroup(std::shared_ptr<Store> store, int rank, int size, ProcessGroupOptions options,
                   const std::string& master_host, uint16_t master_port)
      : ProcessGroup(rank, size, std::move(options)), store_(std::move(store)) {
    // The store is already scoped to this job attempt (connect_store_from_env), so
    // only the group needs naming here.
    // The k-th group of a name is the same group on every rank: each rank counts its own
    // on the store, so nothing else the process created shifts the number (and ranks
    // that share a process, as in tests, agree too).
    const int64_t created = store_->add(fmt::format("gloo/{}/created/{}", options_.name, rank_), 1);
    prefix_ = fmt::format("gloo/{}/{}", options_.name, created - 1);
    device_ = create_tcp_device(local_address_reaching(master_host, master_port));
    GlooStoreAdapter rendezvous(*store_, prefix_ + "/rdzv", options_.timeout);
    context_ = std::make_shared<gloo::rendezvous::Context>(rank_, size_);
    context_->setTimeout(options_.timeout);
    try {
      context_->connectFullMesh(rendezvous, device_);
      // Note [Connected on every rank]
      gloo::BarrierOptions connected(context_);
      connected.setTag(kConnectedTag);
      connected.setTimeout(options_.timeout);
      gloo::barrier(connected);
    } catch (const TimeoutError& e) {
      throw TimeoutError(fmt::format("gloo group '{}': rank {} of {} could not connect to its "
                                     "peers within {}: {}",
                                     options_.name, rank_, size_,
                                     format_duration(options_.timeout), e.what()));
    } catch (const std::exception& e) {
      throw CommError(fmt::format("gloo group '{}': rank {} of {} could not connect to its peers: {}",
                                  options_.name, rank_, size_, e.what()));
    }
    progress_ = std::make_unique<CollectiveProgress>(*store_, prefix_, rank_, size_);
    thread_ = std::thread([queue = queue_] { queue->run_until_closed(); });
  }

  ~GlooProcessGroup() override {
    queue_->close();
    thread_.join();  // runs every queued operation first: the peers expect them
  }

  std::string backend_name() const override { return "gloo"; }

  WorkPtr allreduce(Tensor& tensor, ReduceOp op) override {
    check_tensor(tensor, "allreduce", "tensor");
    const ReduceFn fn = reduce_fn(tensor.dtype(), op);
    check_avg_dtype(OpType::AllReduce, op, tensor.dtype());
    Tensor t = tensor;
    return enqueue(OpType::AllReduce, {t}, t.numel(), [this, t, fn, op](uint32_t tag) {
      allreduce_in_place(t, fn, tag);
      if (op == ReduceOp::Avg) divide_in_place(t, size_);
    });
  }

  WorkPtr broadcast(Tensor& tensor, int root) override {
    check_tensor(tensor, "broadcast", "tensor");
    check_root(root);
    Tensor t = tensor;
    return enqueue(OpType::Broadcast, {t}, t.numel(), [this, t, root](uint32_t tag) {
      gloo::BroadcastOptions opts(context_);
      opts.setOutput(static_cast<uint8_t*>(t.raw_data()), t.nbytes());
      opts.setRoot(root);
      opts.setTag(tag);
      opts.setTimeout(options_.timeout);
      gloo::broadcast(opts);
    });
  }

  WorkPtr allgather(const Tensor& input, Tensor& output) override {
    check_tensor(input, "allgather", "input");
    check_tensor(output, "allgather", "output");
    check_same_dtype(OpType::AllGather, input, output);
    check_allgather_sizes(input, output);
    Tensor in = input, out = output;
    return enqueue(OpType::AllGather, {in, out}, out.numel(), [this, in, out](uint32_t tag) {
      gloo::AllgatherOptions opts(context_);
      opts.setInput(static_cast<uint8_t*>(in.raw_data()), in.nbytes());
      opts.setOutput(static_cast<uint8_t*>(out.raw_data()), out.nbytes());
      opts.setTag(tag);
      opts.setTimeout(options_.timeout);
      gloo::allgather(opts);
    });
  }

  WorkPtr allgatherv(const Tensor& input, Tensor& output,
                     const std::vector<int64_t>& counts) override {
    check_tensor(input, "allgatherv", "input");
    check_tensor(output, "allgatherv", "output");
    check_same_dtype(OpType::AllGatherV, input, output);
    const int64_t total = check_allgatherv_sizes(input, output, counts);
    std::vector<size_t> byte_counts;
    for (const int64_t c : counts) byte_counts.push_back(static_cast<size_t>(c) * dtype_size(input.dtype()));
    Tensor in = input, out = output;
    return enqueue(OpType::AllGatherV, {in, out}, total,
                   [this, in, out, byte_counts](uint32_t tag) {
                     gloo::AllgathervOptions opts(context_);
                     opts.setInput(static_cast<uint8_t*>(in.raw_data()), in.nbytes());
                     opts.setOutput(static_cast<uint8_t*>(out.raw_data()), byte_counts);
                     opts.setTag(tag);
                     opts.setTimeout(options_.timeout);
                     gloo::allgatherv(opts);
                   });
  }

  WorkPtr reduce_scatter(const Tensor& input, Tensor& output, ReduceOp op) override {
    check_tensor(input, "reduce_scatter", "input");
    check_tensor(output, "reduce_scatter", "output");
    check_same_dtype(OpType::ReduceScatter, input, output);
    check_reduce_scatter_sizes(input, output);
    check_avg_dtype(OpType::ReduceScatter, op, input.dtype());
    const ReduceFn fn = reduce_fn(input.dtype(), op);
    Tensor in = input, out = output;
    return enqueue(OpType::ReduceScatter, {in, out}, in.numel(), [this, in, out, fn, op](uint32_t tag) {
      // Note [Reduce-scatter through allreduce]
      // ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
      // Gloo's reduce-scatter (ReduceScatterHalvingDoubling) predates its options API: it
      // takes no tag and no timeout of ours, reports a timeout as "Read timeout" rather
      // than a TimeoutError naming the stragglers, and with a group size that is not a
      // power of two it returns before its sends to the larger block are known to be
      // done, while the caller frees the buffer they read. So the group all-reduces a
      // copy with the options every other collective uses, and keeps this rank's chunk:
      // twice the traffic of a true reduce-scatter, for an operation training never
      // runs (it is offered for completeness and benchmarked by mtrain-bench).
      Tensor scratch = in.clone();
      allreduce_in_place(scratch, fn, tag);
      std::memcpy(out.raw_data(), static_cast<const char*>(scratch.raw_data()) + static_cast<size_t>(rank_) * out.nbytes(),
                  out.nbytes());
      if (op == ReduceOp::Avg) divide_in_place(out, size_);
    });
  }

  WorkPtr barrier() override {
    return enqueue(OpType::Barrier, {}, 1, [this](uint32_t tag) {
      gloo::BarrierOptions opts(context_);
      opts.setTag(tag);
      opts.setTimeout(options_.timeout);
      gloo::barrier(opts);
    });
  }

 private:
  // Registers the tensor as the allreduce's input and output with its element size
  // (the reduce function is called with element counts).
  template <class T>
  static void set_in_place(gloo::AllreduceOptions& opts, const Tensor& t) {
    T* p = static_cast<T*>(t.raw_data());
    opts.setInput(p, static_cast<size_t>(t.numel()));
    opts.setOutput(p, static_cast<size_t>(t.numel()));
  }

  // gloo's allreduce of `t` into itself, as operation `tag` with the group's timeout.
  void allreduce_in_place(const Tensor& t, const ReduceFn& fn, uint32_t tag) {
    gloo::AllreduceOptions opts(context_);
    switch (dtype_size(t.dtype())) {
      case 8: set_in_place<int64_t>(opts, t); break;
      case 4: set_in_place<float>(opts, t); break;
      default: set_in_place<uint16_t>(opts, t); break;
    }
    opts.setReduceFunction(fn);
    opts.setTag(tag);
    opts.setTimeout(options_.timeout);
    gloo::allreduce(opts);
  }

  void check_tensor(const Tensor& t, const char* op, const char* what) const {
    if (!t.defined()) {
      throw InvalidArgument(fmt::format("{} in group '{}': the {} tensor is undefined", op,
                                        options_.name, what));
    }
    if (!t.device().is_cpu()) {
      throw InvalidArgument(fmt::format("{} in group '{}': gloo needs CPU tensors, the {} is on {}",
                                        op, options_.name, what, t.device().str()));
    }
    const DType d = t.dtype();
    if (d != DType::Float32 && d != DType::Int64 && !half::is_half_dtype(d)) {
      throw InvalidArgument(fmt::format("{} in group '{}': expected a float32, int64, float16 or "
                                        "bfloat16 {}, found {}",
                                        op, options_.name, what, dtype_name(d)));
    }
  }

  WorkPtr enqueue(OpType op, std::vector<Tensor> keep_alive, int64_t numel,
                  std::function<void(uint32_t)> run) {
    // One lock over numbering and queueing, so that issue order is sequence order even
    // when several threads issue.
    std::lock_guard<std::mutex> lock(issue_mu_);
    auto work = std::make_shared<GlooWork>(op, next_seq_, std::move(keep_alive), queue_,
                                           options_.timeout);
    const bool queued = queue_->push(
        {work.get(), [this, work, numel, run = std::move(run)] { run_task(*work, numel, run); }});
    MTRAIN_CHECK(queued, "{} issued on group '{}' while it is being destroyed", op_type_name(op),
                 options_.name);
    ++next_seq_;
    return work;
  }

  // Runs on the communication thread or on a waiting caller, one operation at a time
  // (Note [Running an operation on the waiting thread]).
  void run_task(Work& work, int64_t numel, const std::function<void(uint32_t)>& run) {
    const uint64_t seq = work.seq();
    const char* name = op_type_name(work.op());
    if (first_error_) {
      // Not marked started: this rank never reached it, which is what its peers' timeout
      // diagnosis must say.
      work.mark_failed(first_error_);
      return;
    }
    progress_->started(seq);
    // Empty tensors exchange nothing; the sequence number was still taken, so every
    // rank stays in step.
    if (numel == 0) {
      work.mark_completed();
      return;
    }
    try {
      // Tags only need to differ between operations that could be in flight together.
      run(static_cast<uint32_t>(seq & 0x7fffffffu));
      work.mark_completed();
      return;
    } catch (const std::exception& e) {
      std::exception_ptr error;
      if (is_gloo_timeout(e)) {
        error = std::make_exception_ptr(TimeoutError(fmt::format(
            "{} #{} in group '{}' timed out after {}: {}", name, seq, options_.name,
            format_duration(options_.timeout), progress_->describe_stragglers(seq))));
      } else if (dynamic_cast<const Error*>(&e) != nullptr) {
        error = std::current_exception();
      } else {
        error = std::make_exception_ptr(CommError(fmt::format(
            "{} #{} in group '{}' failed on rank {}: {}", name, seq, options_.name, rank_, e.what())));
      }
      first_error_ = error;
      work.mark_failed(error);
    }
  }

  std::shared_ptr<Store> store_;
  std::string prefix_;
  std::shared_ptr<gloo::transport::Device> device_;
  std::shared_ptr<gloo::rendezvous::Context> context_;
  std::unique_ptr<CollectiveProgress> progress_;
  std::exception_ptr first_error_;  // only touched by the thread running an operation

  std::mutex issue_mu_;
  uint64_t next_seq_ = 0;  // guarded by issue_mu_
  std::shared_ptr<OperationQueue> queue_ = std::make_shared<OperationQueue>();
  std::thread thread_;
};

}  // namespace

std::unique_ptr<ProcessGroup> create_gloo_process_group(std::shared_ptr<Store> store, int rank,
                                                        int size, ProcessGroupOptions options) {
  // Only used to pick the local interface that routes to the rendezvous; nothing is sent.
  const std::string host = options.rendezvous_host.empty() ? "127.0.0.1" : options.rendezvous_host;
  const uint16_t port = options.rendezvous_port == 0 ? 29500 : options.rendezvous_port;
  return std::make_unique<GlooProcessGroup>(std::move(store), rank, size, std::move(options), host,
                                            port);
}

}  // namespace mtrain

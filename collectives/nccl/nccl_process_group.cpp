#include "collectives/nccl/nccl_process_group.h"

#include <fmt/format.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <deque>
#include <functional>
#include <optional>
#include <thread>

#include "collectives/collective_progress.h"
#include "collectives/nccl/device_identity.h"
#include "collectives/nccl/nccl_check.h"
#include "core/error.h"
#include "tensor/cuda/cuda_check.h"
#include "tensor/cuda/stream.h"
#include "tensor/cuda_devices.h"

namespace mtrain {
namespace {

using Clock = std::chrono::steady_clock;

// How long the watchdog sleeps between polls, with and without operations in flight.
constexpr Millis kBusyPollPeriod{2};
constexpr Millis kIdlePollPeriod{100};
// Waiting callers poll with a backoff from 1 us up to this. A sleeping thread wakes some
// 50 us late anyway (Linux's timer slack), and every microsecond it sleeps past the
// operation's end is one the GPU may sit idle (SyncBatchNorm waits 3 times a layer), so
// the cap is that slack: about 20 event queries a millisecond, each a microsecond.
constexpr std::chrono::microseconds kMaxWaitBackoff{50};

std::string format_duration(Millis t) {
  if (t.count() % 1000 == 0) return fmt::format("{} s", t.count() / 1000);
  return fmt::format("{} ms", t.count());
}

ncclDataType_t nccl_dtype(DType d) {
  switch (d) {
    case DType::Float32: return ncclFloat32;
    case DType::Int64: return ncclInt64;
    case DType::Float16: return ncclFloat16;
    case DType::BFloat16: return ncclBfloat16;
    default: throw InternalError(fmt::format("no NCCL type for {}", dtype_name(d)));
  }
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return ncclSum;
    case ReduceOp::Avg: return ncclAvg;
    case ReduceOp::Max: return ncclMax;
    case ReduceOp::Min: return ncclMin;
  }
  throw InternalError("unknown ReduceOp");
}

// The communicator's state after a non-blocking call: ncclSuccess, an error, or
// ncclInProgress if it is still in progress at `deadline`.
ncclResult_t settle(ncclComm_t comm, ncclResult_t first, Clock::time_point deadline) {
  ncclResult_t state = first;
  auto backoff = std::chrono::microseconds(1);
  while (state == ncclInProgress) {
    if (Clock::now() >= deadline) return ncclInProgress;
    std::this_thread::sleep_for(backoff);
    backoff = std::min(backoff * 2, std::chrono::microseconds(1000));
    const ncclResult_t r = ncclCommGetAsyncError(comm, &state);
    if (r != ncclSuccess) return r;
  }
  return state;
}

std::atomic<uint64_t> g_groups_created{0};

// Note [NCCL backend]
// ~~~~~~~~~~~~~~~~~~~
// Bootstrap: every rank publishes which GPU it drives and the group stops with a clear error when
// two ranks share one (device_identity.h); rank 0 then creates the ncclUniqueId and publishes it
// under "nccl/<group name>/<n>/unique_id" (n counts the groups this process created, equal on
// every rank since all create their groups in the same order), and every rank creates a
// non-blocking communicator with ncclCommInitRankConfig, polled with ncclCommGetAsyncError up to
// the group timeout. Non-blocking, because a blocking NCCL call that waits for a peer that never
// comes cannot be interrupted: here every NCCL call returns at once and the waiting is ours, with
// a deadline.
//
// Operations (Note [Asynchronous collectives]): an event recorded on the caller's current stream
// makes the group stream wait for it; the NCCL call is queued on the group stream (the first one
// may block its caller while NCCL connects the peers, up to the timeout); a completion event is
// recorded after it. The tensors stay referenced until that event completes. allgatherv is a
// group of broadcasts (ncclGroupStart/End), one per rank; barrier is a one-element all-reduce; avg
// is ncclAvg.
//
// Completion and timeouts: a watchdog thread polls the completion events in issue order,
// ncclCommGetAsyncError and the deadline of the oldest operation (issue time + timeout). Past it,
// or on an asynchronous NCCL error, it aborts the communicator (ncclCommAbort), which stops its
// kernels, and fails every pending operation: a TimeoutError names the operation, its sequence
// number, the group and, from the store's progress keys (collectives/collective_progress.h), the
// ranks that never reached it. The group is unusable afterwards: every later operation fails with
// the same error. Work::wait() polls the events itself (with a short backoff) instead of waiting
// for the watchdog, so a small collective is not delayed by the watchdog's period.
class NcclWork;

// Everything an operation's lifetime touches: the communicator, the group stream and the
// operations in flight. Shared by the group, its Works and the watchdog, so a Work may
// outlive its group. Every member below mu_ is guarded by it.
class NcclState {
 public:
  NcclState(std::shared_ptr<Store> store, int rank, int size, int device,
            const ProcessGroupOptions& options);
  ~NcclState();

  using Launch = std::function<ncclResult_t(ncclComm_t, cudaStream_t)>;
  std::shared_ptr<Work> issue(OpType op, std::vector<Tensor> tensors, int64_t numel,
                              const Launch& launch, const std::shared_ptr<NcclState>& self);
  void poll();
  void block_current_stream(const Work& work);
  // Lets the queued operations finish (or time out), then releases the communicator.
  void shutdown();

 private:
  struct PendingOp {
    std::shared_ptr<Work> work;
    std::vector<Tensor> tensors;
    std::unique_ptr<cuda::Event> done;
    Clock::time_point deadline;
  };

  void watchdog_loop();
  void poll_locked();
  void fail_locked(std::exception_ptr error);
  std::exception_ptr timeout_error(OpType op, uint64_t seq);
  std::unique_ptr<cuda::Event> take_event();

  std::shared_ptr<Store> store_;  // bootstrap, then the progress keys
  const int rank_;
  const int size_;
  const int device_;
  const std::string name_;
  const Millis timeout_;
  std::string prefix_;
  std::unique_ptr<cuda::OwnedStream> stream_;
  std::unique_ptr<cuda::Event> ready_;  // the caller's stream, before each operation
  ncclComm_t comm_ = nullptr;
  std::unique_ptr<CollectiveProgress> progress_;

  std::mutex mu_;
  std::condition_variable cv_;
  uint64_t next_seq_ = 0;
  std::deque<PendingOp> pending_;
  std::vector<std::unique_ptr<cuda::Event>> free_events_;
  std::exception_ptr failure_;
  // After an abort: what the aborted operations used, never freed or reused, since
  // nothing tells when their kernels have really stopped (the process exits soon).
  std::vector<PendingOp> abandoned_;
  bool stop_ = false;
  std::thread watchdog_;
};

class NcclWork final : public Work {
 public:
  NcclWork(OpType op, uint64_t seq, std::shared_ptr<NcclState> state)
      : Work(op, seq), state_(std::move(state)) {}

  bool is_completed() const override {
    state_->poll();
    return Work::is_completed();
  }
  void wait() override { wait_until(std::nullopt, Millis(0)); }
  void wait(Millis timeout) override { wait_until(Clock::now() + timeout, timeout); }
  void wait_on_current_stream() override { state_->block_current_stream(*this); }

 private:
  void wait_until(std::optional<Clock::time_point> deadline, Millis timeout) {
    auto backoff = std::chrono::microseconds(1);
    while (!Work::is_completed()) {
      state_->poll();
      if (Work::is_completed()) break;
      if (deadline && Clock::now() >= *deadline) {
        throw TimeoutError(fmt::format("{} #{} did not complete within {} ms of waiting",
                                       op_type_name(op()), seq(), timeout.count()));
      }
      std::this_thread::sleep_for(backoff);
      backoff = std::min(backoff * 2, kMaxWaitBackoff);
    }
    Work::wait();  // rethrows the operation's error
  }

  std::shared_ptr<NcclState> state_;
};

NcclState::NcclState(std::shared_ptr<Store> store_ptr, int rank, int size, int device,
                     const ProcessGroupOptions& options)
    : store_(std::move(store_ptr)),
      rank_(rank), size_(size), device_(device), name_(options.name), timeout_(options.timeout) {
  prefix_ = fmt::format("nccl/{}/{}", name_, g_groups_created.fetch_add(1));
  Store& store = *store_;
  cuda::DeviceGuard guard(device_);
  stream_ = std::make_unique<cuda::OwnedStream>(device_);
  ready_ = std::make_unique<cuda::Event>(device_);

  char bus[64] = {};
  MTRAIN_CUDA_CHECK(cudaDeviceGetPCIBusId(bus, sizeof(bus), device_));
  check_one_device_per_rank(store, prefix_, name_, rank_, size_,
                            DeviceIdentity{local_host_name(), bus, fmt::format("cuda:{}", device_)},
                            timeout_);

  ncclUniqueId id;
  const std::string id_key = prefix_ + "/unique_id";
  if (rank_ == 0) {
    MTRAIN_NCCL_CHECK(ncclGetUniqueId(&id), nullptr);
    const auto* bytes = reinterpret_cast<const uint8_t*>(&id);
    store.set(id_key, Bytes(bytes, bytes + sizeof(id)));
  } else {
    store.wait({id_key}, timeout_);
    const Bytes value = store.get(id_key);
    if (value.size() != sizeof(id)) {
      throw CommError(fmt::format("nccl group '{}': the unique id from rank 0 has {} bytes, "
                                  "expected {} (a different NCCL version on rank 0?)",
                                  name_, value.size(), sizeof(id)));
    }
    std::memcpy(&id, value.data(), sizeof(id));
  }

  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  const ncclResult_t started = ncclCommInitRankConfig(&comm_, size_, id, rank_, &config);
  if (started != ncclSuccess && started != ncclInProgress) {
    throw CommError(fmt::format("nccl group '{}': rank {} of {} could not create its communicator "
                                "on cuda:{}: {} ({})",
                                name_, rank_, size_, device_, ncclGetErrorString(started),
                                ncclGetLastError(comm_)));
  }
  const ncclResult_t state = settle(comm_, started, Clock::now() + timeout_);
  if (state != ncclSuccess) {
    const std::string detail = ncclGetLastError(comm_);
    ncclCommAbort(comm_);
    comm_ = nullptr;
    if (state == ncclInProgress) {
      throw TimeoutError(fmt::format("nccl group '{}': rank {} of {} could not create its "
                                     "communicator within {} (do all {} ranks reach it?)",
                                     name_, rank_, size_, format_duration(timeout_), size_));
    }
    throw CommError(fmt::format("nccl group '{}': rank {} of {} could not create its communicator "
                                "on cuda:{}: {} ({})",
                                name_, rank_, size_, device_, ncclGetErrorString(state), detail));
  }
  progress_ = std::make_unique<CollectiveProgress>(store, prefix_, rank_, size_);
  watchdog_ = std::thread([this] { watchdog_loop(); });
}

NcclState::~NcclState() {
  // shutdown() already ran in the group's destructor; this is a safety net.
  try {
    if (watchdog_.joinable()) shutdown();
  } catch (const std::exception&) {
    // A destructor cannot report; the failure already failed the pending operations.
  }
}

std::unique_ptr<cuda::Event> NcclState::take_event() {
  if (free_events_.empty()) return std::make_unique<cuda::Event>(device_);
  auto e = std::move(free_events_.back());
  free_events_.pop_back();
  return e;
}

std::shared_ptr<Work> NcclState::issue(OpType op, std::vector<Tensor> tensors, int64_t numel,
                                       const Launch& launch,
                                       const std::shared_ptr<NcclState>& self) {
  std::lock_guard<std::mutex> lock(mu_);
  MTRAIN_CHECK(!stop_, "{} issued on nccl group '{}' while it is being destroyed", op_type_name(op),
               name_);
  const uint64_t seq = next_seq_++;
  auto work = std::make_shared<NcclWork>(op, seq, self);
  progress_->started(seq);
  if (failure_) {
    work->mark_failed(failure_);
    return work;
  }
  try {
    cuda::DeviceGuard guard(device_);
    const cuda::Stream stream = stream_->stream();
    ready_->record(cuda::current_stream(device_));
    ready_->block(stream);
    // Empty tensors exchange nothing (every rank agrees, since sizes must); the
    // sequence number was still taken, so every rank stays in step.
    if (numel > 0) {
      const ncclResult_t r = settle(comm_, launch(comm_, stream.handle()), Clock::now() + timeout_);
      if (r == ncclInProgress) {
        fail_locked(timeout_error(op, seq));
      } else if (r != ncclSuccess) {
        fail_locked(std::make_exception_ptr(CommError(fmt::format(
            "{} #{} in group '{}' failed on rank {}: {} ({})", op_type_name(op), seq, name_,
            rank_, ncclGetErrorString(r), ncclGetLastError(comm_)))));
      }
      if (failure_) {
        work->mark_failed(failure_);
        return work;
      }
    }
    PendingOp pending{work, std::move(tensors), take_event(), Clock::now() + timeout_};
    pending.done->record(stream);
    pending_.push_back(std::move(pending));
  } catch (const Error&) {
    // A CUDA failure (event, stream): the device is in trouble, the group cannot go on.
    fail_locked(std::current_exception());
    if (!work->Work::is_completed()) work->mark_failed(failure_);
  }
  cv_.notify_all();
  return work;
}

void NcclState::poll() {
  std::lock_guard<std::mutex> lock(mu_);
  poll_locked();
}

void NcclState::poll_locked() {
  if (failure_ || comm_ == nullptr) return;
  try {
    while (!pending_.empty() && pending_.front().done->completed()) {
      PendingOp op = std::move(pending_.front());
      pending_.pop_front();
      op.work->mark_completed();
      free_events_.push_back(std::move(op.done));
    }
    ncclResult_t async = ncclSuccess;
    const ncclResult_t r = ncclCommGetAsyncError(comm_, &async);
    if (r != ncclSuccess || (async != ncclSuccess && async != ncclInProgress)) {
      const ncclResult_t bad = r != ncclSuccess ? r : async;
      fail_locked(std::make_exception_ptr(CommError(fmt::format(
          "nccl group '{}' on rank {}: NCCL reported an asynchronous error: {} ({}); the "
          "communicator was aborted",
          name_, rank_, ncclGetErrorString(bad), ncclGetLastError(comm_)))));
      return;
    }
    if (!pending_.empty() && Clock::now() >= pending_.front().deadline) {
      const PendingOp& oldest = pending_.front();
      fail_locked(timeout_error(oldest.work->op(), oldest.work->seq()));
    }
  } catch (const Error&) {
    fail_locked(std::current_exception());
  }
}

std::exception_ptr NcclState::timeout_error(OpType op, uint64_t seq) {
  return std::make_exception_ptr(TimeoutError(fmt::format(
      "{} #{} in group '{}' timed out after {}: {}; the NCCL communicator was aborted",
      op_type_name(op), seq, name_, format_duration(timeout_),
      progress_->describe_stragglers(seq))));
}

void NcclState::fail_locked(std::exception_ptr error) {
  if (failure_) return;
  failure_ = error;
  if (comm_ != nullptr) {
    ncclCommAbort(comm_);  // blocking; stops the communicator's kernels
    comm_ = nullptr;
  }
  for (PendingOp& op : pending_) {
    op.work->mark_failed(error);
    abandoned_.push_back(std::move(op));
  }
  pending_.clear();
}

void NcclState::block_current_stream(const Work& work) {
  std::lock_guard<std::mutex> lock(mu_);
  for (const PendingOp& op : pending_) {
    if (op.work.get() == &work) {
      cuda::DeviceGuard guard(device_);
      op.done->block(cuda::current_stream(device_));
      return;
    }
  }
  // Not pending: completed, or failed (then the error is rethrown here).
  if (const auto error = work.error()) std::rethrow_exception(error);
}

void NcclState::watchdog_loop() {
  // Its event queries and the frees of finished operations' tensors must not open a
  // context on GPU 0 (Note [Helper threads and the process's GPU]).
  // An error here resurfaces, with its context, at the first checked call.
  if (cudaSetDevice(device_) != cudaSuccess) cudaGetLastError();
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    cv_.wait_for(lock, pending_.empty() ? kIdlePollPeriod : kBusyPollPeriod);
    if (stop_) break;
    poll_locked();
  }
}

void NcclState::shutdown() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (watchdog_.joinable()) watchdog_.join();
  std::unique_lock<std::mutex> lock(mu_);
  // The peers expect the queued operations; poll_locked enforces their deadlines.
  while (!pending_.empty() && !failure_) {
    poll_locked();
    if (pending_.empty() || failure_) break;
    lock.unlock();
    std::this_thread::sleep_for(std::chrono::microseconds(100));
    lock.lock();
  }
  if (comm_ == nullptr) return;  // aborted: the error already names the stragglers
  progress_.reset();              // no operation can start any more
  cuda::DeviceGuard guard(device_);
  // Finalize flushes the communicator's work and is polled like every call; past the
  // timeout (a peer gone) abort instead of destroying.
  const ncclResult_t state = settle(comm_, ncclCommFinalize(comm_), Clock::now() + timeout_);
  if (state == ncclSuccess) {
    ncclCommDestroy(comm_);
  } else {
    ncclCommAbort(comm_);
  }
  comm_ = nullptr;
}

class NcclProcessGroup final : public ProcessGroup {
 public:
  NcclProcessGroup(std::shared_ptr<Store> store, int rank, int size, Device device,
                   ProcessGroupOptions options)
      : ProcessGroup(rank, size, std::move(options)), device_(device) {
    state_ = std::make_shared<NcclState>(std::move(store), rank_, size_, device_.index, options_);
    // The barrier's one element, allocated on the caller's current stream before any
    // barrier can wait for that stream.
    barrier_buffer_ = Tensor::zeros({1}, DType::Float32, device_);
  }

  ~NcclProcessGroup() override {
    try {
      state_->shutdown();
    } catch (const std::exception&) {
      // Only a CUDA failure while releasing the communicator gets here; a destructor
      // cannot report it, and the process is going down with a broken device anyway.
    }
  }

  std::string backend_name() const override { return "nccl"; }

  WorkPtr allreduce(Tensor& tensor, ReduceOp op) override {
    check_tensor(tensor, "allreduce", "tensor");
    check_avg_dtype(OpType::AllReduce, op, tensor.dtype());
    Tensor t = tensor;
    return state_->issue(OpType::AllReduce, {t}, t.numel(),
                         [&](ncclComm_t comm, cudaStream_t stream) {
                           return ncclAllReduce(t.raw_data(), t.raw_data(),
                                                static_cast<size_t>(t.numel()),
                                                nccl_dtype(t.dtype()), nccl_op(op), comm, stream);
                         },
                         state_);
  }

  WorkPtr broadcast(Tensor& tensor, int root) override {
    check_tensor(tensor, "broadcast", "tensor");
    check_root(root);
    Tensor t = tensor;
    return state_->issue(OpType::Broadcast, {t}, t.numel(),
                         [&](ncclComm_t comm, cudaStream_t stream) {
                           return ncclBroadcast(t.raw_data(), t.raw_data(),
                                                static_cast<size_t>(t.numel()),
                                                nccl_dtype(t.dtype()), root, comm, stream);
                         },
                         state_);
  }

  WorkPtr allgather(const Tensor& input, Tensor& output) override {
    check_tensor(input, "allgather", "input");
    check_tensor(output, "allgather", "output");
    check_same_dtype(OpType::AllGather, input, output);
    check_allgather_sizes(input, output);
    Tensor in = input, out = output;
    return state_->issue(OpType::AllGather, {in, out}, in.numel(),
                         [&](ncclComm_t comm, cudaStream_t stream) {
                           return ncclAllGather(in.raw_data(), out.raw_data(),
                                                static_cast<size_t>(in.numel()),
                                                nccl_dtype(in.dtype()), comm, stream);
                         },
                         state_);
  }

  WorkPtr allgatherv(const Tensor& input, Tensor& output,
                     const std::vector<int64_t>& counts) override {
    check_tensor(input, "allgatherv", "input");
    check_tensor(output, "allgatherv", "output");
    check_same_dtype(OpType::AllGatherV, input, output);
    const int64_t total = check_allgatherv_sizes(input, output, counts);
    Tensor in = input, out = output;
    // One broadcast per rank into its slice of the output, fused into one NCCL group so
    // that they progress together (a rank's broadcasts in sequence would serialise).
    return state_->issue(
        OpType::AllGatherV, {in, out}, total,
        [&](ncclComm_t comm, cudaStream_t stream) {
          const size_t elem = dtype_size(in.dtype());
          auto* base = static_cast<char*>(out.raw_data());
          ncclResult_t first = ncclGroupStart();
          if (first != ncclSuccess) return first;
          size_t offset = 0;
          for (int r = 0; r < size_; ++r) {
            const auto n = static_cast<size_t>(counts[r]);
            if (n > 0) {
              const void* send = r == rank_ ? in.raw_data() : base + offset * elem;
              const ncclResult_t res = ncclBroadcast(send, base + offset * elem, n,
                                                     nccl_dtype(in.dtype()), r, comm, stream);
              if (first == ncclSuccess) first = res;
            }
            offset += n;
          }
          const ncclResult_t end = ncclGroupEnd();
          return first != ncclSuccess ? first : end;
        },
        state_);
  }

  WorkPtr reduce_scatter(const Tensor& input, Tensor& output, ReduceOp op) override {
    check_tensor(input, "reduce_scatter", "input");
    check_tensor(output, "reduce_scatter", "output");
    check_same_dtype(OpType::ReduceScatter, input, output);
    check_avg_dtype(OpType::ReduceScatter, op, input.dtype());
    check_reduce_scatter_sizes(input, output);
    Tensor in = input, out = output;
    return state_->issue(OpType::ReduceScatter, {in, out}, in.numel(),
                         [&](ncclComm_t comm, cudaStream_t stream) {
                           return ncclReduceScatter(in.raw_data(), out.raw_data(),
                                                    static_cast<size_t>(out.numel()),
                                                    nccl_dtype(in.dtype()), nccl_op(op), comm,
                                                    stream);
                         },
                         state_);
  }

  WorkPtr barrier() override {
    Tensor t = barrier_buffer_;
    return state_->issue(OpType::Barrier, {t}, 1,
                         [&](ncclComm_t comm, cudaStream_t stream) {
                           return ncclAllReduce(t.raw_data(), t.raw_data(), 1, ncclFloat32, ncclSum,
                                                comm, stream);
                         },
                         state_);
  }

 private:
  void check_tensor(const Tensor& t, const char* op, const char* what) const {
    if (!t.defined()) {
      throw InvalidArgument(fmt::format("{} in group '{}': the {} tensor is undefined", op,
                                        options_.name, what));
    }
    if (t.device() != device_) {
      throw InvalidArgument(fmt::format("{} in group '{}': nccl works on this rank's GPU {}, the {} "
                                        "is on {}",
                                        op, options_.name, device_.str(), what, t.device().str()));
    }
    const DType d = t.dtype();
    if (d != DType::Float32 && d != DType::Int64 && d != DType::Float16 && d != DType::BFloat16) {
      throw InvalidArgument(fmt::format("{} in group '{}': expected a float32, int64, float16 or "
                                        "bfloat16 {}, found {}",
                                        op, options_.name, what, dtype_name(d)));
    }
  }


  const Device device_;
  std::shared_ptr<NcclState> state_;
  Tensor barrier_buffer_;
};

}  // namespace

std::unique_ptr<ProcessGroup> create_nccl_process_group(std::shared_ptr<Store> store, int rank,
                                                        int size, Device device,
                                                        ProcessGroupOptions options) {
  const CudaInfo& info = cuda_info();
  if (!device.is_cuda() || device.index < 0 || device.index >= info.device_count) {
    throw InvalidArgument(fmt::format("nccl group '{}': rank {} asked for device {}, but {}",
                                      options.name, rank, device.str(), cuda_summary()));
  }
  return std::make_unique<NcclProcessGroup>(std::move(store), rank, size, device,
                                            std::move(options));
}

}  // namespace mtrain

// HostStagingProcessGroup: GPU tensors through a CPU-backend group (Note [Host staging]).
#include "collectives/host_staging.h"

#include <fmt/format.h>

#include <condition_variable>
#include <deque>
#include <thread>

#include "core/error.h"
#include "tensor/cuda_devices.h"

#ifdef MTRAIN_HAVE_CUDA
#include "tensor/cuda/stream.h"
#endif

// Note [Host staging]
// ~~~~~~~~~~~~~~~~~~~
// HostStagingProcessGroup wraps a CPU-backend group. CPU tensors go straight to the wrapped group:
// the call returns the wrapped group's own Work. A GPU tensor (it must be on the group's device)
// is staged:
//   1. at the call, its values are copied into a pinned host tensor with Tensor::copy_, queued on
//      the caller's current stream (Note [Current stream]); the call returns once the host copy
//      holds them, so the input is read after every kernel the caller queued before the call, and
//      the caller may overwrite it as soon as the call returns. An event recorded on the caller's
//      current stream marks that point too;
//   2. the wrapped group's operation is issued on the host tensors, under a lock, so the wrapped
//      group's issue order (its sequence numbers, which this group's Works carry) is the order of
//      the calls;
//   3. the group's copy-back thread takes the operations in that order, waits for each wrapped
//      operation, and copies the host result into the device tensor on the group's own CUDA
//      stream, after the event of step 1 (the caller's earlier kernels may still use that memory:
//      the caching allocator reuses blocks in stream order), then waits for that copy. Only then
//      is the Work completed.
// So Note [Asynchronous collectives] holds: the call returns at once (after the copy to the host),
// and a completed Work means the device tensor holds the result. Since the copy back has finished
// by then, wait_on_current_stream() is wait(): every kernel the caller queues afterwards runs after
// the copy. The copy-back thread waits for the wrapped operations without a deadline of its own:
// each wrapped operation ends, at the latest, at the wrapped group's timeout. A failed wrapped
// operation fails the Work with the very same exception (message, type: op, group, seq, missing
// ranks), and nothing is copied back. Argument errors of the wrapped group surface at the call,
// unchanged.
//
// Inputs are only copied down where they are read: broadcast copies the root's tensor down and
// copies back on the other ranks. A collective on GPU tensors thus costs two copies over PCIe and
// a host synchronisation at the call; it is for tests and small set-ups, not for speed (use nccl
// with one GPU per rank for that). The pinned staging tensors come from the caching pinned
// allocator, so the steady state makes no cudaHostAlloc. The group touches CUDA only when the
// first GPU tensor arrives: with CPU tensors alone it is exactly the wrapped group.

namespace mtrain {
namespace {

#ifdef MTRAIN_HAVE_CUDA

// Where the caller's current stream had got to when an operation was issued.
using CallerMark = std::unique_ptr<cuda::Event>;

// The CUDA side of staging: the group's stream for the copies back.
class StagingStream {
 public:
  explicit StagingStream(int device) : device_(device), stream_(device) {}

  // Makes the group's GPU current for the calling (copy-back) thread, so that its CUDA
  // calls open no context elsewhere (Note [Helper threads and the process's GPU] in
  // tensor/cuda_devices.h). An error resurfaces at the thread's first checked call.
  void bind_thread() const {
    if (cudaSetDevice(device_) != cudaSuccess) cudaGetLastError();
  }

  // Called on the issuing thread.
  CallerMark mark_caller_stream() const {
    auto mark = std::make_unique<cuda::Event>(device_);
    mark->record(cuda::current_stream(device_));
    return mark;
  }

  // dst (on the device) <- src (pinned host), after the caller's work up to `after`;
  // returns once the copy is done.
  void copy_back(Tensor dst, const Tensor& src, const CallerMark& after) {
    after->block(stream_.stream());
    cuda::StreamGuard on_own_stream(stream_.stream());
    // From pinned memory without non_blocking, copy_ synchronises the stream.
    dst.copy_(src);
  }

 private:
  const int device_;
  cuda::OwnedStream stream_;
};

#else

// No GPU tensor can be staged in a build without CUDA: staging its input needs pinned
// memory, which already refuses (tensor/no_cuda.cpp). This stands in so that the group
// compiles, and refuses too should anything get this far.
struct CallerMark {};

class StagingStream {
 public:
  explicit StagingStream(int device) {
    throw InvalidArgument(fmt::format(
        "staging tensors of cuda:{} through host memory needs a build with CUDA; this one has none",
        device));
  }
  CallerMark mark_caller_stream() const { return {}; }
  void bind_thread() const {}
  void copy_back(const Tensor&, const Tensor&, const CallerMark&) {}
};

#endif

}  // namespace

// The copy-back thread: finishes staged operations in issue order (Note [Host staging]).
class HostStagingProcessGroup::CopyBack {
 public:
  explicit CopyBack(Device device) : stream_(device.index) {
    thread_ = std::thread([this] { run(); });
  }

  ~CopyBack() {
    {
      std::lock_guard lock(mu_);
      closed_ = true;
    }
    cv_.notify_all();
    thread_.join();  // drains the queue first: callers may still wait on those Works
  }

  CopyBack(const CopyBack&) = delete;
  CopyBack& operator=(const CopyBack&) = delete;

  // On the issuing thread, right after the wrapped operation was issued.
  void push(std::shared_ptr<Work> work, WorkPtr wrapped, Tensor host_result, Tensor device_result) {
    Pending pending{std::move(work), std::move(wrapped), std::move(host_result),
                    std::move(device_result), stream_.mark_caller_stream()};
    {
      std::lock_guard lock(mu_);
      queue_.push_back(std::move(pending));
    }
    cv_.notify_one();
  }

 private:
  struct Pending {
    std::shared_ptr<Work> work;  // ours
    WorkPtr wrapped;
    Tensor host_result;
    Tensor device_result;  // undefined: nothing to copy back
    CallerMark issued;
  };

  void run() {
    stream_.bind_thread();
    std::unique_lock lock(mu_);
    for (;;) {
      cv_.wait(lock, [&] { return closed_ || !queue_.empty(); });
      if (queue_.empty()) return;  // closed and drained
      Pending pending = std::move(queue_.front());
      queue_.pop_front();
      lock.unlock();
      settle(pending);
      pending = Pending{};  // frees the staging tensors outside the lock
      lock.lock();
    }
  }

  void settle(Pending& p) noexcept {
    std::exception_ptr error;
    try {
      p.wrapped->wait();  // rethrows the wrapped operation's own error
      if (p.device_result.defined()) stream_.copy_back(p.device_result, p.host_result, p.issued);
    } catch (...) {
      error = std::current_exception();
    }
    if (error) {
      p.work->mark_failed(error);
    } else {
      p.work->mark_completed();
    }
  }

  StagingStream stream_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Pending> queue_;
  bool closed_ = false;
  std::thread thread_;  // last: started after everything it reads
};

HostStagingProcessGroup::HostStagingProcessGroup(std::unique_ptr<ProcessGroup> wrapped, Device device)
    : ProcessGroup(wrapped ? wrapped->rank() : 0, wrapped ? wrapped->size() : 1,
                   wrapped ? wrapped->options() : ProcessGroupOptions{}),
      wrapped_(std::move(wrapped)),
      device_(device) {
  if (!wrapped_) {
    throw InvalidArgument("host staging: expected a process group to wrap, found none");
  }
  if (backend_info(wrapped_->backend_name()).device_tensors_only) {
    throw InvalidArgument(fmt::format(
        "host staging of group '{}': expected a group working on host memory (gloo or mpi), "
        "found {}, which takes GPU tensors itself",
        options_.name, wrapped_->backend_name()));
  }
  if (!device_.is_cuda()) {
    throw InvalidArgument(fmt::format(
        "host staging of group '{}': expected a GPU device to stage tensors of, found {}",
        options_.name, device_.str()));
  }
}

HostStagingProcessGroup::~HostStagingProcessGroup() {
  // The copy backs wait for wrapped operations: finish them while the wrapped group lives.
  copy_back_.reset();
}

bool HostStagingProcessGroup::staged(
    OpType op, const std::vector<std::pair<const char*, const Tensor*>>& tensors) const {
  const char* gpu_tensor = nullptr;
  const char* cpu_tensor = nullptr;
  const char* undefined_tensor = nullptr;
  for (const auto& [what, t] : tensors) {
    if (!t->defined()) {
      undefined_tensor = what;
      continue;
    }
    if (t->device().is_cpu()) {
      cpu_tensor = what;
      continue;
    }
    if (t->device() != device_) {
      throw InvalidArgument(fmt::format(
          "{} in group '{}': this group stages tensors of {} through host memory; the {} is on {}",
          op_type_name(op), options_.name, device_.str(), what, t->device().str()));
    }
    gpu_tensor = what;
  }
  if (gpu_tensor != nullptr && undefined_tensor != nullptr) {
    // (Without a GPU tensor the call passes through and the wrapped group says so.)
    throw InvalidArgument(fmt::format("{} in group '{}': the {} tensor is undefined",
                                      op_type_name(op), options_.name, undefined_tensor));
  }
  if (gpu_tensor != nullptr && cpu_tensor != nullptr) {
    throw InvalidArgument(fmt::format(
        "{} in group '{}': expected the {} and the {} on one device, found the {} on {} and the {} on cpu",
        op_type_name(op), options_.name, gpu_tensor, cpu_tensor, gpu_tensor, device_.str(),
        cpu_tensor));
  }
  return gpu_tensor != nullptr;
}

namespace {

// A pinned host copy of `t`, read after the work queued so far on the caller's current
// stream; host memory is ready when this returns.
Tensor to_host(const Tensor& t) {
  Tensor host = Tensor::empty_pinned(t.shape(), t.dtype());
  host.copy_(t);
  return host;
}

}  // namespace

WorkPtr HostStagingProcessGroup::issue(OpType op, const std::function<WorkPtr()>& launch,
                                       std::vector<Tensor> keep_alive, const Tensor& host_result,
                                       const Tensor& device_result) {
  std::lock_guard lock(issue_mu_);
  if (!copy_back_) copy_back_ = std::make_unique<CopyBack>(device_);
  WorkPtr wrapped = launch();  // argument errors surface here, unchanged
  auto work = std::make_shared<Work>(op, wrapped->seq(), std::move(keep_alive));
  copy_back_->push(work, std::move(wrapped), host_result, device_result);
  return work;
}

WorkPtr HostStagingProcessGroup::allreduce(Tensor& tensor, ReduceOp op) {
  if (!staged(OpType::AllReduce, {{"tensor", &tensor}})) return wrapped_->allreduce(tensor, op);
  Tensor host = to_host(tensor);
  return issue(
      OpType::AllReduce, [&] { return wrapped_->allreduce(host, op); }, {tensor, host}, host, tensor);
}

WorkPtr HostStagingProcessGroup::broadcast(Tensor& tensor, int root) {
  if (!staged(OpType::Broadcast, {{"tensor", &tensor}})) return wrapped_->broadcast(tensor, root);
  // The root only sends and the others only receive: each side copies one way.
  const bool sends = root == rank_;
  Tensor host = sends ? to_host(tensor) : Tensor::empty_pinned(tensor.shape(), tensor.dtype());
  return issue(
      OpType::Broadcast, [&] { return wrapped_->broadcast(host, root); }, {tensor, host}, host,
      sends ? Tensor() : tensor);
}

WorkPtr HostStagingProcessGroup::allgather(const Tensor& input, Tensor& output) {
  if (!staged(OpType::AllGather, {{"input", &input}, {"output", &output}})) {
    return wrapped_->allgather(input, output);
  }
  Tensor host_in = to_host(input);
  Tensor host_out = Tensor::empty_pinned(output.shape(), output.dtype());
  return issue(
      OpType::AllGather, [&] { return wrapped_->allgather(host_in, host_out); },
      {input, output, host_in, host_out}, host_out, output);
}

WorkPtr HostStagingProcessGroup::allgatherv(const Tensor& input, Tensor& output,
                                            const std::vector<int64_t>& counts) {
  if (!staged(OpType::AllGatherV, {{"input", &input}, {"output", &output}})) {
    return wrapped_->allgatherv(input, output, counts);
  }
  Tensor host_in = to_host(input);
  Tensor host_out = Tensor::empty_pinned(output.shape(), output.dtype());
  return issue(
      OpType::AllGatherV, [&] { return wrapped_->allgatherv(host_in, host_out, counts); },
      {input, output, host_in, host_out}, host_out, output);
}

WorkPtr HostStagingProcessGroup::reduce_scatter(const Tensor& input, Tensor& output, ReduceOp op) {
  if (!staged(OpType::ReduceScatter, {{"input", &input}, {"output", &output}})) {
    return wrapped_->reduce_scatter(input, output, op);
  }
  Tensor host_in = to_host(input);
  Tensor host_out = Tensor::empty_pinned(output.shape(), output.dtype());
  return issue(
      OpType::ReduceScatter, [&] { return wrapped_->reduce_scatter(host_in, host_out, op); },
      {input, output, host_in, host_out}, host_out, output);
}

// No tensors: nothing to stage. It completes with the wrapped barrier, which may be
// before the copy backs of earlier operations: their Works say when those are done.
WorkPtr HostStagingProcessGroup::barrier() { return wrapped_->barrier(); }

void check_host_staging_device(const std::string& backend, Device device) {
  const CudaInfo& info = cuda_info();
  if (!device.is_cuda()) {
    throw InvalidArgument(fmt::format("the {} backend stages GPU tensors; expected a GPU device, found {}",
                                      backend, device.str()));
  }
  if (!info.compiled) {
    throw InvalidArgument(fmt::format(
        "the {} backend on {} stages GPU tensors through host memory, which needs a build with "
        "CUDA; this one has none ({})",
        backend, device.str(), info.reason));
  }
  if (device.index < 0 || device.index >= info.device_count) {
    throw InvalidArgument(fmt::format(
        "the {} backend on {}: expected a usable GPU, found {}", backend, device.str(),
        info.device_count == 0 ? fmt::format("none ({})", info.reason)
                               : fmt::format("{} GPU(s), cuda:0 to cuda:{}", info.device_count,
                                             info.device_count - 1)));
  }
}

}  // namespace mtrain

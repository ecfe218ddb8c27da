// Work, the ProcessGroup base, and the backend factory.
#include "collectives/process_group.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>

#include "collectives/gloo/gloo_device.h"
#include "collectives/gloo/gloo_process_group.h"
#include "collectives/host_staging.h"
#include "core/error.h"
#ifdef MTRAIN_HAVE_MPI
#include "collectives/mpi/mpi_process_group.h"
#endif
#ifdef MTRAIN_HAVE_CUDA
#include "collectives/nccl/nccl_process_group.h"
#endif

namespace mtrain {

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return "sum";
    case ReduceOp::Avg: return "avg";
    case ReduceOp::Max: return "max";
    case ReduceOp::Min: return "min";
  }
  return "?";
}

ReduceOp parse_reduce_op(const std::string& name) {
  for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min}) {
    if (name == reduce_op_name(op)) return op;
  }
  throw InvalidArgument(
      fmt::format("unknown reduce op '{}': expected one of sum, avg, max, min", name));
}

const char* op_type_name(OpType op) {
  switch (op) {
    case OpType::AllReduce: return "allreduce";
    case OpType::Broadcast: return "broadcast";
    case OpType::AllGather: return "allgather";
    case OpType::AllGatherV: return "allgatherv";
    case OpType::ReduceScatter: return "reduce_scatter";
    case OpType::Barrier: return "barrier";
  }
  return "?";
}

// Note [Asynchronous collectives]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Every call returns at once with a Work; the operation runs on the group's own communication
// thread (or CUDA stream) in the order the calls were made, which must be the same order on every
// rank. The Work keeps the tensors it uses alive until it completes, even if the caller drops its
// handles. wait() rethrows the operation's error; wait(timeout) additionally throws TimeoutError
// if the operation is not done in time. Callers may issue several operations before waiting on
// any (the DDP reducer overlaps bucket all-reduces with backward this way).
//
// On GPUs (the nccl backend) an operation runs on the group's own CUDA stream, after the work
// already queued on the caller's current stream (Note [Current stream] in tensor/cuda/stream.h),
// so the caller needs no synchronisation before issuing it. Two ways to consume the result:
//   * wait(): blocks the host until the operation is done (e.g. before reading a loss value on
//     the host, or before an optimizer step done on the host);
//   * wait_on_current_stream(): returns at once; kernels the caller queues afterwards on its
//     current stream run after the operation. The DDP reducer uses this to overlap bucket
//     all-reduces with backward without stalling the host. Errors still surface: through a later
//     wait(), is_completed() or the next operation of the group, and the group's watchdog fails
//     every pending operation at its deadline.
// On CPU backends wait_on_current_stream() is wait().
//
// Note [Collective timeouts]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// Every operation has a deadline (ProcessGroupOptions::timeout, per group). A collective that a
// peer never joins fails on the ranks that did join, within the timeout, with a TimeoutError
// naming the operation, the group, its sequence number and, where the store can tell, the ranks
// that never reached it. Nothing hangs silently; the worker then exits and the launcher tears the
// gang down.
Work::Work(OpType op, uint64_t seq, std::vector<Tensor> keep_alive)
    : op_(op), seq_(seq), keep_alive_(std::move(keep_alive)) {}

bool Work::is_completed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return done_;
}

void Work::wait() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return done_; });
  if (error_) std::rethrow_exception(error_);
}

void Work::wait(Millis timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!cv_.wait_for(lock, timeout, [&] { return done_; })) {
    throw TimeoutError(fmt::format("{} #{} did not complete within {} ms of waiting",
                                   op_type_name(op_), seq_, timeout.count()));
  }
  if (error_) std::rethrow_exception(error_);
}

void Work::wait_on_current_stream() { wait(); }

std::exception_ptr Work::error() const {
  std::lock_guard<std::mutex> lock(mu_);
  return error_;
}

std::optional<std::chrono::steady_clock::time_point> Work::completed_at() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (!done_) return std::nullopt;
  return completed_at_;
}

void Work::mark_completed() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    MTRAIN_CHECK(!done_, "{} #{} finished twice", op_type_name(op_), seq_);
    done_ = true;
    completed_at_ = std::chrono::steady_clock::now();
    // The tensors are no longer in use by the backend; the caller holds its own handles.
    keep_alive_.clear();
  }
  cv_.notify_all();
}

void Work::mark_failed(std::exception_ptr error) {
  MTRAIN_CHECK(error != nullptr, "{} #{} failed without an error", op_type_name(op_), seq_);
  {
    std::lock_guard<std::mutex> lock(mu_);
    MTRAIN_CHECK(!done_, "{} #{} finished twice", op_type_name(op_), seq_);
    done_ = true;
    completed_at_ = std::chrono::steady_clock::now();
    error_ = std::move(error);
    keep_alive_.clear();
  }
  cv_.notify_all();
}

void check_group_arguments(int rank, int size, const ProcessGroupOptions& options) {
  if (size < 1) {
    throw InvalidArgument(fmt::format("process group '{}': expected a size >= 1, found {}", options.name, size));
  }
  if (rank < 0 || rank >= size) {
    throw InvalidArgument(fmt::format("process group '{}': expected a rank in [0, {}), found {}",
                                      options.name, size, rank));
  }
  if (options.timeout.count() <= 0) {
    throw InvalidArgument(fmt::format("process group '{}': expected a positive timeout, found {} ms",
                                      options.name, options.timeout.count()));
  }
}

ProcessGroup::ProcessGroup(int rank, int size, ProcessGroupOptions options)
    : rank_(rank), size_(size), options_(std::move(options)) {
  check_group_arguments(rank_, size_, options_);
}

void ProcessGroup::check_root(int root) const {
  if (root < 0 || root >= size_) {
    throw InvalidArgument(fmt::format("broadcast in group '{}': expected a root in [0, {}), found {}",
                                      options_.name, size_, root));
  }
}

void ProcessGroup::check_same_dtype(OpType op, const Tensor& input, const Tensor& output) const {
  if (input.dtype() != output.dtype()) {
    throw InvalidArgument(fmt::format("{} in group '{}': input and output dtypes differ: {} vs {}",
                                      op_type_name(op), options_.name, dtype_name(input.dtype()),
                                      dtype_name(output.dtype())));
  }
}

void ProcessGroup::check_avg_dtype(OpType op, ReduceOp reduce, DType dtype) const {
  if (reduce == ReduceOp::Avg && dtype != DType::Float32 && dtype != DType::Float16 &&
      dtype != DType::BFloat16) {
    throw InvalidArgument(fmt::format("{} in group '{}': avg of {} would truncate; expected float32, "
                                      "float16 or bfloat16 (use sum and divide yourself)",
                                      op_type_name(op), options_.name, dtype_name(dtype)));
  }
}

void ProcessGroup::check_allgather_sizes(const Tensor& input, const Tensor& output) const {
  if (output.numel() != input.numel() * size_) {
    throw InvalidArgument(fmt::format("allgather in group '{}': expected an output of {} x {} = {} elements, found {}",
                                      options_.name, size_, input.numel(), input.numel() * size_,
                                      output.numel()));
  }
}

int64_t ProcessGroup::check_allgatherv_sizes(const Tensor& input, const Tensor& output,
                                             const std::vector<int64_t>& counts) const {
  if (counts.size() != static_cast<size_t>(size_)) {
    throw InvalidArgument(fmt::format("allgatherv in group '{}': expected {} counts (one per rank), found {}",
                                      options_.name, size_, counts.size()));
  }
  int64_t total = 0;
  for (size_t r = 0; r < counts.size(); ++r) {
    if (counts[r] < 0) {
      throw InvalidArgument(fmt::format("allgatherv in group '{}': counts[{}] is negative ({})", options_.name,
                                        r, counts[r]));
    }
    total += counts[r];
  }
  if (input.numel() != counts[rank_]) {
    throw InvalidArgument(fmt::format(
        "allgatherv in group '{}': rank {} contributes counts[{}] = {} elements but its input has {}",
        options_.name, rank_, rank_, counts[rank_], input.numel()));
  }
  if (output.numel() != total) {
    throw InvalidArgument(fmt::format(
        "allgatherv in group '{}': expected an output of sum(counts) = {} elements, found {}", options_.name,
        total, output.numel()));
  }
  return total;
}

void ProcessGroup::check_reduce_scatter_sizes(const Tensor& input, const Tensor& output) const {
  if (input.numel() != output.numel() * size_) {
    throw InvalidArgument(fmt::format(
        "reduce_scatter in group '{}': expected an input of {} x {} = {} elements (size x output), found {}",
        options_.name, size_, output.numel(), output.numel() * size_, input.numel()));
  }
}

const std::vector<BackendInfo>& known_backends() {
  static const std::vector<BackendInfo> backends = [] {
    BackendInfo gloo{"gloo", true, "", false, false, true};
    BackendInfo mpi{"mpi", false, "Open MPI was not found at configure time", false, true, false};
    BackendInfo nccl{"nccl", false,
                     "configured with -DMTRAIN_CUDA=OFF, or the CUDA toolkit or NCCL was not found", true, false,
                     false};
#ifdef MTRAIN_HAVE_MPI
    mpi.built = true;
#endif
#ifdef MTRAIN_HAVE_CUDA
    nccl.built = true;
#endif
    return std::vector<BackendInfo>{gloo, mpi, nccl};
  }();
  return backends;
}

const BackendInfo& backend_info(const std::string& name) {
  for (const BackendInfo& b : known_backends()) {
    if (b.name == name) return b;
  }
  throw InvalidArgument(fmt::format("unknown process group backend '{}': expected auto or one of {}", name,
                                    fmt::join(available_backends(), ", ")));
}

std::vector<std::string> available_backends() {
  std::vector<std::string> names;
  for (const BackendInfo& b : known_backends()) {
    if (b.built) names.push_back(b.name);
  }
  return names;
}

void check_backend_environment() { (void)loop_scheduling_from_env(); }

const BackendInfo& auto_backend(bool on_gpu, bool mpi_launched) {
  if (on_gpu) return backend_info("nccl");
  return mpi_launched && backend_info("mpi").built ? backend_info("mpi") : backend_info("gloo");
}

std::string resolve_backend(const std::string& requested, bool on_gpu, bool mpi_launched) {
  return requested == "auto" ? auto_backend(on_gpu, mpi_launched).name : requested;
}

std::unique_ptr<ProcessGroup> create_process_group(const std::string& backend,
                                                   std::shared_ptr<Store> store, int rank,
                                                   int size, Device device,
                                                   ProcessGroupOptions options) {
#ifdef MTRAIN_HAVE_MPI
  const bool mpi_launched = started_by_mpirun();
#else
  const bool mpi_launched = false;
#endif
  const std::string chosen = resolve_backend(backend, device.is_cuda(), mpi_launched);
  const BackendInfo& info = backend_info(chosen);
  if (!info.built) {
    throw InvalidArgument(fmt::format("the {} backend is not built in ({}); available backends: {}", chosen,
                                      info.not_built, fmt::join(available_backends(), ", ")));
  }
  if (info.device_tensors_only && !device.is_cuda()) {
    throw InvalidArgument(fmt::format("the {} backend works on GPU tensors; found device {} (use gloo or mpi on CPUs)",
                                      chosen, device.str()));
  }
  if (store == nullptr && !info.bootstraps_without_store) {
    throw InvalidArgument(fmt::format("the {} backend needs a rendezvous store; none was given", chosen));
  }
  // gloo and mpi work on host memory; on a GPU they stage its tensors through it (Note
  // [Host staging]), checked before the group connects to its peers.
  const bool staged = device.is_cuda() && !info.device_tensors_only;
  if (staged) check_host_staging_device(chosen, device);
  std::unique_ptr<ProcessGroup> group;
  if (chosen == "gloo") {
    group = create_gloo_process_group(std::move(store), rank, size, std::move(options));
#ifdef MTRAIN_HAVE_MPI
  } else if (chosen == "mpi") {
    group = create_mpi_process_group(rank, size, std::move(options));
#endif
#ifdef MTRAIN_HAVE_CUDA
  } else if (chosen == "nccl") {
    return create_nccl_process_group(std::move(store), rank, size, device, std::move(options));
#endif
  } else {
    throw InternalError(fmt::format("backend '{}' is listed as built but has no factory", chosen));
  }
  if (staged) return std::make_unique<HostStagingProcessGroup>(std::move(group), device);
  return group;
}

}  // namespace mtrain

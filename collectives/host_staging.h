// Collectives on GPU tensors through a process group that works on host memory (Gloo,
// and Open MPI, which is not CUDA-aware here): what lets two ranks share one GPU, since
// NCCL refuses two ranks on the same device.
//
// Note [Host staging]
// ~~~~~~~~~~~~~~~~~~~
// HostStagingProcessGroup wraps a CPU-backend group. CPU tensors go straight to the
// wrapped group: the call returns the wrapped group's own Work. A GPU tensor (it must be
// on the group's device) is staged:
//   1. at the call, its values are copied into a pinned host tensor with Tensor::copy_,
//      queued on the caller's current stream (Note [Current stream]); the call returns
//      once the host copy holds them, so the input is read after every kernel the caller
//      queued before the call, and the caller may overwrite it as soon as the call
//      returns. An event recorded on the caller's current stream marks that point too;
//   2. the wrapped group's operation is issued on the host tensors, under a lock, so the
//      wrapped group's issue order (its sequence numbers, which this group's Works
//      carry) is the order of the calls;
//   3. the group's copy-back thread takes the operations in that order, waits for each
//      wrapped operation, and copies the host result into the device tensor on the
//      group's own CUDA stream, after the event of step 1 (the caller's earlier kernels
//      may still use that memory: the caching allocator reuses blocks in stream order),
//      then waits for that copy. Only then is the Work completed.
// So Note [Asynchronous collectives] holds: the call returns at once (after the copy to
// the host), and a completed Work means the device tensor holds the result. Since the
// copy back has finished by then, wait_on_current_stream() is wait(): every kernel the
// caller queues afterwards runs after the copy. The copy-back thread waits for the
// wrapped operations without a deadline of its own: each wrapped operation ends, at the
// latest, at the wrapped group's timeout. A failed wrapped operation fails the Work with
// the very same exception (message, type: op, group, seq, missing ranks), and nothing
// is copied back. Argument errors of the wrapped group surface at the call, unchanged.
//
// Inputs are only copied down where they are read: broadcast copies the root's tensor
// down and copies back on the other ranks. A collective on GPU tensors thus costs two
// copies over PCIe and a host synchronisation at the call; it is for tests and small
// set-ups, not for speed (use nccl with one GPU per rank for that). The pinned staging
// tensors come from the caching pinned allocator, so the steady state makes no
// cudaHostAlloc. The group touches CUDA only when the first GPU tensor arrives: with
// CPU tensors alone it is exactly the wrapped group.
#pragma once

#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "collectives/process_group.h"

namespace mtrain {

class HostStagingProcessGroup final : public ProcessGroup {
 public:
  // `wrapped`: a group whose backend works on host memory (gloo or mpi); `device`: the
  // GPU whose tensors are staged. Throws InvalidArgument for a null or nccl group or a
  // device that is not a GPU; whether the GPU is usable is checked by
  // check_host_staging_device (create_process_group calls it first).
  HostStagingProcessGroup(std::unique_ptr<ProcessGroup> wrapped, Device device);
  // Lets every issued operation finish (or time out) and its copy back run first.
  ~HostStagingProcessGroup() override;

  std::string backend_name() const override { return wrapped_->backend_name(); }
  Device device() const { return device_; }
  ProcessGroup& wrapped() const { return *wrapped_; }

  WorkPtr allreduce(Tensor& tensor, ReduceOp op = ReduceOp::Sum) override;
  WorkPtr broadcast(Tensor& tensor, int root) override;
  WorkPtr allgather(const Tensor& input, Tensor& output) override;
  WorkPtr allgatherv(const Tensor& input, Tensor& output,
                     const std::vector<int64_t>& counts) override;
  WorkPtr reduce_scatter(const Tensor& input, Tensor& output,
                         ReduceOp op = ReduceOp::Sum) override;
  WorkPtr barrier() override;

 private:
  class CopyBack;  // the copy-back thread and stream (host_staging.cpp)

  // Whether the operation's tensors are on the GPU (staged) or on the host (passed
  // through); InvalidArgument for a mix, or a GPU other than device().
  bool staged(OpType op, const std::vector<std::pair<const char*, const Tensor*>>& tensors) const;
  // Issues `launch` (the wrapped operation on host tensors) and queues the copy of
  // `host_result` into `device_result` (undefined: nothing to copy back).
  WorkPtr issue(OpType op, const std::function<WorkPtr()>& launch, std::vector<Tensor> keep_alive,
                const Tensor& host_result, const Tensor& device_result);

  std::unique_ptr<ProcessGroup> wrapped_;
  const Device device_;
  std::mutex issue_mu_;                 // issue order; guards copy_back_
  std::unique_ptr<CopyBack> copy_back_;  // created with the first staged operation
};

// Throws InvalidArgument unless `device` is a GPU this process can use for staging with
// `backend` (the build has CUDA, the index names a usable GPU).
void check_host_staging_device(const std::string& backend, Device device);

}  // namespace mtrain

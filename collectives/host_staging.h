// Collectives on GPU tensors through a process group that works on host memory (Gloo, and Open
// MPI, which is not CUDA-aware here): what lets two ranks share one GPU, since NCCL refuses two
// ranks on the same device. How and why: Note [Host staging] in host_staging.cpp.
//
// Contract: CPU tensors pass straight to the wrapped group (its own Work). For GPU tensors (on
// the group's device) the call returns once the input has been copied to the host, after every
// kernel the caller queued before it: the caller may overwrite the input at once. A completed
// Work means the device tensor holds the result, so wait_on_current_stream() is wait(). A failed
// wrapped operation fails the Work with the very same exception; argument errors surface at the
// call. Each GPU collective costs two PCIe copies and a host synchronisation: for tests and small
// set-ups, not for speed. Calls may come from any thread; the issue order is the call order.
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

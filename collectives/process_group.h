// ProcessGroup: the collectives every distributed feature stands on, over existing engines (Gloo,
// Open MPI, NCCL), never a hand-rolled algorithm.
//
// Contract (Note [Asynchronous collectives] in process_group.cpp): every call returns at once with
// a Work; operations run in call order, which must be the same on every rank; the Work keeps its
// tensors alive until the operation completes. On GPUs an operation runs after the work already
// queued on the caller's current stream. Every operation has a deadline (the group's timeout): a
// collective a peer never joins fails with a TimeoutError naming the operation, group, sequence
// number and, where the store can tell, the missing ranks (Note [Collective timeouts]).
#pragma once

#include <chrono>
#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "store/store.h"
#include "tensor/tensor.h"

namespace mtrain {

enum class ReduceOp { Sum, Avg, Max, Min };
const char* reduce_op_name(ReduceOp op);  // "sum", "avg", "max", "min"
ReduceOp parse_reduce_op(const std::string& name);  // InvalidArgument listing the valid names

enum class OpType { AllReduce, Broadcast, AllGather, AllGatherV, ReduceScatter, Barrier };
const char* op_type_name(OpType op);  // "allreduce", ...

// Handle to one asynchronous operation. Thread-safe. Backends whose completion is
// observed by polling (nccl) override the waiting functions.
class Work {
 public:
  Work(OpType op, uint64_t seq, std::vector<Tensor> keep_alive = {});
  virtual ~Work() = default;

  OpType op() const { return op_; }
  uint64_t seq() const { return seq_; }  // the group's sequence number of this operation

  virtual bool is_completed() const;
  // Blocks until done; rethrows the operation's error if it failed.
  virtual void wait();
  // As wait(), but throws TimeoutError (naming the op and seq) when not done in time.
  // The operation itself goes on and may still write its output: a caller that catches
  // the error must not reuse the tensors. Waiting at least the group's timeout gives the
  // operation's own outcome, its timeout error included (Note [Collective timeouts]).
  virtual void wait(Millis timeout);
  // Device-side wait: returns at once; kernels the caller queues afterwards on its current
  // stream run after the operation. Rethrows an error already known; later errors surface
  // through a later wait(), is_completed() or the group's next operation. CPU backends: wait().
  virtual void wait_on_current_stream();
  // The error the operation failed with, or nullptr (also nullptr while running).
  std::exception_ptr error() const;
  // When the backend marked it finished (steady clock); unset while running. On a GPU
  // that is when the backend saw the device finish, which may be later.
  std::optional<std::chrono::steady_clock::time_point> completed_at() const;

  // For backends: finish the operation (exactly once).
  void mark_completed();
  void mark_failed(std::exception_ptr error);

 private:
  const OpType op_;
  const uint64_t seq_;
  std::vector<Tensor> keep_alive_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::exception_ptr error_;
  std::chrono::steady_clock::time_point completed_at_;
};
using WorkPtr = std::shared_ptr<Work>;

struct ProcessGroupOptions {
  std::string name = "world";             // appears in errors and store keys
  Millis timeout = Millis(30 * 60 * 1000); // per operation; 30 min like c10d's default
  // Where the ranks rendezvous (the store's host and port): a backend that opens
  // sockets of its own (gloo) listens on the local address that routes there. Empty:
  // the loopback interface.
  std::string rendezvous_host;
  uint16_t rendezvous_port = 0;
};

// InvalidArgument unless 0 <= rank < size and the timeout is positive; every group's
// constructor checks this, and a backend whose creation already talks to its peers
// (MPI_Comm_dup) checks it before that.
void check_group_arguments(int rank, int size, const ProcessGroupOptions& options);

// Tensors: contiguous, on one device; float32 and int64 for every op, float16/bfloat16
// for allreduce/broadcast/allgather buffers. Shapes are checked on every rank against
// the documented rule and violations throw InvalidArgument at the call.
class ProcessGroup {
 public:
  virtual ~ProcessGroup() = default;

  int rank() const { return rank_; }
  int size() const { return size_; }
  const ProcessGroupOptions& options() const { return options_; }
  virtual std::string backend_name() const = 0;  // "gloo", "mpi", "nccl"

  // In place: every rank's `tensor` becomes the reduction over all ranks.
  virtual WorkPtr allreduce(Tensor& tensor, ReduceOp op = ReduceOp::Sum) = 0;
  // In place: every rank's `tensor` becomes `root`'s.
  virtual WorkPtr broadcast(Tensor& tensor, int root) = 0;
  // output (numel = size() * input.numel()) = concatenation of every rank's input, by rank.
  virtual WorkPtr allgather(const Tensor& input, Tensor& output) = 0;
  // Per-rank sizes: rank r contributes counts[r] elements (input.numel() == counts[rank()]);
  // output (numel = sum(counts)) = concatenation by rank. counts must agree on all ranks.
  virtual WorkPtr allgatherv(const Tensor& input, Tensor& output,
                             const std::vector<int64_t>& counts) = 0;
  // input.numel() == size() * output.numel(); output = this rank's chunk of the
  // reduction of every rank's input.
  virtual WorkPtr reduce_scatter(const Tensor& input, Tensor& output,
                                 ReduceOp op = ReduceOp::Sum) = 0;
  virtual WorkPtr barrier() = 0;

 protected:
  ProcessGroup(int rank, int size, ProcessGroupOptions options);

  // The argument rules of this interface, the same for every backend; each throws
  // InvalidArgument naming the operation and the group. Backends add their own device
  // and dtype checks before these.
  void check_root(int root) const;
  void check_same_dtype(OpType op, const Tensor& input, const Tensor& output) const;
  // avg of an integer tensor would truncate: only float32, float16 and bfloat16.
  void check_avg_dtype(OpType op, ReduceOp reduce, DType dtype) const;
  void check_allgather_sizes(const Tensor& input, const Tensor& output) const;
  // Returns sum(counts).
  int64_t check_allgatherv_sizes(const Tensor& input, const Tensor& output,
                                 const std::vector<int64_t>& counts) const;
  void check_reduce_scatter_sizes(const Tensor& input, const Tensor& output) const;

  const int rank_;
  const int size_;
  const ProcessGroupOptions options_;
};

// What the rest of mtrain may ask about a backend without naming it: one entry per
// backend mtrain knows, built into this build or not.
struct BackendInfo {
  std::string name;                     // "gloo", "mpi", "nccl"
  bool built = false;                   // compiled into this build
  std::string not_built;                // why not, when it is not
  bool device_tensors_only = false;     // collectives on GPU tensors only: host values need another group
  bool bootstraps_without_store = false;  // under its own starter (mpi under mpirun) needs no store
  bool batch_stats_group = false;       // SyncBatchNorm gets a group of its own (Note [SyncBatchNorm's own group])
};

// Every backend mtrain knows, in a fixed order (gloo, mpi, nccl).
const std::vector<BackendInfo>& known_backends();
// The entry for `name`; InvalidArgument naming the known backends for any other name.
const BackendInfo& backend_info(const std::string& name);
// The names of the backends compiled into this build, e.g. {"gloo", "mpi"}.
std::vector<std::string> available_backends();

// Checks the environment variables the backends read (MTRAIN_GLOO_LOOP_SCHED), so a bad
// value fails when a worker starts, also in a run that never makes a group. Throws
// InvalidArgument naming the variable.
void check_backend_environment();

// The one rule for "auto": nccl for a rank on a GPU, else mpi for a process an MPI
// starter started (when mpi is built in), else gloo.
const BackendInfo& auto_backend(bool on_gpu, bool mpi_launched);
// `requested` resolved: auto_backend for "auto", other names returned as given.
std::string resolve_backend(const std::string& requested, bool on_gpu, bool mpi_launched);

// Creates a group of `size` ranks; every rank calls this with the same backend and
// options. `backend` is a known name or "auto" (resolve_backend, with `device` and
// whether mpirun started this process). `store` is the rendezvous store (null only for
// a backend that bootstraps without one). For "nccl", `device` is this rank's GPU (one
// GPU per rank); gloo and mpi on a GPU stage its tensors through host memory. Unknown or
// unbuilt backends throw InvalidArgument saying which are built in.
std::unique_ptr<ProcessGroup> create_process_group(const std::string& backend,
                                                   std::shared_ptr<Store> store, int rank,
                                                   int size, Device device,
                                                   ProcessGroupOptions options = {});

}  // namespace mtrain

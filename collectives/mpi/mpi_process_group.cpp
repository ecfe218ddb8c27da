// MpiProcessGroup: ProcessGroup over a duplicate of MPI_COMM_WORLD, every MPI call made
// by the runtime's queue, one operation at a time (Note [MPI backend threading]).
#include "collectives/mpi/mpi_process_group.h"

#include <fmt/format.h>

#include <atomic>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <future>

#include "collectives/half_math.h"
#include "collectives/mpi/mpi_half_ops.h"
#include "collectives/mpi/mpi_runtime.h"
#include "core/error.h"

namespace mtrain {
namespace {

// MPI forbids a send buffer that overlaps the receive buffer (MPI 4.0, 2.4.1), which an
// input that is a view of its output is (an all-gather of each rank's slice of the
// result, a reduce-scatter into part of its input); Gloo's versions allow it. Such an
// input is copied first, on the thread that runs the operation.
Tensor separate_from(const Tensor& input, const Tensor& output) {
  const auto* a = static_cast<const char*>(input.raw_data());
  const auto* b = static_cast<const char*>(output.raw_data());
  const bool overlap = input.nbytes() > 0 && output.nbytes() > 0 && a < b + output.nbytes() && b < a + input.nbytes();
  return overlap ? input.clone() : input;
}

using mpi::MpiRuntime;
using mpi::MpiTask;

// Reductions of float32/int64/int32 use MPI's arithmetic types and operators; 16-bit
// floats travel as 16-bit words, reduced by mpi_half_ops' user operators (data movement
// needs no arithmetic at all).
MPI_Datatype mpi_type(DType dtype, OpType op) {
  switch (dtype) {
    case DType::Float32: return MPI_FLOAT;
    case DType::Int64: return MPI_INT64_T;
    case DType::Int32: return MPI_INT32_T;
    case DType::Float16:
    case DType::BFloat16: return mpi::half_carrier_type();
    default: break;
  }
  throw InvalidArgument(fmt::format(
      "mpi {}: unsupported dtype {}; expected float32, int64, int32, float16 or bfloat16",
      op_type_name(op), dtype_name(dtype)));
}

// Runs inside an operation's body, where MPI calls are serialized: the 16-bit operators
// are created there at first use.
MPI_Op mpi_op(DType dtype, ReduceOp op) {
  if (half::is_half_dtype(dtype)) return mpi::half_reduce_op(dtype, op);
  switch (op) {
    case ReduceOp::Sum:
    case ReduceOp::Avg: return MPI_SUM;  // avg = sum / size, divided afterwards
    case ReduceOp::Max: return MPI_MAX;
    case ReduceOp::Min: return MPI_MIN;
  }
  throw InternalError("unhandled ReduceOp");
}

// avg = sum / size, in the tensor's own precision (see check_avg_dtype).
void divide_by(const Tensor& t, int size) {
  if (half::is_half_dtype(t.dtype())) {
    half::divide_in_place(t, size);
    return;
  }
  float* p = t.data<float>();
  const float d = static_cast<float>(size);
  for (int64_t i = 0; i < t.numel(); ++i) p[i] /= d;
}

int mpi_count(int64_t numel, OpType op, const char* what) {
  if (numel > INT_MAX) {
    throw InvalidArgument(fmt::format(
        "mpi {}: {} has {} elements; MPI counts are int, so at most {} are supported",
        op_type_name(op), what, numel, INT_MAX));
  }
  return static_cast<int>(numel);
}

void check_tensor(const Tensor& t, OpType op, const char* what) {
  if (!t.defined()) {
    throw InvalidArgument(fmt::format("mpi {}: {} is an undefined tensor", op_type_name(op), what));
  }
  if (!t.device().is_cpu()) {
    throw InvalidArgument(fmt::format("mpi {}: {} must be a CPU tensor, found {} (use nccl for GPUs)",
                                      op_type_name(op), what, t.device().str()));
  }
}

// A Work whose waiter runs the operation itself when it is next in line and nothing is
// running (Note [MPI operations on the waiting thread]).
class MpiWork final : public Work {
 public:
  MpiWork(OpType op, uint64_t seq, std::vector<Tensor> keep_alive, Millis group_timeout)
      : Work(op, seq, std::move(keep_alive)), group_timeout_(group_timeout) {}

  // Set once, before the task is submitted.
  void set_task_id(uint64_t id) { task_id_ = id; }

  void wait() override {
    MpiRuntime::instance().run_if_next(task_id_);
    Work::wait();
  }

  void wait(Millis timeout) override {
    // A waiter running the operation returns only when it is done or the job ends at
    // the group's timeout; a caller willing to wait less leaves it to the
    // communication thread.
    if (timeout >= group_timeout_) MpiRuntime::instance().run_if_next(task_id_);
    Work::wait(timeout);
  }

 private:
  const Millis group_timeout_;
  uint64_t task_id_ = 0;
};

class MpiProcessGroup final : public ProcessGroup {
 public:
  MpiProcessGroup(int rank, int size, ProcessGroupOptions options, MPI_Comm comm)
      : ProcessGroup(rank, size, std::move(options)), comm_(comm) {}

  // Frees the communicator after every operation already queued (FIFO); does not wait,
  // so destroying a group whose operation timed out cannot hang.
  ~MpiProcessGroup() override {
    auto task = std::make_shared<MpiTask>();
    task->description = fmt::format("MPI_Comm_free of group '{}'", options().name);
    task->timeout = options().timeout;
    MPI_Comm comm = comm_;
    task->body = [comm]() mutable { MTRAIN_MPI_CHECK(MPI_Comm_free(&comm)); };
    task->finish = [](std::exception_ptr) {};
    MpiRuntime::instance().submit(std::move(task));
  }

  std::string backend_name() const override { return "mpi"; }

  WorkPtr allreduce(Tensor& tensor, ReduceOp op) override {
    constexpr OpType kOp = OpType::AllReduce;
    check_tensor(tensor, kOp, "tensor");
    const MPI_Datatype type = mpi_type(tensor.dtype(), kOp);
    check_avg_dtype(kOp, op, tensor.dtype());
    const int count = mpi_count(tensor.numel(), kOp, "tensor");
    const int size = this->size();
    return enqueue(kOp, {tensor}, [=, comm = comm_] {
      MTRAIN_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, tensor.raw_data(), count, type,
                                     mpi_op(tensor.dtype(), op), comm));
      if (op == ReduceOp::Avg) divide_by(tensor, size);
    });
  }

  WorkPtr broadcast(Tensor& tensor, int root) override {
    constexpr OpType kOp = OpType::Broadcast;
    check_tensor(tensor, kOp, "tensor");
    check_root(root);
    const MPI_Datatype type = mpi_type(tensor.dtype(), kOp);
    const int count = mpi_count(tensor.numel(), kOp, "tensor");
    return enqueue(kOp, {tensor}, [=, comm = comm_] {
      MTRAIN_MPI_CHECK(MPI_Bcast(tensor.raw_data(), count, type, root, comm));
    });
  }

  WorkPtr allgather(const Tensor& input, Tensor& output) override {
    constexpr OpType kOp = OpType::AllGather;
    check_tensor(input, kOp, "input");
    check_tensor(output, kOp, "output");
    check_same_dtype(kOp, input, output);
    check_allgather_sizes(input, output);
    const MPI_Datatype type = mpi_type(input.dtype(), kOp);
    const int count = mpi_count(input.numel(), kOp, "input");
    mpi_count(output.numel(), kOp, "output");
    return enqueue(kOp, {input, output}, [=, comm = comm_] {
      const Tensor source = separate_from(input, output);
      MTRAIN_MPI_CHECK(MPI_Allgather(source.raw_data(), count, type, output.raw_data(), count, type, comm));
    });
  }

  WorkPtr allgatherv(const Tensor& input, Tensor& output,
                     const std::vector<int64_t>& counts) override {
    constexpr OpType kOp = OpType::AllGatherV;
    check_tensor(input, kOp, "input");
    check_tensor(output, kOp, "output");
    check_same_dtype(kOp, input, output);
    check_allgatherv_sizes(input, output, counts);
    std::vector<int> recv_counts(counts.size());
    std::vector<int> displacements(counts.size());
    int64_t offset = 0;
    for (size_t r = 0; r < counts.size(); ++r) {
      recv_counts[r] = mpi_count(counts[r], kOp, "a rank's chunk");
      displacements[r] = mpi_count(offset, kOp, "the output offset of a rank's chunk");
      offset += counts[r];
    }
    const MPI_Datatype type = mpi_type(input.dtype(), kOp);
    const int count = recv_counts[rank()];
    return enqueue(kOp, {input, output},
                   [=, comm = comm_, recv_counts = std::move(recv_counts),
                    displacements = std::move(displacements)] {
                     const Tensor source = separate_from(input, output);
                     MTRAIN_MPI_CHECK(MPI_Allgatherv(source.raw_data(), count, type, output.raw_data(),
                                                     recv_counts.data(), displacements.data(), type,
                                                     comm));
                   });
  }

  WorkPtr reduce_scatter(const Tensor& input, Tensor& output, ReduceOp op) override {
    constexpr OpType kOp = OpType::ReduceScatter;
    check_tensor(input, kOp, "input");
    check_tensor(output, kOp, "output");
    check_same_dtype(kOp, input, output);
    check_reduce_scatter_sizes(input, output);
    const MPI_Datatype type = mpi_type(input.dtype(), kOp);
    check_avg_dtype(kOp, op, input.dtype());
    const int count = mpi_count(output.numel(), kOp, "output");
    mpi_count(input.numel(), kOp, "input");
    const int size = this->size();
    return enqueue(kOp, {input, output}, [=, comm = comm_] {
      const Tensor source = separate_from(input, output);
      MTRAIN_MPI_CHECK(MPI_Reduce_scatter_block(source.raw_data(), output.raw_data(), count, type,
                                                mpi_op(input.dtype(), op), comm));
      if (op == ReduceOp::Avg) divide_by(output, size);
    });
  }

  WorkPtr barrier() override {
    return enqueue(OpType::Barrier, {}, [comm = comm_] { MTRAIN_MPI_CHECK(MPI_Barrier(comm)); });
  }

 private:
  WorkPtr enqueue(OpType op, std::vector<Tensor> tensors, std::function<void()> body) {
    const uint64_t seq = next_seq_++;
    auto work = std::make_shared<MpiWork>(op, seq, std::move(tensors), options().timeout);
    auto task = std::make_shared<MpiTask>();
    task->description = fmt::format("{} #{} of group '{}'", op_type_name(op), seq, options().name);
    task->timeout = options().timeout;
    task->body = std::move(body);
    task->finish = [work](std::exception_ptr error) {
      if (error) {
        work->mark_failed(std::move(error));
      } else {
        work->mark_completed();
      }
    };
    work->set_task_id(task->id);
    MpiRuntime::instance().submit(std::move(task));
    return work;
  }

  const MPI_Comm comm_;
  std::atomic<uint64_t> next_seq_{0};
};

}  // namespace

std::unique_ptr<ProcessGroup> create_mpi_process_group(int rank, int size,
                                                       ProcessGroupOptions options) {
  // Before the collective MPI_Comm_dup: a timeout of 0 would expire it at once and leave
  // the runtime broken for every later group.
  check_group_arguments(rank, size, options);
  MpiRuntime& runtime = MpiRuntime::instance();
  if (rank != runtime.world_rank() || size != runtime.world_size()) {
    throw InvalidArgument(fmt::format(
        "mpi process group '{}': asked for rank {} of {}, but this process is rank {} of {} in "
        "MPI_COMM_WORLD{}; the mpi backend spans the whole MPI world (start the job with "
        "mpirun -np {})",
        options.name, rank, size, runtime.world_rank(), runtime.world_size(),
        started_by_mpirun() ? "" : " (not started by mpirun, so MPI runs as a 1-rank singleton)",
        size));
  }
  // MPI_Comm_dup is collective: it goes through the queue and the watchdog like any
  // operation, so a rank that never creates the group makes the others time out.
  auto created = std::make_shared<std::promise<MPI_Comm>>();
  auto task = std::make_shared<MpiTask>();
  task->description = fmt::format("MPI_Comm_dup creating group '{}'", options.name);
  task->timeout = options.timeout;
  auto comm = std::make_shared<MPI_Comm>(MPI_COMM_NULL);
  task->body = [comm] {
    MTRAIN_MPI_CHECK(MPI_Comm_dup(MPI_COMM_WORLD, comm.get()));
    // Errors on the group's communicator come back as codes for MTRAIN_MPI_CHECK
    // instead of aborting the job (MPI_ERRORS_ARE_FATAL is the default).
    MTRAIN_MPI_CHECK(MPI_Comm_set_errhandler(*comm, MPI_ERRORS_RETURN));
  };
  task->finish = [created, comm](std::exception_ptr error) {
    if (error) {
      created->set_exception(std::move(error));
    } else {
      created->set_value(*comm);
    }
  };
  std::future<MPI_Comm> result = created->get_future();
  runtime.submit(std::move(task));
  return std::make_unique<MpiProcessGroup>(rank, size, std::move(options), result.get());
}

bool started_by_mpirun() {
  return std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr || std::getenv("PMIX_RANK") != nullptr;
}

// Note [A failing rank under mpirun]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// MPI_Finalize waits until every rank reaches it (Open MPI: a PMIx fence), so a rank that fails
// while the others train would hang in its finalisation at exit, mpirun would never see it leave,
// and the others would wait --timeout in their next collective. A process leaving with an error
// therefore calls abort_mpi_job_on_error first: with more than one rank it ends the whole job with
// MPI_Abort(exit_code), as mpirun's users expect ("when a rank exits non-zero, mpirun aborts the
// others").
void abort_mpi_job_on_error(const char* program, int exit_code) {
  if (mpi::MpiRuntime::started_world_size() <= 1) return;
  std::fprintf(stderr, "%s: ending the MPI job (MPI_Abort %d): this rank failed, and MPI_Finalize would wait for "
               "the others\n", program, exit_code);
  std::fflush(stderr);
  abort_mpi_job(exit_code);
}

void abort_mpi_job(int exit_code) {
  int initialised = 0;
  int finalised = 0;
  MPI_Initialized(&initialised);
  MPI_Finalized(&finalised);
  if (initialised && !finalised) {
    // Called from any thread on purpose: the communication thread may be stuck in MPI.
    MPI_Abort(MPI_COMM_WORLD, exit_code);
  }
  std::exit(exit_code);
}

}  // namespace mtrain

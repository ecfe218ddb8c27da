#include "collectives/mpi/mpi_half_ops.h"

#include <fmt/format.h>

#include "collectives/half_math.h"
#include "collectives/mpi/mpi_runtime.h"
#include "core/error.h"

namespace mtrain::mpi {
namespace {

// MPI's contract for a user function: inout[i] = in[i] (op) inout[i] for *len elements
// of the datatype the operation was called with (always half_carrier_type() here).
template <DType D, ReduceOp Op>
void combine(void* in, void* inout, int* len, MPI_Datatype* /*type*/) {
  static const half::ReduceFn fn = half::reduce_fn(D, Op);
  fn(inout, in, inout, static_cast<size_t>(*len));
}

struct HalfOps {
  MPI_Op float16[3];   // sum, max, min
  MPI_Op bfloat16[3];

  // Every combine is commutative (float addition, max and min are), which lets MPI pick
  // its fastest algorithm. The operators live until MPI_Finalize, which frees them.
  HalfOps() {
    create(&combine<DType::Float16, ReduceOp::Sum>, &float16[0]);
    create(&combine<DType::Float16, ReduceOp::Max>, &float16[1]);
    create(&combine<DType::Float16, ReduceOp::Min>, &float16[2]);
    create(&combine<DType::BFloat16, ReduceOp::Sum>, &bfloat16[0]);
    create(&combine<DType::BFloat16, ReduceOp::Max>, &bfloat16[1]);
    create(&combine<DType::BFloat16, ReduceOp::Min>, &bfloat16[2]);
  }
  static void create(MPI_User_function* fn, MPI_Op* op) {
    MTRAIN_MPI_CHECK(MPI_Op_create(fn, /*commute=*/1, op));
  }
};

int op_index(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum:
    case ReduceOp::Avg: return 0;
    case ReduceOp::Max: return 1;
    case ReduceOp::Min: return 2;
  }
  throw InternalError(fmt::format("unhandled reduce op {}", static_cast<int>(op)));
}

}  // namespace

MPI_Op half_reduce_op(DType dtype, ReduceOp op) {
  if (!half::is_half_dtype(dtype)) {
    throw InvalidArgument(fmt::format("mpi 16-bit float reduction: expected a float16 or bfloat16 "
                                      "tensor, found {}",
                                      dtype_name(dtype)));
  }
  static const HalfOps ops;
  return dtype == DType::Float16 ? ops.float16[op_index(op)] : ops.bfloat16[op_index(op)];
}

}  // namespace mtrain::mpi

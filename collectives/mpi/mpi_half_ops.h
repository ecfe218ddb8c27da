// MPI reduction operators for float16 and bfloat16, which MPI has no arithmetic types
// for: user functions (MPI_Op_create) over MPI_UINT16_T that combine through
// collectives/half_math, so MPI rounds exactly as the Gloo backend does (Note
// [Half-precision reductions]). Internal to the MPI backend.
#pragma once

#include <mpi.h>

#include "collectives/process_group.h"

namespace mtrain::mpi {

// The datatype a float16/bfloat16 buffer is reduced as, with half_reduce_op's operators.
inline MPI_Datatype half_carrier_type() { return MPI_UINT16_T; }

// The operator for a float16/bfloat16 reduction: sum (also for avg, which divides
// afterwards), max or min. Creates the operators at first use, so it must run inside
// an operation's body, serialized like every MPI call (Note [MPI backend threading]).
// InvalidArgument for any other dtype.
MPI_Op half_reduce_op(DType dtype, ReduceOp op);

}  // namespace mtrain::mpi

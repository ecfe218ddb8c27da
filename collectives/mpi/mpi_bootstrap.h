// Bytes from MPI_COMM_WORLD's rank 0 to every rank, for bootstrapping what MPI can carry
// before any process group exists (the store address under mpirun, see
// trainer/setup/worker_store.h). Defined only in builds with MPI (MTRAIN_HAVE_MPI).
#pragma once

#include <string>

#include "store/store.h"

namespace mtrain {

// Collective over MPI_COMM_WORLD: rank 0's `value` is returned on every rank (other
// ranks' `value` is ignored). Runs through the MPI runtime's queue under its
// watchdog, so a rank that never calls it makes the others fail with CommError after
// `timeout` instead of hanging. `what` names the payload in errors.
std::string mpi_broadcast_from_rank0(const std::string& value, const std::string& what, Millis timeout);

// This process's rank and size in MPI_COMM_WORLD (initialising MPI on first use).
int mpi_world_rank();
int mpi_world_size();

}  // namespace mtrain

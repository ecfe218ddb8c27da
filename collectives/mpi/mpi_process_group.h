// The Open MPI backend of ProcessGroup. Only compiled when CMake finds MPI (then
// MTRAIN_HAVE_MPI is defined for everything that links mtrain_collectives).
//
// Operations of every group run one at a time, in the order the process issued them, across
// groups too: ranks must issue collectives of different groups in the same order (as with c10d's
// MPI backend). Notes in mpi_runtime.cpp: [MPI backend threading], [MPI operations on the waiting
// thread], [MPI timeouts]. A program that initialised MPI itself before the first group must have
// asked for MPI_THREAD_SERIALIZED or more and must not call MPI while groups exist. After an
// operation times out the process must exit; abort_mpi_job() is the quickest way.
#pragma once

#include <memory>

#include "collectives/process_group.h"

namespace mtrain {

// A group over all of MPI_COMM_WORLD (a duplicate communicator per group). rank and
// size must equal the process's MPI world rank and size (InvalidArgument otherwise).
std::unique_ptr<ProcessGroup> create_mpi_process_group(int rank, int size,
                                                       ProcessGroupOptions options);

// True when the process was started by mpirun/mpiexec (OMPI_COMM_WORLD_SIZE or
// PMIX_RANK is set).
bool started_by_mpirun();

// MPI_Abort(MPI_COMM_WORLD, exit_code): ends every rank of the job; for a process whose
// collective timed out (Note [MPI timeouts]). Exits with exit_code when MPI was never
// initialised.
[[noreturn]] void abort_mpi_job(int exit_code);

// For a process leaving with an error (Note [A failing rank under mpirun] in
// mpi_process_group.cpp): when it started MPI with more than one rank, prints why and ends
// the whole job with MPI_Abort(exit_code); otherwise returns and the process exits as usual.
void abort_mpi_job_on_error(const char* program, int exit_code);

}  // namespace mtrain

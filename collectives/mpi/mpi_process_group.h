// The Open MPI backend of ProcessGroup. Only compiled when CMake finds MPI (then
// MTRAIN_HAVE_MPI is defined for everything that links mtrain_collectives).
//
// Note [MPI backend threading]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Every MPI call of the process, MPI_Init_thread and MPI_Finalize included, runs on one
// process-wide communication thread (collectives/mpi/mpi_runtime.h); groups only queue
// work for it. MPI is initialised on that thread asking for MPI_THREAD_SERIALIZED,
// which is all one calling thread needs and what every Open MPI build provides. The
// queue is shared by all groups, so operations run in the order the process issued
// them, across groups too: ranks must issue collectives of different groups in the
// same order (as with c10d's MPI backend). If the program initialised MPI itself
// before the first group, it must have asked for MPI_THREAD_SERIALIZED or more and
// must not call MPI while groups exist; MPI is then left for the program to finalise.
//
// Note [MPI timeouts]
// ~~~~~~~~~~~~~~~~~~~
// An MPI collective cannot be cancelled. A watchdog fails the Work of an operation
// that exceeds the group's timeout with a TimeoutError naming the operation, group and
// sequence number (MPI cannot tell which ranks never arrived), and fails every other
// queued or later operation with a CommError: the communication thread stays blocked
// inside MPI forever and the collective order is broken. The process must then exit;
// at exit MPI is not finalised (that would hang), so mpirun sees a rank leave without
// MPI_Finalize and tears the job down. abort_mpi_job() (MPI_Abort) ends every rank at
// once and is the quickest way out.
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

}  // namespace mtrain

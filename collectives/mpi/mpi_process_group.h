// The Open MPI backend of ProcessGroup. Only compiled when CMake finds MPI (then
// MTRAIN_HAVE_MPI is defined for everything that links mtrain_collectives).
//
// Note [MPI backend threading]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Groups only queue work; one process-wide queue (collectives/mpi/mpi_runtime.h) runs
// it one operation at a time, in the order the process issued it, across groups too:
// ranks must issue collectives of different groups in the same order (as with c10d's
// MPI backend). A process-wide communication thread makes MPI_Init_thread,
// MPI_Finalize and every operation's MPI calls, except that a thread waiting for the
// next operation may run it itself (Note [MPI operations on the waiting thread]).
// Since never two threads are inside MPI at once, MPI_THREAD_SERIALIZED is all that is
// asked for, and every Open MPI build provides it. If the program initialised MPI
// itself before the first group, it must have asked for MPI_THREAD_SERIALIZED or more
// and must not call MPI while groups exist; MPI is then left for the program to
// finalise.
//
// Note [MPI operations on the waiting thread]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Handing each operation to the communication thread costs two thread wake-ups, and
// for a caller that issues and waits at once (mtrain-bench, SyncBatchNorm, metrics)
// both lie on the critical path: 10-40 us per all-reduce on the 2-core VM, 10-30 % of
// a 1 MiB all-reduce (docs/benchmarks.md). So, as in the Gloo backend, a waiter whose
// operation is next in line while nothing runs takes it off the queue and makes the
// MPI call on its own thread. That alone rarely happens: the communication thread,
// woken by the issue and having slept longer, preempts the issuer on its core (mpirun
// binds each rank to one core) and takes the operation first, about 9 times in 10 in a
// throwaway test. Both of the runtime's threads therefore run under SCHED_BATCH, whose
// wake-ups never preempt a running thread: an issued operation starts on the
// communication thread when a core is free or at the next scheduler tick, and an
// operation waited on at once runs on the waiter with no hand-off at all (417 times
// in 420 in the same test). MTRAIN_MPI_THREAD_SCHED=normal gives the two threads
// normal scheduling again.
//
// An MPI call cannot be interrupted, so a waiter running a collective that never
// completes cannot receive its TimeoutError. When the watchdog finds the running
// operation past its deadline and on a waiting thread, it prints the TimeoutError's
// message and ends the job with MPI_Abort (exit status 1), which is what a program
// must do after an MPI timeout anyway (Note [MPI timeouts]). wait(timeout) with a
// timeout shorter than the group's never runs the operation itself, so it always
// returns by its own timeout.
//
// Note [MPI timeouts]
// ~~~~~~~~~~~~~~~~~~~
// An MPI collective cannot be cancelled. A watchdog fails the Work of an operation
// that runs longer than its group's timeout (counted from when it starts: one queued
// behind a slow operation of another group is not late) with a TimeoutError naming the operation, group and
// sequence number (MPI cannot tell which ranks never arrived), and fails every other
// queued or later operation with a CommError: the thread running it stays blocked
// inside MPI forever and the collective order is broken (when that thread is the
// waiter itself, see Note [MPI operations on the waiting thread]). The process must then exit;
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

// Note [A failing rank under mpirun]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// MPI_Finalize waits until every rank reaches it (Open MPI: a PMIx fence), so a rank
// that fails while the others train would hang in its finalisation at exit, mpirun would
// never see it leave, and the others would wait --timeout (30 min by default) in their
// next collective. A process leaving with an error calls this first: when it started
// MPI with more than one rank, it prints why and ends the whole job with
// MPI_Abort(exit_code), as mpirun's users expect ("when a rank exits non-zero, mpirun
// aborts the others"); otherwise it returns and the process exits as usual.
void abort_mpi_job_on_error(const char* program, int exit_code);

}  // namespace mtrain

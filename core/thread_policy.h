// Scheduling policy and nice value of the calling thread, for helper threads that must not compete
// with the training thread on equal terms (Note [Gloo event-loop priority], Note [MPI
// operations on the waiting thread]).
#pragma once

namespace mtrain {

// Switches the calling thread to `policy` (SCHED_IDLE, SCHED_BATCH, ...) at static
// priority 0. A refusal is not an error: the thread keeps its policy, and the reason
// is logged at debug level naming `what`. Returns whether the switch happened.
bool set_this_thread_policy(int policy, const char* what);

// Sets the calling thread's nice value (threads it starts later inherit it). A refusal
// is logged at debug level naming `what`, as above. Returns whether it was set.
bool set_this_thread_nice(int nice, const char* what);

// The calling thread's nice value.
int own_nice();

}  // namespace mtrain

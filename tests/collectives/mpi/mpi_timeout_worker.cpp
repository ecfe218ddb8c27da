// Run under `mpirun -np 2`: rank 1 never joins an allreduce. Rank 0 must fail within
// the group's timeout with a TimeoutError naming the operation, group and sequence
// number, fail the operation queued behind it and any later one with a CommError, and
// then end the job: with abort_mpi_job (Note [MPI timeouts]), or with the argument
// `return` by returning from main, which must not hang on the communication thread
// stuck in MPI (Note [MPI runtime shutdown]). Prints "MPI-TIMEOUT-CHECKED" only when
// every check held.
//
// With the argument `waiter`, rank 0 waits for the stuck all-reduce at once, so its own
// thread runs it inside MPI and cannot receive an error: the watchdog must then print
// the timeout and end the job itself (Note [MPI operations on the waiting thread]).
// The pass line is that message. Rank 0 keeps to one CPU there, so the communication
// thread (SCHED_BATCH) cannot take the operation between the issue and the wait.
//
// With the argument `queued`, nothing times out: an all-reduce of a group with a 10 s
// timeout waits 2.5 s for rank 1, and an all-reduce of a group with a 1 s timeout queued
// behind it must then succeed, since its clock starts when it does (Note [MPI
// timeouts]). Prints "MPI-QUEUED-CHECKED".
#include <fmt/format.h>
#include <sched.h>

#include <chrono>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>

#include "collectives/mpi/mpi_process_group.h"
#include "core/error.h"

namespace {

using Clock = std::chrono::steady_clock;

void expect(bool ok, const std::string& what) {
  if (!ok) {
    std::printf("MPI-TIMEOUT-FAILED: %s\n", what.c_str());
    std::fflush(stdout);
    mtrain::abort_mpi_job(1);
  }
}

template <class E, class Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const E& e) {
    return e.what();
  } catch (const std::exception& e) {
    return fmt::format("<wrong exception type: {}>", e.what());
  }
  return "<no exception>";
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "abort";
  const bool end_by_returning = mode == "return";
  using namespace mtrain;
  const int rank = std::atoi(std::getenv("OMPI_COMM_WORLD_RANK") ? std::getenv("OMPI_COMM_WORLD_RANK") : "0");
  const int size = std::atoi(std::getenv("OMPI_COMM_WORLD_SIZE") ? std::getenv("OMPI_COMM_WORLD_SIZE") : "1");
  if (size != 2) {
    std::printf("MPI-TIMEOUT-FAILED: expected mpirun -np 2, found %d ranks\n", size);
    return 1;
  }
  if (mode == "waiter" && rank == 0) {
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(sched_getcpu(), &one);
    if (sched_setaffinity(0, sizeof one, &one) != 0) {
      std::printf("MPI-TIMEOUT-FAILED: sched_setaffinity: %s\n", std::strerror(errno));
      return 1;
    }
  }
  if (mode == "queued") {
    ProcessGroupOptions slow_options, quick_options;
    slow_options.name = "slow";
    slow_options.timeout = Millis(10000);
    quick_options.name = "quick";
    quick_options.timeout = Millis(1000);
    auto slow = create_mpi_process_group(rank, size, slow_options);
    auto quick = create_mpi_process_group(rank, size, quick_options);
    quick->barrier()->wait();
    if (rank == 1) std::this_thread::sleep_for(std::chrono::milliseconds(2500));
    Tensor a = Tensor::full({1000}, 1.0f), b = Tensor::full({1000}, 2.0f);
    WorkPtr first = slow->allreduce(a);
    WorkPtr second = quick->allreduce(b);
    second->wait();
    first->wait();
    expect(a.data<float>()[0] == 2.0f && b.data<float>()[999] == 4.0f, "queued all-reduce results");
    std::printf("MPI-QUEUED-CHECKED on rank %d\n", rank);
    return 0;
  }
  ProcessGroupOptions options;
  options.name = "timeout";
  options.timeout = Millis(1500);
  auto group = create_mpi_process_group(rank, size, options);
  group->barrier()->wait();
  if (rank == 1) {
    // Never joins; rank 0 ends the job. Give up on our own only if that never happens.
    std::this_thread::sleep_for(std::chrono::seconds(30));
    std::printf("MPI-TIMEOUT-FAILED: rank 1 was not ended by rank 0's abort\n");
    return 1;
  }
  Tensor t = Tensor::full({1000}, 1.0f);
  if (mode == "waiter") {
    group->allreduce(t)->wait();  // must never return: the watchdog ends the job
    std::printf("MPI-TIMEOUT-FAILED: the all-reduce rank 1 never joined returned\n");
    std::fflush(stdout);
    abort_mpi_job(1);
  }
  const auto start = Clock::now();
  WorkPtr stuck = group->allreduce(t);
  WorkPtr behind = group->allreduce(t);
  // The caller's own shorter wait times out first, naming the op.
  const std::string short_wait = error_of<TimeoutError>([&] { stuck->wait(Millis(100)); });
  expect(short_wait.find("allreduce #1") != std::string::npos, "short wait: " + short_wait);
  const std::string timed_out = error_of<TimeoutError>([&] { stuck->wait(); });
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  expect(timed_out.find("allreduce #1 of group 'timeout'") != std::string::npos &&
             timed_out.find("1500 ms") != std::string::npos,
         "timeout error: " + timed_out);
  expect(seconds >= 1.4 && seconds < 6.0, fmt::format("timed out after {:.2f} s, expected ~1.5 s", seconds));
  const std::string queued = error_of<CommError>([&] { behind->wait(Millis(1000)); });
  expect(queued.find("allreduce #2") != std::string::npos && queued.find("timed out") != std::string::npos,
         "queued op: " + queued);
  const std::string later = error_of<CommError>([&] { group->barrier()->wait(Millis(1000)); });
  expect(later.find("barrier #3") != std::string::npos, "later op: " + later);
  std::printf("MPI-TIMEOUT-CHECKED after %.2f s: %s\n", seconds, timed_out.c_str());
  std::fflush(stdout);
  if (end_by_returning) return 3;
  abort_mpi_job(3);
}

// The worker's stop machinery in-process: which signal does what (Note [Stopping on a
// signal]), how the ranks' votes combine under all-reduce(max) (Note [Stop votes]), and
// that a real signal reaches the flag the training loop reads.
#include <signal.h>

#include <catch2/catch.hpp>

#include <algorithm>
#include <vector>

#include "trainer/gradient_sync.h"
#include "trainer/stop_signals.h"

using mtrain::StopSignalAction;

namespace {

constexpr int64_t kSecond = 1'000'000'000;

}  // namespace

TEST_CASE("the first stop signal asks for a stop; a second SIGTERM or SIGINT means now") {
  using mtrain::classify_stop_signal;
  for (int sig : {SIGTERM, SIGINT, SIGUSR1}) {
    CHECK(classify_stop_signal(0, 0, sig, 5 * kSecond) == StopSignalAction::kRequestStop);
  }
  // Two seconds later: a deliberate second signal.
  CHECK(classify_stop_signal(SIGTERM, kSecond, SIGTERM, 3 * kSecond) == StopSignalAction::kExitImmediately);
  CHECK(classify_stop_signal(SIGTERM, kSecond, SIGINT, 3 * kSecond) == StopSignalAction::kExitImmediately);
  CHECK(classify_stop_signal(SIGUSR1, kSecond, SIGTERM, 3 * kSecond) == StopSignalAction::kExitImmediately);
  // SIGUSR1 is a warning: repeating it never forces an exit.
  CHECK(classify_stop_signal(SIGTERM, kSecond, SIGUSR1, 30 * kSecond) == StopSignalAction::kIgnoreRepeat);
  CHECK(classify_stop_signal(SIGUSR1, kSecond, SIGUSR1, 30 * kSecond) == StopSignalAction::kIgnoreRepeat);
  // The same SIGTERM delivered by slurmstepd and by the launcher, a few ms apart.
  CHECK(classify_stop_signal(SIGTERM, kSecond, SIGTERM, kSecond + 5'000'000) == StopSignalAction::kIgnoreRepeat);
  CHECK(classify_stop_signal(SIGTERM, kSecond, SIGTERM, kSecond + mtrain::kDuplicateSignalWindowNs) ==
        StopSignalAction::kExitImmediately);
  // The same two copies handled on two threads at once: the second handler runs between
  // the first one's publishing the signal and its storing the time.
  CHECK(classify_stop_signal(SIGTERM, 0, SIGTERM, 5 * kSecond) == StopSignalAction::kIgnoreRepeat);
  CHECK(classify_stop_signal(SIGTERM, 0, SIGINT, 5 * kSecond) == StopSignalAction::kIgnoreRepeat);
}

TEST_CASE("the maximum of the ranks' votes names the highest signal and the lowest rank that got it") {
  using mtrain::decode_stop_vote;
  using mtrain::encode_stop_vote;
  CHECK(encode_stop_vote(0, 3) == 0);
  CHECK(decode_stop_vote(0).signal == 0);
  for (int rank : {0, 1, 7, 4095, 1 << 30}) {
    const auto v = decode_stop_vote(encode_stop_vote(SIGUSR1, rank));
    CHECK(v.signal == SIGUSR1);
    CHECK(v.rank == rank);
  }
  // What all-reduce(max) computes over ranks 0..3 when ranks 1 and 3 got SIGTERM and
  // rank 2 SIGUSR1.
  const std::vector<int64_t> votes = {encode_stop_vote(0, 0), encode_stop_vote(SIGTERM, 1),
                                      encode_stop_vote(SIGUSR1, 2), encode_stop_vote(SIGTERM, 3)};
  const auto agreed = decode_stop_vote(*std::max_element(votes.begin(), votes.end()));
  CHECK(agreed.signal == SIGTERM);
  CHECK(agreed.rank == 1);
  CHECK(mtrain::stop_signal_name(SIGTERM) == "SIGTERM");
  CHECK(mtrain::stop_signal_name(SIGUSR1) == "SIGUSR1");
}

TEST_CASE("a real signal sets the pending stop, and a world of one agrees with itself") {
  mtrain::install_stop_signal_handlers();
  mtrain::clear_pending_stop_signal();
  REQUIRE(mtrain::pending_stop_signal() == 0);
  REQUIRE(::raise(SIGUSR1) == 0);  // the default action would end this test binary
  CHECK(mtrain::pending_stop_signal() == SIGUSR1);
  REQUIRE(::raise(SIGUSR1) == 0);  // a repeat changes nothing
  CHECK(mtrain::pending_stop_signal() == SIGUSR1);

  // LocalGradients takes the vote of the synchronizing micro-batch only.
  mtrain::LocalGradients local;
  local.before_backward({8, false, mtrain::encode_stop_vote(SIGUSR1, 0)});
  CHECK(local.agreed_stop_vote() == 0);
  local.before_backward({8, true, mtrain::encode_stop_vote(mtrain::pending_stop_signal(), 0)});
  CHECK(mtrain::decode_stop_vote(local.agreed_stop_vote()).signal == SIGUSR1);
  mtrain::clear_pending_stop_signal();
  CHECK(mtrain::pending_stop_signal() == 0);
}

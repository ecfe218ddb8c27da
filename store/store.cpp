// The parts of store.h that are not tied to a transport: byte/string conversion, the
// barrier built on add/set/wait, and job-token generation.
#include "store/store.h"

#include <sys/random.h>

#include <algorithm>
#include <cerrno>

#include "store/socket.h"
#include "store/wire.h"
#include "core/error.h"

namespace mtrain {

Bytes to_bytes(const std::string& s) { return Bytes(s.begin(), s.end()); }

std::string to_string(const Bytes& b) { return std::string(b.begin(), b.end()); }

// Note [Store barrier]
// ~~~~~~~~~~~~~~~~~~~~
// Keys: "__barrier/<name>/arrived" (a counter) and "__barrier/<name>/done/<g>".
// Each arrival adds 1 to the counter; arrival number a (1-based) belongs to generation
// g = (a - 1) / n, and the arrival that completes a generation (a % n == 0) sets
// done/<g>, which everyone of that generation waits for. The counter is never reset,
// so a name can be reused with no clean-up race: the next n arrivals form generation
// g + 1. Whoever completes generation g deletes done/<g - 1>; that is safe because each
// of the n participants arrives at g only after its wait for g - 1 returned. So after a
// barrier two keys remain per name (the counter and the latest done key). Every use of
// one name must pass the same n, and each participant must call it once per round.
void Store::barrier(const std::string& name, int64_t n, Millis timeout) {
  if (n < 1) {
    throw InvalidArgument(
        fmt::format("barrier '{}': expected at least 1 participant, found n = {}", name, n));
  }
  if (timeout.count() <= 0) {
    throw InvalidArgument(fmt::format("barrier '{}': expected a positive timeout, found {} ms",
                                      name, timeout.count()));
  }
  const auto start = std::chrono::steady_clock::now();
  const std::string base = "__barrier/" + name + "/";
  const std::string counter = base + "arrived";
  const int64_t arrival = add(counter, 1);
  const int64_t generation = (arrival - 1) / n;
  const std::string done = base + "done/" + std::to_string(generation);
  if (arrival % n == 0) {
    set(done, std::string("1"));
    if (generation > 0) delete_key(base + "done/" + std::to_string(generation - 1));
  }
  const auto elapsed =
      std::chrono::duration_cast<Millis>(std::chrono::steady_clock::now() - start);
  // The add/set above may have used the whole budget; still ask once, briefly.
  const Millis left = std::max(timeout - elapsed, Millis{1});
  try {
    wait({done}, left);
  } catch (const TimeoutError&) {
    std::string arrived;
    try {
      // Later arrivals may already belong to the next generation; never report > n.
      const int64_t in_generation = std::clamp<int64_t>(add(counter, 0) - generation * n, 0, n);
      arrived = fmt::format("{} of {}", in_generation, n);
    } catch (const Error&) {
      arrived = fmt::format("an unknown number (the store did not answer) of {}", n);
    }
    throw TimeoutError(fmt::format("barrier '{}' timed out after {} ms: {} participants arrived",
                                   name, timeout.count(), arrived));
  }
}

std::string generate_store_token() {
  uint8_t raw[32];
  size_t filled = 0;
  while (filled < sizeof raw) {
    const ssize_t n = ::getrandom(raw + filled, sizeof raw - filled, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      throw IoError(fmt::format("cannot generate the store token: getrandom failed: {}",
                                store_socket::errno_text(errno)));
    }
    filled += static_cast<size_t>(n);
  }
  std::string hex;
  hex.reserve(2 * sizeof raw);
  for (const uint8_t byte : raw) hex += fmt::format("{:02x}", byte);
  return hex;
}

}  // namespace mtrain

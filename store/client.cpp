// TcpStore: the client side of the store protocol (docs/store-protocol.md).
//
// Note [Store client connection state]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A request is a frame out and a frame back, each under the call's deadline. When a
// call fails part-way (its deadline passes, the server closes, a reply is malformed)
// the connection is no longer in a known state: a reply may still be in flight, or a
// WAIT may still be parked on the server. The client then closes the socket (which also
// makes the server forget the parked WAIT) and the next call reconnects, retrying for
// at most min(connect_timeout, that call's timeout). Nothing is retried behind the
// caller's back: a request that may have been applied (add) is never sent twice.
// A wait() that times out reconnects at once, for at most kDiagnoseBudget, to ask the
// server which keys are still missing so that the TimeoutError can name them; if that
// fails the error names every key waited for.
#include <netinet/in.h>
#include <poll.h>
#include <spdlog/spdlog.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <mutex>
#include <optional>
#include <thread>

#include "store/store.h"
#include "store/socket.h"
#include "store/wire.h"
#include "core/error.h"

namespace mtrain {

namespace {

using namespace store_socket;
using namespace store_wire;

constexpr auto kFirstBackoff = std::chrono::milliseconds(10);
constexpr auto kMaxBackoff = std::chrono::milliseconds(1000);
constexpr auto kFirstWaitReport = std::chrono::seconds(2);  // a store on its way is there by then
constexpr auto kWaitReportEvery = std::chrono::seconds(5);
constexpr auto kDiagnoseBudget = std::chrono::milliseconds(2000);

// One request's description and deadline, for messages and for every poll().
struct Call {
  std::string what;  // "set of key 'a'"
  Millis budget;
  Clock::time_point deadline;
};

Call make_call(std::string what, Millis budget) {
  return Call{std::move(what), budget, Clock::now() + budget};
}

// The reply did not come before the call's deadline (see Note [Store client connection
// state]); wait() catches it to name the missing keys.
class ReplyTimeout : public TimeoutError {
 public:
  using TimeoutError::TimeoutError;
};

// The server closed (or reset) the connection before its reply: during the handshake,
// what it does to a wrong token (Note [Store handshake]).
class ConnectionLost : public CommError {
 public:
  using CommError::CommError;
};

// The reply is not a store reply (no frame, or a malformed one): during the handshake, a
// sign that something else listens at the address.
class NotAStoreReply : public CommError {
 public:
  using CommError::CommError;
};

std::string seconds_text(Millis m) { return fmt::format("{:g} s", m.count() / 1000.0); }

void check_key(const std::string& key) {
  if (key.size() > kMaxKeyBytes) {
    throw InvalidArgument(fmt::format("store key {} has {} bytes; the cap is {} bytes",
                                      quote_key(key), key.size(), kMaxKeyBytes));
  }
}

void check_value(const std::string& key, const Bytes& value, const char* which) {
  if (value.size() > kMaxValueBytes) {
    throw InvalidArgument(fmt::format("store {} for key {} has {} bytes; the cap is {} bytes",
                                      which, quote_key(key), value.size(), kMaxValueBytes));
  }
}

void check_key_list(const std::vector<std::string>& keys, const char* op) {
  if (keys.size() > kMaxKeysPerRequest) {
    throw InvalidArgument(fmt::format("store {} of {} keys: the cap is {} keys per request", op,
                                      keys.size(), kMaxKeysPerRequest));
  }
  size_t payload = 1 + 4;
  for (const auto& k : keys) {
    check_key(k);
    payload += 4 + k.size();
  }
  if (payload > kMaxFrameBytes) {
    throw InvalidArgument(fmt::format(
        "store {} of {} keys needs a {}-byte frame; the cap is {} bytes: split the keys", op,
        keys.size(), payload, kMaxFrameBytes));
  }
}

}  // namespace

struct TcpStore::Impl {
  std::string host;
  uint16_t port;
  std::string token;
  Millis connect_timeout;
  std::string where;  // "host:port" for messages
  std::mutex mutex;   // one request at a time (see store.h)
  UniqueFd fd;

  // The handshake gets `handshake_budget` but ends by `latest` (a reconnect inside a
  // call must not outlast that call's deadline).
  void connect(Clock::time_point deadline, Millis budget, Millis handshake_budget,
               Clock::time_point latest);
  bool try_address(const SocketAddress& address, Clock::time_point deadline, std::string& error);
  void handshake(Millis budget, Clock::time_point latest);
  void ensure_connected(const Call& call);
  void send_all(const Bytes& frame, const Call& call);
  void receive_exact(uint8_t* data, size_t size, const Call& call);
  Bytes receive_frame(const Call& call);
  // Sends `frame`, returns the reply payload. Any failure drops the connection.
  Bytes request(const Bytes& frame, const Call& call);
  [[noreturn]] void fail_connection_lost(const Call& call, int err);
  // Reads the status byte; throws the server's error. Returns the status.
  // The reply's status; KEY_MISSING only where `key_missing_allowed` (GET), ERROR thrown.
  Status read_status(FrameReader& r, const Call& call, bool key_missing_allowed = false);
  void wait(const std::vector<std::string>& keys, Clock::time_point deadline, Millis budget,
            const std::string& what);
  std::optional<std::vector<std::string>> missing_keys(const std::vector<std::string>& keys);

  template <class Fn>
  auto parse(const Call& call, Fn&& fn) {
    try {
      return fn();
    } catch (const ProtocolError& e) {
      fd.reset();
      throw NotAStoreReply(fmt::format("store at {} sent a malformed reply to the {}: {}", where,
                                  call.what, e.what()));
    }
  }
};

void TcpStore::Impl::connect(Clock::time_point deadline, Millis budget, Millis handshake_budget,
                             Clock::time_point latest) {
  auto backoff = kFirstBackoff;
  std::string last_error = "no attempt made";
  const auto started = Clock::now();
  auto next_report = started + kFirstWaitReport;
  while (true) {
    std::vector<SocketAddress> addresses;
    try {
      addresses = resolve(host, port);
    } catch (const CommError& e) {
      last_error = e.what();  // a temporary resolver failure; a name that does not exist throws at once
    }
    for (const auto& address : addresses) {
      if (try_address(address, deadline, last_error)) {
        handshake(handshake_budget, latest);
        return;
      }
    }
    const auto now = Clock::now();
    if (now >= deadline) {
      throw CommError(fmt::format("could not reach the store at {} after {}: {}", where,
                                  seconds_text(budget), last_error));
    }
    if (now >= next_report) {
      // A worker waiting for a store that is not there says so, with what it has seen.
      spdlog::warn("still waiting for the store at {} ({:.0f} s of {}): {}", where,
                   std::chrono::duration<double>(now - started).count(), seconds_text(budget), last_error);
      next_report = now + kWaitReportEvery;
    }
    std::this_thread::sleep_for(std::min<Clock::duration>(backoff, deadline - now));
    backoff = std::min(backoff * 2, kMaxBackoff);
  }
}

bool TcpStore::Impl::try_address(const SocketAddress& address, Clock::time_point deadline,
                                 std::string& error) {
  UniqueFd s(::socket(address.family(), SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (!s.valid()) {
    error = fmt::format("socket: {}", errno_text(errno));
    return false;
  }
  int err = 0;
  if (::connect(s.get(), address.get(), address.length) != 0) {
    err = errno;
    if (err == EINPROGRESS) {
      pollfd p{s.get(), POLLOUT, 0};
      int n;
      do {
        n = ::poll(&p, 1, poll_timeout_ms(deadline));
      } while (n < 0 && errno == EINTR);
      if (n == 0) {
        error = fmt::format("connecting to {} timed out", describe(address));
        return false;
      }
      socklen_t len = sizeof err;
      if (n < 0 || ::getsockopt(s.get(), SOL_SOCKET, SO_ERROR, &err, &len) != 0) err = errno;
    }
  }
  if (err != 0) {
    error = errno_text(err);
    return false;
  }
  set_no_delay(s.get(), "at " + where);
  fd = std::move(s);
  return true;
}

// Note [Store handshake]: the server answers a right token with OK and says nothing at
// all to a wrong one, it just closes. So a close before the OK means "rejected"; any
// other failure (a reply that is no store frame, a status other than OK) means something
// else answers at that address, and its own error is kept.
void TcpStore::Impl::handshake(Millis budget, Clock::time_point latest) {
  const Clock::time_point now = Clock::now();
  const Clock::time_point deadline = std::min(now + budget, latest);
  const Call call{"handshake",
                  std::chrono::ceil<Millis>(std::max<Clock::duration>(deadline - now, {})),
                  deadline};
  const Bytes hello = FrameWriter()
                          .op(Opcode::kHello)
                          .u32(kHelloMagic)
                          .u32(kProtocolVersion)
                          .bytes(token)
                          .finish();
  try {
    const Bytes payload = request(hello, call);
    parse(call, [&] {
      FrameReader r(payload.data(), payload.size());
      read_status(r, call);  // only OK (ERROR throws, KEY_MISSING is malformed here)
      r.expect_end("HELLO reply");
    });
  } catch (const ReplyTimeout&) {
    throw TimeoutError(fmt::format(
        "the store at {} accepted the connection but did not answer the handshake within {} (is it at "
        "its connection limit, or is something else listening there?)",
        where, seconds_text(call.budget)));
  } catch (const ConnectionLost&) {
    throw CommError(fmt::format(
        "store at {} rejected the job token (check MTRAIN_STORE_TOKEN)", where));
  } catch (const NotAStoreReply& e) {
    throw CommError(fmt::format("{} (is something other than an mtrain store listening at {}?)",
                                e.what(), where));
  }
}

void TcpStore::Impl::ensure_connected(const Call& call) {
  if (fd.valid()) return;
  const auto now = Clock::now();
  const auto deadline = std::min(now + connect_timeout, call.deadline);
  const Millis budget = std::chrono::duration_cast<Millis>(deadline - now);
  spdlog::debug("store client reconnecting to {}", where);
  connect(deadline, budget, call.budget, call.deadline);
}

[[noreturn]] void TcpStore::Impl::fail_connection_lost(const Call& call, int err) {
  fd.reset();
  if (err == 0 || err == EPIPE || err == ECONNRESET) {
    throw ConnectionLost(fmt::format(
        "the store at {} closed the connection during {}{}; has the server exited?", where,
        call.what, err == 0 ? "" : fmt::format(" ({})", errno_text(err))));
  }
  throw CommError(fmt::format("store at {}: {} failed: {}", where, call.what, errno_text(err)));
}

void TcpStore::Impl::send_all(const Bytes& frame, const Call& call) {
  size_t done = 0;
  while (done < frame.size()) {
    const ssize_t n =
        ::send(fd.get(), frame.data() + done, frame.size() - done, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      done += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK) fail_connection_lost(call, errno);
    pollfd p{fd.get(), POLLOUT, 0};
    const int ready = ::poll(&p, 1, poll_timeout_ms(call.deadline));
    if (ready == 0) {
      fd.reset();
      throw ReplyTimeout(fmt::format("store {} at {} could not send its request within {}",
                                     call.what, where, seconds_text(call.budget)));
    }
    // poll errors (EINTR) and POLLERR/POLLHUP: the next send() reports what happened.
  }
}

void TcpStore::Impl::receive_exact(uint8_t* data, size_t size, const Call& call) {
  size_t done = 0;
  while (done < size) {
    const ssize_t n = ::recv(fd.get(), data + done, size - done, MSG_DONTWAIT);
    if (n > 0) {
      done += static_cast<size_t>(n);
      continue;
    }
    if (n == 0) fail_connection_lost(call, 0);
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) fail_connection_lost(call, errno);
    pollfd p{fd.get(), POLLIN, 0};
    const int ready = ::poll(&p, 1, poll_timeout_ms(call.deadline));
    if (ready == 0) {
      fd.reset();
      throw ReplyTimeout(fmt::format("store {} at {} got no reply within {}", call.what, where,
                                     seconds_text(call.budget)));
    }
  }
}

Bytes TcpStore::Impl::receive_frame(const Call& call) {
  uint8_t prefix[kLengthPrefixBytes];
  receive_exact(prefix, sizeof prefix, call);
  const uint32_t length = load_u32_le(prefix);
  if (length == 0 || length > kMaxFrameBytes) {
    fd.reset();
    throw NotAStoreReply(fmt::format("store at {} sent a reply frame of {} bytes to {} (expected 1 to {})",
                                where, length, call.what, kMaxFrameBytes));
  }
  Bytes payload(length);
  receive_exact(payload.data(), payload.size(), call);
  return payload;
}

Bytes TcpStore::Impl::request(const Bytes& frame, const Call& call) {
  ensure_connected(call);
  send_all(frame, call);
  return receive_frame(call);
}

Status TcpStore::Impl::read_status(FrameReader& r, const Call& call, bool key_missing_allowed) {
  const auto status = static_cast<Status>(r.u8("status"));
  if (status == Status::kError) {
    const auto kind = static_cast<ErrorKind>(r.u8("error kind"));
    const std::string message = r.string(kMaxErrorMessageBytes, "error message");
    if (kind == ErrorKind::kInvalidArgument) throw InvalidArgument(message);
    fd.reset();
    throw CommError(fmt::format("store at {} refused the {}: {}", where, call.what, message));
  }
  if (status != Status::kOk && status != Status::kKeyMissing) {
    throw ProtocolError(fmt::format("unknown reply status 0x{:02x}", static_cast<int>(status)));
  }
  if (status == Status::kKeyMissing && !key_missing_allowed) {
    throw ProtocolError(fmt::format("reply status KEY_MISSING to the {}, expected OK or ERROR",
                                    call.what));
  }
  return status;
}

std::optional<std::vector<std::string>> TcpStore::Impl::missing_keys(
    const std::vector<std::string>& keys) {
  try {
    const Call call = make_call("check after a timed-out wait", kDiagnoseBudget);
    const Bytes payload = request(FrameWriter().op(Opcode::kCheck).key_list(keys).finish(), call);
    FrameReader r(payload.data(), payload.size());
    read_status(r, call);
    const uint32_t n = r.u32("missing count");
    std::vector<std::string> missing;
    for (uint32_t i = 0; i < n; ++i) {
      const uint32_t index = r.u32("missing index");
      if (index >= keys.size()) throw ProtocolError("missing-key index out of range");
      missing.push_back(keys[index]);
    }
    r.expect_end("CHECK reply");
    return missing;
  } catch (const std::exception& e) {
    spdlog::debug("store at {}: could not ask which keys are missing: {}", where, e.what());
    fd.reset();
    return std::nullopt;
  }
}

void TcpStore::Impl::wait(const std::vector<std::string>& keys, Clock::time_point deadline,
                          Millis budget, const std::string& what) {
  const Call call{what, budget, deadline};
  Bytes payload;
  try {
    payload = request(FrameWriter().op(Opcode::kWait).key_list(keys).finish(), call);
  } catch (const ReplyTimeout&) {
    const auto missing = missing_keys(keys);
    if (!missing) {
      throw TimeoutError(fmt::format("store {} at {} timed out after {}; waited for {}", what,
                                     where, seconds_text(budget), quote_keys(keys)));
    }
    if (missing->empty()) {
      throw TimeoutError(fmt::format(
          "store {} at {} timed out after {}; the keys {} appeared just after the deadline", what,
          where, seconds_text(budget), quote_keys(keys)));
    }
    throw TimeoutError(fmt::format("store {} at {} timed out after {}; {} of {} keys still missing: {}",
                                   what, where, seconds_text(budget), missing->size(), keys.size(),
                                   quote_keys(*missing)));
  }
  parse(call, [&] {
    FrameReader r(payload.data(), payload.size());
    read_status(r, call);
    r.expect_end("WAIT reply");
  });
}

// ---------------------------------------------------------------------------------------

TcpStore::TcpStore(const std::string& host, uint16_t port, const std::string& token,
                   Millis timeout, Millis connect_timeout)
    : impl_(std::make_unique<Impl>()) {
  if (token.size() > kMaxTokenBytes) {
    throw InvalidArgument(fmt::format("store token has {} bytes; the cap is {} bytes",
                                      token.size(), kMaxTokenBytes));
  }
  if (timeout.count() <= 0 || connect_timeout.count() <= 0) {
    throw InvalidArgument(fmt::format(
        "store timeouts must be positive; found timeout {} ms and connect timeout {} ms",
        timeout.count(), connect_timeout.count()));
  }
  timeout_ = timeout;
  impl_->host = host;
  impl_->port = port;
  impl_->token = token;
  impl_->connect_timeout = connect_timeout;
  impl_->where = endpoint(host, port);
  std::lock_guard lock(impl_->mutex);
  impl_->connect(Clock::now() + connect_timeout, connect_timeout, timeout,
                 Clock::time_point::max());
}

TcpStore::~TcpStore() = default;

const std::string& TcpStore::host() const { return impl_->host; }
uint16_t TcpStore::port() const { return impl_->port; }

// Each public call: validate, build the frame, one request, parse the reply with
// Impl::parse (a malformed reply drops the connection and becomes a CommError).

void TcpStore::set(const std::string& key, const Bytes& value) {
  check_key(key);
  check_value(key, value, "value");
  std::lock_guard lock(impl_->mutex);
  const Call call = make_call("set of key " + quote_key(key), timeout());
  const Bytes payload =
      impl_->request(FrameWriter().op(Opcode::kSet).bytes(key).bytes(value).finish(), call);
  impl_->parse(call, [&] {
    FrameReader r(payload.data(), payload.size());
    impl_->read_status(r, call);
    r.expect_end("SET reply");
  });
}

Bytes TcpStore::get(const std::string& key) {
  check_key(key);
  std::lock_guard lock(impl_->mutex);
  const Call call = make_call("get of key " + quote_key(key), timeout());
  while (true) {
    impl_->wait({key}, call.deadline, call.budget, call.what);
    const Bytes payload =
        impl_->request(FrameWriter().op(Opcode::kGet).bytes(key).finish(), call);
    const auto value = impl_->parse(call, [&]() -> std::optional<Bytes> {
      FrameReader r(payload.data(), payload.size());
      if (impl_->read_status(r, call, /*key_missing_allowed=*/true) == Status::kKeyMissing) {
        r.expect_end("GET reply");
        return std::nullopt;
      }
      Bytes v = r.value("value");
      r.expect_end("GET reply");
      return v;
    });
    if (value) return *value;
    // Deleted between the WAIT and the GET: wait again within the same deadline.
  }
}

int64_t TcpStore::add(const std::string& key, int64_t delta) {
  check_key(key);
  std::lock_guard lock(impl_->mutex);
  const Call call = make_call("add on key " + quote_key(key), timeout());
  const Bytes payload =
      impl_->request(FrameWriter().op(Opcode::kAdd).bytes(key).i64(delta).finish(), call);
  return impl_->parse(call, [&] {
    FrameReader r(payload.data(), payload.size());
    impl_->read_status(r, call);
    const int64_t sum = r.i64("sum");
    r.expect_end("ADD reply");
    return sum;
  });
}

Bytes TcpStore::compare_set(const std::string& key, const Bytes& expected, const Bytes& desired) {
  check_key(key);
  check_value(key, expected, "expected value");
  check_value(key, desired, "desired value");
  std::lock_guard lock(impl_->mutex);
  const Call call = make_call("compare_set of key " + quote_key(key), timeout());
  const Bytes payload = impl_->request(
      FrameWriter().op(Opcode::kCompareSet).bytes(key).bytes(expected).bytes(desired).finish(),
      call);
  return impl_->parse(call, [&] {
    FrameReader r(payload.data(), payload.size());
    impl_->read_status(r, call);
    Bytes now = r.value("value");
    r.expect_end("COMPARE_SET reply");
    return now;
  });
}

bool TcpStore::check(const std::vector<std::string>& keys) {
  check_key_list(keys, "check");
  std::lock_guard lock(impl_->mutex);
  const Call call = make_call(fmt::format("check of {} keys", keys.size()), timeout());
  const Bytes payload =
      impl_->request(FrameWriter().op(Opcode::kCheck).key_list(keys).finish(), call);
  return impl_->parse(call, [&] {
    FrameReader r(payload.data(), payload.size());
    impl_->read_status(r, call);
    const uint32_t missing = r.u32("missing count");
    if (missing > keys.size()) throw ProtocolError("more keys missing than were asked about");
    for (uint32_t i = 0; i < missing; ++i) r.u32("missing index");
    r.expect_end("CHECK reply");
    return missing == 0;
  });
}

void TcpStore::wait(const std::vector<std::string>& keys, Millis timeout) {
  check_key_list(keys, "wait");
  if (timeout.count() <= 0) {
    throw InvalidArgument(fmt::format("store wait: expected a positive timeout, found {} ms",
                                      timeout.count()));
  }
  std::lock_guard lock(impl_->mutex);
  const std::string what = fmt::format("wait for {} key{}", keys.size(), keys.size() == 1 ? "" : "s");
  impl_->wait(keys, Clock::now() + timeout, timeout, what);
}

bool TcpStore::delete_key(const std::string& key) {
  check_key(key);
  std::lock_guard lock(impl_->mutex);
  const Call call = make_call("delete of key " + quote_key(key), timeout());
  const Bytes payload =
      impl_->request(FrameWriter().op(Opcode::kDelete).bytes(key).finish(), call);
  return impl_->parse(call, [&] {
    FrameReader r(payload.data(), payload.size());
    impl_->read_status(r, call);
    const uint8_t existed = r.u8("existed");
    r.expect_end("DELETE reply");
    return existed != 0;
  });
}

int64_t TcpStore::num_keys() {
  std::lock_guard lock(impl_->mutex);
  const Call call = make_call("num_keys", timeout());
  const Bytes payload = impl_->request(FrameWriter().op(Opcode::kNumKeys).finish(), call);
  return impl_->parse(call, [&] {
    FrameReader r(payload.data(), payload.size());
    impl_->read_status(r, call);
    const int64_t n = r.i64("key count");
    r.expect_end("NUM_KEYS reply");
    return n;
  });
}

}  // namespace mtrain

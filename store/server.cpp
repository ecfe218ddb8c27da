// TcpStoreServer: one thread, one poll() loop, non-blocking sockets.
//
// Note [Store server loop]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// Every socket is non-blocking and every connection has its own input and output
// buffer, so no peer can stall the loop: half a frame just sits in that peer's input
// buffer, and a reply the peer does not read sits in its output buffer. While a
// connection has unsent output the loop stops reading from it (it polls POLLOUT only),
// which bounds what a client that never reads can make the server hold. A connection
// must authenticate within kHandshakeTimeout of being accepted; the poll timeout is the
// nearest such deadline, so a silent peer is dropped on time even when nothing else
// happens. The destructor wakes the loop through an eventfd, joins it and closes every
// socket, so it returns promptly whatever the clients are doing.
//
// Note [Store connection limits]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Connecting needs no token, so the number of connections is bounded too: the server
// shares its process's descriptors (the launcher's pipes to its workers, its own store
// clients), and a flood of idle connections must not take those away.
// * Every connection is read as soon as it is accepted, so a real client, whose HELLO
//   follows its connect at once, is through the handshake before the next accept.
// * At most kMaxPendingHandshakes connections may be waiting to present the token. Each
//   one beyond that closes the oldest of them if it has waited kPendingGrace: one that
//   has said nothing for that long is idle. Younger ones are not closed (a job's ranks
//   all connect at once), and the server never stops accepting for them: a paused
//   accept fills the kernel's backlog, and a real client behind a flood of idle ones
//   then waits out SYN retransmissions there, past its handshake timeout. So the number
//   waiting exceeds the cap by what arrives within the grace, bounded by the next rule.
// * At most max_connections() in all: the soft RLIMIT_NOFILE less kReservedDescriptors
//   for the rest of the process (and never below kMinConnections). At the cap the server
//   stops accepting, and new connections wait in the kernel's backlog until one closes.
// * Warnings about peers that never authenticated are rate-limited (kWarningsPerWindow
//   per kWarningWindow, then one line counting the rest), and a peer that closes
//   without sending a byte (a port probe) is logged at debug level only, so that no one
//   without the token can flood the launcher's stderr. An "accept failed" is said once
//   per episode.
//
// Note [Store security]
// ~~~~~~~~~~~~~~~~~~~~~
// The server binds only the address it is given (never "every interface" unless the caller
// literally passes 0.0.0.0), and every connection must present the job token (MTRAIN_STORE_TOKEN)
// as its first frame. A connection with a wrong or missing token gets no reply and is closed.
// Frames are length-prefixed with hard caps (kMaxKeyBytes etc.); a malformed or oversized frame
// closes that one connection and is logged, and the server keeps serving everyone else. The wire
// format is documented in docs/store-protocol.md.
#include <netinet/in.h>
#include <poll.h>
#include <spdlog/spdlog.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <deque>
#include <limits>
#include <memory>
#include <optional>
#include <thread>
#include <unordered_map>

#include "store/store.h"
#include "store/socket.h"
#include "store/table.h"
#include "store/wire.h"
#include "core/error.h"

namespace mtrain {

namespace {

using namespace store_socket;
using namespace store_wire;
using store_server::StoreTable;
using store_server::WaiterId;

constexpr auto kHandshakeTimeout = std::chrono::seconds(5);
constexpr auto kAcceptPause = std::chrono::milliseconds(100);
constexpr size_t kReadChunkBytes = 64 * 1024;
// Per poll round and connection, so one fast sender cannot starve the others.
constexpr size_t kReadBudgetBytes = 1024 * 1024;
// Note [Store connection limits].
constexpr size_t kMaxPendingHandshakes = 128;
constexpr auto kPendingGrace = std::chrono::seconds(1);
// Accepts per poll round, so that a flood of connections delays the others' requests
// by one bounded batch at a time.
constexpr int kAcceptsPerRound = 512;
constexpr size_t kReservedDescriptors = 256;
constexpr size_t kMinConnections = 64;
constexpr auto kWarningWindow = std::chrono::seconds(10);
constexpr int kWarningsPerWindow = 10;

size_t max_connections() {
  rlimit files{};
  if (::getrlimit(RLIMIT_NOFILE, &files) != 0 || files.rlim_cur == RLIM_INFINITY) {
    return std::numeric_limits<size_t>::max();
  }
  const auto soft = static_cast<size_t>(files.rlim_cur);
  return std::max(kMinConnections, soft > kReservedDescriptors ? soft - kReservedDescriptors : 0);
}

// Compares in time that depends only on the length of `expected`, so a peer learns
// nothing from how long a wrong guess takes. noinline keeps the optimiser from merging
// it into a caller where it might add an early exit.
[[gnu::noinline]] bool token_matches(const std::string& given, const std::string& expected) {
  uint8_t diff = given.size() == expected.size() ? 0 : 1;
  for (size_t i = 0; i < expected.size(); ++i) {
    const uint8_t g = i < given.size() ? static_cast<uint8_t>(given[i]) : 0;
    diff |= static_cast<uint8_t>(static_cast<uint8_t>(expected[i]) ^ g);
  }
  return diff == 0;
}

struct Connection {
  WaiterId id = 0;
  UniqueFd fd;
  std::string peer;
  Clock::time_point accepted_at;
  bool authenticated = false;
  bool waiting = false;  // a WAIT is parked in the table
  bool closed = false;
  Bytes in;
  size_t in_pos = 0;
  Bytes out;
  size_t out_pos = 0;

  bool has_output() const { return out_pos < out.size(); }
  size_t unread() const { return in.size() - in_pos; }
};

Bytes ok_reply() { return FrameWriter().status(Status::kOk).finish(); }

Bytes error_reply(ErrorKind kind, const std::string& message) {
  return FrameWriter()
      .status(Status::kError)
      .u8(static_cast<uint8_t>(kind))
      .bytes(message.substr(0, kMaxErrorMessageBytes))
      .finish();
}

}  // namespace

struct TcpStoreServer::Impl {
  Impl(const std::string& host_in, uint16_t port_in, const std::string& token_in, bool authenticated);
  ~Impl();

  std::string host;
  uint16_t port = 0;
  std::string token;
  std::vector<UniqueFd> listeners;
  UniqueFd wake;
  std::atomic<uint64_t> rejected{0};
  std::thread thread;

  // Owned by the loop thread. unique_ptr keeps a Connection in place while the map
  // grows, because handling one connection's request may answer another's WAIT.
  std::unordered_map<WaiterId, std::unique_ptr<Connection>> connections;
  WaiterId next_id = 1;
  StoreTable table;
  Clock::time_point accept_paused_until{};
  bool accept_failing = false;  // an "accept failed" was said and no accept succeeded since
  bool said_full = false;       // the connection cap was reported and is still reached
  // Note [Store connection limits]: read once, from the open-file limit at start.
  const size_t connection_cap = max_connections();
  size_t pending = 0;           // open connections that have not authenticated
  std::deque<WaiterId> pending_order;  // their ids in accept order (and some no longer pending)
  // Rate limit of warnings about unauthenticated peers (Note [Store connection limits]).
  Clock::time_point warning_window_start{};
  int warnings_in_window = 0;
  uint64_t warnings_suppressed = 0;
  // Answered waiters whose input may hold a request that arrived with the WAIT; they
  // are processed after the current event instead of re-entering process_frames().
  std::vector<WaiterId> resumed;

  void bind_and_listen(uint16_t requested_port);
  void run() noexcept;
  void serve();
  int next_poll_timeout() const;
  void accept_from(int listener);
  void read_from(Connection& c);
  void process_frames(Connection& c);
  void handle_frame(Connection& c, FrameReader& r);
  void handle_hello(Connection& c, FrameReader& r);
  void answer_waiters(const std::vector<WaiterId>& ready);
  void process_resumed();
  void reply(Connection& c, Bytes frame);
  void flush(Connection& c);
  void expire_handshakes();
  void reject(Connection& c, const std::string& why);
  void warn_unauthenticated(const std::string& message);
  void end_warning_window();  // says how many were suppressed once the window is over
  // The oldest connection that has not authenticated, or nullptr; the mutable form first
  // drops the ids at the front of pending_order that are no longer pending.
  const Connection* oldest_pending() const;
  Connection* oldest_pending();
  // Closes the oldest unauthenticated connection if it has waited kPendingGrace.
  void close_oldest_pending();
  void close(Connection& c, const char* why);
};

TcpStoreServer::Impl::Impl(const std::string& host_in, uint16_t port_in,
                           const std::string& token_in, bool authenticated)
    : host(host_in), token(token_in) {
  if (token.empty() && authenticated) {
    throw InvalidArgument(
        "store server token is empty; expected the job token (MTRAIN_STORE_TOKEN, see "
        "generate_store_token())");
  }
  if (token.size() > kMaxTokenBytes) {
    throw InvalidArgument(fmt::format("store server token has {} bytes; the cap is {} bytes",
                                      token.size(), kMaxTokenBytes));
  }
  bind_and_listen(port_in);
  wake.reset(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!wake.valid()) {
    throw CommError(fmt::format("store at {}: eventfd failed: {}", endpoint(host, port),
                                errno_text(errno)));
  }
  thread = std::thread([this] { run(); });
  spdlog::debug("store listening on {}", endpoint(host, port));
}

TcpStoreServer::Impl::~Impl() {
  if (thread.joinable()) {
    const uint64_t one = 1;
    // A failed write leaves the loop running and join() would hang; it cannot fail for
    // a valid eventfd below its maximum count, so treat failure as a broken invariant.
    ssize_t written;
    do {
      written = ::write(wake.get(), &one, sizeof one);
    } while (written < 0 && errno == EINTR);
    if (written != sizeof one) std::terminate();
    thread.join();
  }
}

// A name may resolve to several addresses ("localhost" -> ::1 and 127.0.0.1); listen
// on each so that a client using either spelling reaches us. Only these addresses are
// bound, never the wildcard (unless the caller passes it).
void TcpStoreServer::Impl::bind_and_listen(uint16_t requested_port) {
  const std::vector<SocketAddress> addresses = resolve(host, requested_port);
  std::optional<int> first_errno;
  std::string first_call;
  port = requested_port;
  for (SocketAddress address : addresses) {
    // Every address shares the port the first successful bind picked (still 0 before it
    // when the caller asked for any free port).
    if (address.family() == AF_INET6) {
      reinterpret_cast<sockaddr_in6*>(&address.storage)->sin6_port = htons(port);
    } else {
      reinterpret_cast<sockaddr_in*>(&address.storage)->sin_port = htons(port);
    }
    UniqueFd fd(::socket(address.family(), SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
    const char* call = "socket";
    bool ok = fd.valid();
    if (ok) {
      const int one = 1;
      // Lets a restarted launcher reuse its port while old connections sit in TIME_WAIT.
      ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
      // "::" must not silently take every IPv4 address too.
      if (address.family() == AF_INET6) {
        ::setsockopt(fd.get(), IPPROTO_IPV6, IPV6_V6ONLY, &one, sizeof one);
      }
      call = "bind";
      ok = ::bind(fd.get(), address.get(), address.length) == 0;
      if (ok) {
        call = "listen";
        ok = ::listen(fd.get(), SOMAXCONN) == 0;
      }
    }
    if (!ok) {
      const int err = errno;
      if (!first_errno) {
        first_errno = err;
        first_call = call;
      }
      spdlog::debug("store: {} on {} failed: {}", call, describe(address), errno_text(err));
      continue;
    }
    if (listeners.empty() && requested_port == 0) {
      SocketAddress bound;
      bound.length = sizeof bound.storage;
      if (::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&bound.storage), &bound.length) !=
          0) {
        throw CommError(fmt::format("store at {}: getsockname failed: {}",
                                    endpoint(host, requested_port), errno_text(errno)));
      }
      port = ntohs(bound.family() == AF_INET6
                       ? reinterpret_cast<const sockaddr_in6*>(&bound.storage)->sin6_port
                       : reinterpret_cast<const sockaddr_in*>(&bound.storage)->sin_port);
    }
    listeners.push_back(std::move(fd));
  }
  if (!listeners.empty()) {
    if (first_errno) {
      spdlog::warn("store: {} resolves to {} addresses; listening on {} of them ({} failed: {})",
                   host, addresses.size(), listeners.size(), first_call,
                   errno_text(*first_errno));
    }
    return;
  }
  const std::string where = endpoint(host, requested_port);
  if (*first_errno == EADDRINUSE) {
    throw CommError(fmt::format(
        "cannot start the store on {}: {}; port {} on {} is already in use: pick another or "
        "pass --master_port 0",
        where, errno_text(EADDRINUSE), requested_port, host));
  }
  std::string hint;
  if (*first_errno == EADDRNOTAVAIL) hint = fmt::format("; is {} an address of this machine?", host);
  if (*first_errno == EACCES) hint = "; ports below 1024 need privileges";
  throw CommError(fmt::format("cannot start the store on {}: {} failed: {}{}", where, first_call,
                              errno_text(*first_errno), hint));
}

void TcpStoreServer::Impl::run() noexcept {
  try {
    serve();
  } catch (const std::exception& e) {
    // Closing every socket turns a dead loop into CommErrors on the clients instead
    // of hangs until their timeouts.
    spdlog::error("store at {} stopped serving: {}", endpoint(host, port), e.what());
  }
  connections.clear();
  listeners.clear();
}

int TcpStoreServer::Impl::next_poll_timeout() const {
  std::optional<Clock::time_point> deadline;
  if (const Connection* oldest = oldest_pending()) deadline = oldest->accepted_at + kHandshakeTimeout;
  if (accept_paused_until > Clock::now() && (!deadline || accept_paused_until < *deadline)) {
    deadline = accept_paused_until;
  }
  if (warnings_suppressed > 0) {
    const auto window_end = warning_window_start + kWarningWindow;
    if (!deadline || window_end < *deadline) deadline = window_end;
  }
  return deadline ? poll_timeout_ms(*deadline) : -1;
}

void TcpStoreServer::Impl::serve() {
  std::vector<pollfd> fds;
  std::vector<WaiterId> ids;  // ids[i] belongs to fds[1 + listeners.size() + i]
  while (true) {
    fds.clear();
    ids.clear();
    fds.push_back({wake.get(), POLLIN, 0});
    const bool full = connections.size() >= connection_cap;
    if (full && !said_full) {
      spdlog::warn("store at {}: {} connections, the most this process's open-file limit allows (soft "
                   "RLIMIT_NOFILE less {} for everything else): new ones wait until one closes; raise "
                   "`ulimit -n` for larger jobs",
                   endpoint(host, port), connections.size(), kReservedDescriptors);
    }
    said_full = full;
    const bool accepting = Clock::now() >= accept_paused_until && !full;
    for (const auto& l : listeners) fds.push_back({l.get(), short(accepting ? POLLIN : 0), 0});
    for (const auto& [id, c] : connections) {
      fds.push_back({c->fd.get(), short(c->has_output() ? POLLOUT : POLLIN), 0});
      ids.push_back(id);
    }
    const int n = ::poll(fds.data(), fds.size(), next_poll_timeout());
    if (n < 0) {
      if (errno == EINTR) continue;
      throw CommError(fmt::format("poll failed: {}", errno_text(errno)));
    }
    if (fds[0].revents != 0) return;  // the destructor asked us to stop
    for (size_t i = 0; i < listeners.size(); ++i) {
      if (fds[1 + i].revents & POLLIN) accept_from(fds[1 + i].fd);
    }
    for (size_t i = 0; i < ids.size(); ++i) {
      const short revents = fds[1 + listeners.size() + i].revents;
      if (revents == 0) continue;
      const auto it = connections.find(ids[i]);
      if (it == connections.end()) continue;
      Connection& c = *it->second;
      if (c.closed) continue;
      try {
        if (revents & POLLOUT) {
          flush(c);
          if (!c.closed && !c.has_output()) process_frames(c);
        }
        // The POLLOUT branch may have closed it (peer gone, or a rejected frame): reading
        // a closed connection would reject and count it a second time.
        if (!c.closed && (revents & (POLLIN | POLLHUP | POLLERR | POLLNVAL))) read_from(c);
      } catch (const std::exception& e) {
        // bad_alloc on a huge legal value, or a bug: lose this peer, not the server.
        spdlog::error("store: closing connection from {} after an internal error: {}", c.peer,
                      e.what());
        close(c, "internal error");
      }
      process_resumed();
    }
    expire_handshakes();
    if (warnings_suppressed > 0) end_warning_window();
    std::erase_if(connections, [](const auto& kv) { return kv.second->closed; });
  }
}

void TcpStoreServer::Impl::accept_from(int listener) {
  for (int accepted = 0; accepted < kAcceptsPerRound; ++accepted) {
    SocketAddress peer;
    peer.length = sizeof peer.storage;
    const int fd = ::accept4(listener, reinterpret_cast<sockaddr*>(&peer.storage), &peer.length,
                             SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      const int err = errno;
      if (err == EINTR || err == ECONNABORTED || err == EPROTO) continue;
      if (err == EAGAIN || err == EWOULDBLOCK) return;
      // Out of descriptors: the pending connection stays in the backlog and the
      // listener stays readable, so pause accepting instead of spinning.
      if (!accept_failing) {
        spdlog::warn("store at {}: accept failed: {}; pausing new connections for {} ms at a "
                     "time until it succeeds",
                     endpoint(host, port), errno_text(err), kAcceptPause.count());
      }
      accept_failing = true;
      accept_paused_until = Clock::now() + kAcceptPause;
      return;
    }
    accept_failing = false;
    auto c = std::make_unique<Connection>();
    c->fd.reset(fd);
    c->peer = describe(peer);
    c->accepted_at = Clock::now();
    c->id = next_id++;
    try {
      set_no_delay(fd, "connection from " + c->peer);
    } catch (const CommError& e) {
      spdlog::warn("{}", e.what());
    }
    Connection& added = *connections.emplace(c->id, std::move(c)).first->second;
    ++pending;
    pending_order.push_back(added.id);
    try {
      read_from(added);  // Note [Store connection limits]: a real client's HELLO is there
    } catch (const std::exception& e) {
      spdlog::error("store: closing connection from {} after an internal error: {}", added.peer, e.what());
      close(added, "internal error");
    }
    if (pending > kMaxPendingHandshakes) close_oldest_pending();
    if (connections.size() >= connection_cap) return;  // serve() stops polling the listener
  }
}

const Connection* TcpStoreServer::Impl::oldest_pending() const {
  for (const WaiterId id : pending_order) {
    const auto it = connections.find(id);
    if (it != connections.end() && !it->second->closed && !it->second->authenticated) return it->second.get();
  }
  return nullptr;
}

Connection* TcpStoreServer::Impl::oldest_pending() {
  // Ids leave the queue lazily: those that authenticated or closed since go here.
  while (!pending_order.empty()) {
    const auto it = connections.find(pending_order.front());
    if (it != connections.end() && !it->second->closed && !it->second->authenticated) return it->second.get();
    pending_order.pop_front();
  }
  return nullptr;
}

void TcpStoreServer::Impl::close_oldest_pending() {
  Connection* oldest = oldest_pending();
  if (oldest == nullptr || Clock::now() - oldest->accepted_at < kPendingGrace) return;
  reject(*oldest, fmt::format("{} connections are waiting to present the job token; the "
                              "oldest, silent for {} s, is closed to make room",
                              kMaxPendingHandshakes,
                              std::chrono::duration<double>(Clock::now() - oldest->accepted_at).count()));
}

void TcpStoreServer::Impl::read_from(Connection& c) {
  // Before the handshake read no more than one legal HELLO per round, so a peer
  // without the token never makes the server buffer more than that.
  size_t budget =
      c.authenticated ? kReadBudgetBytes : kLengthPrefixBytes + kMaxHelloFrameBytes;
  const size_t unread_before = c.unread();
  while (budget > 0) {
    const size_t at = c.in.size();
    const size_t want = std::min(kReadChunkBytes, budget);
    c.in.resize(at + want);
    const ssize_t got = ::recv(c.fd.get(), c.in.data() + at, want, MSG_DONTWAIT);
    c.in.resize(at + (got > 0 ? static_cast<size_t>(got) : 0));
    if (got > 0) {
      budget -= static_cast<size_t>(got);
      continue;
    }
    if (got < 0 && errno == EINTR) continue;
    if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
    // End of stream or a reset. Complete frames already buffered are not answered: the
    // peer has gone and cannot read a reply.
    const std::string how =
        got == 0 ? "connection closed" : fmt::format("connection failed ({})", errno_text(errno));
    if (!c.authenticated && c.in.empty() && got == 0) {
      // Connected and left without a byte: a port probe or a health check, not an error.
      spdlog::debug("store at {}: connection from {} closed without a byte", endpoint(host, port),
                    c.peer);
      rejected.fetch_add(1, std::memory_order_relaxed);
      close(c, "closed before the handshake");
    } else if (!c.authenticated) {
      reject(c, fmt::format("{} before presenting the job token", how));
    } else if (c.unread() > 0) {
      reject(c, fmt::format("{} in the middle of a frame ({} bytes of it received)", how,
                            c.unread()));
    } else {
      close(c, got == 0 ? "peer closed" : "connection reset");
    }
    return;
  }
  if (c.waiting && c.unread() > unread_before) {
    reject(c, "request sent while its WAIT was still parked");
    return;
  }
  process_frames(c);
}

void TcpStoreServer::Impl::process_frames(Connection& c) {
  while (!c.closed && !c.waiting && !c.has_output() && c.unread() >= kLengthPrefixBytes) {
    const uint32_t length = load_u32_le(c.in.data() + c.in_pos);
    const size_t cap = c.authenticated ? kMaxFrameBytes : kMaxHelloFrameBytes;
    if (length == 0) {
      reject(c, "empty frame (length 0)");
      return;
    }
    if (length > cap) {
      reject(c, fmt::format("frame of {} bytes{}; the cap is {} bytes", length,
                            c.authenticated ? "" : " before the handshake", cap));
      return;
    }
    if (c.unread() < kLengthPrefixBytes + length) break;
    FrameReader reader(c.in.data() + c.in_pos + kLengthPrefixBytes, length);
    c.in_pos += kLengthPrefixBytes + length;
    try {
      handle_frame(c, reader);
    } catch (const ProtocolError& e) {
      reject(c, e.what());
      return;
    } catch (const InvalidArgument& e) {
      // A well-formed request that cannot apply (add on a non-integer): the client gets
      // the error and the connection stays usable.
      reply(c, error_reply(ErrorKind::kInvalidArgument, e.what()));
    }
  }
  if (c.closed) return;
  // Drop consumed bytes; a partial frame moves to the front once per consumed frame.
  if (c.in_pos > 0) {
    c.in.erase(c.in.begin(), c.in.begin() + static_cast<ptrdiff_t>(c.in_pos));
    c.in_pos = 0;
  }
}

void TcpStoreServer::Impl::handle_frame(Connection& c, FrameReader& r) {
  const uint8_t opcode = r.u8("opcode");
  if (!c.authenticated) {
    if (opcode != static_cast<uint8_t>(Opcode::kHello)) {
      throw ProtocolError(fmt::format(
          "opcode 0x{:02x} ({}) before the HELLO handshake (no job token presented)",
          opcode, opcode_name(opcode)));
    }
    handle_hello(c, r);
    return;
  }
  std::vector<WaiterId> ready;
  switch (static_cast<Opcode>(opcode)) {
    case Opcode::kSet: {
      std::string key = r.key();
      Bytes value = r.value("value");
      r.expect_end("SET");
      table.set(key, std::move(value), ready);
      reply(c, ok_reply());
      break;
    }
    case Opcode::kGet: {
      const std::string key = r.key();
      r.expect_end("GET");
      const Bytes* value = table.find(key);
      reply(c, value ? FrameWriter().status(Status::kOk).bytes(*value).finish()
                     : FrameWriter().status(Status::kKeyMissing).finish());
      break;
    }
    case Opcode::kAdd: {
      const std::string key = r.key();
      const int64_t delta = r.i64("delta");
      r.expect_end("ADD");
      const int64_t sum = table.add(key, delta, ready);
      reply(c, FrameWriter().status(Status::kOk).i64(sum).finish());
      break;
    }
    case Opcode::kCompareSet: {
      const std::string key = r.key();
      const Bytes expected = r.value("expected value");
      Bytes desired = r.value("desired value");
      r.expect_end("COMPARE_SET");
      const Bytes now = table.compare_set(key, expected, std::move(desired), ready);
      reply(c, FrameWriter().status(Status::kOk).bytes(now).finish());
      break;
    }
    case Opcode::kCheck: {
      const std::vector<std::string> keys = r.key_list();
      r.expect_end("CHECK");
      const std::vector<uint32_t> missing = table.missing(keys);
      FrameWriter w;
      w.status(Status::kOk).u32(static_cast<uint32_t>(missing.size()));
      for (const uint32_t i : missing) w.u32(i);
      reply(c, w.finish());
      break;
    }
    case Opcode::kWait: {
      const std::vector<std::string> keys = r.key_list();
      r.expect_end("WAIT");
      if (table.park(c.id, keys)) {
        c.waiting = true;  // answered from answer_waiters() once the keys exist
      } else {
        reply(c, ok_reply());
      }
      break;
    }
    case Opcode::kDelete: {
      const std::string key = r.key();
      r.expect_end("DELETE");
      const bool existed = table.erase(key);
      reply(c, FrameWriter().status(Status::kOk).u8(existed ? 1 : 0).finish());
      break;
    }
    case Opcode::kNumKeys:
      r.expect_end("NUM_KEYS");
      reply(c, FrameWriter().status(Status::kOk).i64(table.size()).finish());
      break;
    case Opcode::kHello:
      throw ProtocolError("second HELLO on an authenticated connection");
    default:
      throw ProtocolError(fmt::format("unknown opcode 0x{:02x} (expected 0x02 to 0x09)", opcode));
  }
  answer_waiters(ready);
}

void TcpStoreServer::Impl::handle_hello(Connection& c, FrameReader& r) {
  const uint32_t magic = r.u32("magic");
  if (magic != kHelloMagic) {
    throw ProtocolError(fmt::format("HELLO magic 0x{:08x}; expected 0x{:08x}", magic,
                                    kHelloMagic));
  }
  const uint32_t version = r.u32("protocol version");
  const std::string presented = r.string(kMaxTokenBytes, "job token");
  r.expect_end("HELLO");
  // The token is checked before anything else is said, so a peer without it learns
  // nothing, not even the protocol version.
  if (!token_matches(presented, token)) {
    throw ProtocolError("wrong job token");
  }
  if (version != kProtocolVersion) {
    // Stays unauthenticated: the client closes on this error, or the handshake
    // deadline drops it.
    reply(c, error_reply(ErrorKind::kUnsupported,
                         fmt::format("the store speaks protocol version {}, the client {}",
                                     kProtocolVersion, version)));
    return;
  }
  c.authenticated = true;
  --pending;
  reply(c, ok_reply());
}

void TcpStoreServer::Impl::answer_waiters(const std::vector<WaiterId>& ready) {
  for (const WaiterId id : ready) {
    const auto it = connections.find(id);
    if (it == connections.end() || it->second->closed) continue;
    it->second->waiting = false;
    reply(*it->second, ok_reply());
    resumed.push_back(id);
  }
}

void TcpStoreServer::Impl::process_resumed() {
  while (!resumed.empty()) {
    const WaiterId id = resumed.back();
    resumed.pop_back();
    const auto it = connections.find(id);
    if (it == connections.end()) continue;
    Connection& c = *it->second;
    if (c.closed || c.has_output()) continue;  // POLLOUT resumes it once flushed
    try {
      process_frames(c);
    } catch (const std::exception& e) {
      spdlog::error("store: closing connection from {} after an internal error: {}", c.peer,
                    e.what());
      close(c, "internal error");
    }
  }
}

void TcpStoreServer::Impl::reply(Connection& c, Bytes frame) {
  if (c.out_pos == c.out.size()) {
    c.out = std::move(frame);
    c.out_pos = 0;
  } else {
    c.out.insert(c.out.end(), frame.begin(), frame.end());
  }
  flush(c);
}

void TcpStoreServer::Impl::flush(Connection& c) {
  while (c.has_output()) {
    const ssize_t sent = ::send(c.fd.get(), c.out.data() + c.out_pos, c.out.size() - c.out_pos,
                                MSG_NOSIGNAL | MSG_DONTWAIT);
    if (sent > 0) {
      c.out_pos += static_cast<size_t>(sent);
      continue;
    }
    if (sent < 0 && errno == EINTR) continue;
    if (sent < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    close(c, "peer stopped reading");  // EPIPE / ECONNRESET: the client has gone
    return;
  }
  c.out.clear();
  c.out_pos = 0;
}

void TcpStoreServer::Impl::expire_handshakes() {
  const auto now = Clock::now();
  // In accept order, so the first one still in time ends the search.
  while (Connection* oldest = oldest_pending()) {
    if (now - oldest->accepted_at < kHandshakeTimeout) return;
    reject(*oldest, fmt::format("no job token presented within {} s",
                                std::chrono::seconds(kHandshakeTimeout).count()));
  }
}

void TcpStoreServer::Impl::reject(Connection& c, const std::string& why) {
  const std::string message =
      fmt::format("store at {}: closing the connection from {}: {}", endpoint(host, port), c.peer, why);
  if (c.authenticated) {
    spdlog::warn("{}", message);
  } else {
    warn_unauthenticated(message);
  }
  rejected.fetch_add(1, std::memory_order_relaxed);
  close(c, "rejected");
}

void TcpStoreServer::Impl::end_warning_window() {
  const auto now = Clock::now();
  if (now - warning_window_start < kWarningWindow) return;
  if (warnings_suppressed > 0) {
    spdlog::warn("store at {}: {} more connection(s) without the job token were closed (not "
                 "shown: at most {} such warnings per {} s)",
                 endpoint(host, port), warnings_suppressed, kWarningsPerWindow,
                 std::chrono::seconds(kWarningWindow).count());
  }
  warning_window_start = now;
  warnings_in_window = 0;
  warnings_suppressed = 0;
}

void TcpStoreServer::Impl::warn_unauthenticated(const std::string& message) {
  end_warning_window();
  if (warnings_in_window < kWarningsPerWindow) {
    ++warnings_in_window;
    spdlog::warn("{}", message);
  } else {
    ++warnings_suppressed;
  }
}

void TcpStoreServer::Impl::close(Connection& c, const char* why) {
  if (c.closed) return;
  spdlog::debug("store at {}: connection from {} closed ({})", endpoint(host, port), c.peer, why);
  if (!c.authenticated) --pending;
  if (c.waiting) table.unpark(c.id);
  c.waiting = false;
  c.closed = true;
  c.fd.reset();
}

TcpStoreServer::TcpStoreServer(const std::string& host, uint16_t port, const std::string& token)
    : impl_(std::make_unique<Impl>(host, port, token, true)) {}

TcpStoreServer::TcpStoreServer(const std::string& host, uint16_t port, Unauthenticated)
    : impl_(std::make_unique<Impl>(host, port, std::string(), false)) {}

TcpStoreServer::~TcpStoreServer() = default;

const std::string& TcpStoreServer::host() const { return impl_->host; }
uint16_t TcpStoreServer::port() const { return impl_->port; }
uint64_t TcpStoreServer::rejected_connections() const {
  return impl_->rejected.load(std::memory_order_relaxed);
}

}  // namespace mtrain

// The rendezvous key-value store: an abstract Store, the TCP client (TcpStore), the server
// (TcpStoreServer) and a key-prefixing view (PrefixStore). The server binds only the address it
// is given and serves only connections that present the job token (Note [Store security] in
// store/server.cpp); the wire format is docs/store-protocol.md. Blocking calls end by timeout()
// with a TimeoutError naming the keys; connection failures are CommError.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace mtrain {

using Bytes = std::vector<uint8_t>;
using Millis = std::chrono::milliseconds;

inline constexpr size_t kMaxKeyBytes = 8 * 1024;                // 8 KiB per key
inline constexpr size_t kMaxValueBytes = 64 * 1024 * 1024;      // 64 MiB per value
inline constexpr size_t kMaxKeysPerRequest = 128 * 1024;        // wait/check lists
inline constexpr size_t kMaxTokenBytes = 1024;
inline constexpr Millis kDefaultStoreTimeout{300'000};          // 5 min, as c10d

Bytes to_bytes(const std::string& s);
std::string to_string(const Bytes& b);

// Abstract store. All blocking calls honour timeout(); a TimeoutError names the keys.
class Store {
 public:
  virtual ~Store() = default;

  virtual void set(const std::string& key, const Bytes& value) = 0;
  // Blocks until `key` exists (up to timeout()), then returns its value.
  virtual Bytes get(const std::string& key) = 0;
  // Atomically adds `delta` to the integer stored at `key` (absent = 0); returns the new value.
  virtual int64_t add(const std::string& key, int64_t delta) = 0;
  // Sets `key` to `desired` if its current value equals `expected` (an absent key
  // matches an empty `expected`); returns the value after the operation.
  virtual Bytes compare_set(const std::string& key, const Bytes& expected,
                            const Bytes& desired) = 0;
  // True when every key exists, without blocking.
  virtual bool check(const std::vector<std::string>& keys) = 0;
  // Blocks until every key exists or `timeout` passes (TimeoutError names the missing keys).
  virtual void wait(const std::vector<std::string>& keys, Millis timeout) = 0;
  void wait(const std::vector<std::string>& keys) { wait(keys, timeout()); }
  // Deletes `key`; true if it existed.
  virtual bool delete_key(const std::string& key) = 0;
  virtual int64_t num_keys() = 0;

  void set(const std::string& key, const std::string& value) { set(key, to_bytes(value)); }
  std::string get_string(const std::string& key) { return to_string(get(key)); }

  // Every one of `n` participants calls barrier(name, n, t); all return once n have
  // arrived. Throws TimeoutError saying how many of n arrived. A name may be reused
  // only after every participant has left the previous barrier of that name.
  void barrier(const std::string& name, int64_t n, Millis timeout);

  Millis timeout() const { return timeout_; }
  void set_timeout(Millis t) { timeout_ = t; }

 protected:
  Millis timeout_ = kDefaultStoreTimeout;
};

// Client. Connects (retrying until `connect_timeout`, so workers may start before the
// server) and authenticates with `token`. One request at a time per client (calls are
// serialised by an internal mutex); use one client per thread for concurrency.
class TcpStore final : public Store {
 public:
  TcpStore(const std::string& host, uint16_t port, const std::string& token,
           Millis timeout = kDefaultStoreTimeout, Millis connect_timeout = kDefaultStoreTimeout);
  ~TcpStore() override;
  TcpStore(const TcpStore&) = delete;
  TcpStore& operator=(const TcpStore&) = delete;

  void set(const std::string& key, const Bytes& value) override;
  Bytes get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t delta) override;
  Bytes compare_set(const std::string& key, const Bytes& expected, const Bytes& desired) override;
  bool check(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys, Millis timeout) override;
  bool delete_key(const std::string& key) override;
  int64_t num_keys() override;
  using Store::set;
  using Store::wait;

  const std::string& host() const;
  uint16_t port() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Server: a background thread serving many clients with poll(); slow or silent clients
// cannot block the others. Throws CommError naming host:port when it cannot bind (e.g.
// "port 29500 on 127.0.0.1 is already in use; pick another or pass --master_port 0").
class TcpStoreServer {
 public:
  // port 0 picks a free port; see port(). `token` must not be empty.
  TcpStoreServer(const std::string& host, uint16_t port, const std::string& token);
  // A server that admits every client (whose HELLO carries an empty token): only for
  // workers that share no secret (Note [Workers without a shared secret] in
  // trainer/setup/worker_store.cpp), who say so in their log.
  struct Unauthenticated {};
  TcpStoreServer(const std::string& host, uint16_t port, Unauthenticated);
  ~TcpStoreServer();  // stops the thread and closes every connection
  TcpStoreServer(const TcpStoreServer&) = delete;
  TcpStoreServer& operator=(const TcpStoreServer&) = delete;

  const std::string& host() const;
  uint16_t port() const;
  // Connections closed for a bad token, malformed or oversized frames (for tests/logs).
  uint64_t rejected_connections() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Prepends `prefix + "/"` to every key; shares the underlying store (not owned).
class PrefixStore final : public Store {
 public:
  PrefixStore(std::string prefix, Store& base);
  void set(const std::string& key, const Bytes& value) override;
  Bytes get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t delta) override;
  Bytes compare_set(const std::string& key, const Bytes& expected, const Bytes& desired) override;
  bool check(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys, Millis timeout) override;
  bool delete_key(const std::string& key) override;
  int64_t num_keys() override;  // of the underlying store
  using Store::set;
  using Store::wait;

 private:
  std::string key(const std::string& k) const;
  std::string prefix_;
  Store& base_;
};

// A random 32-byte hex token for MTRAIN_STORE_TOKEN (from /dev/urandom).
std::string generate_store_token();

}  // namespace mtrain

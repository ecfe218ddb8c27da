// The store's wire format: opcodes, reply statuses, caps, and the little-endian frame
// writer/reader shared by the server, the client and the tests. The authoritative
// description is docs/store-protocol.md; keep the two in step.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "store/store.h"

namespace mtrain::store_wire {

// Every message is one frame: a uint32 little-endian length, then that many payload bytes
// starting with an Opcode (request) or a Status (reply). A frame must be consumed exactly.
// Details: Note [Store frames] in store/wire.cpp.

enum class Opcode : uint8_t {
  kHello = 0x01,       // u32 magic, u32 version, bytes token        -> kOk (or close)
  kSet = 0x02,         // key, value                                  -> kOk
  kGet = 0x03,         // key                                         -> kOk value | kKeyMissing
  kAdd = 0x04,         // key, i64 delta                              -> kOk i64 | kError
  kCompareSet = 0x05,  // key, value expected, value desired          -> kOk value
  kCheck = 0x06,       // key list                                    -> kOk u32 n, n x u32 index
  kWait = 0x07,        // key list                                    -> kOk once all exist
  kDelete = 0x08,      // key                                         -> kOk u8 existed
  kNumKeys = 0x09,     // (nothing)                                   -> kOk i64
};

enum class Status : uint8_t {
  kOk = 0x00,
  kError = 0x01,       // u8 ErrorKind, bytes message
  kKeyMissing = 0x02,  // kGet only: the key does not exist (deleted between wait and get)
};

enum class ErrorKind : uint8_t {
  kInvalidArgument = 0x01,  // the request was well-formed but cannot apply (add on "abc")
  kUnsupported = 0x02,      // the handshake asked for a protocol version this server lacks
};

inline constexpr uint32_t kHelloMagic = 0x5352544D;  // bytes "MTRS" on the wire
inline constexpr uint32_t kProtocolVersion = 1;
inline constexpr size_t kLengthPrefixBytes = 4;
// Largest legal payload: compare_set with a maximal key and two maximal values.
inline constexpr size_t kMaxFrameBytes = 1 + 3 * 4 + kMaxKeyBytes + 2 * kMaxValueBytes;
// Before the handshake only a HELLO is legal, so an unauthenticated peer gets a tiny cap.
inline constexpr size_t kMaxHelloFrameBytes = 1 + 4 + 4 + 4 + kMaxTokenBytes;
inline constexpr size_t kMaxErrorMessageBytes = 4096;

// A peer sent bytes that break the protocol. Internal to the store: the server closes
// the connection, the client turns it into a CommError.
class ProtocolError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Builds one frame; the length prefix is filled in by finish().
class FrameWriter {
 public:
  FrameWriter();
  FrameWriter& u8(uint8_t v);
  FrameWriter& u32(uint32_t v);
  FrameWriter& i64(int64_t v);
  FrameWriter& bytes(const uint8_t* data, size_t size);
  FrameWriter& bytes(const Bytes& b) { return bytes(b.data(), b.size()); }
  FrameWriter& bytes(const std::string& s);
  FrameWriter& key_list(const std::vector<std::string>& keys);
  FrameWriter& op(Opcode o) { return u8(static_cast<uint8_t>(o)); }
  FrameWriter& status(Status s) { return u8(static_cast<uint8_t>(s)); }
  size_t payload_size() const { return buf_.size() - kLengthPrefixBytes; }
  // Fills in the length prefix and hands the frame over; the writer is spent afterwards.
  Bytes finish();

 private:
  Bytes buf_;
};

// Reads the fields of one payload (without its length prefix). Every accessor throws
// ProtocolError when the payload is too short or a length exceeds its cap.
class FrameReader {
 public:
  FrameReader(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  uint8_t u8(const char* what);
  uint32_t u32(const char* what);
  int64_t i64(const char* what);
  Bytes bytes(size_t max_size, const char* what);
  std::string string(size_t max_size, const char* what);
  std::string key() { return string(kMaxKeyBytes, "key"); }
  Bytes value(const char* what) { return bytes(kMaxValueBytes, what); }
  std::vector<std::string> key_list();
  // Throws ProtocolError if bytes remain.
  void expect_end(const char* what) const;

 private:
  const uint8_t* need(size_t n, const char* what);
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
};

uint32_t load_u32_le(const uint8_t* p);

// A key as it should appear in a message: quoted, non-printable bytes as \xNN, long
// keys shortened (keys are arbitrary bytes and may be 8 KiB long).
std::string quote_key(const std::string& key);
// Up to `limit` quoted keys joined by ", ", then "and N more".
std::string quote_keys(const std::vector<std::string>& keys, size_t limit = 16);

const char* opcode_name(uint8_t opcode);

}  // namespace mtrain::store_wire

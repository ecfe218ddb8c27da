#include "store/wire.h"

#include <fmt/format.h>


namespace mtrain::store_wire {

namespace {

void store_le(uint8_t* p, uint64_t v, size_t n) {
  for (size_t i = 0; i < n; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}

uint64_t load_le(const uint8_t* p, size_t n) {
  uint64_t v = 0;
  for (size_t i = 0; i < n; ++i) v |= static_cast<uint64_t>(p[i]) << (8 * i);
  return v;
}

}  // namespace

uint32_t load_u32_le(const uint8_t* p) { return static_cast<uint32_t>(load_le(p, 4)); }

// Note [Store frames]
// ~~~~~~~~~~~~~~~~~~~
// Every message in either direction is one frame: a uint32 little-endian length N followed by N
// payload bytes. A request payload starts with a one-byte Opcode, a reply payload with a one-byte
// Status; the fields that follow are fixed-width little-endian integers or length-prefixed byte
// strings (uint32 length + bytes). A frame must be consumed exactly: missing or trailing bytes
// are a protocol error. The receiver checks the length prefix against its cap before buffering
// the payload, so a peer cannot make the other side allocate more than one legal frame.
FrameWriter::FrameWriter() : buf_(kLengthPrefixBytes, 0) {}

FrameWriter& FrameWriter::u8(uint8_t v) {
  buf_.push_back(v);
  return *this;
}

FrameWriter& FrameWriter::u32(uint32_t v) {
  const size_t at = buf_.size();
  buf_.resize(at + 4);
  store_le(buf_.data() + at, v, 4);
  return *this;
}

FrameWriter& FrameWriter::i64(int64_t v) {
  const size_t at = buf_.size();
  buf_.resize(at + 8);
  store_le(buf_.data() + at, static_cast<uint64_t>(v), 8);
  return *this;
}

FrameWriter& FrameWriter::bytes(const uint8_t* data, size_t size) {
  // Callers check sizes against the caps first; this only guards the u32 encoding.
  if (size > UINT32_MAX) throw std::length_error("store frame field over 4 GiB");
  u32(static_cast<uint32_t>(size));
  buf_.insert(buf_.end(), data, data + size);
  return *this;
}

FrameWriter& FrameWriter::bytes(const std::string& s) {
  return bytes(reinterpret_cast<const uint8_t*>(s.data()), s.size());
}

FrameWriter& FrameWriter::key_list(const std::vector<std::string>& keys) {
  u32(static_cast<uint32_t>(keys.size()));
  for (const auto& k : keys) bytes(k);
  return *this;
}

Bytes FrameWriter::finish() {
  const size_t payload = payload_size();
  if (payload > UINT32_MAX) throw std::length_error("store frame over 4 GiB");
  store_le(buf_.data(), payload, kLengthPrefixBytes);
  return std::move(buf_);
}

const uint8_t* FrameReader::need(size_t n, const char* what) {
  if (size_ - pos_ < n) {
    throw ProtocolError(fmt::format("frame ends inside the {} field (needed {} more bytes, {} left)",
                                    what, n, size_ - pos_));
  }
  const uint8_t* p = data_ + pos_;
  pos_ += n;
  return p;
}

uint8_t FrameReader::u8(const char* what) { return *need(1, what); }

uint32_t FrameReader::u32(const char* what) { return load_u32_le(need(4, what)); }

int64_t FrameReader::i64(const char* what) {
  return static_cast<int64_t>(load_le(need(8, what), 8));
}

Bytes FrameReader::bytes(size_t max_size, const char* what) {
  const uint32_t n = u32(what);
  if (n > max_size) {
    throw ProtocolError(
        fmt::format("{} of {} bytes exceeds the cap of {} bytes", what, n, max_size));
  }
  const uint8_t* p = need(n, what);
  return Bytes(p, p + n);
}

std::string FrameReader::string(size_t max_size, const char* what) {
  const uint32_t n = u32(what);
  if (n > max_size) {
    throw ProtocolError(
        fmt::format("{} of {} bytes exceeds the cap of {} bytes", what, n, max_size));
  }
  const uint8_t* p = need(n, what);
  return std::string(reinterpret_cast<const char*>(p), n);
}

std::vector<std::string> FrameReader::key_list() {
  const uint32_t n = u32("key count");
  if (n > kMaxKeysPerRequest) {
    throw ProtocolError(
        fmt::format("request lists {} keys; the cap is {} keys", n, kMaxKeysPerRequest));
  }
  // Each key needs at least its 4-byte length, so a lying count fails here before
  // reserving memory for it.
  if ((size_ - pos_) / 4 < n) {
    throw ProtocolError(fmt::format("request claims {} keys but only {} bytes follow", n,
                                    size_ - pos_));
  }
  std::vector<std::string> keys;
  keys.reserve(n);
  for (uint32_t i = 0; i < n; ++i) keys.push_back(key());
  return keys;
}

void FrameReader::expect_end(const char* what) const {
  if (pos_ != size_) {
    throw ProtocolError(
        fmt::format("{} frame has {} unexpected trailing bytes", what, size_ - pos_));
  }
}

std::string quote_key(const std::string& key) {
  constexpr size_t kShown = 96;
  std::string out = "'";
  for (size_t i = 0; i < key.size() && i < kShown; ++i) {
    const auto c = static_cast<unsigned char>(key[i]);
    if (c >= 0x20 && c < 0x7f && c != '\\' && c != '\'') {
      out.push_back(static_cast<char>(c));
    } else {
      out += fmt::format("\\x{:02x}", c);
    }
  }
  out.push_back('\'');
  if (key.size() > kShown) out += fmt::format(" (first {} of {} bytes)", kShown, key.size());
  return out;
}

std::string quote_keys(const std::vector<std::string>& keys, size_t limit) {
  std::string out;
  for (size_t i = 0; i < keys.size() && i < limit; ++i) {
    if (i > 0) out += ", ";
    out += quote_key(keys[i]);
  }
  if (keys.size() > limit) out += fmt::format(" and {} more", keys.size() - limit);
  return out;
}

const char* opcode_name(uint8_t opcode) {
  switch (static_cast<Opcode>(opcode)) {
    case Opcode::kHello: return "HELLO";
    case Opcode::kSet: return "SET";
    case Opcode::kGet: return "GET";
    case Opcode::kAdd: return "ADD";
    case Opcode::kCompareSet: return "COMPARE_SET";
    case Opcode::kCheck: return "CHECK";
    case Opcode::kWait: return "WAIT";
    case Opcode::kDelete: return "DELETE";
    case Opcode::kNumKeys: return "NUM_KEYS";
  }
  return "unknown";
}

}  // namespace mtrain::store_wire

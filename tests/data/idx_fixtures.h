// Test helpers: a scratch directory and writers for small IDX files, raw or gzip, so
// the reader's error paths can be driven byte by byte.
#pragma once

#include <zlib.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace mtrain::testing {

class ScratchDir {
 public:
  ScratchDir() {
    std::string pattern = (std::filesystem::temp_directory_path() / "mtrain-data-XXXXXX").string();
    if (mkdtemp(pattern.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    path_ = pattern;
  }
  ~ScratchDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  const std::filesystem::path& path() const { return path_; }
  std::filesystem::path operator/(const std::string& name) const { return path_ / name; }

 private:
  std::filesystem::path path_;
};

inline void append_be32(std::vector<uint8_t>& out, uint32_t v) {
  out.push_back(static_cast<uint8_t>(v >> 24));
  out.push_back(static_cast<uint8_t>(v >> 16));
  out.push_back(static_cast<uint8_t>(v >> 8));
  out.push_back(static_cast<uint8_t>(v));
}

// Header + payload of an images file; pixel (i, k) = (7 * i + k) mod 256.
inline std::vector<uint8_t> idx_images_bytes(uint32_t count, uint32_t rows, uint32_t cols,
                                             uint32_t magic = 0x00000803) {
  std::vector<uint8_t> out;
  append_be32(out, magic);
  append_be32(out, count);
  append_be32(out, rows);
  append_be32(out, cols);
  for (uint32_t i = 0; i < count; ++i) {
    for (uint32_t k = 0; k < rows * cols; ++k) out.push_back(static_cast<uint8_t>(7 * i + k));
  }
  return out;
}

inline std::vector<uint8_t> idx_labels_bytes(const std::vector<uint8_t>& labels,
                                             uint32_t magic = 0x00000801) {
  std::vector<uint8_t> out;
  append_be32(out, magic);
  append_be32(out, static_cast<uint32_t>(labels.size()));
  out.insert(out.end(), labels.begin(), labels.end());
  return out;
}

inline void write_raw(const std::filesystem::path& path, const std::vector<uint8_t>& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  if (!out) throw std::runtime_error("cannot write " + path.string());
}

inline void write_gzip(const std::filesystem::path& path, const std::vector<uint8_t>& bytes) {
  gzFile f = gzopen(path.string().c_str(), "wb");
  if (f == nullptr) throw std::runtime_error("cannot open " + path.string());
  const int written = bytes.empty() ? 0 : gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size()));
  gzclose(f);
  if (written != static_cast<int>(bytes.size())) throw std::runtime_error("gzwrite failed");
}

inline std::vector<uint8_t> read_bytes(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(in), {});
}

}  // namespace mtrain::testing

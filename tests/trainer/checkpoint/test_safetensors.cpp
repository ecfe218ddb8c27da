// safetensors: round trips, the byte layout as an independent reader sees it, files
// written the way PyTorch's `safetensors` package writes them, every kind of corrupt
// file, and atomic replacement of the target.
#include <signal.h>
#include <sys/resource.h>
#include <zlib.h>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "tests/trainer/temp_dir.h"
#include "trainer/checkpoint/weights.h"
#include "trainer/checkpoint/safetensors.h"

using mtrain::DType;
using mtrain::IoError;
using mtrain::NamedTensors;
using mtrain::Tensor;
using mtrain::testing::TempDir;
using Catch::Matchers::Contains;

namespace {

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::string u64_le(uint64_t v) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>((v >> (8 * i)) & 0xff);
  return s;
}

template <class T>
std::string raw_le(const std::vector<T>& values) {
  std::string s;
  for (T v : values) {
    unsigned char b[sizeof(T)];
    std::memcpy(b, &v, sizeof(T));  // the test host is little-endian (static_assert in the reader)
    s.append(reinterpret_cast<const char*>(b), sizeof(T));
  }
  return s;
}

// A file from a header JSON text and a data section, with the length field computed.
std::string make_file(const std::string& header_json, const std::string& data) {
  return u64_le(header_json.size()) + header_json + data;
}

NamedTensors sample_tensors() {
  return {
      {"conv.weight", Tensor::from_vector<float>({1.5f, -2.25f, 3.0f, 0.0f, -0.0f, 1e-30f}, {2, 1, 3})},
      {"bn.num_batches_tracked", Tensor::from_vector<int64_t>({123456789012345LL}, {})},
      {"fc.bias", Tensor::from_vector<float>({0.5f, 0.25f}, {2})},
      {"labels", Tensor::from_vector<int64_t>({-1, 0, 7, INT64_MAX}, {2, 2})},
      {"empty", Tensor::empty({0, 3})},
  };
}

void require_load_fails(const std::string& path, const std::string& fragment) {
  REQUIRE_THROWS_MATCHES(mtrain::load_safetensors(path), IoError,
                         Catch::Matchers::Predicate<IoError>(
                             [&](const IoError& e) {
                               const std::string m = e.what();
                               return m.find(path) != std::string::npos &&
                                      m.find(fragment) != std::string::npos;
                             },
                             "message naming the file and containing '" + fragment + "'"));
}

}  // namespace

TEST_CASE("safetensors round trip keeps names, order, dtypes, shapes, values and metadata",
          "[safetensors]") {
  TempDir dir;
  const std::string path = dir.file("w.safetensors");
  const NamedTensors in = sample_tensors();
  mtrain::save_safetensors(path, in, {{"mtrain.model", "lenet"}, {"note", "ünïcode ok"}});

  const auto file = mtrain::load_safetensors(path);
  REQUIRE(file.tensors.size() == in.size());
  for (size_t i = 0; i < in.size(); ++i) {
    INFO(in[i].first);
    CHECK(file.tensors[i].first == in[i].first);
    const Tensor& a = in[i].second;
    const Tensor& b = file.tensors[i].second;
    CHECK(b.dtype() == a.dtype());
    CHECK(b.shape() == a.shape());
    REQUIRE(b.nbytes() == a.nbytes());
    CHECK(std::memcmp(a.raw_data(), b.raw_data(), a.nbytes()) == 0);
  }
  CHECK(file.metadata.at("mtrain.model") == "lenet");
  CHECK(file.metadata.at("note") == "ünïcode ok");
  CHECK(file.metadata.at("format") == "pt");
  CHECK(file.metadata.at(mtrain::kSafetensorsVersionKey) == mtrain::kSafetensorsFormatVersion);
  CHECK(file.find("fc.bias").to_vector<float>() == std::vector<float>{0.5f, 0.25f});
  CHECK_FALSE(file.find("nope").defined());
}

TEST_CASE("safetensors header is what an independent parser expects", "[safetensors]") {
  TempDir dir;
  const std::string path = dir.file("w.safetensors");
  const NamedTensors in = sample_tensors();
  mtrain::save_safetensors(path, in);

  const std::string bytes = read_bytes(path);
  REQUIRE(bytes.size() >= 8);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(bytes[i]);
  REQUIRE(8 + n <= bytes.size());
  CHECK(n % 8 == 0);  // data section 8-aligned, as upstream pads
  const std::string data = bytes.substr(8 + n);
  const auto header = nlohmann::json::parse(bytes.substr(8, n));
  REQUIRE(header.is_object());
  CHECK(header.size() == in.size() + 1);

  uint64_t expected_begin = 0;
  for (const auto& [name, t] : in) {
    INFO(name);
    const auto& e = header.at(name);
    const char* dtype = t.dtype() == DType::Float32 ? "F32" : "I64";
    CHECK(e.at("dtype") == dtype);
    CHECK(e.at("shape").get<std::vector<int64_t>>() == t.shape());
    const auto offsets = e.at("data_offsets").get<std::vector<uint64_t>>();
    REQUIRE(offsets.size() == 2);
    CHECK(offsets[0] == expected_begin);
    CHECK(offsets[1] - offsets[0] == t.nbytes());
    CHECK(std::memcmp(data.data() + offsets[0], t.raw_data(), t.nbytes()) == 0);
    expected_begin = offsets[1];
  }
  CHECK(expected_begin == data.size());

  const auto& meta = header.at("__metadata__");
  for (const auto& [k, v] : meta.items()) CHECK(v.is_string());
  const uint32_t crc = static_cast<uint32_t>(
      ::crc32(::crc32(0L, Z_NULL, 0), reinterpret_cast<const Bytef*>(data.data()), static_cast<uInt>(data.size())));
  CHECK(meta.at("mtrain.crc32") == fmt::format("{:08x}", crc));
}

TEST_CASE("safetensors written byte by byte as PyTorch writes them load", "[safetensors]") {
  TempDir dir;
  const std::string path = dir.file("torch.safetensors");
  // What safetensors.torch.save_file({"weight": w, "bias": b, "steps": s},
  // metadata={"format": "pt"}) produces: no checksum, keys in any order, the header
  // padded with spaces to a multiple of 8, data in offset order.
  std::string header =
      R"({"__metadata__":{"format":"pt"},)"
      R"("steps":{"dtype":"I64","shape":[],"data_offsets":[24,32]},)"
      R"("bias":{"dtype":"F32","shape":[2],"data_offsets":[16,24]},)"
      R"("weight":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}})";
  header.append((8 - header.size() % 8) % 8, ' ');
  const std::string data = raw_le<float>({1.0f, 2.0f, -3.5f, 4.25f}) + raw_le<float>({0.125f, -8.0f}) +
                           raw_le<int64_t>({42});
  write_bytes(path, make_file(header, data));

  const auto file = mtrain::load_safetensors(path);
  REQUIRE(file.tensors.size() == 3);
  CHECK(file.tensors[0].first == "weight");  // data-section order
  CHECK(file.tensors[1].first == "bias");
  CHECK(file.tensors[2].first == "steps");
  CHECK(file.find("weight").shape() == mtrain::Shape{2, 2});
  CHECK(file.find("weight").to_vector<float>() == std::vector<float>{1.0f, 2.0f, -3.5f, 4.25f});
  CHECK(file.find("bias").to_vector<float>() == std::vector<float>{0.125f, -8.0f});
  CHECK(file.find("steps").shape().empty());
  CHECK(file.find("steps").to_vector<int64_t>() == std::vector<int64_t>{42});
  CHECK(file.metadata.at("format") == "pt");
  CHECK(file.metadata.count("mtrain.crc32") == 0);
}

TEST_CASE("corrupt safetensors files are rejected with a message naming the problem",
          "[safetensors]") {
  TempDir dir;
  const std::string path = dir.file("bad.safetensors");
  const std::string two_floats = raw_le<float>({1.0f, 2.0f});
  const auto header_for = [](const std::string& entries) { return "{" + entries + "}"; };

  SECTION("shorter than the length field") {
    write_bytes(path, "abc");
    require_load_fails(path, "8-byte header length");
  }
  SECTION("header length beyond the end of the file") {
    write_bytes(path, u64_le(1000) + "{}");
    require_load_fails(path, "header length 1000 exceeds");
  }
  SECTION("huge header length (not a safetensors file)") {
    write_bytes(path, std::string("PK\x03\x04zipfile-not-safetensors", 26));
    require_load_fails(path, "exceeds");
  }
  SECTION("header is not JSON") {
    write_bytes(path, make_file("{\"a\": [1, 2", ""));
    require_load_fails(path, "not valid JSON");
  }
  SECTION("binary bytes in the header are escaped in the message, which stays one line") {
    // The parser quotes what it last read, here a byte that is not UTF-8.
    write_bytes(path, make_file("{\"a\xff\x01\": 1}", ""));
    require_load_fails(path, "not valid JSON");
    try {
      mtrain::load_safetensors(path);
    } catch (const IoError& e) {
      const std::string m = e.what();
      CHECK(m.find("\\xff") != std::string::npos);
      CHECK(std::all_of(m.begin(), m.end(), [](char c) { return c >= 0x20 && c < 0x7f; }));
    }
  }
  SECTION("header is JSON but not an object") {
    write_bytes(path, make_file("[1, 2, 3]", ""));
    require_load_fails(path, "must be a JSON object");
  }
  SECTION("truncated data section") {
    const std::string file = make_file(
        header_for(R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})"), two_floats);
    write_bytes(path, file.substr(0, file.size() - 3));
    require_load_fails(path, "truncated");
  }
  SECTION("overlapping offsets") {
    write_bytes(path, make_file(header_for(R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                                           R"("b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]})"),
                                two_floats));
    require_load_fails(path, "overlaps");
  }
  SECTION("a gap between tensors") {
    write_bytes(path, make_file(header_for(R"("a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]})"),
                                two_floats));
    require_load_fails(path, "belong to no tensor");
  }
  SECTION("bytes after the last tensor") {
    write_bytes(path, make_file(header_for(R"("a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]})"),
                                two_floats));
    require_load_fails(path, "after the last tensor");
  }
  SECTION("offsets that disagree with dtype and shape") {
    write_bytes(path, make_file(header_for(R"("a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]})"),
                                two_floats));
    require_load_fails(path, "needs 12 bytes");
  }
  SECTION("end before begin") {
    write_bytes(path, make_file(header_for(R"("a":{"dtype":"F32","shape":[0],"data_offsets":[8,0]})"),
                                two_floats));
    require_load_fails(path, "end before begin");
  }
  SECTION("negative shape") {
    write_bytes(path, make_file(header_for(R"("a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]})"),
                                two_floats));
    require_load_fails(path, "non-negative integer");
  }
  SECTION("unknown dtype") {
    write_bytes(path, make_file(header_for(R"("a":{"dtype":"Q7","shape":[2],"data_offsets":[0,8]})"),
                                two_floats));
    require_load_fails(path, "unknown dtype 'Q7'");
  }
  SECTION("valid but unsupported dtype") {
    write_bytes(path, make_file(header_for(R"("a":{"dtype":"F64","shape":[1],"data_offsets":[0,8]})"),
                                two_floats));
    require_load_fails(path, "F64 is valid safetensors but mtrain cannot hold it");
  }
  SECTION("missing field") {
    write_bytes(path, make_file(header_for(R"("a":{"dtype":"F32","data_offsets":[0,8]})"), two_floats));
    require_load_fails(path, "missing \"shape\"");
  }
  SECTION("duplicate tensor names") {
    write_bytes(path, make_file(header_for(R"("a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                                           R"("a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]})"),
                                two_floats));
    require_load_fails(path, "names 'a' twice");
  }
  SECTION("metadata with a non-string value") {
    write_bytes(path, make_file(header_for(R"("__metadata__":{"step":5},)"
                                           R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})"),
                                two_floats));
    require_load_fails(path, "must be a string");
  }
  SECTION("checksum mismatch after one flipped data byte") {
    mtrain::save_safetensors(path, sample_tensors());
    std::string bytes = read_bytes(path);
    bytes[bytes.size() - 40] ^= 0x01;  // inside the data section (fc.bias)
    write_bytes(path, bytes);
    require_load_fails(path, "checksum mismatch");
  }
  SECTION("a number no double holds") {
    write_bytes(path, make_file(header_for(R"("a":{"dtype":"F32","shape":[1e999],"data_offsets":[0,8]})"),
                                two_floats));
    require_load_fails(path, "not valid JSON");
  }
  SECTION("header checksum mismatch after one changed metadata digit or one changed shape") {
    // Note [Header checksum]: the data section is intact, so only the header CRC sees it.
    mtrain::save_safetensors(path, sample_tensors(), {{"mtrain.position.steps_in_epoch", "5"}});
    const std::string original = read_bytes(path);
    std::string bytes = original;
    const size_t at = bytes.find("\"mtrain.position.steps_in_epoch\":\"5\"");
    REQUIRE(at != std::string::npos);
    bytes[bytes.find('5', at + 10)] = '1';
    write_bytes(path, bytes);
    require_load_fails(path, "header checksum mismatch");
    bytes = original;
    const size_t shape = bytes.find("\"shape\":[2,2]");
    REQUIRE(shape != std::string::npos);
    bytes.replace(shape, 13, "\"shape\":[4,1]");  // same size, same bytes: only the header knows
    write_bytes(path, bytes);
    require_load_fails(path, "header checksum mismatch");
    write_bytes(path, original);
    CHECK(mtrain::load_safetensors(path).metadata.count(mtrain::kSafetensorsHeaderChecksumKey) == 1);
  }
  SECTION("missing file") {
    REQUIRE_THROWS_WITH(mtrain::load_safetensors(dir.file("absent.safetensors")),
                        Contains("absent.safetensors") && Contains("No such file"));
  }
}

TEST_CASE("saving replaces the target atomically and leaves no temporary file", "[safetensors]") {
  TempDir dir;
  const std::string path = dir.file("model.safetensors");

  mtrain::save_safetensors(path, sample_tensors());
  CHECK(dir.entries() == std::vector<std::string>{"model.safetensors"});
  const std::string first = read_bytes(path);

  // Overwriting works and again leaves only the target.
  NamedTensors other = {{"x", Tensor::full({3}, 7.0f)}};
  mtrain::save_safetensors(path, other);
  CHECK(dir.entries() == std::vector<std::string>{"model.safetensors"});
  CHECK(mtrain::load_safetensors(path).find("x").to_vector<float>() == std::vector<float>{7, 7, 7});

  SECTION("a write that fails half way leaves the previous file intact") {
    mtrain::save_safetensors(path, sample_tensors());
    // A file-size limit makes write(2) fail with EFBIG after 64 KiB: a real I/O failure
    // in the middle of the data, without a fault-injection hook in the writer.
    NamedTensors big = {{"big", Tensor::full({1 << 20}, 1.0f)}};  // 4 MiB
    struct rlimit old_limit {};
    REQUIRE(::getrlimit(RLIMIT_FSIZE, &old_limit) == 0);
    struct rlimit small = old_limit;
    small.rlim_cur = 64 * 1024;
    auto* old_handler = ::signal(SIGXFSZ, SIG_IGN);
    REQUIRE(::setrlimit(RLIMIT_FSIZE, &small) == 0);
    bool threw = false;
    std::string message;
    try {
      mtrain::save_safetensors(path, big);
    } catch (const IoError& e) {
      threw = true;
      message = e.what();
    }
    ::setrlimit(RLIMIT_FSIZE, &old_limit);
    ::signal(SIGXFSZ, old_handler);
    REQUIRE(threw);
    CHECK_THAT(message, Contains("model.safetensors") && Contains("File too large"));
    CHECK(dir.entries() == std::vector<std::string>{"model.safetensors"});
    CHECK(read_bytes(path) == first);
  }
  SECTION("a missing directory is an IoError and creates nothing") {
    REQUIRE_THROWS_WITH(mtrain::save_safetensors(dir.file("no/such/dir/w.safetensors"), other),
                        Contains("no/such/dir") && Contains("No such file"));
    CHECK(dir.entries() == std::vector<std::string>{"model.safetensors"});
  }
}

TEST_CASE("saving rejects names safetensors cannot hold", "[safetensors]") {
  TempDir dir;
  const std::string path = dir.file("w.safetensors");
  const Tensor t = Tensor::full({1}, 1.0f);
  CHECK_THROWS_WITH(mtrain::save_safetensors(path, {{"a", t}, {"a", t}}), Contains("'a' appears twice"));
  CHECK_THROWS_WITH(mtrain::save_safetensors(path, {{"__metadata__", t}}), Contains("invalid tensor name"));
  CHECK_THROWS_WITH(mtrain::save_safetensors(path, {{"", t}}), Contains("invalid tensor name"));
  CHECK_THROWS_WITH(mtrain::save_safetensors(path, {{"u", Tensor()}}), Contains("'u' is undefined"));
  CHECK(dir.entries().empty());
}

TEST_CASE("loading weights into named destinations checks names, shapes and dtypes",
          "[safetensors][checkpoint]") {
  TempDir dir;
  const std::string path = dir.file("w.safetensors");
  mtrain::save_safetensors(path, {{"a.weight", Tensor::from_vector<float>({1, 2, 3, 4}, {2, 2})},
                                   {"a.bias", Tensor::from_vector<float>({5, 6}, {2})},
                                   {"bn.num_batches_tracked", Tensor::from_vector<int64_t>({9}, {})}});
  const auto file = mtrain::load_safetensors(path);

  SECTION("matching destinations receive the values") {
    NamedTensors dst = {{"a.bias", Tensor::zeros({2})},
                        {"a.weight", Tensor::zeros({2, 2})},
                        {"bn.num_batches_tracked", Tensor::zeros({}, DType::Int64)}};
    mtrain::load_state_into(file, dst, path);
    CHECK(dst[0].second.to_vector<float>() == std::vector<float>{5, 6});
    CHECK(dst[1].second.to_vector<float>() == std::vector<float>{1, 2, 3, 4});
    CHECK(dst[2].second.to_vector<int64_t>() == std::vector<int64_t>{9});
  }
  SECTION("missing, unexpected and mismatched names are all reported and nothing is copied") {
    NamedTensors dst = {{"a.weight", Tensor::zeros({4})},
                        {"a.bias", Tensor::zeros({2})},
                        {"b.weight", Tensor::zeros({1})}};
    REQUIRE_THROWS_MATCHES(
        mtrain::load_state_into(file, dst, path), IoError,
        Catch::Matchers::Predicate<IoError>([&](const IoError& e) {
          const std::string m = e.what();
          return m.find(path) != std::string::npos && m.find("missing b.weight") != std::string::npos &&
                 m.find("mismatched a.weight (file float32 [2, 2], model float32 [4])") != std::string::npos &&
                 m.find("unexpected bn.num_batches_tracked") != std::string::npos &&
                 m.find("was it saved from another model?") != std::string::npos;
        }, "a message listing every problem"));
    CHECK(dst[1].second.to_vector<float>() == std::vector<float>{0, 0});
  }
  SECTION("a dtype mismatch is reported") {
    NamedTensors dst = {{"a.weight", Tensor::zeros({2, 2})},
                        {"a.bias", Tensor::zeros({2})},
                        {"bn.num_batches_tracked", Tensor::zeros({})}};
    CHECK_THROWS_WITH(mtrain::load_state_into(file, dst, path),
                      Contains("bn.num_batches_tracked (file int64 [], model float32 [])"));
  }
}

// Reading and writing safetensors files: the format PyTorch (via the `safetensors` package) and
// Hugging Face use for weights, so mtrain checkpoints load into torch unchanged and torch weights
// load into mtrain. The layout and what mtrain adds to it: Note [safetensors layout] in
// safetensors.cpp. Saves are atomic (Note [Atomic writes]): the target is either the old file or
// the complete new one. Loads validate everything before returning. Free functions, no shared
// state: safe from any thread on distinct paths.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "tensor/tensor.h"

namespace mtrain {

// A name -> tensor list whose order is kept (the order tensors are laid out in a
// file, and the order a model reports its parameters in).
using NamedTensors = std::vector<std::pair<std::string, Tensor>>;

// String -> string, the only value type safetensors allows in `__metadata__`.
using SafetensorsMetadata = std::map<std::string, std::string>;

struct SafetensorsFile {
  NamedTensors tensors;  // in data-section order
  SafetensorsMetadata metadata;

  // The tensor called `name`, or an undefined Tensor.
  Tensor find(const std::string& name) const;
};

// Metadata keys mtrain writes (Note [safetensors layout]).
inline constexpr const char* kSafetensorsChecksumKey = "mtrain.crc32";         // the data section
inline constexpr const char* kSafetensorsHeaderChecksumKey = "mtrain.header_crc32";  // the rest of the header
inline constexpr const char* kSafetensorsVersionKey = "mtrain.format_version";
inline constexpr const char* kSafetensorsFormatVersion = "1";

// "F32", "I64", ... for the dtypes mtrain has; throws InvalidArgument otherwise.
const char* safetensors_dtype_name(DType dtype);
// The inverse; throws IoError naming `file` for a dtype mtrain cannot hold
// (known safetensors dtypes such as F64 get a message saying they are unsupported).
DType parse_safetensors_dtype(const std::string& name, const std::string& file);

// Writes `tensors` (CPU, any supported dtype) in the given order with `metadata`
// plus mtrain's own keys (checksum, version, format) atomically to `path`.
// Names must be unique, non-empty and not "__metadata__". Throws InvalidArgument
// for bad input and IoError (naming the path and errno text) when writing fails.
void save_safetensors(const std::string& path, const NamedTensors& tensors,
                      const SafetensorsMetadata& metadata = {});

// Reads and fully validates `path` (see Note [safetensors layout]). Throws IoError
// naming the file and what is wrong with it.
SafetensorsFile load_safetensors(const std::string& path);

// The name prefix of the temporary files a save of `path` writes beside it
// (".checkpoint.safetensors.tmp-" then the pid and a counter); a save killed before its
// rename leaves one behind.
std::string temporary_file_prefix(const std::string& path);

// Renames `from` over `to` (same directory) and fsyncs the directory, so that the rename
// survives a power cut. Throws IoError naming both and the reason.
void rename_durably(const std::string& from, const std::string& to);

// What an existing path is, for messages ("a FIFO", "a character device", ...), or
// nullopt when it is a regular file (a symlink is followed) or does not exist.
std::optional<std::string> non_regular_file_kind(const std::string& path);

// The CRC-32 (zlib polynomial) of `size` bytes, as 8 lowercase hex digits.
std::string crc32_hex(const void* data, size_t size);

}  // namespace mtrain

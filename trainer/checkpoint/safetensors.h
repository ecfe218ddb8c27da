// Reading and writing safetensors files: the format PyTorch (via the `safetensors`
// package) and Hugging Face use for weights, so mtrain checkpoints load into torch
// unchanged and torch weights load into mtrain.
//
// Note [safetensors layout]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
//   bytes [0, 8)        N, the header length, unsigned 64-bit little-endian
//   bytes [8, 8+N)      a JSON object, padded with spaces to a multiple of 8 bytes:
//                         "<name>": {"dtype": "F32", "shape": [..], "data_offsets": [b, e]}
//                         "__metadata__": {"<key>": "<string value>", ...}   (optional)
//   bytes [8+N, end)    the data section; tensor <name> is bytes [b, e) of it, raw
//                       little-endian, row-major. The tensors tile the data section
//                       exactly: no gaps, no overlaps, nothing after the last one.
// What mtrain adds lives in `__metadata__` (values must be strings there):
//   "format": "pt"                  so Hugging Face tools pick the torch loader;
//   "mtrain.format_version": "1"    bumped if what mtrain stores ever changes meaning;
//   "mtrain.crc32": "<8 hex digits>" zlib CRC-32 of the whole data section. A file
//                                   without it (e.g. written by PyTorch) is accepted;
//                                   a file with a wrong one is rejected.
//
// Note [Atomic writes]
// ~~~~~~~~~~~~~~~~~~~~
// A crash, a full disk or a kill in the middle of a save must never leave a
// half-written file under the target name (the previous checkpoint is worth more than
// a torn new one). save_safetensors writes a temporary file in the target's directory
// (same filesystem, so the rename is atomic), fsyncs it, renames it over the target
// and fsyncs the directory so the rename itself survives a power cut. On any failure
// the temporary file is removed and the target is left as it was.
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

// Metadata keys mtrain writes (see Note [safetensors layout]).
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

// What an existing path is, for messages ("a FIFO", "a character device", ...), or
// nullopt when it is a regular file (a symlink is followed) or does not exist.
std::optional<std::string> non_regular_file_kind(const std::string& path);

// The CRC-32 (zlib polynomial) of `size` bytes, as 8 lowercase hex digits.
std::string crc32_hex(const void* data, size_t size);

}  // namespace mtrain

// Images from their encoded bytes to a network's input, as torchvision's transforms do it on
// a PIL image: PNG through libpng, JPEG through libjpeg-turbo (by content, not by name),
// PIL's bilinear resample to the byte, crops, and the three ways a decoded image of any size
// becomes one of a fixed size (ImageTransform). Every decoding error is an IoError naming
// the image's place (a file's path, or "shard.tar: member").
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace mtrain::data {

// One decoded image: height x width x channels (1 or 3) bytes, row-major, interleaved.
struct DecodedImage {
  int64_t height = 0;
  int64_t width = 0;
  int64_t channels = 0;
  std::vector<uint8_t> pixels;
};

// Whether `bytes` begin as a PNG's or a JPEG's do: the images decode_image reads, told by
// content, not by name.
bool is_png_or_jpeg(const uint8_t* bytes, size_t size);
// A file's bytes, whole; IoError naming it when it cannot be opened.
std::vector<uint8_t> read_file_bytes(const std::filesystem::path& path);

// Decodes a PNG or a JPEG; `name` says where the bytes came from, for errors. An alpha
// channel is dropped, as PIL's convert("RGB") and convert("L") drop it.
DecodedImage decode_image(const std::string& name, const uint8_t* bytes, size_t size);
// The same for a file's bytes.
DecodedImage decode_image(const std::filesystem::path& path);

// PIL's Image.resize((width, height), Image.BILINEAR) of an 8-bit image, to the byte:
// a triangle filter widened by the scale when shrinking (so every source pixel counts),
// fixed-point weights, the width first, then the height. Both sizes >= 1.
DecodedImage resize_bilinear(DecodedImage image, int64_t height, int64_t width);

// A part of an image in its pixels' coordinates, fractional ends allowed.
struct SourceBox {
  double top = 0;
  double left = 0;
  double height = 0;
  double width = 0;
};
// PIL's Image.resize((width, height), Image.BILINEAR, box=(left, top, right, bottom)): the
// box's part resampled to height x width, the filter reading the pixels around the box's
// edges as well. InvalidArgument for a box outside the image.
DecodedImage resize_box_bilinear(DecodedImage image, const SourceBox& box, int64_t height, int64_t width);

// The rows [top, top + height) and columns [left, left + width) of `image`, which must
// hold them (InvalidArgument otherwise): PIL's crop((left, top, left + w, top + h)).
DecodedImage crop(const DecodedImage& image, int64_t top, int64_t left, int64_t height, int64_t width);

// A crop box in the decoded image's pixels.
struct CropBox {
  int64_t top = 0;
  int64_t left = 0;
  int64_t height = 0;
  int64_t width = 0;
};

// How a decoded image of any size becomes `height` x `width` (torchvision's transforms):
//  kResize: Resize((height, width)), the image squashed to the size;
//  kCenterCrop: Resize(shorter_side) keeping the aspect, then CenterCrop((height, width))
//    (the evaluation transform of ImageNet recipes: 256, then 224);
//  kRandomResizedCrop: RandomResizedCrop((height, width)) with torchvision's scale
//    (0.08, 1) and ratio (3/4, 4/3), each image's box drawn from (seed, epoch, index)
//    (Note [Random resized crops] in image_decode.cpp).
struct ImageTransform {
  enum class Kind { kResize, kCenterCrop, kRandomResizedCrop };
  Kind kind = Kind::kResize;
  int64_t height = 0;
  int64_t width = 0;
  int64_t shorter_side = 0;  // kCenterCrop's resize
  uint64_t seed = 0;         // kRandomResizedCrop's draws
  // decode_to_chw: a JPEG the transform shrinks is decoded at 1/2, 1/4 or 1/8 of its size
  // where what it makes stays no larger (Note [Decoding at a reduced scale]); off: always
  // at full size, torchvision's bytes exactly.
  bool reduced_decode = false;

  // One line for logs: "RandomResizedCrop(224)".
  std::string describe() const;
};

// The box RandomResizedCrop takes from an image of `image_height` x `image_width` for item
// `index` in `epoch`: ten tries of an area in [0.08, 1] of the image and a log-uniform
// aspect in [3/4, 4/3], else the largest central box of an allowed aspect.
CropBox random_resized_crop_box(uint64_t seed, int64_t epoch, int64_t index, int64_t image_height,
                                int64_t image_width);

// torchvision's Resize(size) with one int: the shorter side becomes `shorter`, the longer
// int(shorter * longer / shorter_side), as a (height, width) pair.
std::pair<int64_t, int64_t> shorter_side_size(int64_t height, int64_t width, int64_t shorter);

// `image` through `transform` (item `index` of `epoch`), written as `channels` planes of
// height x width bytes (CHW) to `out`; a gray image is repeated into 3 channels, a
// colour one becomes PIL's convert("L") luma for 1.
void transform_to_chw(DecodedImage image, const ImageTransform& transform, int64_t epoch, int64_t index,
                      int64_t channels, uint8_t* out);
// An encoded image (`name` for errors) decoded and through `transform` into `out` as
// transform_to_chw writes it; with transform.reduced_decode, at a reduced scale where it
// allows.
void decode_to_chw(const std::string& name, const uint8_t* bytes, size_t size, const ImageTransform& transform,
                   int64_t epoch, int64_t index, int64_t channels, uint8_t* out);

}  // namespace mtrain::data

#include "data/image_decode.h"

#include <fmt/format.h>
#include <png.h>

#include <cstdio>  // jpeglib.h needs FILE
#include <jpeglib.h>

#include <algorithm>
#include <cmath>
#include <csetjmp>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <memory>

#include "core/cpu_features.h"
#include "core/error.h"
#include "data/random.h"

namespace mtrain::data {
namespace {

// An image of more than 1 GiB decoded is refused as a bad file, not attempted (a corrupt
// header can claim 65,500 x 65,500 pixels).
void require_decodable_size(const std::string& name, uint64_t height, uint64_t width, uint64_t channels) {
  constexpr uint64_t kMaxBytes = uint64_t{1} << 30;
  if (height * width * channels > kMaxBytes) {
    throw IoError(fmt::format("{}: {}x{} pixels, more than 1 GiB decoded", name, height, width));
  }
}

// Note [PNGs through libpng's full API]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// libpng's simplified API would be shorter, but it corrects a file's gAMA chunk towards
// sRGB and composites alpha onto a background; PIL does neither (convert("RGB") drops
// alpha, gamma is ignored), and torchvision trains on PIL's bytes. So the full API, with
// only the transforms that give PIL's bytes: palette and low bit depths expanded,
// transparency and alpha dropped, 16 bits cut to their high byte. libpng reports errors
// by longjmp; the two functions that call into it hold only trivially destructible
// locals, and everything else is allocated outside them.
struct PngDecoder {
  png_structp png = nullptr;
  png_infop info = nullptr;
  const uint8_t* data = nullptr;
  size_t size = 0;
  size_t at = 0;
  char message[256] = "";
  PngDecoder(const uint8_t* bytes, size_t n) : data(bytes), size(n) {}
  PngDecoder(const PngDecoder&) = delete;
  PngDecoder& operator=(const PngDecoder&) = delete;
  ~PngDecoder() {
    if (png != nullptr) png_destroy_read_struct(&png, info != nullptr ? &info : nullptr, nullptr);
  }
};

void png_fail(png_structp png, png_const_charp message) {
  auto* d = static_cast<PngDecoder*>(png_get_error_ptr(png));
  std::snprintf(d->message, sizeof d->message, "%s", message);
  png_longjmp(png, 1);
}

void png_ignore_warning(png_structp, png_const_charp) {}

void png_read_memory(png_structp png, png_bytep out, size_t n) {
  auto* d = static_cast<PngDecoder*>(png_get_io_ptr(png));
  if (n > d->size - d->at) png_error(png, "the file ends early");
  std::memcpy(out, d->data + d->at, n);
  d->at += n;
}

// The header, and the transforms to PIL's bytes; false with d->message on an error.
bool png_read_header(PngDecoder* d, png_uint_32* width, png_uint_32* height, int* channels) {
  if (setjmp(png_jmpbuf(d->png))) return false;
  png_set_read_fn(d->png, d, png_read_memory);
  png_read_info(d->png, d->info);
  png_set_expand(d->png);
  png_set_strip_16(d->png);
  png_set_strip_alpha(d->png);
  png_set_interlace_handling(d->png);
  png_read_update_info(d->png, d->info);
  *width = png_get_image_width(d->png, d->info);
  *height = png_get_image_height(d->png, d->info);
  *channels = png_get_channels(d->png, d->info);
  return true;
}

bool png_read_rows(PngDecoder* d, png_bytepp rows) {
  if (setjmp(png_jmpbuf(d->png))) return false;
  png_read_image(d->png, rows);
  return true;
}

DecodedImage decode_png(const std::string& name, const uint8_t* bytes, size_t size) {
  PngDecoder d(bytes, size);
  const auto fail = [&] { return IoError(fmt::format("{}: not a readable PNG: {}", name, d.message)); };
  d.png = png_create_read_struct(PNG_LIBPNG_VER_STRING, &d, png_fail, png_ignore_warning);
  if (d.png != nullptr) d.info = png_create_info_struct(d.png);
  if (d.info == nullptr) throw IoError(fmt::format("{}: libpng could not start a decoder", name));
  png_uint_32 width = 0, height = 0;
  int channels = 0;
  if (!png_read_header(&d, &width, &height, &channels)) throw fail();
  if (channels != 1 && channels != 3) {
    throw IoError(fmt::format("{}: expected gray or RGB after dropping alpha, found {} channels", name, channels));
  }
  require_decodable_size(name, height, width, channels);
  DecodedImage out{height, width, channels,
                   std::vector<uint8_t>(static_cast<size_t>(width) * height * static_cast<size_t>(channels))};
  std::vector<png_bytep> rows(height);
  for (png_uint_32 y = 0; y < height; ++y) rows[y] = out.pixels.data() + static_cast<size_t>(y) * width * channels;
  if (!png_read_rows(&d, rows.data())) throw fail();
  return out;
}

// Note [CMYK JPEGs]
// ~~~~~~~~~~~~~~~~~
// A few photographs are CMYK JPEGs (22 of ImageNet's training images). libjpeg hands out the
// stored values, which Adobe's convention (the one PIL always assumes, "CMYK;I") stores
// inverted; PIL's convert("RGB") then takes each colour as (255 - k) scaled by (255 - c),
// in its rounded integer form. So: r = s_k - muldiv255(255 - s_c, s_k) for the stored s.
void cmyk_to_rgb(const uint8_t* cmyk, uint8_t* rgb, size_t pixels) {
  const auto muldiv255 = [](int a, int b) {
    const int t = a * b + 128;
    return ((t >> 8) + t) >> 8;
  };
  for (size_t p = 0; p < pixels; ++p) {
    const int k = cmyk[4 * p + 3];
    for (int c = 0; c < 3; ++c) {
      rgb[3 * p + static_cast<size_t>(c)] = static_cast<uint8_t>(std::clamp(k - muldiv255(255 - cmyk[4 * p + static_cast<size_t>(c)], k), 0, 255));
    }
  }
}

bool is_png(const uint8_t* bytes, size_t size) {
  static const uint8_t kPng[] = {0x89, 'P', 'N', 'G'};
  return size >= 4 && std::equal(kPng, kPng + 4, bytes);
}

bool is_jpeg(const uint8_t* bytes, size_t size) {
  return size >= 3 && bytes[0] == 0xFF && bytes[1] == 0xD8 && bytes[2] == 0xFF;
}

// Note [Decoding a crop's region]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// RandomResizedCrop keeps a box of 8 % to 100 % of the image (half of it on average), so
// most of a full decode is thrown away. libjpeg-turbo's own libjpeg API decodes a band of
// rows (jpeg_skip_scanlines passes over the rows above without their inverse DCT and colour
// conversion, and decoding stops after the band) and of columns (jpeg_crop_scanline, widened
// to whole 8x8 or 16x16 blocks); the pixels are those of a full decode
// (tests/data/test_webdataset.cpp checks it), so the crop keeps torchvision's bytes. A whole
// image is the region of all of it: every JPEG goes through this one API, which reads every
// file Pillow's libjpeg reads (TurboJPEG's header call refuses some sampling layouts). Its
// errors come by longjmp: the functions that call into it hold only trivially destructible
// locals, as the PNG decoder's do.
struct JpegRegionDecoder {
  jpeg_decompress_struct cinfo{};
  jpeg_error_mgr errors{};
  std::jmp_buf jump{};
  char message[JMSG_LENGTH_MAX] = "";
  bool created = false;
  JpegRegionDecoder() = default;
  JpegRegionDecoder(const JpegRegionDecoder&) = delete;
  JpegRegionDecoder& operator=(const JpegRegionDecoder&) = delete;
  ~JpegRegionDecoder() {
    if (created) jpeg_destroy_decompress(&cinfo);
  }
};

void jpeg_region_fail(j_common_ptr cinfo) {
  auto* d = reinterpret_cast<JpegRegionDecoder*>(cinfo->client_data);
  (*cinfo->err->format_message)(cinfo, d->message);
  std::longjmp(d->jump, 1);
}

void jpeg_region_ignore(j_common_ptr, int) {}  // warnings (a corrupt stretch of data) do not stop a decode

// The header read: the image's size is then cinfo.image_*.
bool jpeg_region_open(JpegRegionDecoder* d, const uint8_t* bytes, size_t size) {
  d->cinfo.err = jpeg_std_error(&d->errors);
  d->errors.error_exit = jpeg_region_fail;
  d->errors.emit_message = jpeg_region_ignore;
  d->cinfo.client_data = d;
  if (setjmp(d->jump)) return false;
  jpeg_create_decompress(&d->cinfo);
  d->created = true;
  jpeg_mem_src(&d->cinfo, bytes, static_cast<unsigned long>(size));
  jpeg_read_header(&d->cinfo, TRUE);
  return true;
}

// Decoding started at 1/reduction scale: the scaled size is then cinfo.output_*.
bool jpeg_region_start(JpegRegionDecoder* d, int reduction) {
  if (setjmp(d->jump)) return false;
  const J_COLOR_SPACE stored = d->cinfo.jpeg_color_space;
  d->cinfo.out_color_space = stored == JCS_GRAYSCALE                       ? JCS_GRAYSCALE
                             : stored == JCS_CMYK || stored == JCS_YCCK ? JCS_CMYK
                                                                         : JCS_RGB;
  d->cinfo.scale_num = 1;
  d->cinfo.scale_denom = static_cast<unsigned>(reduction);
  jpeg_start_decompress(&d->cinfo);
  return true;
}

// Columns [*x, *x + *width) widened to whole blocks (both updated).
bool jpeg_region_columns(JpegRegionDecoder* d, JDIMENSION* x, JDIMENSION* width) {
  if (setjmp(d->jump)) return false;
  jpeg_crop_scanline(&d->cinfo, x, width);
  return true;
}

// Rows [top, top + rows) into `out` (row_bytes apart), the rows above skipped.
bool jpeg_region_rows(JpegRegionDecoder* d, JDIMENSION top, JDIMENSION rows, uint8_t* out, size_t row_bytes) {
  if (setjmp(d->jump)) return false;
  const auto ends = [&] {
    std::snprintf(d->message, sizeof d->message, "its data ends before row %u", d->cinfo.output_scanline);
    return false;
  };
  if (top > 0 && jpeg_skip_scanlines(&d->cinfo, top) != top) return ends();
  for (JDIMENSION y = 0; y < rows;) {
    JSAMPROW row = out + static_cast<size_t>(y) * row_bytes;
    const JDIMENSION read = jpeg_read_scanlines(&d->cinfo, &row, 1);
    if (read == 0) return ends();
    y += read;
  }
  jpeg_abort_decompress(&d->cinfo);
  return true;
}

// `buffer` with room for at least n bytes (grown, so a buffer reused image after image is
// neither reallocated nor zero-filled once it is large enough).
uint8_t* room(std::vector<uint8_t>& buffer, size_t n) {
  if (buffer.size() < n) buffer.resize(n);
  return buffer.data();
}

// At least the rows [top, top + height) and columns [left, left + width) of a JPEG decoded
// at 1/reduction scale (coordinates in the scaled image), written to `pixels` (grown to
// fit): `rows` x `width` pixels from row `first_row` and column `first_column`. A band of
// kRegionMargin pixels more on every side (where the image has them) keeps the region's own
// pixels those of a full decode: at a region's edge, libjpeg's smooth upsampling of
// subsampled colour lacks its neighbour, one colour sample (two pixels) away. At full
// scale one pixel is enough in the tests (none differs in 480 boxes of 4:2:0, 4:2:2, 4:4:4
// and gray JPEGs; with none, a third do); 4 leave room, and cost less than a wider band's
// decoding. At a reduced scale the band is the resample's reach around the box, plus these.
constexpr int64_t kRegionMargin = 4;
struct JpegRegion {
  int64_t rows = 0;
  int64_t width = 0;
  int64_t channels = 0;  // 1 or 3
  int64_t first_row = 0;
  int64_t first_column = 0;
};

// `d` has read the header (jpeg_region_open).
JpegRegion decode_jpeg_region(JpegRegionDecoder& d, const std::string& name, int reduction, int64_t top,
                              int64_t height, int64_t left, int64_t width, std::vector<uint8_t>& pixels) {
  const auto fail = [&] { return IoError(fmt::format("{}: not a readable JPEG: {}", name, d.message)); };
  if (!jpeg_region_start(&d, reduction)) throw fail();
  const int64_t image_height = d.cinfo.output_height, image_width = d.cinfo.output_width;
  require_decodable_size(name, static_cast<uint64_t>(height), static_cast<uint64_t>(width),
                         static_cast<uint64_t>(d.cinfo.output_components));
  if (top < 0 || left < 0 || height < 1 || width < 1 || top + height > image_height || left + width > image_width) {
    throw InternalError(fmt::format("{}: region {}x{} at ({}, {}) outside the {}x{} image", name, height, width, top,
                                    left, image_height, image_width));
  }
  const int64_t first_row = std::max<int64_t>(top - kRegionMargin, 0);
  const int64_t rows = std::min<int64_t>(top + height + kRegionMargin, image_height) - first_row;
  const int64_t first_column = std::max<int64_t>(left - kRegionMargin, 0);
  auto x = static_cast<JDIMENSION>(first_column);
  auto w = static_cast<JDIMENSION>(std::min<int64_t>(left + width + kRegionMargin, image_width) - first_column);
  if (!jpeg_region_columns(&d, &x, &w)) throw fail();
  const int64_t components = d.cinfo.output_components;  // 1, 3, or 4 for CMYK
  const auto count = static_cast<size_t>(rows * static_cast<int64_t>(w));
  std::vector<uint8_t> cmyk(components == 4 ? count * 4 : 0);
  uint8_t* decoded = components == 4 ? cmyk.data() : room(pixels, count * static_cast<size_t>(components));
  if (!jpeg_region_rows(&d, static_cast<JDIMENSION>(first_row), static_cast<JDIMENSION>(rows), decoded,
                        static_cast<size_t>(static_cast<int64_t>(w) * components))) {
    throw fail();
  }
  if (components == 4) cmyk_to_rgb(cmyk.data(), room(pixels, count * 3), count);
  return {rows, static_cast<int64_t>(w), std::min<int64_t>(components, 3), first_row, static_cast<int64_t>(x)};
}

// The header of `bytes` read into `d` (IoError naming `name` when it is no JPEG).
void open_jpeg(JpegRegionDecoder& d, const std::string& name, const uint8_t* bytes, size_t size) {
  if (!jpeg_region_open(&d, bytes, size)) throw IoError(fmt::format("{}: not a readable JPEG: {}", name, d.message));
}

// A side of `size` pixels decoded at 1/reduction scale, rounded up as libjpeg rounds.
int64_t reduced_size(int64_t size, int reduction) { return (size + reduction - 1) / reduction; }

// The whole JPEG `d` has opened, at 1/reduction of its size in each direction (1, 2, 4 or 8:
// libjpeg-turbo's DCT scaling).
DecodedImage decode_whole_jpeg(JpegRegionDecoder& d, const std::string& name, int reduction) {
  const int64_t height = reduced_size(d.cinfo.image_height, reduction);
  const int64_t width = reduced_size(d.cinfo.image_width, reduction);
  DecodedImage out;
  const JpegRegion region = decode_jpeg_region(d, name, reduction, 0, height, 0, width, out.pixels);
  out.height = region.rows;
  out.width = region.width;
  out.channels = region.channels;
  out.pixels.resize(static_cast<size_t>(out.height * out.width * out.channels));
  return out;
}

DecodedImage decode_jpeg(const std::string& name, const uint8_t* bytes, size_t size) {
  JpegRegionDecoder d;
  open_jpeg(d, name, bytes, size);
  return decode_whole_jpeg(d, name, 1);
}

// Note [Resizing as PIL does]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// torchvision's ImageFolder hands Resize a PIL image, so the bytes a PyTorch user trains
// on are PIL's resample (Pillow's Resample.c): for each output pixel, a triangle filter
// centred at (x + 0.5) * scale, its support widened to `scale` when shrinking, weights
// normalised to sum 1 and then rounded to 22-bit fixed point; the sum rounds half up and
// clamps to 0..255. The width is resampled first, the rows rounded to bytes, then the
// height; a side that keeps its size is not resampled. Doing the same arithmetic gives
// PIL's bytes exactly (tests/data/test_image_folder_pil.cpp checks it against Pillow).
constexpr int kResampleBits = 22;

struct ResampleTaps {
  int64_t size = 0;               // taps per output pixel (the widest window)
  std::vector<int64_t> first;     // per output pixel: its first input pixel
  std::vector<int64_t> count;     // per output pixel: how many input pixels it reads
  std::vector<int32_t> weights;   // per output pixel: `size` fixed-point weights
};

// Pixels read in place: `height` rows of `width` pixels of `channels` bytes, the rows
// `row_step` bytes apart (a part of a larger image, or all of one).
struct PixelView {
  const uint8_t* data = nullptr;
  int64_t height = 0;
  int64_t width = 0;
  int64_t channels = 0;
  int64_t row_step = 0;

  static PixelView of(const DecodedImage& image) {
    return {image.pixels.data(), image.height, image.width, image.channels, image.width * image.channels};
  }
  static PixelView packed(const uint8_t* data, int64_t height, int64_t width, int64_t channels) {
    return {data, height, width, channels, width * channels};
  }
  PixelView part(int64_t top, int64_t left, int64_t rows, int64_t columns) const {
    return {data + top * row_step + left * channels, rows, columns, channels, row_step};
  }
};

// Output pixel o samples the source at in0 + (o + 0.5) * (in1 - in0) / out_size: the whole
// line by default, or a part of it (Pillow's resize with a box), fractional ends allowed.
ResampleTaps bilinear_taps(int64_t in_size, int64_t out_size, double in0, double in1) {
  const double scale = (in1 - in0) / static_cast<double>(out_size);
  const double filter_scale = std::max(scale, 1.0);
  const double support = filter_scale;  // the triangle's support is 1
  ResampleTaps taps;
  taps.size = static_cast<int64_t>(std::ceil(support)) * 2 + 1;
  taps.first.resize(static_cast<size_t>(out_size));
  taps.count.resize(static_cast<size_t>(out_size));
  taps.weights.assign(static_cast<size_t>(out_size * taps.size), 0);
  std::vector<double> w(static_cast<size_t>(taps.size));
  for (int64_t o = 0; o < out_size; ++o) {
    const double centre = in0 + (static_cast<double>(o) + 0.5) * scale;
    const auto lo = std::max<int64_t>(static_cast<int64_t>(centre - support + 0.5), 0);
    const int64_t n = std::min<int64_t>(static_cast<int64_t>(centre + support + 0.5), in_size) - lo;
    double total = 0.0;
    for (int64_t i = 0; i < n; ++i) {
      const double x = std::abs((static_cast<double>(i + lo) - centre + 0.5) / filter_scale);
      w[static_cast<size_t>(i)] = x < 1.0 ? 1.0 - x : 0.0;
      total += w[static_cast<size_t>(i)];
    }
    taps.first[static_cast<size_t>(o)] = lo;
    taps.count[static_cast<size_t>(o)] = n;
    for (int64_t i = 0; i < n; ++i) {
      const double normalised = total != 0.0 ? w[static_cast<size_t>(i)] / total : w[static_cast<size_t>(i)];
      taps.weights[static_cast<size_t>(o * taps.size + i)] =
          static_cast<int32_t>(normalised * (1 << kResampleBits) + 0.5);  // weights are >= 0
    }
  }
  return taps;
}

uint8_t resampled_byte(int32_t sum) {
  if (sum <= 0) return 0;
  if (sum >= (255 << kResampleBits)) return 255;
  return static_cast<uint8_t>(sum >> kResampleBits);
}

// Output pixel o of one row of kChannels-interleaved pixels (Pillow's horizontal pass, one
// pixel at a time).
template <int kChannels>
void resample_pixel(const uint8_t* src, uint8_t* dst, const ResampleTaps& taps, int64_t o) {
  const int32_t* k = taps.weights.data() + o * taps.size;
  const uint8_t* p = src + taps.first[static_cast<size_t>(o)] * kChannels;
  const int64_t n = taps.count[static_cast<size_t>(o)];
  int32_t sum[kChannels];
  for (int c = 0; c < kChannels; ++c) sum[c] = 1 << (kResampleBits - 1);
  for (int64_t i = 0; i < n; ++i) {
    for (int c = 0; c < kChannels; ++c) sum[c] += p[i * kChannels + c] * k[i];
  }
  for (int c = 0; c < kChannels; ++c) dst[o * kChannels + c] = resampled_byte(sum[c]);
}

// Note [RGB pixels in vector lanes]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The horizontal pass of a colour image is most of a resize. Each tap multiplies one RGB
// pixel by one weight: four bytes loaded from the pixel (its three and the next pixel's
// first, whose lane is thrown away) widen to four 32-bit lanes by one byte shuffle (GCC's
// __builtin_convertvector goes through general registers), one multiply-add for all three
// sums. The arithmetic is the scalar one, lane for lane, so the bytes are Pillow's. An
// output column is computed down a block of rows at a time, its weights held in registers
// and its taps unrolled for the usual window sizes; a block's rows stay in the L1 cache
// for all the columns. The last row's pixels whose window ends at the row's end would read
// a byte past the image and go the scalar way.
typedef int32_t Lanes4 __attribute__((vector_size(16)));
typedef uint8_t Bytes16 __attribute__((vector_size(16)));

[[gnu::always_inline]] inline Lanes4 rgb_lanes(const uint8_t* pixel) {
  int32_t bytes;  // R, G, B and the next pixel's R
  std::memcpy(&bytes, pixel, sizeof bytes);
  const auto v = reinterpret_cast<Bytes16>(Lanes4{bytes, 0, 0, 0});
  return reinterpret_cast<Lanes4>(__builtin_shufflevector(v, v, 0, 4, 4, 4, 1, 4, 4, 4, 2, 4, 4, 4, 3, 4, 4, 4));
}

// resampled_byte in the lanes, stored as 3 bytes, or as 4 where the next pixel's first
// byte is written later anyway.
[[gnu::always_inline]] inline void store_rgb(Lanes4 sum, uint8_t* out, bool four) {
  Lanes4 value = sum >> kResampleBits;
  value = value > 255 ? Lanes4{} + 255 : value;
  value = value < 0 ? Lanes4{} : value;  // not with bilinear's weights, which are >= 0
  const auto bytes = reinterpret_cast<Bytes16>(value);
  const auto packed = reinterpret_cast<Lanes4>(
      __builtin_shufflevector(bytes, bytes, 0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0));
  if (four) {
    std::memcpy(out, &packed, 4);  // sizes the compiler knows: plain stores
  } else {
    std::memcpy(out, &packed, 3);
  }
}

// One output column down `rows` rows: `src` its window's first pixel in the first row.
// kTaps > 0: a window of that many pixels; 0: of `n`.
// `four`: store_rgb may write a 4th byte (not the row's last column).
template <int kTaps>
[[gnu::always_inline]] inline void resample_column_rgb(const uint8_t* src, int64_t src_step, uint8_t* dst,
                                                       int64_t dst_step, int64_t rows, const int32_t* k, int64_t n,
                                                       bool four) {
  const Lanes4 half = Lanes4{} + (1 << (kResampleBits - 1));
  if constexpr (kTaps > 0) {
    Lanes4 w[kTaps];
    for (int i = 0; i < kTaps; ++i) w[i] = Lanes4{} + k[i];
    for (int64_t y = 0; y < rows; ++y, src += src_step, dst += dst_step) {
      Lanes4 sum = half;
      for (int i = 0; i < kTaps; ++i) sum += rgb_lanes(src + 3 * i) * w[i];
      store_rgb(sum, dst, four);
    }
  } else {
    for (int64_t y = 0; y < rows; ++y, src += src_step, dst += dst_step) {
      Lanes4 sum = half;
      for (int64_t i = 0; i < n; ++i) sum += rgb_lanes(src + 3 * i) * k[i];
      store_rgb(sum, dst, four);
    }
  }
}

// `in`'s rows resampled to out_width pixels each, packed in `out`.
MTRAIN_CLONES void resample_rows_rgb(PixelView in, uint8_t* out, const ResampleTaps& taps, int64_t out_width) {
  constexpr int64_t kBlockRows = 16;
  const int64_t rows = in.height, in_step = in.row_step, out_step = out_width * 3;
  for (int64_t y0 = 0; y0 < rows; y0 += kBlockRows) {
    const int64_t block = std::min(kBlockRows, rows - y0);
    for (int64_t o = 0; o < out_width; ++o) {
      const int64_t first = taps.first[static_cast<size_t>(o)], n = taps.count[static_cast<size_t>(o)];
      const int32_t* k = taps.weights.data() + o * taps.size;
      const bool last = y0 + block == rows && first + n == in.width;  // Note [RGB pixels in vector lanes]
      const uint8_t* src = in.data + y0 * in_step + first * 3;
      uint8_t* dst = out + y0 * out_step + o * 3;
      const int64_t vector_rows = last ? block - 1 : block;
      const bool four = o + 1 < out_width;  // the next column's pixels are stored after these
      switch (n) {
        case 2: resample_column_rgb<2>(src, in_step, dst, out_step, vector_rows, k, n, four); break;
        case 3: resample_column_rgb<3>(src, in_step, dst, out_step, vector_rows, k, n, four); break;
        case 4: resample_column_rgb<4>(src, in_step, dst, out_step, vector_rows, k, n, four); break;
        case 5: resample_column_rgb<5>(src, in_step, dst, out_step, vector_rows, k, n, four); break;
        case 6: resample_column_rgb<6>(src, in_step, dst, out_step, vector_rows, k, n, four); break;
        default: resample_column_rgb<0>(src, in_step, dst, out_step, vector_rows, k, n, four); break;
      }
      if (last) resample_pixel<3>(in.data + (rows - 1) * in_step, out + (rows - 1) * out_step, taps, o);
    }
  }
}

void resample_rows(PixelView in, uint8_t* out, const ResampleTaps& taps, int64_t out_width) {
  if (in.channels == 3) {
    resample_rows_rgb(in, out, taps, out_width);
    return;
  }
  for (int64_t y = 0; y < in.height; ++y) {
    for (int64_t o = 0; o < out_width; ++o) resample_pixel<1>(in.data + y * in.row_step, out + y * out_width, taps, o);
  }
}

// Down the columns (Pillow's vertical pass), a whole output row at a time: each tap adds a
// source row, scaled, to the row's sums, so the reads run along memory. The same integer
// sums as pixel by pixel, in the same order. `in`'s columns become out_rows rows, packed in
// `out`.
MTRAIN_CLONES void resample_columns(PixelView in, uint8_t* out, const ResampleTaps& taps, int64_t out_rows) {
  const int64_t row_bytes = in.width * in.channels;
  thread_local std::vector<int32_t> sums;
  if (sums.size() < static_cast<size_t>(row_bytes)) sums.resize(static_cast<size_t>(row_bytes));
  for (int64_t o = 0; o < out_rows; ++o) {
    const int32_t* k = taps.weights.data() + o * taps.size;
    const int64_t lo = taps.first[static_cast<size_t>(o)];
    int32_t* acc = sums.data();
    std::fill(acc, acc + row_bytes, 1 << (kResampleBits - 1));
    for (int64_t i = 0; i < taps.count[static_cast<size_t>(o)]; ++i) {
      const uint8_t* row = in.data + (lo + i) * in.row_step;
      const int32_t weight = k[i];
      for (int64_t x = 0; x < row_bytes; ++x) acc[x] += row[x] * weight;
    }
    uint8_t* dst = out + o * row_bytes;
    for (int64_t x = 0; x < row_bytes; ++x) dst[x] = resampled_byte(acc[x]);
  }
}

// The draws of one image, uniform in [lo, hi).
double uniform(Rng& rng, double lo, double hi) { return lo + (hi - lo) * rng.uniform01(); }

// Python's round(): halves to even, as torchvision's sizes are computed.
int64_t round_half_even(double x) { return static_cast<int64_t>(std::nearbyint(x)); }

}  // namespace

namespace {

// The two passes of a resize, `src` to height x width: the rows into `wide`, then the
// columns into `tall` (both grown to fit); a side whose taps are null keeps its pixels.
// The result is a view of one of the three.
PixelView resample_view(PixelView src, int64_t height, int64_t width, const ResampleTaps* across,
                        const ResampleTaps* down, std::vector<uint8_t>& wide, std::vector<uint8_t>& tall) {
  const int64_t c = src.channels;
  PixelView current = src;
  if (across != nullptr) {
    uint8_t* out = room(wide, static_cast<size_t>(current.height * width * c));
    resample_rows(current, out, *across, width);
    current = PixelView::packed(out, current.height, width, c);
  }
  if (down != nullptr) {
    uint8_t* out = room(tall, static_cast<size_t>(height * width * c));
    resample_columns(current, out, *down, height);
    current = PixelView::packed(out, height, width, c);
  }
  return current;
}

// resample_view for resize_bilinear and resize_box_bilinear, into a new image.
DecodedImage resample_sides(DecodedImage image, int64_t height, int64_t width, const ResampleTaps* across,
                            const ResampleTaps* down) {
  std::vector<uint8_t> wide, tall;
  resample_view(PixelView::of(image), height, width, across, down, wide, tall);
  if (down != nullptr) return {height, width, image.channels, std::move(tall)};
  if (across != nullptr) return {height, width, image.channels, std::move(wide)};
  return image;
}

void require_size(const char* what, int64_t height, int64_t width) {
  if (height < 1 || width < 1) {
    throw InvalidArgument(fmt::format("{}: expected a size of at least 1x1, found {}x{}", what, height, width));
  }
}

}  // namespace

DecodedImage resize_bilinear(DecodedImage image, int64_t height, int64_t width) {
  require_size("resize_bilinear", height, width);
  const ResampleTaps across = bilinear_taps(image.width, width, 0.0, static_cast<double>(image.width));
  const ResampleTaps down = bilinear_taps(image.height, height, 0.0, static_cast<double>(image.height));
  const bool wide = width != image.width, tall = height != image.height;
  return resample_sides(std::move(image), height, width, wide ? &across : nullptr, tall ? &down : nullptr);
}

DecodedImage resize_box_bilinear(DecodedImage image, const SourceBox& box, int64_t height, int64_t width) {
  require_size("resize_box_bilinear", height, width);
  if (!(box.top >= 0 && box.left >= 0 && box.height > 0 && box.width > 0 &&
        box.top + box.height <= static_cast<double>(image.height) + 1e-9 &&
        box.left + box.width <= static_cast<double>(image.width) + 1e-9)) {
    throw InvalidArgument(fmt::format("resize_box_bilinear: expected a box inside the {}x{} image, found {}x{} at "
                                      "({}, {})",
                                      image.height, image.width, box.height, box.width, box.top, box.left));
  }
  const ResampleTaps across = bilinear_taps(image.width, width, box.left, box.left + box.width);
  const ResampleTaps down = bilinear_taps(image.height, height, box.top, box.top + box.height);
  return resample_sides(std::move(image), height, width, &across, &down);
}

DecodedImage decode_image(const std::string& name, const uint8_t* bytes, size_t size) {
  if (is_png(bytes, size)) return decode_png(name, bytes, size);
  if (is_jpeg(bytes, size)) return decode_jpeg(name, bytes, size);
  throw IoError(fmt::format("{}: expected a PNG or a JPEG image, found {} bytes of something else", name, size));
}

bool is_png_or_jpeg(const uint8_t* bytes, size_t size) { return is_png(bytes, size) || is_jpeg(bytes, size); }

std::vector<uint8_t> read_file_bytes(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw IoError(fmt::format("{}: cannot open it for reading", path.string()));
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

DecodedImage decode_image(const std::filesystem::path& path) {
  const std::vector<uint8_t> bytes = read_file_bytes(path);
  return decode_image(path.string(), bytes.data(), bytes.size());
}

DecodedImage crop(const DecodedImage& image, int64_t top, int64_t left, int64_t height, int64_t width) {
  if (top < 0 || left < 0 || height < 1 || width < 1 || top + height > image.height || left + width > image.width) {
    throw InvalidArgument(fmt::format("crop: expected a box inside the {}x{} image, found {}x{} at ({}, {})",
                                      image.height, image.width, height, width, top, left));
  }
  const int64_t c = image.channels;
  DecodedImage out{height, width, c, std::vector<uint8_t>(static_cast<size_t>(height * width * c))};
  for (int64_t y = 0; y < height; ++y) {
    const uint8_t* from = image.pixels.data() + ((top + y) * image.width + left) * c;
    std::copy(from, from + width * c, out.pixels.data() + y * width * c);
  }
  return out;
}

// Note [Random resized crops]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// torchvision's RandomResizedCrop.get_params, step for step: up to ten tries of a target
// area uniform in [0.08, 1] of the image's and an aspect exp(uniform(log 3/4, log 4/3)),
// the box's sides round(sqrt(area * aspect)) and round(sqrt(area / aspect)), kept when it
// fits, at a uniform position; else the whole image cut to the nearest allowed aspect,
// centred. Its draws come from torch's global generator, which advances with every image
// a worker transforms; here they come from (seed, epoch, index) as the loader's other
// draws do (Note [Augmentation draws] in dataloader.cpp), so the boxes are the same for
// any number of workers or ranks and a resumed run draws what the whole run drew.
CropBox random_resized_crop_box(uint64_t seed, int64_t epoch, int64_t index, int64_t image_height,
                                int64_t image_width) {
  Rng rng(mix64(mix64(mix64(seed ^ 0x5252435250ull) ^ static_cast<uint64_t>(epoch)) ^ static_cast<uint64_t>(index)));
  const double area = static_cast<double>(image_height * image_width);
  const double log_lo = std::log(3.0 / 4.0), log_hi = std::log(4.0 / 3.0);
  for (int attempt = 0; attempt < 10; ++attempt) {
    const double target = area * uniform(rng, 0.08, 1.0);
    const double aspect = std::exp(uniform(rng, log_lo, log_hi));
    const int64_t w = round_half_even(std::sqrt(target * aspect));
    const int64_t h = round_half_even(std::sqrt(target / aspect));
    if (w > 0 && w <= image_width && h > 0 && h <= image_height) {
      const int64_t top = static_cast<int64_t>(rng.uniform_below(static_cast<uint64_t>(image_height - h + 1)));
      const int64_t left = static_cast<int64_t>(rng.uniform_below(static_cast<uint64_t>(image_width - w + 1)));
      return {top, left, h, w};
    }
  }
  const double in_ratio = static_cast<double>(image_width) / static_cast<double>(image_height);
  int64_t w = image_width, h = image_height;
  if (in_ratio < 3.0 / 4.0) {
    h = round_half_even(static_cast<double>(w) / (3.0 / 4.0));
  } else if (in_ratio > 4.0 / 3.0) {
    w = round_half_even(static_cast<double>(h) * (4.0 / 3.0));
  }
  return {(image_height - h) / 2, (image_width - w) / 2, h, w};
}

std::pair<int64_t, int64_t> shorter_side_size(int64_t height, int64_t width, int64_t shorter) {
  if (height <= width) {
    return {shorter, static_cast<int64_t>(static_cast<double>(shorter) * static_cast<double>(width) /
                                          static_cast<double>(height))};
  }
  return {static_cast<int64_t>(static_cast<double>(shorter) * static_cast<double>(height) / static_cast<double>(width)),
          shorter};
}

namespace {

// torchvision's CenterCrop: the box's corner at round((H - h) / 2), round((W - w) / 2);
// an image smaller than the box is first padded with zeros on every side, as torchvision pads.
DecodedImage center_crop(DecodedImage image, int64_t height, int64_t width) {
  if (image.height < height || image.width < width) {
    const int64_t ph = std::max<int64_t>(height, image.height), pw = std::max<int64_t>(width, image.width);
    const int64_t top = (ph - image.height) / 2, left = (pw - image.width) / 2, c = image.channels;
    DecodedImage padded{ph, pw, c, std::vector<uint8_t>(static_cast<size_t>(ph * pw * c), 0)};
    for (int64_t y = 0; y < image.height; ++y) {
      std::copy_n(image.pixels.data() + y * image.width * c, image.width * c,
                  padded.pixels.data() + ((top + y) * pw + left) * c);
    }
    image = std::move(padded);
  }
  const int64_t top = round_half_even(static_cast<double>(image.height - height) / 2.0);
  const int64_t left = round_half_even(static_cast<double>(image.width - width) / 2.0);
  return crop(image, top, left, height, width);
}

// `box`: RandomResizedCrop's, in `image`'s pixels (unused by the other kinds).
DecodedImage apply(DecodedImage image, const ImageTransform& t, const CropBox& box) {
  switch (t.kind) {
    case ImageTransform::Kind::kResize:
      if (image.height == t.height && image.width == t.width) return image;
      return resize_bilinear(std::move(image), t.height, t.width);
    case ImageTransform::Kind::kCenterCrop: {
      const auto [h, w] = shorter_side_size(image.height, image.width, t.shorter_side);
      if (h != image.height || w != image.width) image = resize_bilinear(std::move(image), h, w);
      return center_crop(std::move(image), t.height, t.width);
    }
    case ImageTransform::Kind::kRandomResizedCrop:
      return resize_bilinear(crop(image, box.top, box.left, box.height, box.width), t.height, t.width);
  }
  throw InternalError("ImageTransform: unknown kind");
}

}  // namespace

std::string ImageTransform::describe() const {
  const std::string size = height == width ? std::to_string(height) : fmt::format("({}, {})", height, width);
  const std::string reduced = reduced_decode ? ", JPEGs decoded at a reduced scale where it allows" : "";
  switch (kind) {
    case Kind::kResize:
      return fmt::format("Resize({}){}", height == width ? fmt::format("({0}, {0})", height) : size, reduced);
    case Kind::kCenterCrop: return fmt::format("Resize({}), CenterCrop({}){}", shorter_side, size, reduced);
    case Kind::kRandomResizedCrop: return fmt::format("RandomResizedCrop({}){}", size, reduced);
  }
  return "?";
}

namespace {

// `pixels` RGB pixels to three planes, 16 pixels (48 bytes) at a time in byte shuffles.
MTRAIN_CLONES void deinterleave_rgb(const uint8_t* in, int64_t pixels, uint8_t* r, uint8_t* g, uint8_t* b) {
  int64_t p = 0;
  for (; p + 16 <= pixels; p += 16) {
    Bytes16 x, y, z;
    std::memcpy(&x, in + 3 * p, 16);
    std::memcpy(&y, in + 3 * p + 16, 16);
    std::memcpy(&z, in + 3 * p + 32, 16);
    // Each plane's first 10 or 11 bytes come from x and y, the rest from z.
    const Bytes16 rxy = __builtin_shufflevector(x, y, 0, 3, 6, 9, 12, 15, 18, 21, 24, 27, 30, 0, 0, 0, 0, 0);
    const Bytes16 gxy = __builtin_shufflevector(x, y, 1, 4, 7, 10, 13, 16, 19, 22, 25, 28, 31, 0, 0, 0, 0, 0);
    const Bytes16 bxy = __builtin_shufflevector(x, y, 2, 5, 8, 11, 14, 17, 20, 23, 26, 29, 0, 0, 0, 0, 0, 0);
    const Bytes16 rp = __builtin_shufflevector(rxy, z, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 17, 20, 23, 26, 29);
    const Bytes16 gp = __builtin_shufflevector(gxy, z, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 18, 21, 24, 27, 30);
    const Bytes16 bp = __builtin_shufflevector(bxy, z, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 19, 22, 25, 28, 31);
    std::memcpy(r + p, &rp, 16);
    std::memcpy(g + p, &gp, 16);
    std::memcpy(b + p, &bp, 16);
  }
  for (; p < pixels; ++p) {
    r[p] = in[3 * p];
    g[p] = in[3 * p + 1];
    b[p] = in[3 * p + 2];
  }
}

// The transformed image as `channels` CHW planes (PIL's convert("L") for a colour image
// into one channel; a gray one repeated into three).
void write_chw(PixelView d, int64_t channels, uint8_t* out) {
  const int64_t plane = d.height * d.width;
  for (int64_t y = 0; y < d.height; ++y) {
    const uint8_t* row = d.data + y * d.row_step;
    const int64_t at = y * d.width;
    if (channels == 1 && d.channels == 3) {
      // ITU-R 601-2 luma in 16-bit fixed point.
      for (int64_t x = 0; x < d.width; ++x) {
        const uint8_t* rgb = row + x * 3;
        out[at + x] = static_cast<uint8_t>((rgb[0] * 19595 + rgb[1] * 38470 + rgb[2] * 7471 + 0x8000) >> 16);
      }
    } else if (d.channels == 3) {
      deinterleave_rgb(row, d.width, out + at, out + plane + at, out + 2 * plane + at);
    } else {
      for (int64_t c = 0; c < channels; ++c) std::copy_n(row, d.width, out + c * plane + at);
    }
  }
}

CropBox draw_box(const ImageTransform& t, int64_t epoch, int64_t index, int64_t height, int64_t width) {
  return t.kind == ImageTransform::Kind::kRandomResizedCrop ? random_resized_crop_box(t.seed, epoch, index, height, width)
                                                            : CropBox{};
}

// Note [Decoding at a reduced scale]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A JPEG is coded in 8x8 blocks of frequencies, and libjpeg-turbo can decode it at 1/2, 1/4
// or 1/8 of its size by keeping only the lower frequencies of each block: less inverse DCT,
// colour conversion and memory, which is most of a decode. A transform that shrinks the
// image anyway loses little by it: the largest reduction is taken that leaves what the
// transform reads (RandomResizedCrop's box, Resize's image) at least as large as what it
// makes, so the last resample still only shrinks, and the box, drawn on the full size, is
// scaled with the image (to fractional pixels, which the resample reads as Pillow's
// resize(box=) does). PIL's Image.draft() does the same; torchvision's loader does not,
// so the bytes differ slightly from its own (a full decode with reduced_decode off gives
// them exactly, tests/data/test_image_transforms_torch.cpp).
int reduction_for(const ImageTransform& t, const CropBox& box, int64_t height, int64_t width) {
  double need_h = 0, need_w = 0, have_h = static_cast<double>(height), have_w = static_cast<double>(width);
  switch (t.kind) {
    case ImageTransform::Kind::kRandomResizedCrop:
      have_h = static_cast<double>(box.height);
      have_w = static_cast<double>(box.width);
      need_h = static_cast<double>(t.height);
      need_w = static_cast<double>(t.width);
      break;
    case ImageTransform::Kind::kCenterCrop: {
      const auto [h, w] = shorter_side_size(height, width, t.shorter_side);
      need_h = static_cast<double>(h);
      need_w = static_cast<double>(w);
      break;
    }
    case ImageTransform::Kind::kResize:
      need_h = static_cast<double>(t.height);
      need_w = static_cast<double>(t.width);
      break;
  }
  for (const int r : {8, 4, 2}) {
    if (have_h / r >= need_h && have_w / r >= need_w) return r;
  }
  return 1;
}

// The buffers of the RandomResizedCrop path, kept by each thread (Note [Decoding without page
// faults] in dataloader.cpp); one that a large photograph grew is given back before the
// next image rather than kept for the thread's life.
struct CropBuffers {
  std::vector<uint8_t> region, wide, tall;
};
CropBuffers& crop_buffers() {
  thread_local CropBuffers buffers;
  constexpr size_t kKeptBytes = size_t{16} << 20;
  for (std::vector<uint8_t>* b : {&buffers.region, &buffers.wide, &buffers.tall}) {
    if (b->size() > kKeptBytes) std::vector<uint8_t>().swap(*b);
  }
  return buffers;
}

// RandomResizedCrop's `box` of a height x width image in the image decoded at 1/r scale:
// the box to fractional pixels, and the rows [top, bottom) and columns [left, right) the
// resample reads (the box and the filter's reach around it).
struct ScaledBox {
  SourceBox box;
  int64_t top, bottom, left, right;
};
ScaledBox scaled_box(const CropBox& box, int64_t height, int64_t width, int r, const ImageTransform& t) {
  const int64_t scaled_h = reduced_size(height, r), scaled_w = reduced_size(width, r);
  const double sy = static_cast<double>(scaled_h) / static_cast<double>(height);
  const double sx = static_cast<double>(scaled_w) / static_cast<double>(width);
  const SourceBox part{static_cast<double>(box.top) * sy, static_cast<double>(box.left) * sx,
                       static_cast<double>(box.height) * sy, static_cast<double>(box.width) * sx};
  const auto reach = [](double length, int64_t out_size) {
    return static_cast<int64_t>(std::ceil(std::max(length / static_cast<double>(out_size), 1.0))) + 1;
  };
  const int64_t ry = reach(part.height, t.height), rx = reach(part.width, t.width);
  return {part, std::max<int64_t>(static_cast<int64_t>(std::floor(part.top)) - ry, 0),
          std::min<int64_t>(static_cast<int64_t>(std::ceil(part.top + part.height)) + ry, scaled_h),
          std::max<int64_t>(static_cast<int64_t>(std::floor(part.left)) - rx, 0),
          std::min<int64_t>(static_cast<int64_t>(std::ceil(part.left + part.width)) + rx, scaled_w)};
}

// RandomResizedCrop's `box` of the JPEG `decoder` has opened, decoded at 1/r scale, resized
// and written to `out` as write_chw writes. Note [Decoding a crop's region]: at full scale,
// exactly the box (crop, then resize); reduced, the box scaled to fractional pixels with
// the resample's reach around it (Pillow's resize(box=)).
void random_resized_crop_jpeg(JpegRegionDecoder& decoder, const std::string& name, const CropBox& box, int r,
                              const ImageTransform& t, int64_t channels, uint8_t* out) {
  CropBuffers& buffers = crop_buffers();
  const auto view = [&](const JpegRegion& region) {
    return PixelView::packed(buffers.region.data(), region.rows, region.width, region.channels);
  };
  if (r == 1) {
    const JpegRegion region =
        decode_jpeg_region(decoder, name, 1, box.top, box.height, box.left, box.width, buffers.region);
    const PixelView part =
        view(region).part(box.top - region.first_row, box.left - region.first_column, box.height, box.width);
    const ResampleTaps across = bilinear_taps(box.width, t.width, 0.0, static_cast<double>(box.width));
    const ResampleTaps down = bilinear_taps(box.height, t.height, 0.0, static_cast<double>(box.height));
    write_chw(resample_view(part, t.height, t.width, box.width != t.width ? &across : nullptr,
                            box.height != t.height ? &down : nullptr, buffers.wide, buffers.tall),
              channels, out);
    return;
  }
  const ScaledBox s = scaled_box(box, decoder.cinfo.image_height, decoder.cinfo.image_width, r, t);
  const JpegRegion region =
      decode_jpeg_region(decoder, name, r, s.top, s.bottom - s.top, s.left, s.right - s.left, buffers.region);
  const double box_top = s.box.top - static_cast<double>(region.first_row);
  const double box_left = s.box.left - static_cast<double>(region.first_column);
  const ResampleTaps across = bilinear_taps(region.width, t.width, box_left, box_left + s.box.width);
  const ResampleTaps down = bilinear_taps(region.rows, t.height, box_top, box_top + s.box.height);
  write_chw(resample_view(view(region), t.height, t.width, &across, &down, buffers.wide, buffers.tall), channels,
            out);
}

}  // namespace

void transform_to_chw(DecodedImage image, const ImageTransform& transform, int64_t epoch, int64_t index,
                      int64_t channels, uint8_t* out) {
  const CropBox box = draw_box(transform, epoch, index, image.height, image.width);
  const DecodedImage transformed = apply(std::move(image), transform, box);
  write_chw(PixelView::of(transformed), channels, out);
}

void decode_to_chw(const std::string& name, const uint8_t* bytes, size_t size, const ImageTransform& transform,
                   int64_t epoch, int64_t index, int64_t channels, uint8_t* out) {
  const bool crops = transform.kind == ImageTransform::Kind::kRandomResizedCrop;
  if (!is_jpeg(bytes, size) || (!transform.reduced_decode && !crops)) {
    transform_to_chw(decode_image(name, bytes, size), transform, epoch, index, channels, out);
    return;
  }
  // One header read: the decoder that then decodes the region or the image.
  JpegRegionDecoder decoder;
  open_jpeg(decoder, name, bytes, size);
  const auto height = static_cast<int64_t>(decoder.cinfo.image_height);
  const auto width = static_cast<int64_t>(decoder.cinfo.image_width);
  const CropBox box = draw_box(transform, epoch, index, height, width);
  const int r = transform.reduced_decode ? reduction_for(transform, box, height, width) : 1;
  if (crops) {
    random_resized_crop_jpeg(decoder, name, box, r, transform, channels, out);
    return;
  }
  const DecodedImage transformed = apply(decode_whole_jpeg(decoder, name, r), transform, box);
  write_chw(PixelView::of(transformed), channels, out);
}

}  // namespace mtrain::data

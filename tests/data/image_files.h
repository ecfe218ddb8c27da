// Writes PNG and JPEG files for tests (libpng's and libjpeg-turbo's simplified APIs).
#pragma once

#include <png.h>
#include <turbojpeg.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace mtrain::testing {

// `pixels`: height x width x channels (1 or 3), interleaved.
inline void write_png(const std::filesystem::path& path, int64_t height, int64_t width, int64_t channels,
                      const std::vector<uint8_t>& pixels) {
  png_image image{};
  image.version = PNG_IMAGE_VERSION;
  image.width = static_cast<png_uint_32>(width);
  image.height = static_cast<png_uint_32>(height);
  image.format = channels == 3 ? PNG_FORMAT_RGB : PNG_FORMAT_GRAY;
  if (png_image_write_to_file(&image, path.c_str(), 0, pixels.data(), 0, nullptr) == 0) {
    throw std::runtime_error("write_png " + path.string() + ": " + image.message);
  }
}

// Colour is subsampled 4:4:4 unless `subsampling` says otherwise (TJSAMP_420: cameras' and
// Pillow's default).
inline void write_jpeg(const std::filesystem::path& path, int64_t height, int64_t width, int64_t channels,
                       const std::vector<uint8_t>& pixels, int quality = 95, int subsampling = TJSAMP_444) {
  tjhandle h = tjInitCompress();
  unsigned char* out = nullptr;
  unsigned long size = 0;
  const int pf = channels == 3 ? TJPF_RGB : TJPF_GRAY;
  const int sub = channels == 3 ? subsampling : TJSAMP_GRAY;
  if (tjCompress2(h, pixels.data(), static_cast<int>(width), 0, static_cast<int>(height), pf, &out, &size, sub, quality,
                  0) != 0) {
    tjDestroy(h);
    throw std::runtime_error("write_jpeg " + path.string());
  }
  std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(out), static_cast<std::streamsize>(size));
  tjFree(out);
  tjDestroy(h);
}

}  // namespace mtrain::testing

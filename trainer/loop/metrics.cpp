#include "trainer/loop/metrics.h"

#include <cerrno>
#include <cmath>
#include <cstring>

#include "core/error.h"

namespace mtrain {

MetricsWriter::MetricsWriter(const std::string& path, Mode mode) : path_(path) {
  file_.reset(std::fopen(path.c_str(), mode == Mode::kAppend ? "a" : "w"));
  if (file_ == nullptr) {
    throw IoError(fmt::format("cannot create metrics file {}: {}", path, std::strerror(errno)));
  }
}

void MetricsWriter::write(const nlohmann::json& event) {
  if (!file_) return;
  // Invalid UTF-8 in a string (a file name) is replaced rather than thrown on: a
  // metrics line must never abort a training run.
  const std::string line = event.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
  if (std::fwrite(line.data(), 1, line.size(), file_.get()) != line.size() ||
      std::fflush(file_.get()) != 0) {
    throw IoError(fmt::format("writing metrics file {}: {}", path_, std::strerror(errno)));
  }
}

nlohmann::json json_number(double v) {
  if (!std::isfinite(v)) return nullptr;
  return v;
}

}  // namespace mtrain

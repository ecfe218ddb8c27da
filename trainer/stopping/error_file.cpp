#include "trainer/stopping/error_file.h"

#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstdio>
#include <fstream>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/env.h"

namespace mtrain {

namespace {

// The rank for the record, read leniently: the error may be that these variables are
// malformed, and the record must still be written.
int best_effort_rank() {
  for (const char* name : {"RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID"}) {
    if (auto v = env::get(name)) {
      char* end = nullptr;
      const long r = std::strtol(v->c_str(), &end, 10);
      if (end != v->c_str() && *end == '\0' && r >= 0) return static_cast<int>(r);
    }
  }
  return 0;
}

}  // namespace

void write_error_record(const std::string& message, const nlohmann::json& extra) noexcept {
  try {
    auto path = env::get("MTRAIN_ERROR_FILE");
    if (!path || path->empty()) path = env::get("TORCHELASTIC_ERROR_FILE");
    if (!path || path->empty()) return;
    char host[256] = {};
    if (::gethostname(host, sizeof host - 1) != 0) host[0] = '\0';
    const double now =
        std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
    nlohmann::json record = {
        {"rank", best_effort_rank()}, {"host", host}, {"message", message}, {"timestamp", now}};
    for (const auto& [key, value] : extra.items()) record[key] = value;
    // Serialised before the file is touched, with bytes that are not UTF-8 (a Latin-1
    // path in the message) replaced rather than thrown on; then written beside the
    // record and renamed over it, so the launcher reads a whole record or none, never an
    // empty or half-written one.
    const std::string text =
        record.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + '\n';
    const std::string temporary = fmt::format("{}.tmp.{}", *path, ::getpid());
    std::ofstream out(temporary, std::ios::trunc);
    out << text;
    out.close();
    if (!out || std::rename(temporary.c_str(), path->c_str()) != 0) {
      std::remove(temporary.c_str());
      std::fprintf(stderr, "mtrain-train: could not write the error record to %s\n", path->c_str());
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "mtrain-train: could not write the error record: %s\n", e.what());
  }
}

void write_stop_record(const StopRecord& record) noexcept {
  try {
    nlohmann::json stopped = {{"signal", record.signal},
                              {"signal_rank", record.signal_rank},
                              {"epoch", record.epoch},
                              {"step", record.step},
                              {"checkpoint", record.checkpoint}};
    if (record.during_startup) stopped["during_startup"] = true;
    write_error_record(record.message, {{"rank", record.rank}, {"stopped", std::move(stopped)}});
  } catch (const std::exception&) {
    // Building the JSON failed (out of memory): nothing sensible is left to report.
  }
}

}  // namespace mtrain

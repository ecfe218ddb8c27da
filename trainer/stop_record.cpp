#include "trainer/stop_record.h"

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/env.h"

namespace mtrain {

void write_stop_record(const StopRecord& record) noexcept {
  try {
    auto path = env::get("MTRAIN_ERROR_FILE");
    if (!path || path->empty()) path = env::get("TORCHELASTIC_ERROR_FILE");
    if (!path || path->empty()) return;
    char host[256] = {};
    if (::gethostname(host, sizeof host - 1) != 0) host[0] = '\0';
    const double now =
        std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
    const nlohmann::json json = {{"rank", record.rank},
                                 {"host", host},
                                 {"message", record.message},
                                 {"timestamp", now},
                                 {"stopped",
                                  {{"signal", record.signal},
                                   {"signal_rank", record.signal_rank},
                                   {"epoch", record.epoch},
                                   {"step", record.step},
                                   {"checkpoint", record.checkpoint}}}};
    std::ofstream out(*path, std::ios::trunc);
    out << json.dump() << '\n';
    out.close();
    if (!out) std::fprintf(stderr, "mtrain-train: could not write the stop record to %s\n", path->c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "mtrain-train: could not write the stop record: %s\n", e.what());
  }
}

}  // namespace mtrain

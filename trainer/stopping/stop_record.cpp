#include "trainer/stopping/stop_record.h"

#include "trainer/stopping/error_file.h"

namespace mtrain {

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

// The worker's side of the launcher's failure report (docs/launcher.md "Error file"):
// a worker that knows why it is dying writes {"rank", "host", "message", "timestamp"}
// to $MTRAIN_ERROR_FILE (or torchrun's $TORCHELASTIC_ERROR_FILE) before it exits, so
// the launcher can name the root cause rather than the ranks that died of it.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

namespace mtrain {

// Writes the record when either variable names a file; does nothing otherwise. The
// members of `extra` are added to it (and replace the defaults of the same name, e.g.
// "rank"). Never throws: it runs while an error is already on its way out, and a
// failure to write the record must not hide that error (it is reported on stderr
// instead).
void write_error_record(const std::string& message,
                        const nlohmann::json& extra = nlohmann::json::object()) noexcept;

}  // namespace mtrain

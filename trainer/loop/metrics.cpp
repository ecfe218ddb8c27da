#include "trainer/loop/metrics.h"

#include <cerrno>
#include <cmath>
#include <cstring>

#include <spdlog/spdlog.h>

#include "core/error.h"
#include "tensor/cuda_memory.h"
#include "trainer/ddp/reducer.h"
#include "trainer/ddp/step_exchange.h"

namespace mtrain {

// Note [Metrics events]
// ~~~~~~~~~~~~~~~~~~~~~
// The events mtrain-train writes:
//   {"event":"step","epoch":1,"step":50,"loss":0.61,"lr":0.1,"img_per_s":5210.4,
//    "images":5120,"sec":0.98}
//       every --log-every optimizer steps (counted over the whole run); "loss" is the mean
//       training loss over the steps since the previous step event (the window), "images" and
//       "sec" the window's images and seconds, "img_per_s" their ratio;
//   {"event":"epoch","epoch":1,"step":94,"train_loss":..,"train_acc":..,"test_acc":..,
//    "test_loss":..,"sec":..,"img_per_s":..,"devices":["cpu"]}
//       at the end of every epoch ("test_acc"/"test_loss" are null under --no-eval);
//   {"event":"eval","epoch":0,"step":0,"test_loss":..,"test_acc":..}
//       when a run trains no step (--max-steps 0), the evaluation of the initial weights;
//   {"event":"balance","step":7,"shares_before":[32,32],"shares":[40,24],..}
//       when --balance auto moves the split (trainer/ddp/batch_resplitter.cpp).
// Non-finite numbers (a diverged loss) are written as null: JSON has no NaN.
MetricsWriter::MetricsWriter(const std::string& path, Mode mode) : path_(path) {
  file_.reset(std::fopen(path.c_str(), mode == Mode::kAppend ? "a" : "w"));
  if (file_ == nullptr) {
    throw IoError(fmt::format("cannot create metrics file {}: {}", path, std::strerror(errno)));
  }
}

// A metrics line must never end a training run: invalid UTF-8 in a string (a file name) is
// replaced rather than thrown on, and a write that fails (a full disk) is said once, after
// which the writer is off and training goes on.
void MetricsWriter::write(const nlohmann::json& event) {
  if (!file_) return;
  const std::string line = event.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
  if (std::fwrite(line.data(), 1, line.size(), file_.get()) != line.size() ||
      std::fflush(file_.get()) != 0) {
    spdlog::warn("--metrics {}: cannot write: {}; training goes on without metrics from here", path_,
                 std::strerror(errno));
    file_.reset();
  }
}

nlohmann::json json_number(double v) {
  if (!std::isfinite(v)) return nullptr;
  return v;
}

namespace {
constexpr double kMiB = 1024.0 * 1024.0;
}  // namespace

void add_memory_fields(nlohmann::json& event, Device device) {
  const AllocatorStats host = host_allocator_stats();
  event["host_tensor_peak_mib"] = static_cast<double>(host.peak_in_use_bytes) / kMiB;
  event["host_tensor_held_mib"] = static_cast<double>(host.peak_reserved_bytes) / kMiB;
  if (device.is_cuda()) {
    const BlockAllocatorStats gpu = cuda_memory_stats(device.index);
    event["cuda_in_use_mib"] = static_cast<double>(gpu.in_use_bytes) / kMiB;
    event["cuda_reserved_mib"] = static_cast<double>(gpu.reserved_bytes) / kMiB;
  }
}

void add_data_parallel_fields(nlohmann::json& event, const Reducer& reducer, const StepExchange& exchange,
                              double syncbn_wait_seconds) {
  const ReducerStepStats& last = reducer.last_step();
  nlohmann::json launches = nlohmann::json::array();
  for (const auto& l : last.launches) {
    launches.push_back({{"bucket", l.bucket}, {"params_pending", l.params_pending}});
  }
  event["comm_wait_sec"] = reducer.totals().wait_seconds;
  // Not measured when the buckets are awaited on the GPU (Note [Reducer statistics]).
  event["comm_hidden_fraction"] =
      last.waited_on_device ? nlohmann::json(nullptr) : nlohmann::json(reducer.totals().hidden_fraction());
  event["bucket_launches"] = std::move(launches);
  // Note [Every rank's wait]; running totals like comm_wait_sec.
  const RankWaits& waits = exchange.rank_waits();
  event["rank_waits"] = last.waited_on_device ? nlohmann::json(nullptr)
                                              : nlohmann::json{{"steps", waits.steps},
                                                               {"wait_sec", waits.wait_seconds},
                                                               {"slowest_steps", waits.slowest_steps},
                                                               {"exposed_sec", waits.exposed_seconds}};
  if (syncbn_wait_seconds >= 0) event["syncbn_wait_sec"] = syncbn_wait_seconds;
}

nlohmann::json initial_eval_event(const EvalResult& r) {
  return {{"event", "eval"},
          {"epoch", 0},
          {"step", 0},
          {"test_loss", json_number(r.mean_loss())},
          {"test_acc", r.accuracy()}};
}

}  // namespace mtrain

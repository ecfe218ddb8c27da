// A worker for the nccl launch tests: joins a nccl group on the GPU its arguments name
// and all-reduces once. Started by mtrain-launch (RANK, WORLD_SIZE, the store).
//   nccl_test_worker same-device   every rank uses cuda:0
//   nccl_test_worker own-device    rank r uses cuda:LOCAL_RANK
#include <fmt/format.h>

#include <cstdio>
#include <string>

#include "collectives/bootstrap.h"
#include "collectives/process_group.h"
#include "core/env.h"
#include "core/error.h"
#include "core/main_guard.h"

namespace mtrain {
namespace {

int run(int argc, char** argv) {
  if (argc != 2) throw InvalidArgument("usage: nccl_test_worker same-device|own-device");
  const std::string mode = argv[1];
  const int world = static_cast<int>(env::get_int("WORLD_SIZE", 1, 1 << 20).value_or(1));
  const int rank = static_cast<int>(env::get_int("RANK", 0, world - 1).value_or(0));
  const int local = static_cast<int>(env::get_int("LOCAL_RANK", 0, 1 << 20).value_or(0));
  const Millis timeout(20000);
  ProcessGroupOptions options;
  options.timeout = timeout;
  const Device device = Device::cuda(mode == "same-device" ? 0 : local);
  auto group = create_process_group("nccl", connect_store_from_env(timeout).store, rank, world, device,
                                    options);
  Tensor t = Tensor::full({1024}, static_cast<float>(rank + 1)).to(device);
  group->allreduce(t, ReduceOp::Sum)->wait(timeout);
  const float expected = static_cast<float>(world * (world + 1) / 2);
  for (float v : t.to_vector<float>()) {
    if (v != expected) throw InternalError(fmt::format("allreduce gave {}, expected {}", v, expected));
  }
  std::printf("rank %d: OK\n", rank);
  return 0;
}

}  // namespace
}  // namespace mtrain

int main(int argc, char** argv) {
  return mtrain::run_main("nccl_test_worker", [&] { return mtrain::run(argc, argv); });
}

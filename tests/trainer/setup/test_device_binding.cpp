// Device binding (trainer/setup/device.h): the device and backend each local rank gets,
// and the errors for configurations that cannot work. Pure logic: the GPU count is an
// input, so every branch runs on machines without a GPU.
#include <catch2/catch.hpp>

#include "collectives/process_group.h"
#include "core/error.h"
#include "trainer/setup/device.h"

using Catch::Matchers::Contains;
using mtrain::bind_device;
using mtrain::Device;
using mtrain::DeviceChoice;
using mtrain::DeviceRequest;

namespace {
mtrain::BackendChoice named(const std::string& backend) { return {&mtrain::backend_info(backend)}; }

DeviceRequest request(const std::string& device, int local_rank, int local_world, int gpus,
                      const std::string& backend = "auto") {
  DeviceRequest r;
  r.device = device == "cpu" ? DeviceChoice::kCpu : device == "cuda" ? DeviceChoice::kCuda : DeviceChoice::kAuto;
  if (backend != "auto") r.backend = named(backend);
  r.local_rank = local_rank;
  r.local_world_size = local_world;
  r.visible_gpus = gpus;
  r.no_gpu_reason = gpus == 0 ? "CUDA driver version is insufficient" : "";
  return r;
}
}  // namespace

TEST_CASE("auto takes a GPU when one is visible, else the CPU", "[device]") {
  auto b = bind_device(request("auto", 1, 2, 0), false);
  CHECK(b.device == Device::cpu(1));
  CHECK(b.backend == "gloo");
  CHECK_THAT(b.reason, Contains("no GPU is usable (CUDA driver version is insufficient), so the CPU trains"));
  CHECK(bind_device(request("auto", 1, 2, 0), true).backend == "mpi");

  b = bind_device(request("auto", 1, 2, 2), false);
  CHECK(b.device == Device::cuda(1));
  CHECK(b.backend == "nccl");
  CHECK(b.warning.empty());
  CHECK_THAT(b.reason, Contains("CUDA_DEVICE_ORDER unset"));
  auto r = request("auto", 0, 1, 2);
  r.device_order = "PCI_BUS_ID";
  CHECK_THAT(bind_device(r, false).reason, !Contains("CUDA_DEVICE_ORDER"));

  CHECK(bind_device(request("cpu", 0, 1, 8), false).device == Device::cpu(0));
}

TEST_CASE("more local ranks than GPUs: NCCL refuses, Gloo and MPI share", "[device]") {
  auto r = request("cuda", 2, 3, 2);
  r.visible_devices = "4,5";
  CHECK_THROWS_WITH(bind_device(r, false), Contains("only 2 are visible (CUDA_VISIBLE_DEVICES=4,5)") &&
                                               Contains("--backend gloo"));
  r.backend = named("gloo");
  auto b = bind_device(r, false);
  CHECK(b.device == Device::cuda(0));
  CHECK(b.backend == "gloo");
  CHECK_THAT(b.warning, Contains("3 local ranks share 2 visible GPU(s)"));
  r.backend = named("mpi");
  CHECK(bind_device(r, true).device == Device::cuda(0));
}

TEST_CASE("impossible requests are clear errors", "[device]") {
  CHECK_THROWS_WITH(bind_device(request("cuda", 0, 1, 0), false),
                    Contains("no GPU is usable: CUDA driver version is insufficient"));
  // The one place that refuses a GPU-only backend on the CPU, saying why the rank is there.
  CHECK_THROWS_WITH(bind_device(request("cpu", 0, 1, 1, "nccl"), false),
                    Contains("--backend nccl needs GPUs, but this rank trains on the CPU (--device cpu)"));
  CHECK_THROWS_WITH(bind_device(request("auto", 0, 1, 0, "nccl"), false),
                    Contains("--backend nccl needs GPUs") && Contains("no GPU is usable"));
}

TEST_CASE("a process that sees one GPU binds it whatever its local rank", "[device]") {
  // SLURM's --gpus-per-task=1: every task sees its own GPU as cuda:0.
  auto r = request("auto", 3, 4, 1);
  r.visible_devices.emplace("2");
  auto b = bind_device(r, false);
  CHECK(b.device == Device::cuda(0));
  CHECK(b.backend == "nccl");
  CHECK(b.warning.empty());
  CHECK_THAT(b.reason, Contains("the one GPU this process sees (CUDA_VISIBLE_DEVICES=2)") &&
                           Contains("refused before NCCL starts"));
  // Two visible GPUs for four local ranks is still refused: that is no per-task binding.
  CHECK_THROWS_WITH(bind_device(request("cuda", 3, 4, 2), false), Contains("needs its own GPU for NCCL"));
}

#include "trainer/setup/run_plan.h"

#include <fmt/format.h>

#include "collectives/process_group.h"
#include "core/error.h"
#include "tensor/ops.h"

namespace mtrain {

// Note [The run plan]
// ~~~~~~~~~~~~~~~~~~~
// Some of a run's facts are known only once the device is bound: --backend auto is nccl on a
// GPU and gloo or mpi on the CPU, whether the worker needs a rendezvous store depends on that
// backend (mpi under mpirun bootstraps itself; nccl even under mpirun does not), and --amp
// depends on what the device computes in. Each is decided here, once, in this order: device and
// backend (bind_device, the only place that resolves auto or refuses a GPU-only backend on the
// CPU), the store for that backend (locate_store), then threads, compute type and data. Every
// later phase reads the plan: none parses a flag's words again, compares a backend's name with
// "auto", or asks which device it is on. The model's recipe is no part of it: the parser has
// already applied it to the options (Note [Each model's recipe] in options.cpp).

namespace {

// The compute type --amp asks for, once it is known to exist on `device`.
DType amp_compute_dtype(const TrainOptions& o, const Device& device) {
  const DType t = o.amp.value;
  if (t == DType::Float32) return t;
  if (!ops::compute_dtype_supported(t, device)) {
    // Suggest what works here: the other half type when this device has it.
    const DType other = t == DType::BFloat16 ? DType::Float16 : DType::BFloat16;
    const std::string suggestion = ops::compute_dtype_supported(other, device)
                                       ? fmt::format("use --amp {} instead", other == DType::BFloat16 ? "bf16" : "fp16")
                                       : std::string("run without --amp");
    const std::string library = device.is_cuda() ? std::string() : ops::cpu_convolution_library();
    const std::string why =
        device.is_cuda() ? (t == DType::BFloat16 ? "bfloat16 needs compute capability 8.0 or newer"
                                                 : "float16 needs compute capability 7.0 or newer")
        : t == DType::BFloat16 ? fmt::format("{} needs AVX512_BF16, or at least AVX-512, for them", library)
                               : fmt::format("{} has none for this CPU", library);
    throw InvalidArgument(fmt::format("--amp {}: {} has no {} convolutions ({}); {}", o.amp.text, device.str(),
                                      dtype_name(t), why, suggestion));
  }
  return t;
}

}  // namespace

RunPlan plan_run(const TrainOptions& o, WorkerEnvironment env) {
  check_backend_environment();
  RunPlan plan;
  plan.speedups = speedups_from_environment();
  plan.device = set_up_training_device(o, env, plan.speedups);
  locate_store(backend_info(plan.backend()), env);
  plan.env = std::move(env);
  plan.threads = resolve_num_threads(o.threads, plan.env);
  plan.amp = amp_compute_dtype(o, plan.compute());
  plan.data = data::resolve_data_dir(o.dataset, o.data_dir);
  return plan;
}

}  // namespace mtrain

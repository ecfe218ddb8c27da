// The CUDA entry points of a build without CUDA: every one explains why it cannot run.
#include <fmt/format.h>

#include "core/error.h"
#include "tensor/cuda_memory.h"
#include "tensor/cuda_devices.h"
#include "tensor/cuda_graph.h"
#include "tensor/cuda_ops.h"
#include "tensor/cuda_hooks.h"

namespace mtrain {
namespace {
[[noreturn]] void no_cuda(const char* what) {
  throw InvalidArgument(fmt::format(
      "{} needs a build with CUDA; this one has none (configured with -DMTRAIN_CUDA=OFF, or "
      "the CUDA toolkit, cuDNN or NCCL was not found: see docs/building.md)",
      what));
}
}  // namespace

namespace detail {
Allocator& cuda_allocator(int device) { no_cuda(fmt::format("device cuda:{}", device).c_str()); }
Allocator& pinned_allocator() { no_cuda("pinned host memory"); }
void set_private_stream(int device, void*, bool) { no_cuda(fmt::format("a stream of cuda:{}", device).c_str()); }
void cuda_copy(const Tensor&, const Tensor&, bool) { no_cuda("a copy to or from a GPU"); }
void cuda_zero(const Tensor&) { no_cuda("zero_ on a GPU tensor"); }
void cuda_fill(const Tensor&, float) { no_cuda("fill_ on a GPU tensor"); }
}  // namespace detail

BlockAllocatorStats cuda_memory_stats(int) { no_cuda("cuda_memory_stats"); }
void cuda_release_cached_memory(int) { no_cuda("cuda_release_cached_memory"); }
BlockAllocatorStats pinned_memory_stats() { no_cuda("pinned_memory_stats"); }
void pinned_release_cached_memory() { no_cuda("pinned_release_cached_memory"); }
void record_stream(const Tensor&, int, void*) { no_cuda("record_stream"); }
void set_current_device(int index) { no_cuda(fmt::format("binding device cuda:{}", index).c_str()); }
void adopt_process_device() {}

struct GpuStopwatch::Events {};
GpuStopwatch::GpuStopwatch(int device) { no_cuda(fmt::format("timing cuda:{}", device).c_str()); }
GpuStopwatch::~GpuStopwatch() = default;
void GpuStopwatch::start() { no_cuda("GpuStopwatch"); }
void GpuStopwatch::stop() { no_cuda("GpuStopwatch"); }
std::optional<double> GpuStopwatch::seconds() const { no_cuda("GpuStopwatch"); }

struct GpuMark::Event {};
GpuMark::GpuMark(int device) { no_cuda(fmt::format("marking a stream of cuda:{}", device).c_str()); }
GpuMark::~GpuMark() = default;
void GpuMark::wait() const { no_cuda("GpuMark"); }

struct GpuGraph::State {};
GpuGraph::GpuGraph(int device) { no_cuda(fmt::format("a CUDA graph on cuda:{}", device).c_str()); }
GpuGraph::~GpuGraph() = default;
std::string GpuGraph::capture(const std::function<void()>&) { no_cuda("GpuGraph"); }
void GpuGraph::replay() { no_cuda("GpuGraph"); }
bool GpuGraph::captured() const { return false; }
size_t GpuGraph::nodes() const { return 0; }


// The CUDA entries of the op table (tensor/ops.def): the dispatch comes here only for a
// tensor borrowed with a GPU device, which no memory of this build can back.
namespace cuda_ops {
namespace {
NumericsOptions& numerics_options() {
  static NumericsOptions options;
  return options;
}
}  // namespace

// Settings are kept (and ignored) so a CPU run that passes --deterministic works.
void set_numerics(const NumericsOptions& options) { numerics_options() = options; }
NumericsOptions numerics() { return numerics_options(); }

#define MTRAIN_OP(RETURN, NAME, PARAMS, ARGS, DEVICE, WITHOUT_CUDA) \
  RETURN NAME PARAMS { WITHOUT_CUDA; }
#include "tensor/ops.def"
#undef MTRAIN_OP
}  // namespace cuda_ops

}  // namespace mtrain

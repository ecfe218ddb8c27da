// The CUDA entry points of a build without CUDA: every one explains why it cannot run.
#include <fmt/format.h>

#include "core/error.h"
#include "tensor/cuda_memory.h"
#include "tensor/cuda_runtime.h"
#include "tensor/cuda_ops.h"
#include "tensor/device_dispatch.h"

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


// No GPU tensor can exist in this build, so the kernel dispatch never gets here; these
// definitions only satisfy the linker (Note [Kernel dispatch] in tensor/cuda_ops.h).
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

void add(const Tensor&, const Tensor&, Tensor&) { no_cuda("add on a GPU"); }
void add_(Tensor&, const Tensor&, float) { no_cuda("add_ on a GPU"); }
void scale_(Tensor&, float) { no_cuda("scale_ on a GPU"); }
void relu_forward(const Tensor&, Tensor&) { no_cuda("relu on a GPU"); }
void relu_backward(const Tensor&, const Tensor&, Tensor&) { no_cuda("relu on a GPU"); }
void sigmoid_forward(const Tensor&, Tensor&) { no_cuda("sigmoid on a GPU"); }
void sigmoid_backward(const Tensor&, const Tensor&, Tensor&) { no_cuda("sigmoid on a GPU"); }
void matmul(const Tensor&, bool, const Tensor&, bool, Tensor&, float, float) {
  no_cuda("matmul on a GPU");
}
void linear_forward(const Tensor&, const Tensor&, const Tensor&, Tensor&, DType) {
  no_cuda("linear on a GPU");
}
void linear_backward(const Tensor&, const Tensor&, const Tensor&, Tensor&, Tensor&, Tensor&, bool,
                     DType) {
  no_cuda("linear on a GPU");
}
void conv2d_forward(const Tensor&, const Tensor&, const Tensor&, Tensor&, const ops::Conv2dParams&) {
  no_cuda("conv2d on a GPU");
}
void conv2d_backward_data(const Tensor&, const Tensor&, Tensor&, const ops::Conv2dParams&) {
  no_cuda("conv2d on a GPU");
}
void conv2d_backward_weights(const Tensor&, const Tensor&, Tensor&, Tensor&,
                             const ops::Conv2dParams&, bool) {
  no_cuda("conv2d on a GPU");
}
void maxpool2d_forward(const Tensor&, Tensor&, Tensor&, const ops::Pool2dParams&) {
  no_cuda("max pooling on a GPU");
}
void maxpool2d_backward(const Tensor&, const Tensor&, Tensor&) { no_cuda("max pooling on a GPU"); }
void avgpool2d_forward(const Tensor&, Tensor&, const ops::Pool2dParams&) {
  no_cuda("average pooling on a GPU");
}
void avgpool2d_backward(const Tensor&, Tensor&, const ops::Pool2dParams&) {
  no_cuda("average pooling on a GPU");
}
void global_avgpool_forward(const Tensor&, Tensor&) { no_cuda("average pooling on a GPU"); }
void global_avgpool_backward(const Tensor&, Tensor&) { no_cuda("average pooling on a GPU"); }
void batchnorm_stats(const Tensor&, Tensor&, Tensor&) { no_cuda("batch norm on a GPU"); }
void batchnorm_apply(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                     Tensor&) {
  no_cuda("batch norm on a GPU");
}
void batchnorm_backward_reduce(const Tensor&, const Tensor&, const Tensor&, Tensor&, Tensor&) {
  no_cuda("batch norm on a GPU");
}
void batchnorm_backward_apply(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                              const Tensor&, const Tensor&, const Tensor&, double, Tensor&) {
  no_cuda("batch norm on a GPU");
}
void batchnorm_invstd(const Tensor&, double, Tensor&) { no_cuda("batch norm on a GPU"); }
void batchnorm_update_running(const Tensor&, const Tensor&, int64_t, double, Tensor&, Tensor&,
                              Tensor&) {
  no_cuda("batch norm on a GPU");
}
void batchnorm_param_grads(const Tensor&, const Tensor&, const Tensor&, Tensor&, Tensor&) {
  no_cuda("batch norm on a GPU");
}
void batchnorm_merge_stats(const Tensor&, Tensor&, Tensor&) { no_cuda("batch norm on a GPU"); }
double cross_entropy(const Tensor&, const Tensor&, Tensor&, float) {
  no_cuda("cross-entropy on a GPU");
}
int64_t count_correct(const Tensor&, const Tensor&) { no_cuda("accuracy on a GPU"); }
void sgd_step(Tensor&, const Tensor&, Tensor&, float, float, float, float, bool, bool) {
  no_cuda("an SGD step on a GPU");
}
bool compute_dtype_supported(DType, Device) { return false; }
void convert(const Tensor&, Tensor&) { no_cuda("dtype conversion on a GPU"); }
bool non_finite_check_and_unscale(const std::vector<Tensor*>&, float) {
  no_cuda("loss scaling on a GPU");
  return false;
}
void sgd_step_all(const std::vector<ops::SgdParamRef>&, float, float, float, float, bool, bool) {
  no_cuda("an SGD step on a GPU");
}
}  // namespace cuda_ops

}  // namespace mtrain

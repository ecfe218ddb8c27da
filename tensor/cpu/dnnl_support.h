// Shared oneDNN plumbing for the CPU kernels: the engine, a stream per thread, and
// BoundArg, which connects a user tensor (plain layout, new pointer every call) to
// the memory a cached primitive reads or writes.
#pragma once

#include <oneapi/dnnl/dnnl.hpp>

namespace mtrain::ops::cpu {

const dnnl::engine& dnnl_engine();
// Streams are not safe to share between threads; each thread gets its own.
dnnl::stream& dnnl_stream();

// c[M,N] = alpha * op(a) @ op(b) + beta * c on oneDNN's sgemm, all row-major; a and b
// contiguous, c's rows `ldc` floats apart (0: n, contiguous) so that c may be a block of
// columns of a wider matrix (defined in matmul.cpp).
void sgemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
           const float* b, float beta, float* c, int64_t ldc = 0);

// Note [Staging from the tensor cache]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Each argument's staging is a block of the caching host allocator, taken for the call
// and given back after it (run_entry in conv.cpp). A blocked layout of C channels (C a
// multiple of the block) has the bytes of the plain tensor, so the staging of an
// activation reuses the block an activation of the same size left in the cache: backward
// frees the saved activations as it goes, and forward runs before they are all
// allocated. Staging then adds almost nothing to the process's footprint, where a
// per-thread buffer the size of the largest call would come on top of the tensors and
// fit no cached activation. A steady-state call creates no primitive and does not reach
// the system allocator.

// A tensor argument of a cached primitive. Its user memory describes the caller's plain
// (NCHW/OIHW/x) layout and is pointed at each call's tensor (bind). When the primitive
// computes in another layout, or an output must be added into the user's tensor, a
// staging buffer bound for each call (bind_internal, internal_bytes() of it) holds the
// primitive's side and reorders made once move data across (Note [Bound primitive
// arguments] in dnnl_support.cpp).
class BoundArg {
 public:
  enum class Role { Input, Output, AccumulatedOutput };

  BoundArg() = default;
  BoundArg(const dnnl::memory::desc& user_md, const dnnl::memory::desc& primitive_md, Role role);

  void bind(void* data) { user_.set_data_handle(data); }
  // Bytes of staging this argument needs (0 when the primitive uses the user's memory).
  size_t internal_bytes() const { return internal_bytes_; }
  void bind_internal(void* data) {
    if (internal_bytes_ > 0) internal_.set_data_handle(data);
  }
  // Input: copy the user's data into the primitive's layout (if they differ).
  void before(dnnl::stream& s) {
    if (to_internal_) to_internal_.execute(s, user_, internal_);
  }
  // Output: move the result into the user's tensor (if it went elsewhere).
  void after(dnnl::stream& s) {
    if (from_internal_) from_internal_.execute(s, internal_, user_);
  }
  const dnnl::memory& primitive_memory() const { return internal_; }

 private:
  dnnl::memory user_;
  dnnl::memory internal_;
  dnnl::reorder to_internal_;
  dnnl::reorder from_internal_;
  size_t internal_bytes_ = 0;
};

}  // namespace mtrain::ops::cpu

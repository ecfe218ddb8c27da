// Shared oneDNN plumbing for the CPU kernels: the engine, a stream per thread, and
// BoundArg, which connects a user tensor (plain layout, new pointer every call) to
// the memory a cached primitive reads or writes.
#pragma once

#include <oneapi/dnnl/dnnl.hpp>

namespace mtrain::ops::cpu {

const dnnl::engine& dnnl_engine();
// Streams are not safe to share between threads; each thread gets its own.
dnnl::stream& dnnl_stream();

// Note [Bound primitive arguments]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A cached primitive keeps one BoundArg per tensor argument. `user` describes the
// caller's plain (NCHW/OIHW/x) memory and has no buffer of its own: bind() points it at
// the tensor of this call. When the primitive wants another layout (format_tag::any
// chose a blocked one), or an output must be added into the user's tensor rather than
// overwrite it, `internal` is a buffer owned by the cache entry and a reorder moves
// data across (for outputs that reorder carries a sum post-op when accumulating). The
// reorders and buffers are made once with the entry, so a steady-state call creates
// no primitive and allocates nothing.
class BoundArg {
 public:
  enum class Role { Input, Output, AccumulatedOutput };

  BoundArg() = default;
  BoundArg(const dnnl::memory::desc& user_md, const dnnl::memory::desc& primitive_md, Role role);

  void bind(void* data) { user_.set_data_handle(data); }
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
};

}  // namespace mtrain::ops::cpu

#include "tensor/cpu/dnnl_support.h"

#include <fmt/format.h>

#include "core/error.h"
#include "tensor/ops.h"

namespace mtrain::ops::cpu {

const dnnl::engine& dnnl_engine() {
  static const dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

dnnl::stream& dnnl_stream() {
  thread_local dnnl::stream stream(dnnl_engine());
  return stream;
}

}  // namespace mtrain::ops::cpu

namespace mtrain::ops {

std::string cpu_convolution_library() {
  const dnnl_version_t* v = dnnl_version();
  return fmt::format("oneDNN {}.{}.{}", v->major, v->minor, v->patch);
}

}  // namespace mtrain::ops

namespace mtrain::ops::cpu {

// Note [Bound primitive arguments]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A cached primitive keeps one BoundArg per tensor argument. `user_` has no buffer of its
// own: bind() points it at the tensor of this call. When the primitive wants another
// layout (format_tag::any chose a blocked one), or an output must be added into the
// user's tensor rather than overwrite it, `internal_` is a staging buffer and a reorder
// moves data across (for outputs that reorder carries a sum post-op when accumulating).
// The reorders are made once, here; the staging buffers are not owned by the argument but
// bound for each call, because they only live during one call: entries that kept their
// own would hold the staging of every cached shape at once, about 300 MiB for ResNet-18
// at batch 64.
BoundArg::BoundArg(const dnnl::memory::desc& user_md, const dnnl::memory::desc& primitive_md,
                   Role role) {
  const dnnl::engine& engine = dnnl_engine();
  user_ = dnnl::memory(user_md, engine, DNNL_MEMORY_NONE);
  if (primitive_md == user_md && role != Role::AccumulatedOutput) {
    internal_ = user_;
    return;
  }
  internal_ = dnnl::memory(primitive_md, engine, DNNL_MEMORY_NONE);
  internal_bytes_ = primitive_md.get_size();
  if (role == Role::Input) {
    to_internal_ = dnnl::reorder(user_, internal_);
    return;
  }
  dnnl::primitive_attr attr;
  if (role == Role::AccumulatedOutput) {
    dnnl::post_ops ops;
    ops.append_sum(1.0f);
    attr.set_post_ops(ops);
  }
  from_internal_ = dnnl::reorder(dnnl::reorder::primitive_desc(internal_, user_, attr));
}

}  // namespace mtrain::ops::cpu

#include "tensor/tensor.h"

#include <cstring>

#include "core/error.h"
#include "tensor/cuda_hooks.h"

namespace mtrain {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::Float32: return 4;
    case DType::BFloat16: return 2;
    case DType::Float16: return 2;
    case DType::Int64: return 8;
    case DType::Int32: return 4;
    case DType::UInt8: return 1;
  }
  throw InternalError("unknown dtype");
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::Float32: return "float32";
    case DType::BFloat16: return "bfloat16";
    case DType::Float16: return "float16";
    case DType::Int64: return "int64";
    case DType::Int32: return "int32";
    case DType::UInt8: return "uint8";
  }
  return "unknown";
}

std::string Device::str() const {
  const char* kind = is_cpu() ? "cpu" : "cuda";
  if (is_cpu() && index == 0) return kind;
  return fmt::format("{}:{}", kind, index);
}

int64_t shape_numel(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) {
    // A product past int64 is undefined behaviour and would size a tiny buffer for a
    // huge tensor; no real shape comes near it, so it is a user error.
    if (__builtin_mul_overflow(n, d, &n)) {
      throw InvalidArgument(
          fmt::format("shape {}: expected at most {} elements, found more", shape_str(s), INT64_MAX));
    }
  }
  return n;
}

std::string shape_str(const Shape& s) { return fmt::format("[{}]", fmt::join(s, ", ")); }

namespace detail {
void check_value_count(size_t count, const Shape& shape) {
  if (static_cast<int64_t>(count) != shape_numel(shape)) {
    throw InvalidArgument(fmt::format("tensor of shape {} needs {} values, got {}",
                                      shape_str(shape), shape_numel(shape), count));
  }
}
}  // namespace detail

Storage::Storage(size_t bytes, Device device, Allocator* allocator)
    : data_(allocator->allocate(bytes)), bytes_(bytes), device_(device), allocator_(allocator) {}

Storage::Storage(void* data, size_t bytes, Device device)
    : data_(data), bytes_(bytes), device_(device), allocator_(nullptr) {}

Storage::~Storage() {
  if (allocator_ != nullptr) allocator_->deallocate(data_, bytes_);
}

namespace {
Allocator& allocator_for(Device device) {
  if (device.is_cpu()) return host_allocator();
  return detail::cuda_allocator(device.index);
}

// Every dimension >= 0 and the byte size representable: returns the element count.
int64_t checked_numel(const Shape& shape, DType dtype) {
  for (int64_t d : shape) {
    if (d < 0) {
      throw InvalidArgument(fmt::format("shape {}: expected dimensions >= 0, found {}",
                                        shape_str(shape), d));
    }
  }
  const int64_t numel = shape_numel(shape);
  int64_t bytes = 0;
  if (__builtin_mul_overflow(numel, static_cast<int64_t>(dtype_size(dtype)), &bytes)) {
    throw InvalidArgument(fmt::format("shape {} of {}: expected at most {} bytes, found more",
                                      shape_str(shape), dtype_name(dtype), INT64_MAX));
  }
  return numel;
}
}  // namespace

Tensor Tensor::empty(const Shape& shape, DType dtype, Device device) {
  Tensor t;
  t.numel_ = checked_numel(shape, dtype);
  t.shape_ = shape;
  t.dtype_ = dtype;
  t.storage_ = std::make_shared<Storage>(t.nbytes(), device, &allocator_for(device));
  return t;
}

Tensor Tensor::zeros(const Shape& shape, DType dtype, Device device) {
  Tensor t = empty(shape, dtype, device);
  t.zero_();
  return t;
}

Tensor Tensor::full(const Shape& shape, float value) {
  Tensor t = empty(shape);
  t.fill_(value);
  return t;
}

Tensor Tensor::empty_pinned(const Shape& shape, DType dtype) {
  Tensor t;
  t.numel_ = checked_numel(shape, dtype);
  t.shape_ = shape;
  t.dtype_ = dtype;
  t.storage_ = std::make_shared<Storage>(t.nbytes(), Device::cpu(), &detail::pinned_allocator());
  return t;
}

Tensor Tensor::borrow(void* data, const Shape& shape, DType dtype, Device device) {
  Tensor t;
  t.numel_ = checked_numel(shape, dtype);
  t.shape_ = shape;
  t.dtype_ = dtype;
  t.storage_ = std::make_shared<Storage>(data, t.nbytes(), device);
  return t;
}

int64_t Tensor::size(int dim) const {
  const int n = ndim();
  const int d = dim < 0 ? dim + n : dim;
  MTRAIN_CHECK(d >= 0 && d < n, "dim {} out of range for {}", dim, str());
  return shape_[d];
}

Device Tensor::device() const { return storage_ ? storage_->device() : Device::cpu(); }

void* Tensor::raw_data() const {
  MTRAIN_CHECK(defined(), "data of an undefined tensor");
  return static_cast<char*>(storage_->data()) + offset_bytes_;
}

void Tensor::check_dtype(DType expected) const {
  MTRAIN_CHECK(dtype_ == expected, "{} accessed as {}", str(), dtype_name(expected));
}

Tensor Tensor::view(const Shape& shape) const {
  Shape s = shape;
  int infer = -1;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == -1) {
      MTRAIN_CHECK(infer < 0, "view {}: only one dimension may be -1", shape_str(shape));
      infer = static_cast<int>(i);
      s[i] = 1;  // counted as 1 until its size is known
    } else {
      // Two negative sizes multiply to a positive count that could pass the check below.
      MTRAIN_CHECK(s[i] >= 0, "view {}: expected dimensions >= 0 or one -1, found {}",
                   shape_str(shape), s[i]);
    }
  }
  if (infer >= 0) {
    const int64_t known = shape_numel(s);
    MTRAIN_CHECK(known > 0 && numel_ % known == 0, "cannot view {} as {}", str(), shape_str(shape));
    s[infer] = numel_ / known;
  }
  MTRAIN_CHECK(shape_numel(s) == numel_, "cannot view {} as {}", str(), shape_str(shape));
  Tensor t = *this;
  t.shape_ = s;
  return t;
}

Tensor Tensor::narrow0(int64_t start, int64_t length) const {
  MTRAIN_CHECK(ndim() >= 1 && start >= 0 && length >= 0 && start <= shape_[0] &&
                   length <= shape_[0] - start,
               "narrow0({}, {}) of {}", start, length, str());
  Tensor t = *this;
  t.shape_[0] = length;
  t.numel_ = shape_numel(t.shape_);
  const int64_t row = shape_[0] == 0 ? 0 : numel_ / shape_[0];
  t.offset_bytes_ += static_cast<size_t>(start * row) * dtype_size(dtype_);
  return t;
}

Tensor Tensor::flat_view(int64_t offset, const Shape& shape) const {
  const int64_t n = checked_numel(shape, dtype_);
  MTRAIN_CHECK(offset >= 0 && offset <= numel_ && n <= numel_ - offset, "flat_view({}, {}) of {}", offset,
               shape_str(shape), str());
  Tensor t = *this;
  t.shape_ = shape;
  t.numel_ = n;
  t.offset_bytes_ += static_cast<size_t>(offset) * dtype_size(dtype_);
  return t;
}

Tensor Tensor::clone() const {
  Tensor t = empty(shape_, dtype_, device());
  t.copy_(*this);
  return t;
}

Tensor Tensor::to(Device device) const {
  if (device == this->device()) return *this;
  Tensor t = empty(shape_, dtype_, device);
  t.copy_(*this);
  return t;
}

void Tensor::copy_(const Tensor& src, bool non_blocking) {
  MTRAIN_CHECK(dtype_ == src.dtype_ && numel_ == src.numel_, "copy_ from {} into {}", src.str(), str());
  if (!device().is_cpu() || !src.device().is_cpu()) {
    detail::cuda_copy(*this, src, non_blocking);
    return;
  }
  if (nbytes() > 0 && raw_data() != src.raw_data()) std::memmove(raw_data(), src.raw_data(), nbytes());
}

void Tensor::zero_() {
  if (!device().is_cpu()) {
    detail::cuda_zero(*this);
    return;
  }
  if (nbytes() > 0) std::memset(raw_data(), 0, nbytes());
}

void Tensor::fill_(float value) {
  if (!device().is_cpu()) {
    check_dtype(DType::Float32);
    detail::cuda_fill(*this, value);
    return;
  }
  float* p = data<float>();
  for (int64_t i = 0; i < numel_; ++i) p[i] = value;
}

std::string Tensor::str() const {
  if (!defined()) return "Tensor[undefined]";
  return fmt::format("Tensor[{}, {}, {}]", dtype_name(dtype_), shape_str(shape_), device().str());
}

}  // namespace mtrain

// Tensor: a contiguous, row-major (NCHW for images) n-d array with a dtype and a
// device, viewing a shared Storage at an offset. Owned storage comes from an
// Allocator (the host one and the per-GPU ones cache blocks so the steady state of
// training does no malloc or cudaMalloc: tensor/cuda_memory.h); borrowed storage wraps
// memory someone else owns (e.g. an mmapped file).
//
// Note [Tensor semantics]
// ~~~~~~~~~~~~~~~~~~~~~~~
// Copying a Tensor copies the handle, not the data (like torch.Tensor). Views
// (view, narrow, flat_view) share the storage. Every tensor is contiguous: there are
// no strides, which keeps kernels simple; a layer that needs another layout copies.
// data<T>() checks that T matches the dtype, so a wrong cast fails loudly.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace mtrain {

enum class DType : uint8_t { Float32, BFloat16, Float16, Int64, Int32, UInt8 };
size_t dtype_size(DType t);
const char* dtype_name(DType t);  // "float32", "bfloat16", ... (safetensors uses F32 etc.)
// bfloat16 or float16: --amp's compute types, and the types of 16-bit activations.
inline bool is_16bit_float(DType t) { return t == DType::BFloat16 || t == DType::Float16; }
// float32 or a 16-bit float: a type that activations may have.
inline bool is_floating(DType t) { return t == DType::Float32 || is_16bit_float(t); }

enum class DeviceType : uint8_t { CPU, CUDA };

struct Device {
  DeviceType type = DeviceType::CPU;
  int index = 0;

  static Device cpu(int index = 0) { return {DeviceType::CPU, index}; }
  static Device cuda(int index) { return {DeviceType::CUDA, index}; }
  bool is_cpu() const { return type == DeviceType::CPU; }
  bool is_cuda() const { return type == DeviceType::CUDA; }
  std::string str() const;  // "cpu", "cpu:1", "cuda:0"
  // Written out rather than defaulted: .cu files include this header and nvcc compiles
  // them as C++17 (Dependencies.cmake).
  bool operator==(const Device& o) const { return type == o.type && index == o.index; }
  bool operator!=(const Device& o) const { return !(*this == o); }
};

using Shape = std::vector<int64_t>;
int64_t shape_numel(const Shape& s);  // throws InvalidArgument past INT64_MAX elements
std::string shape_str(const Shape& s);  // "[2, 3, 28, 28]"

// Memory source for owned storage. Implementations must be thread-safe.
class Allocator {
 public:
  virtual ~Allocator() = default;
  virtual void* allocate(size_t bytes) = 0;
  virtual void deallocate(void* ptr, size_t bytes) = 0;
  // Page-locked host memory (cudaHostAlloc): copies from and to it can be asynchronous.
  virtual bool pinned_host() const { return false; }
};

struct AllocatorStats {
  size_t in_use_bytes = 0;    // handed out and not yet returned
  size_t cached_bytes = 0;    // returned and kept for reuse
  uint64_t system_allocs = 0; // times the allocator went to the system
  uint64_t cache_hits = 0;    // allocations served from the cache
  size_t peak_in_use_bytes = 0;    // the most ever handed out at once
  size_t peak_reserved_bytes = 0;  // the most ever held from the system (in use + cached)
};

// The process-wide caching host allocator (64-byte aligned blocks).
Allocator& host_allocator();
AllocatorStats host_allocator_stats();
void host_allocator_release_cache();  // frees every cached block

class Storage {
 public:
  Storage(size_t bytes, Device device, Allocator* allocator);  // owned
  Storage(void* data, size_t bytes, Device device);            // borrowed
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  Device device() const { return device_; }
  bool owned() const { return allocator_ != nullptr; }
  bool pinned() const { return allocator_ != nullptr && allocator_->pinned_host(); }

 private:
  void* data_;
  size_t bytes_;
  Device device_;
  Allocator* allocator_;  // nullptr = borrowed
};

namespace detail {
// Throws InvalidArgument unless `count` equals the number of elements of `shape`.
void check_value_count(size_t count, const Shape& shape);
}  // namespace detail

template <class T> struct DTypeOf;
template <> struct DTypeOf<float> { static constexpr DType value = DType::Float32; };
template <> struct DTypeOf<int64_t> { static constexpr DType value = DType::Int64; };
template <> struct DTypeOf<int32_t> { static constexpr DType value = DType::Int32; };
template <> struct DTypeOf<uint8_t> { static constexpr DType value = DType::UInt8; };

class Tensor {
 public:
  Tensor() = default;  // undefined tensor

  static Tensor empty(const Shape& shape, DType dtype = DType::Float32,
                      Device device = Device::cpu());
  static Tensor zeros(const Shape& shape, DType dtype = DType::Float32,
                      Device device = Device::cpu());
  static Tensor full(const Shape& shape, float value);  // float32, CPU
  // Host tensor in pinned memory (tensor/cuda_memory.h), for asynchronous copies.
  static Tensor empty_pinned(const Shape& shape, DType dtype = DType::Float32);
  // Wraps memory owned elsewhere; it must outlive every view of the result.
  static Tensor borrow(void* data, const Shape& shape, DType dtype = DType::Float32,
                       Device device = Device::cpu());
  template <class T>
  static Tensor from_vector(const std::vector<T>& values, const Shape& shape);

  bool defined() const { return storage_ != nullptr; }
  const Shape& shape() const { return shape_; }
  int ndim() const { return static_cast<int>(shape_.size()); }
  int64_t size(int dim) const;  // negative dims count from the end
  int64_t numel() const { return numel_; }
  size_t nbytes() const { return static_cast<size_t>(numel_) * dtype_size(dtype_); }
  DType dtype() const { return dtype_; }
  Device device() const;
  bool is_pinned() const { return storage_ != nullptr && storage_->pinned(); }
  // The storage this tensor views (for the allocator's record_stream).
  const std::shared_ptr<Storage>& storage() const { return storage_; }

  void* raw_data() const;
  template <class T> T* data() const {
    check_dtype(DTypeOf<T>::value);
    return static_cast<T*>(raw_data());
  }

  // Same data, new shape (one dim may be -1). Shares storage.
  Tensor view(const Shape& shape) const;
  // Rows [start, start+length) along dim 0. Shares storage.
  Tensor narrow0(int64_t start, int64_t length) const;
  // `shape`-shaped view of elements [offset, offset + numel(shape)) of this tensor
  // (e.g. a gradient living inside a flat all-reduce bucket). Shares storage.
  Tensor flat_view(int64_t offset, const Shape& shape) const;

  Tensor clone() const;
  // A copy on `device` (same shape and dtype); this tensor itself when already there.
  Tensor to(Device device) const;
  // Same dtype and numel (shapes may differ), between any devices. GPU copies are queued
  // on the current stream (Note [Current stream] in tensor/cuda/stream.h) and return with
  // host memory safe to use, except that `non_blocking` with a pinned host tensor returns
  // at once: synchronise the stream before touching the host side.
  void copy_(const Tensor& src, bool non_blocking = false);
  void zero_();                   // on GPUs: queued on the current stream
  void fill_(float value);        // float32 only; on GPUs: queued on the current stream
  bool shares_storage_with(const Tensor& other) const { return storage_ == other.storage_; }
  std::string str() const;        // "Tensor[float32, [2, 3], cpu]"

  // A deep copy of the values into a std::vector (for tests and small tensors).
  template <class T> std::vector<T> to_vector() const {
    if (!device().is_cpu()) return to(Device::cpu()).to_vector<T>();
    const T* p = data<T>();
    return std::vector<T>(p, p + numel_);
  }

 private:
  void check_dtype(DType expected) const;

  std::shared_ptr<Storage> storage_;
  size_t offset_bytes_ = 0;
  Shape shape_;
  int64_t numel_ = 0;
  DType dtype_ = DType::Float32;
};

template <class T>
Tensor Tensor::from_vector(const std::vector<T>& values, const Shape& shape) {
  detail::check_value_count(values.size(), shape);
  Tensor t = empty(shape, DTypeOf<T>::value);
  T* p = t.data<T>();
  for (size_t i = 0; i < values.size(); ++i) p[i] = values[i];
  return t;
}

}  // namespace mtrain

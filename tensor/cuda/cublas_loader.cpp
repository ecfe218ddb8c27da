#include "tensor/cuda/cublas_loader.h"

#include <dlfcn.h>
#include <fmt/format.h>

#include <string>

#include "core/error.h"

namespace mtrain::cuda {
namespace {

template <class Fn>
void look_up(void* library, const std::string& soname, const char* symbol, Fn& out) {
  void* address = dlsym(library, symbol);
  if (address == nullptr) {
    throw InvalidArgument(fmt::format("{} has no {}: expected the cuBLAS {} this build was compiled "
                                      "against ({})",
                                      soname, symbol, CUBLAS_VER_MAJOR, dlerror()));
  }
  out = reinterpret_cast<Fn>(address);
}

// Note [cuBLAS is loaded lazily]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Linking libcublas pulls in libcublasLt (over 500 MB), whose load-time relocations touch
// some 200 MiB of pages in every process, GPU or not: every CPU rank would pay for them.
// So cuBLAS is dlopen'ed the first time a matrix product runs on a GPU, and the few entry
// points mtrain calls are looked up by name; the prototypes still come from cublas_v2.h
// (CublasApi), so a signature change fails to compile. cuDNN and the CUDA runtime stay
// linked: they cost little at load time.
CublasApi open_cublas() {
  const std::string soname = fmt::format("libcublas.so.{}", CUBLAS_VER_MAJOR);
  void* library = dlopen(soname.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (library == nullptr) {
    throw InvalidArgument(fmt::format(
        "matrix products on a GPU need cuBLAS, but {} cannot be loaded ({}); install the CUDA "
        "toolkit's cuBLAS or add its directory to LD_LIBRARY_PATH",
        soname, dlerror()));
  }
  // Never dlclose'd: handles and kernels live until the process ends.
  CublasApi api{};
  look_up(library, soname, "cublasCreate_v2", api.create);
  look_up(library, soname, "cublasDestroy_v2", api.destroy);
  look_up(library, soname, "cublasSetStream_v2", api.set_stream);
  look_up(library, soname, "cublasSetWorkspace_v2", api.set_workspace);
  look_up(library, soname, "cublasGemmEx_64", api.gemm_ex_64);
  look_up(library, soname, "cublasSgemv_v2_64", api.sgemv_64);
  look_up(library, soname, "cublasSscal_v2_64", api.sscal_64);
  look_up(library, soname, "cublasGetStatusName", api.status_name);
  look_up(library, soname, "cublasGetStatusString", api.status_string);
  return api;
}

}  // namespace

const CublasApi& cublas() {
  static const CublasApi api = open_cublas();
  return api;
}

}  // namespace mtrain::cuda

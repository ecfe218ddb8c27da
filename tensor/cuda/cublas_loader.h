// cuBLAS, opened at first use instead of linked (CUDA builds only).
//
// Note [cuBLAS is loaded lazily]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Linking libcublas pulls in libcublasLt (over 500 MB). Its load-time relocations
// touch about 215 MiB of pages in every process, GPU or not: `mtrain-train --help`
// measured 228 MiB peak RSS linked against 12 MiB without it, and every CPU rank paid
// the same. So cuBLAS is dlopen'ed the first time a matrix product runs on a GPU, and the
// few entry points mtrain calls are looked up by name; the prototypes still come from
// cublas_v2.h, so a signature change fails to compile. cuDNN and the CUDA runtime stay
// linked: they cost little at load time.
#pragma once

#include <cublas_v2.h>

namespace mtrain::cuda {

struct CublasApi {
  decltype(&cublasCreate_v2) create;
  decltype(&cublasDestroy_v2) destroy;
  decltype(&cublasSetStream_v2) set_stream;
  decltype(&cublasSetWorkspace_v2) set_workspace;
  decltype(&cublasGemmEx_64) gemm_ex_64;
  decltype(&cublasSgemv_v2_64) sgemv_64;
  decltype(&cublasSscal_v2_64) sscal_64;
  decltype(&cublasGetStatusName) status_name;
  decltype(&cublasGetStatusString) status_string;
};

// Opens libcublas.so.<major of the headers> once; throws InvalidArgument quoting the
// loader's error when the library or one of the entry points is missing.
const CublasApi& cublas();

}  // namespace mtrain::cuda

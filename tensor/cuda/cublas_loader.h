// cuBLAS, opened at first use instead of linked (CUDA builds only; Note [cuBLAS is loaded
// lazily] in cublas_loader.cpp): the entry points mtrain calls, typed from cublas_v2.h.
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

// MTRAIN_NCCL_CHECK(call, comm): a failed NCCL call throws CommError naming the call, the
// file and line, NCCL's error string and its last-error detail for `comm` (may be null).
#pragma once

#include <nccl.h>

#include "core/error.h"

#if NCCL_VERSION_CODE < NCCL_VERSION(2, 14, 0)
#error "mtrain's nccl backend needs NCCL >= 2.14 (non-blocking communicators, ncclAvg)"
#endif

#define MTRAIN_NCCL_CHECK(call, comm)                                                       \
  do {                                                                                      \
    ncclResult_t mtrain_nccl_res_ = (call);                                                 \
    if (mtrain_nccl_res_ != ncclSuccess && mtrain_nccl_res_ != ncclInProgress) {            \
      throw ::mtrain::CommError(::fmt::format("{} failed at {}:{}: {} ({})", #call, __FILE__, \
                                              __LINE__, ncclGetErrorString(mtrain_nccl_res_), \
                                              ncclGetLastError(comm)));                      \
    }                                                                                       \
  } while (0)

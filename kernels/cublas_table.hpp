// SPDX-License-Identifier: Apache-2.0
// Internal to kernels/: the table of cuBLAS entry points that kernels/cublas_loader.cpp resolves
// at run time (see kernels/cublas_loader.hpp). Each member has the exact type of the function
// cublas_api.h declares, so a changed signature fails to compile rather than to run. Includes
// only cublas_api.h (types and declarations), never cublas_v2.h: its macros would turn
// cublasCreate and friends back into calls that need libcublas at link time.
#pragma once

#include <cublas_api.h>

#include "kernels/cublas_loader.hpp"

// X(member, exported name): every entry point the cuda char model calls. Add one here and both
// the table and the loader's list of names follow.
#define TERRACE_CUBLAS_ENTRY_POINTS(X) \
  X(create, cublasCreate_v2)           \
  X(destroy, cublasDestroy_v2)         \
  X(set_stream, cublasSetStream_v2)    \
  X(sgemm, cublasSgemm_v2)             \
  X(status_name, cublasGetStatusName)  \
  X(status_string, cublasGetStatusString)

namespace terrace::model::detail {

struct cublas_api {
#define TERRACE_CUBLAS_MEMBER(member, symbol) decltype(&::symbol) member = nullptr;
  TERRACE_CUBLAS_ENTRY_POINTS(TERRACE_CUBLAS_MEMBER)
#undef TERRACE_CUBLAS_MEMBER
};

}  // namespace terrace::model::detail

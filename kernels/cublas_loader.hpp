// SPDX-License-Identifier: Apache-2.0
// Internal to kernels/: cuBLAS reached at run time. Nothing links libcublas: the cuda char model
// asks for the library when it is made (dlopen of the soname this build was compiled against,
// e.g. libcublas.so.13) and calls it through a table of the entry points it uses, resolved with
// dlsym. A binary that links terrace_model therefore starts, and runs everything but the cuda
// model, on a machine without cuBLAS; a missing library or symbol is a device_error from
// make_char_model for a CUDA device that says what to do. The driver API is reached the same way,
// through cudaGetDriverEntryPoint.
//
// Free of CUDA headers, so that tests include it; the table itself (cublas_api) is defined in
// kernels/cublas_table.hpp, which needs cublas_api.h. C++17, as nvcc compiles it here. Built only
// with TERRACE_ENABLE_CUDA.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace terrace::model::detail {

/// The environment variable that names the library to load instead of the default: a soname
/// searched the usual way, or a path. When set (and not empty) it is the only one tried.
inline constexpr const char* cublas_library_env = "TERRACE_CUBLAS_LIBRARY";

/// The soname of the cuBLAS this build was compiled against, "libcublas.so.<CUBLAS_VER_MAJOR>".
const char* cublas_default_library() noexcept;

/// The entry points the table resolves, by their exported names (the `_v2` ones).
const std::vector<std::string>& cublas_entry_points();

/// The resolved entry points; complete in kernels/cublas_table.hpp.
struct cublas_api;

/// Opens `library` with dlopen and resolves every entry point; the library stays loaded for the
/// life of the process, and a second call with the same name returns the same table. Thread-safe.
/// @throws device_error naming the library, dlerror()'s text, and what to do (LD_LIBRARY_PATH,
///         TERRACE_CUBLAS_LIBRARY), when the library cannot be opened or lacks an entry point.
const cublas_api& load_cublas(const std::string& library);

/// The table the cuda char model uses: load_cublas($TERRACE_CUBLAS_LIBRARY) when that is set,
/// otherwise load_cublas(cublas_default_library()), then, if the soname is not found on the
/// loader's path, the same file in the library folder of the toolkit this build used (what the
/// run path of earlier builds gave). A failure is not remembered: the next call tries again.
/// @throws device_error as load_cublas, naming every file tried.
const cublas_api& cublas();

/// The file cublas() tries when the soname is not on the loader's path: libcublas.so.<major> in
/// the library folder of the toolkit this build used; empty when the build named none.
std::string cublas_toolkit_library();

/// How many of the table's entry points are resolved (all of them, in a table that was returned).
std::size_t resolved_entry_points(const cublas_api& api) noexcept;

}  // namespace terrace::model::detail

// SPDX-License-Identifier: Apache-2.0
// cuBLAS at run time (kernels/cublas_loader.hpp): dlopen of the soname this build was compiled
// against, dlsym of each entry point into a cublas_api table. Plain C++: it needs cublas_api.h for
// the types and the version, nothing of libcublas or nvcc.
#include "kernels/cublas_loader.hpp"

#include <dlfcn.h>

#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "kernels/cublas_table.hpp"
#include "terrace/error.hpp"

#define TERRACE_CUBLAS_STRINGIFY_(x) #x
#define TERRACE_CUBLAS_STRINGIFY(x) TERRACE_CUBLAS_STRINGIFY_(x)

namespace terrace::model::detail {
namespace {

// The major version is the soname's: libcublas.so.13 for every CUDA 13 toolkit.
constexpr const char* default_soname = "libcublas.so." TERRACE_CUBLAS_STRINGIFY(CUBLAS_VER_MAJOR);

// Tables already loaded, by the name they were asked for. Never unloaded: cuBLAS handles may
// outlive any one model, and unloading cuBLAS while the CUDA runtime runs is not supported.
std::mutex& loaded_mutex() {
  static std::mutex m;
  return m;
}
std::map<std::string, std::unique_ptr<cublas_api>, std::less<>>& loaded() {
  static std::map<std::string, std::unique_ptr<cublas_api>, std::less<>> m;
  return m;
}

std::string advice() {
  return std::string("Set LD_LIBRARY_PATH to the folder that holds ") + default_soname +
         " (the CUDA toolkit's lib64; in the site-packages of a PyTorch installed with pip, "
         "nvidia/cu13/lib for CUDA 13 wheels or nvidia/cublas/lib for CUDA 12 ones), or " +
         cublas_library_env + " to the library's path.";
}

std::string last_dlerror() {
  const char* e = dlerror();
  return e != nullptr ? e : "no reason given";
}

// Opens `library` and resolves every entry point; on failure returns nothing and says why (the
// library is closed again then).
std::unique_ptr<cublas_api> try_load(const std::string& library, std::string& why) {
  dlerror();  // clear a stale message
  void* handle = dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    why = "dlopen(\"" + library + "\") failed: " + last_dlerror();
    return nullptr;
  }
  auto api = std::make_unique<cublas_api>();
  std::string missing;
#define TERRACE_CUBLAS_RESOLVE(member, symbol)                                              \
  if (void* p = dlsym(handle, #symbol); p != nullptr) {                                     \
    api->member = reinterpret_cast<decltype(api->member)>(p);                               \
  } else {                                                                                  \
    missing += std::string(missing.empty() ? "" : "; ") + #symbol + " (" + last_dlerror() + ")"; \
  }
  TERRACE_CUBLAS_ENTRY_POINTS(TERRACE_CUBLAS_RESOLVE)
#undef TERRACE_CUBLAS_RESOLVE
  if (!missing.empty()) {
    dlclose(handle);
    why = "\"" + library + "\" was opened but lacks entry points this build calls: " + missing +
          ". It is not the cuBLAS " TERRACE_CUBLAS_STRINGIFY(CUBLAS_VER_MAJOR) ".x this build was "
          "compiled against";
    return nullptr;
  }
  return api;
}

const cublas_api* find_loaded(const std::string& library) {
  const auto it = loaded().find(library);
  return it == loaded().end() ? nullptr : it->second.get();
}

const cublas_api& remember(const std::string& library, std::unique_ptr<cublas_api> api) {
  return *loaded().emplace(library, std::move(api)).first->second;
}

[[noreturn]] void fail(const std::string& tried) {
  throw device_error(std::string("terrace: cannot load cuBLAS (") + default_soname +
                     ", which the cuda char model of this build calls): " + tried + ". " +
                     advice());
}

}  // namespace

const char* cublas_default_library() noexcept { return default_soname; }

const std::vector<std::string>& cublas_entry_points() {
  static const std::vector<std::string> names{
#define TERRACE_CUBLAS_NAME(member, symbol) #symbol,
      TERRACE_CUBLAS_ENTRY_POINTS(TERRACE_CUBLAS_NAME)
#undef TERRACE_CUBLAS_NAME
  };
  return names;
}

std::string cublas_toolkit_library() {
#if defined(TERRACE_CUBLAS_TOOLKIT_DIR)
  return std::string(TERRACE_CUBLAS_TOOLKIT_DIR) + "/" + default_soname;
#else
  return {};
#endif
}

const cublas_api& load_cublas(const std::string& library) {
  const std::lock_guard lock(loaded_mutex());
  if (const cublas_api* api = find_loaded(library)) return *api;
  std::string why;
  auto api = try_load(library, why);
  if (!api) fail(why);
  return remember(library, std::move(api));
}

const cublas_api& cublas() {
  if (const char* chosen = std::getenv(cublas_library_env); chosen != nullptr && *chosen != '\0') {
    try {
      return load_cublas(chosen);
    } catch (const device_error& e) {
      throw device_error(std::string(e.what()) + " (the library was chosen by " +
                         cublas_library_env + "=" + chosen + ")");
    }
  }
  const std::lock_guard lock(loaded_mutex());
  if (const cublas_api* api = find_loaded(default_soname)) return *api;
  std::string why;
  if (auto api = try_load(default_soname, why)) return remember(default_soname, std::move(api));
  // Not on the loader's path: the toolkit this build used, if this machine has it in the same
  // place (what the run path of builds that linked libcublas gave).
  if (const std::string beside = cublas_toolkit_library(); !beside.empty()) {
    if (const cublas_api* api = find_loaded(beside)) return *api;
    std::string why_beside;
    if (auto api = try_load(beside, why_beside)) return remember(beside, std::move(api));
    why += "; then " + why_beside;
  }
  fail(why);
}

std::size_t resolved_entry_points(const cublas_api& api) noexcept {
  std::size_t n = 0;
#define TERRACE_CUBLAS_COUNT(member, symbol) n += api.member != nullptr ? 1 : 0;
  TERRACE_CUBLAS_ENTRY_POINTS(TERRACE_CUBLAS_COUNT)
#undef TERRACE_CUBLAS_COUNT
  return n;
}

}  // namespace terrace::model::detail

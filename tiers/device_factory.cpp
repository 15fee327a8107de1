// SPDX-License-Identifier: Apache-2.0
// make_device: from a backend's name (configuration, the CLI, TERRACE_ALLOC_CONF) to a backend.
// The one place that knows which backends this build has.
#include <memory>
#include <string>
#include <string_view>

#include "terrace/device.hpp"
#include "terrace/error.hpp"
#include "tiers/backends.hpp"

namespace terrace {
namespace {

constexpr const char* kValidNames = "sim, null, cuda, cuda-vmm, auto";

std::unique_ptr<device_backend> make_cuda_backend(std::string_view name,
                                                  const device_options& options) {
#ifdef TERRACE_WITH_CUDA
  if (!detail::cuda_runtime_device_present()) {
    throw device_error("terrace: device '" + std::string(name) +
                       "' requested, but the CUDA runtime reports no usable GPU");
  }
  return name == "cuda" ? detail::make_cuda_device(options) : detail::make_cuda_vmm_device(options);
#else
  (void)options;
  throw device_error("terrace: device '" + std::string(name) +
                     "' requested, but this build has no CUDA support (configure with "
                     "-DTERRACE_ENABLE_CUDA=ON); 'sim' and 'null' are available");
#endif
}

}  // namespace

bool cuda_device_available() noexcept {
#ifdef TERRACE_WITH_CUDA
  return detail::cuda_runtime_device_present();
#else
  return false;
#endif
}

std::unique_ptr<device_backend> make_device(std::string_view name, const device_options& options) {
  if (name == "sim") return detail::make_sim_device(options);
  if (name == "null") return detail::make_null_device(options);
  if (name == "cuda" || name == "cuda-vmm") return make_cuda_backend(name, options);
  if (name == "auto") {
    return cuda_device_available() ? make_cuda_backend("cuda", options)
                                   : detail::make_sim_device(options);
  }
  throw logic_error("terrace: unknown device backend '" + std::string(name) +
                    "'; valid names: " + kValidNames);
}

}  // namespace terrace

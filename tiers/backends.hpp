// SPDX-License-Identifier: Apache-2.0
// Internal to tiers/: the constructors of the concrete backends, which make_device
// (device_factory.cpp) dispatches to by name, plus the few helpers all backends share.
// Nothing outside tiers/ includes this header; everyone else goes through terrace::make_device.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <string_view>

#include "terrace/device.hpp"

namespace terrace::detail {

// ------------------------------------------------------------------ host-side backends
// Both validate `options` and throw terrace::logic_error on a bad value (a granularity that is not
// a power of two, a negative bandwidth, ...).

/// Host memory with a capacity limit, one worker thread per stream (sim_device.cpp).
std::unique_ptr<device_backend> make_sim_device(const device_options& options);
/// Address bookkeeping only; memory is never touched (null_device.cpp).
std::unique_ptr<device_backend> make_null_device(const device_options& options);

// ------------------------------------------------------------------ CUDA backends
// Defined in cuda_device.cpp / cuda_vmm_device.cpp, which are compiled only when TERRACE_WITH_CUDA
// is defined; make_device never names them otherwise.

/// cudaMalloc / cudaFree, CUDA streams and events. @throws device_error when no device is usable.
std::unique_ptr<device_backend> make_cuda_device(const device_options& options);
/// cuMemCreate / cuMemAddressReserve / cuMemMap. @throws device_error when no device is usable.
std::unique_ptr<device_backend> make_cuda_vmm_device(const device_options& options);
/// True when the CUDA runtime reports at least one usable device.
bool cuda_runtime_device_present() noexcept;

// ------------------------------------------------------------------ shared helpers

/// "4.00 MiB (4194304 bytes)": the exact figure for scripts, the rounded one for people.
std::string describe_bytes(std::size_t bytes);

/// "0x7f12a4000000", for messages about an address.
inline std::string hex_address(std::uintptr_t a) {
  char buf[24];
  std::snprintf(buf, sizeof buf, "0x%jx", static_cast<std::uintmax_t>(a));
  return buf;
}

/// A broken precondition in a call that may not throw (release, unmap, destroy_*): the state the
/// backend would leave is unknowable, so it reports and aborts, as mimalloc does on a bad free.
[[noreturn]] void contract_violation(std::string_view backend, std::string_view message) noexcept;

}  // namespace terrace::detail

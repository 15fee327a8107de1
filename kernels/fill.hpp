// SPDX-License-Identifier: Apache-2.0
/// @file fill.hpp
/// @brief GPU test kernels: fill a byte range with a seeded pattern, count the bytes that differ
/// from it, and hold a stream until the host says go.
///
/// The GPU tests use them to prove that memory a backend or the allocator hands out is writable
/// from a kernel, and that stream-ordered reuse does not race: a block refilled with a new seed on
/// one stream must read back with that seed only, never with bytes of an earlier user still
/// running on another stream. The pattern depends on the offset, so writes that land in the wrong
/// place are caught too.
///
/// Every launcher is asynchronous on `stream` (nullptr: the legacy default stream) and returns the
/// launch's cudaError_t; errors of the kernel itself surface at the next synchronization.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#if defined(__CUDACC__)
#define TERRACE_HOST_DEVICE __host__ __device__
#else
#define TERRACE_HOST_DEVICE
#endif

namespace terrace::kernels {

/// @brief The byte at `offset` of a range filled with `seed`. Two seeds differ at about 255 of
/// every 256 offsets; host code uses this to check a copy of the range.
TERRACE_HOST_DEVICE constexpr std::uint8_t pattern_byte(std::uint32_t seed,
                                                        std::uint64_t offset) noexcept {
  std::uint32_t x = static_cast<std::uint32_t>(offset) * 2654435761u ^
                    static_cast<std::uint32_t>(offset >> 32) ^ (seed * 0x85EBCA6Bu + 0x9E3779B9u);
  x ^= x >> 15;
  x *= 0x2C1B3C6Du;
  x ^= x >> 12;
  return static_cast<std::uint8_t>(x ^ (x >> 24));
}

/// @brief Queues a write of pattern_byte(seed, i) to dst[i] for every i < bytes.
/// REQUIRES: [dst, dst+bytes) is device-writable memory. bytes == 0 queues nothing.
cudaError_t fill_pattern(void* dst, std::size_t bytes, std::uint32_t seed,
                         cudaStream_t stream) noexcept;

/// @brief Queues a check of [src, src+bytes) against pattern_byte(seed, i); the number of
/// differing bytes is ADDED to *device_counter (device memory; zero it first).
cudaError_t count_pattern_mismatches(const void* src, std::size_t bytes, std::uint32_t seed,
                                     unsigned long long* device_counter,
                                     cudaStream_t stream) noexcept;

/// @brief Queues one thread that spins until *flag != 0 or `timeout_ns` have passed, so that work
/// queued after it on `stream` is deterministically pending until the host sets the flag.
/// REQUIRES: `flag` is readable from the device while the host writes it (cudaHostAllocMapped
/// memory). The timeout keeps a failed test from hanging the GPU forever. Loads the kernels of this
/// file first: under lazy loading, a kernel loaded while this one spins would wait for it.
cudaError_t wait_for_host_flag(const volatile std::uint32_t* flag, std::uint64_t timeout_ns,
                               cudaStream_t stream) noexcept;

}  // namespace terrace::kernels

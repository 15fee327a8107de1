// SPDX-License-Identifier: Apache-2.0
// The GPU test kernels of fill.hpp. Bytes, not words: ranges start and end anywhere, and speed is
// not the point (a grid-stride byte loop still fills gigabytes in milliseconds).
#include "kernels/fill.hpp"

#include "kernels/launch.cuh"

#include <algorithm>

namespace terrace::kernels {

namespace {

constexpr unsigned threads_per_block = 256;
constexpr std::size_t max_blocks = 4096;

unsigned blocks_for(std::size_t bytes) {
  const std::size_t blocks = (bytes + threads_per_block - 1) / threads_per_block;
  return static_cast<unsigned>(std::min(blocks, max_blocks));
}

__global__ void fill_kernel(std::uint8_t* dst, std::size_t bytes, std::uint32_t seed) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < bytes;
       i += stride) {
    dst[i] = pattern_byte(seed, i);
  }
}

__global__ void check_kernel(const std::uint8_t* src, std::size_t bytes, std::uint32_t seed,
                             unsigned long long* counter) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  unsigned long long mismatches = 0;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < bytes;
       i += stride) {
    mismatches += src[i] != pattern_byte(seed, i) ? 1u : 0u;
  }
  // One atomic per thread that saw a mismatch, not one per byte.
  if (mismatches != 0) atomicAdd(counter, mismatches);
}

__device__ std::uint64_t global_time_ns() {
  std::uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void wait_kernel(const volatile std::uint32_t* flag, std::uint64_t timeout_ns) {
  const std::uint64_t start = global_time_ns();
  while (*flag == 0 && global_time_ns() - start < timeout_ns) {
    __nanosleep(1000);
  }
}

// Lazy loading (the default since CUDA 12.2) loads a kernel at its first launch, and the load may
// wait for the kernels already running. A kernel first launched while wait_kernel spins would
// therefore block in its launch until the gate times out: load all of them before holding.
cudaError_t load_kernels() {
  cudaFuncAttributes attributes;
  if (const cudaError_t e = cudaFuncGetAttributes(&attributes, fill_kernel)) return e;
  if (const cudaError_t e = cudaFuncGetAttributes(&attributes, check_kernel)) return e;
  return cudaFuncGetAttributes(&attributes, wait_kernel);
}

}  // namespace

cudaError_t fill_pattern(void* dst, std::size_t bytes, std::uint32_t seed,
                         cudaStream_t stream) noexcept {
  if (bytes == 0) return cudaSuccess;
  return launch(fill_kernel, blocks_for(bytes), threads_per_block, stream, static_cast<std::uint8_t*>(dst),
                bytes, seed);
}

cudaError_t count_pattern_mismatches(const void* src, std::size_t bytes, std::uint32_t seed,
                                     unsigned long long* device_counter,
                                     cudaStream_t stream) noexcept {
  if (bytes == 0) return cudaSuccess;
  return launch(check_kernel, blocks_for(bytes), threads_per_block, stream,
                static_cast<const std::uint8_t*>(src), bytes, seed, device_counter);
}

cudaError_t wait_for_host_flag(const volatile std::uint32_t* flag, std::uint64_t timeout_ns,
                               cudaStream_t stream) noexcept {
  if (const cudaError_t e = load_kernels()) return e;
  return launch(wait_kernel, 1, 1, stream, flag, timeout_ns);
}

}  // namespace terrace::kernels

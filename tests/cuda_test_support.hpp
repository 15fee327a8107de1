// SPDX-License-Identifier: Apache-2.0
// What the GPU tests that drive CUDA themselves share: a checked call, a fixture that skips every
// case when no GPU is present (so the `gpu` label never fails or passes silently on a CPU
// machine), and an owning device buffer.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstddef>
#include <stdexcept>
#include <string>

namespace terrace::testing {

inline void cuda_ok(cudaError_t e, const char* call) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(call) + ": " + cudaGetErrorString(e));
}

class gpu_test : public ::testing::Test {
 protected:
  void SetUp() override {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) GTEST_SKIP() << "no CUDA device";
  }
};

struct device_buffer {
  explicit device_buffer(std::size_t bytes) { cuda_ok(cudaMalloc(&ptr, bytes), "cudaMalloc"); }
  ~device_buffer() { cudaFree(ptr); }
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;
  void* ptr = nullptr;
};

}  // namespace terrace::testing

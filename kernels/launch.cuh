// SPDX-License-Identifier: Apache-2.0
// One kernel launch that reports its own failure. `kernel<<<...>>>` returns nothing, and the
// cudaGetLastError() after it returns whatever error the calling thread left pending, perhaps the
// embedder's own from long before: terrace would then blame its kernel for it, and clear it from
// under the embedder. cudaLaunchKernelEx returns the launch's own status instead.
#pragma once

#include <cuda_runtime.h>

#include <utility>

namespace terrace::kernels {

template <class... Params, class... Args>
cudaError_t launch(void (*kernel)(Params...), unsigned blocks, unsigned threads, cudaStream_t stream,
                   Args&&... args) noexcept {
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(blocks);
  config.blockDim = dim3(threads);
  config.stream = stream;
  const cudaError_t e = cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
  // The failure is returned; left pending too, the embedder's next check would report it again.
  if (e != cudaSuccess) (void)cudaGetLastError();
  return e;
}

}  // namespace terrace::kernels

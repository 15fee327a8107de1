// SPDX-License-Identifier: Apache-2.0
// The pinned host tier over a real GPU: buffers come from cudaHostAlloc and round-trip through
// device memory with async copies. Skips when no GPU is present.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "terrace/device.hpp"
#include "terrace/pinned_pool.hpp"

namespace terrace {
namespace {

constexpr std::size_t MiB = 1024 * 1024;

TEST(PinnedPoolGpu, BuffersRoundTripThroughDeviceMemory) {
  if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device present";
  auto dev = make_device("cuda", {});
  pinned_pool_options o;
  o.region_size = 64 * MiB;
  pinned_host_pool pool(*dev, o);
  const std::size_t n = 3 * MiB + 123;
  auto* up = static_cast<unsigned char*>(pool.allocate(n));
  auto* down = static_cast<unsigned char*>(pool.allocate(n));
  for (std::size_t i = 0; i < n; ++i) up[i] = static_cast<unsigned char>(i * 7);
  std::memset(down, 0, n);
  void* d = dev->reserve(n);
  const stream_ref s = dev->create_stream();
  dev->copy_async(d, up, n, copy_kind::host_to_device, s);
  dev->copy_async(down, d, n, copy_kind::device_to_host, s);
  dev->synchronize(s);
  EXPECT_EQ(std::memcmp(up, down, n), 0);
  dev->destroy_stream(s);
  dev->release(d, n);
  pool.deallocate(up);
  pool.deallocate(down);
  pool.check_invariants();
  EXPECT_EQ(pool.stats().reserved_bytes.current, static_cast<std::int64_t>(64 * MiB));
}

}  // namespace
}  // namespace terrace

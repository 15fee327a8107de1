// SPDX-License-Identifier: Apache-2.0
// record_stream of nullptr. allocate(0) hands out nullptr and deallocate(nullptr) ignores it, so
// an empty tensor's data pointer reaches record_stream too; PyTorch's allocator (and terrace's C
// hook) ignore it there as well. It must not be refused as a foreign pointer, under either policy.
#include <gtest/gtest.h>

#include "terrace/caching_allocator.hpp"
#include "terrace/error.hpp"
#include "terrace/sim_device.hpp"

namespace terrace {
namespace {

void expect_null_record_stream_ignored(alloc_policy policy) {
  auto dev = make_device("sim", {});
  allocator_config cfg;
  cfg.policy = policy;
  caching_allocator a(*dev, cfg);
  const stream_ref side = dev->create_stream();
  void* empty = a.allocate(0, side);
  ASSERT_EQ(empty, nullptr);
  EXPECT_NO_THROW(a.record_stream(empty, side));
  EXPECT_NO_THROW(a.deallocate(empty, side));
  EXPECT_EQ(a.stats().allocation[0].current, 0);
  a.check_invariants();
  dev->destroy_stream(side);
}

TEST(AllocatorRecordStreamNull, IsIgnoredUnderTheCachingPolicy) {
  expect_null_record_stream_ignored(alloc_policy::caching);
}

TEST(AllocatorRecordStreamNull, IsIgnoredUnderThePlannedPolicy) {
  expect_null_record_stream_ignored(alloc_policy::planned);
}

}  // namespace
}  // namespace terrace

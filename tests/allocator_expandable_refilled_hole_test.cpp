// SPDX-License-Identifier: Apache-2.0
// Expandable segments refill the holes that empty_cache unmapped between live blocks: a map that
// joins the mapped pages on both sides. The host VMM backends' page books (tiers/vmm_book.hpp,
// shared with cuda-vmm) keep one spare node for every later unmap that can cut a run in two; the
// join dropped one of the two runs' nodes instead of keeping it, so unmapping the refilled page
// again had no spare node left and crashed the process (an empty vector's back()).
#include <gtest/gtest.h>

#include <cstddef>
#include <string>

#include "terrace/caching_allocator.hpp"
#include "terrace/device.hpp"

namespace terrace {
namespace {

constexpr std::size_t kPage = 2u << 20;

std::unique_ptr<device_backend> paged(const std::string& backend) {
  device_options o;
  o.capacity = 64 * kPage;
  o.map_granularity = kPage;
  return make_device(backend, o);
}

class ExpandableRefilledHole : public ::testing::TestWithParam<std::string> {};

TEST_P(ExpandableRefilledHole, TheDeviceUnmapsAPageThatJoinedTwoRuns) {
  auto dev = paged(GetParam());
  const std::size_t g = dev->properties().map_granularity;
  char* r = static_cast<char*>(dev->reserve_address_range(3 * g));
  dev->map(r, g);
  dev->map(r + 2 * g, g);
  dev->map(r + g, g);  // joins the runs on both sides into one
  dev->unmap(r + g, g);  // cuts it in two again
  EXPECT_EQ(dev->used_bytes(), 2 * g);
  dev->unmap(r, g);
  dev->unmap(r + 2 * g, g);
  dev->release_address_range(r, 3 * g);
  EXPECT_EQ(dev->used_bytes(), 0u);
}

TEST_P(ExpandableRefilledHole, TheAllocatorUnmapsARefilledHoleAgain) {
  auto dev = paged(GetParam());
  const std::size_t g = dev->properties().map_granularity;
  allocator_config cfg;
  cfg.expandable_segments = true;
  caching_allocator a(*dev, cfg);
  void* low = a.allocate(g);
  void* mid = a.allocate(g);
  void* high = a.allocate(g);
  a.deallocate(mid);
  a.empty_cache();  // unmaps the page between two live blocks
  void* refill = a.allocate(g);
  ASSERT_EQ(refill, mid);  // mapped into the hole, joining the pages on both sides
  a.deallocate(refill);
  a.empty_cache();  // and unmapped again
  a.check_invariants();
  EXPECT_EQ(a.stats().reserved_bytes[0].current, static_cast<std::int64_t>(2 * g));
  a.deallocate(low);
  a.deallocate(high);
  a.empty_cache();
  EXPECT_EQ(dev->used_bytes(), 0u);
  a.check_invariants();
}

INSTANTIATE_TEST_SUITE_P(HostVmmBackends, ExpandableRefilledHole, ::testing::Values("sim", "null"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace terrace

// SPDX-License-Identifier: Apache-2.0
// The tiers' books when the host is out of memory. The host-side backends' noexcept calls (unmap,
// release, destroy_stream, destroy_event) may not allocate at all: unmapping the middle of a
// mapped run splits it in two, and the virtual-memory books (tiers/vmm_book.hpp) must hold that
// second run's node; destroying a stream parks it in the device's draining list. The extent
// allocator (the pinned pool's and the NVMe store's free space) and the pinned pool must fail a
// call having changed nothing. This executable replaces the global operator new (every form the
// plain operator delete frees) with one that fails every allocation on the test thread while a
// host_out_of_memory lives.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <optional>
#include <random>
#include <vector>

#include "terrace/device.hpp"
#include "terrace/pinned_pool.hpp"
#include "tiers/extent_allocator.hpp"
#include "tiers/vmm_book.hpp"
#include "failing_operator_new.hpp"

namespace terrace::detail {
namespace {

using testing::host_out_of_memory;

constexpr std::size_t kPage = 4096;
constexpr std::uintptr_t kBase = std::uintptr_t{1} << 30;

TEST(VmmBookHostOom, UnmappingTheMiddleOfRunsNeedsNoHostMemory) {
  vmm_book book("test", kPage);
  book.add_range(kBase, 16 * kPage);
  book.check_map(kBase, 16 * kPage);
  book.mark_mapped(kBase, 16 * kPage);
  {
    host_out_of_memory full;
    // Every other page: each unmap but the last splits a run.
    for (std::size_t i = 1; i < 16; i += 2) {
      ASSERT_TRUE(book.why_not_unmappable(kBase + i * kPage, kPage).empty());
      EXPECT_NO_THROW(book.mark_unmapped(kBase + i * kPage, kPage)) << "page " << i;
    }
  }
  EXPECT_EQ(book.mapped_runs().size(), 8u);
  EXPECT_EQ(book.mapped_bytes(), 8 * kPage);
  for (std::size_t i = 0; i < 16; ++i) {
    EXPECT_EQ(book.is_mapped(kBase + i * kPage, kPage), i % 2 == 0) << "page " << i;
  }
}

// Maps (the host has memory) and unmaps (it has none) at random against a page-by-page model.
TEST(VmmBookHostOom, RandomMapsAndUnmapsWithAFullHostKeepTheBooksRight) {
  constexpr std::size_t kPages = 64;
  vmm_book book("test", kPage);
  book.add_range(kBase, kPages * kPage);
  std::vector<bool> mapped(kPages, false);
  std::mt19937 rng(7);
  for (int step = 0; step < 5000; ++step) {
    const std::size_t first = rng() % kPages;
    const std::size_t count = 1 + rng() % std::min<std::size_t>(8, kPages - first);
    bool all_mapped = true;
    bool none_mapped = true;
    for (std::size_t i = first; i < first + count; ++i) {
      all_mapped = all_mapped && mapped[i];
      none_mapped = none_mapped && !mapped[i];
    }
    const std::uintptr_t p = kBase + first * kPage;
    if (none_mapped) {
      book.check_map(p, count * kPage);
      book.mark_mapped(p, count * kPage);
      for (std::size_t i = first; i < first + count; ++i) mapped[i] = true;
    } else if (all_mapped) {
      ASSERT_TRUE(book.why_not_unmappable(p, count * kPage).empty());
      host_out_of_memory full;
      ASSERT_NO_THROW(book.mark_unmapped(p, count * kPage)) << "step " << step;
      for (std::size_t i = first; i < first + count; ++i) mapped[i] = false;
    }
  }
  std::size_t bytes = 0;
  for (std::size_t i = 0; i < kPages; ++i) {
    ASSERT_EQ(book.is_mapped(kBase + i * kPage, kPage), mapped[i]) << "page " << i;
    bytes += mapped[i] ? kPage : 0;
  }
  EXPECT_EQ(book.mapped_bytes(), bytes);
}

// Through the device: before the fix the split's bad_alloc left the noexcept unmap and terminated.
TEST(VmmBookHostOom, SimAndNullUnmapTheMiddleOfAMappedRunWithAFullHost) {
  for (const char* name : {"sim", "null"}) {
    SCOPED_TRACE(name);
    device_options o;
    o.capacity = 64 * (std::size_t{1} << 20);
    auto dev = make_device(name, o);
    const std::size_t g = dev->properties().map_granularity;
    void* r = dev->reserve_address_range(3 * g);
    dev->map(r, 3 * g);
    char* middle = static_cast<char*>(r) + g;
    {
      host_out_of_memory full;
      dev->unmap(middle, g);
    }
    EXPECT_EQ(dev->used_bytes(), 2 * g);
    dev->map(middle, g);  // the books still know the hole
    if (dev->properties().touches_memory) {
      std::memset(r, 1, 3 * g);
    }
    dev->unmap(r, 3 * g);
    dev->release_address_range(r, 3 * g);
  }
}

// Found in review: destroy_stream parked the stream in the sim device's draining list with a
// push_back, which allocates; with the host out of memory the noexcept call terminated. The list
// has room for every stream from their creation.
TEST(DeviceHostOom, SimAndNullReleaseAndDestroyWithAFullHost) {
  for (const char* name : {"sim", "null"}) {
    SCOPED_TRACE(name);
    device_options o;
    o.capacity = 64 * (std::size_t{1} << 20);
    auto dev = make_device(name, o);
    std::vector<stream_ref> streams;
    std::vector<event_ref> events;
    std::vector<void*> segments;
    for (int i = 0; i < 5; ++i) {
      streams.push_back(dev->create_stream());
      events.push_back(dev->create_event());
      segments.push_back(dev->reserve(64 * 1024));
      dev->record(events.back(), streams.back());
    }
    dev->synchronize_device();
    {
      host_out_of_memory full;
      for (event_ref e : events) dev->destroy_event(e);
      for (stream_ref s : streams) dev->destroy_stream(s);
      for (void* p : segments) dev->release(p, 64 * 1024);
    }
    EXPECT_EQ(dev->used_bytes(), 0u);
  }
}

// A reserve the host has no memory for fails having changed nothing: no capacity stays charged and
// no address range is lost (the null device's charge and range leaked when its books threw).
TEST(DeviceHostOom, AReserveTheHostCannotBookChangesNothing) {
  for (const char* name : {"sim", "null"}) {
    SCOPED_TRACE(name);
    device_options o;
    o.capacity = 8 * (std::size_t{1} << 20);
    auto dev = make_device(name, o);
    void* held = dev->reserve(64 * 1024);  // the first range is not the only one
    for (int i = 0; i < 3; ++i) {
      host_out_of_memory full;
      EXPECT_ANY_THROW(dev->reserve(64 * 1024));
      EXPECT_ANY_THROW(dev->reserve_address_range(dev->properties().map_granularity));
    }
    EXPECT_EQ(dev->used_bytes(), 64 * 1024u);
    void* all = dev->reserve(o.capacity - 64 * 1024);
    dev->release(all, o.capacity - 64 * 1024);
    dev->release(held, 64 * 1024);
    EXPECT_EQ(dev->used_bytes(), 0u);
  }
}

// Found in review: the extent allocator erased a hole before it inserted what was left of it, so a
// host out of memory in an allocate lost the rest of the hole (free space that no call would ever
// hand out again), and one between a release's two insertions left its two indexes disagreeing.
// Now allocate and a release beside a hole allocate nothing, and the calls that need a new hole
// fail having changed nothing.
TEST(ExtentAllocatorHostOom, AFullHostNeverCostsFreeSpace) {
  constexpr std::uint64_t kUnit = 4096;
  extent_allocator ea(64 * kUnit, kUnit);
  std::mt19937_64 rng(7);
  std::vector<std::pair<std::uint64_t, std::uint64_t>> live;  // offset, bytes
  std::uint64_t used = 0;
  for (int i = 0; i < 4000; ++i) {
    const bool full_host = rng() % 2 == 0;
    const std::uint64_t free_before = ea.free_bytes();
    if (live.empty() || rng() % 2 == 0) {
      const std::uint64_t bytes = (1 + rng() % 4) * kUnit - rng() % 100;
      std::optional<std::uint64_t> at;
      {
        std::optional<host_out_of_memory> full;
        if (full_host) full.emplace();
        at = ea.allocate(bytes);  // never allocates: no throw even with a full host
      }
      if (at) {
        live.emplace_back(*at, bytes);
        used += ea.extent_size(bytes);
      }
    } else {
      const std::size_t k = rng() % live.size();
      const auto [offset, bytes] = live[k];
      bool released = true;
      try {
        std::optional<host_out_of_memory> full;
        if (full_host) full.emplace();
        ea.release(offset, bytes);
      } catch (const std::bad_alloc&) {
        released = false;  // between two extents, with no memory for a new hole
        EXPECT_EQ(ea.free_bytes(), free_before);
      }
      if (released) {
        live.erase(live.begin() + static_cast<std::ptrdiff_t>(k));
        used -= ea.extent_size(bytes);
      }
    }
    ASSERT_TRUE(ea.consistent()) << "operation " << i;
    ASSERT_EQ(ea.free_bytes() + used, ea.capacity()) << "operation " << i;
  }
}

TEST(ExtentAllocatorHostOom, AReserveThatFailsChangesNothing) {
  constexpr std::uint64_t kUnit = 4096;
  extent_allocator ea(16 * kUnit, kUnit);
  {
    host_out_of_memory full;
    EXPECT_THROW(ea.reserve(4 * kUnit, kUnit), std::bad_alloc);  // the middle: two holes needed
  }
  EXPECT_TRUE(ea.consistent());
  EXPECT_EQ(ea.free_bytes(), 16 * kUnit);
  {
    host_out_of_memory full;
    EXPECT_TRUE(ea.reserve(0, kUnit));  // the head: the hole's nodes carry the rest
    EXPECT_TRUE(ea.reserve(15 * kUnit, kUnit));  // the tail
  }
  EXPECT_TRUE(ea.reserve(4 * kUnit, kUnit));
  EXPECT_TRUE(ea.consistent());
  EXPECT_EQ(ea.free_bytes(), 13 * kUnit);
}

// The pinned pool took the extent before the live table's entry; with the host out of memory for
// the entry the extent was lost, and a free whose hole could not be made dropped the buffer.
TEST(PinnedPoolHostOom, AllocateAndFreeWithAFullHostChangeNothingOrSucceed) {
  device_options o;
  o.capacity = 64 * (std::size_t{1} << 20);
  auto dev = make_device("sim", o);
  pinned_pool_options po;
  po.region_size = 4 * (std::size_t{1} << 20);
  pinned_host_pool pool(*dev, po);
  std::vector<void*> held;
  for (int i = 0; i < 8; ++i) held.push_back(pool.allocate(64 * 1024));
  const auto before = pool.stats();
  for (int i = 0; i < 4; ++i) {
    host_out_of_memory full;
    EXPECT_THROW(pool.allocate(64 * 1024), std::bad_alloc);
  }
  pool.check_invariants();
  EXPECT_EQ(pool.stats().allocation.current, before.allocation.current);
  // Freeing a buffer between two live ones needs a new hole: refused, the buffer still live.
  {
    host_out_of_memory full;
    EXPECT_THROW(pool.deallocate(held[3]), std::bad_alloc);
  }
  pool.check_invariants();
  EXPECT_EQ(pool.allocation_size(held[3]), 64 * 1024u);
  for (void* p : held) pool.deallocate(p);
  pool.check_invariants();
  EXPECT_EQ(pool.stats().allocated_bytes.current, 0);
}

}  // namespace
}  // namespace terrace::detail

// SPDX-License-Identifier: Apache-2.0
// The host-side backends' noexcept calls (unmap, release, destroy_stream, destroy_event) when the
// host is out of memory: a host allocation there is fatal by their contract, so what they need
// must already be in hand. Unmapping the middle of a mapped run splits it in two, and the
// virtual-memory books (tiers/vmm_book.hpp) must hold that second run's node; destroying a stream
// parks it in the device's draining list. This executable replaces the global operator new (every
// form the plain operator delete frees) with one that fails every allocation on the test thread
// while a host_out_of_memory lives.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <random>
#include <vector>

#include "terrace/device.hpp"
#include "tiers/vmm_book.hpp"

namespace {

// Only the test thread's allocations fail: the sim device's stream workers allocate too.
thread_local bool host_full = false;

void* counted_allocation(std::size_t n) {
  if (host_full) throw std::bad_alloc();
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}

}  // namespace

void* operator new(std::size_t n) { return counted_allocation(n); }
void* operator new[](std::size_t n) { return counted_allocation(n); }
void* operator new(std::size_t n, const std::nothrow_t&) noexcept {
  try {
    return counted_allocation(n);
  } catch (const std::bad_alloc&) {
    return nullptr;
  }
}
void* operator new[](std::size_t n, const std::nothrow_t&) noexcept {
  return operator new(n, std::nothrow);
}
void operator delete(void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }

namespace terrace::detail {
namespace {

// While it lives, every allocation on this thread fails.
class host_out_of_memory {
 public:
  host_out_of_memory() { host_full = true; }
  ~host_out_of_memory() { host_full = false; }
  host_out_of_memory(const host_out_of_memory&) = delete;
  host_out_of_memory& operator=(const host_out_of_memory&) = delete;
};

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

}  // namespace
}  // namespace terrace::detail

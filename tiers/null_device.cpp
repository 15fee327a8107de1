// SPDX-License-Identifier: Apache-2.0
// The null device ("null"): addresses without memory. It hands out aligned, non-overlapping
// addresses from a fake address space and keeps the same books as a real device (capacity, live
// segments, reserved ranges, mapped pages), so that an allocator's policy runs unchanged over it
// and a trace with a 70 GB peak replays on a 24 GB machine. Nothing is ever touched: streams and
// events complete at once and copies do nothing.
//
// The fake addresses live in [2^47, 2^53): above every user-space address of a 4-level-paging
// x86-64 or AArch64 process (so a stray dereference faults at once instead of scribbling over real
// memory), and below 2^53, so that they survive a trip through JSON numbers (snapshots, memory_viz).
#include <atomic>
#include <cstdint>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "terrace/error.hpp"
#include "tiers/backends.hpp"
#include "tiers/capacity_meter.hpp"
#include "tiers/interval_nodes.hpp"
#include "tiers/vmm_book.hpp"

namespace terrace::detail {
namespace {

constexpr std::size_t kDefaultCapacity = std::size_t{1} << 40;
constexpr std::size_t kDefaultGranularity = std::size_t{2} << 20;
constexpr std::size_t kAlignment = 512;
constexpr std::uintptr_t kSpaceBegin = std::uintptr_t{1} << 47;
constexpr std::uintptr_t kSpaceEnd = std::uintptr_t{1} << 53;

// Free fake address space as coalesced [begin, end) intervals. The last interval is the untouched
// tail; taking from it first makes the common case a bump allocation in O(log n), and a release at
// the tail's edge moves it back down. Holes are searched (first fit) only when the tail is short.
//
// give() runs in noexcept calls (release, release_address_range), yet a range that touches no
// free neighbour is a new interval, whose node a full host could not provide. Free intervals are
// separated by taken ranges, so there are at most taken + 1 of them: take() (which may throw)
// makes the books hold that many nodes, in intervals or spare, before it changes anything, and
// give() and carve() only move nodes between the two.
// REQUIRES: the owner serializes calls.
class fake_address_space {
 public:
  fake_address_space() { free_.emplace(kSpaceBegin, kSpaceEnd); }

  // 0 when no free interval can hold `bytes` at `align` (a power of two).
  // @throws std::bad_alloc, having changed nothing.
  std::uintptr_t take(std::size_t bytes, std::size_t align) {
    auto it = find(bytes, align);
    if (it == free_.end()) return 0;
    nodes_.hold(free_, taken_ + 2);  // the ranges after this take, plus one
    ++taken_;
    return carve(it, bytes, align);
  }

  // REQUIRES: [begin, begin + bytes) was taken. Allocates nothing.
  void give(std::uintptr_t begin, std::size_t bytes) noexcept {
    --taken_;
    std::uintptr_t end = begin + bytes;
    auto next = free_.lower_bound(end);
    if (next != free_.end() && next->first == end) {
      end = next->second;
      auto after = std::next(next);
      nodes_.keep(free_, next);
      next = after;
    }
    if (next != free_.begin()) {
      auto prev = std::prev(next);
      if (prev->second == begin) {
        prev->second = end;  // joined in place
        return;
      }
    }
    nodes_.insert(free_, begin, end);
  }

 private:
  using interval_map = interval_nodes::interval_map;
  using iterator = interval_map::iterator;

  iterator find(std::size_t bytes, std::size_t align) {
    if (free_.empty()) return free_.end();
    if (auto it = std::prev(free_.end()); fits(it, bytes, align)) return it;
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if (fits(it, bytes, align)) return it;
    }
    return free_.end();
  }

  static std::uintptr_t aligned_start(iterator it, std::size_t align) {
    return (it->first + align - 1) & ~static_cast<std::uintptr_t>(align - 1);
  }

  static bool fits(iterator it, std::size_t bytes, std::size_t align) {
    const std::uintptr_t start = aligned_start(it, align);
    return start < it->second && it->second - start >= bytes;
  }

  // Allocates nothing: the interval keeps its node for its head, and its tail takes a spare.
  std::uintptr_t carve(iterator it, std::size_t bytes, std::size_t align) noexcept {
    const std::uintptr_t begin = it->first;
    const std::uintptr_t end = it->second;
    const std::uintptr_t start = aligned_start(it, align);
    if (begin < start) {
      it->second = start;
    } else {
      nodes_.keep(free_, it);
    }
    if (start + bytes < end) nodes_.insert(free_, start + bytes, end);
    return start;
  }

  interval_map free_;
  interval_nodes nodes_;     // at least taken_ + 1 of them, in free_ or spare
  std::size_t taken_ = 0;    // ranges handed out and not given back
};

std::size_t round_up(std::size_t n, std::size_t align) { return (n + align - 1) / align * align; }

class null_device final : public device_backend {
 public:
  explicit null_device(const device_options& options)
      : vmm_("null", options.map_granularity ? options.map_granularity : kDefaultGranularity),
        meter_("null", options.capacity ? options.capacity : kDefaultCapacity) {
    properties_.name = "null";
    properties_.capacity = meter_.capacity();
    properties_.alignment = kAlignment;
    properties_.touches_memory = false;
    properties_.supports_vmm = true;
    properties_.map_granularity = vmm_.granularity();
    properties_.device_index = options.device_index;
  }

 private:
  // -------------------------------------------------------------- segments

  void* do_reserve(std::size_t bytes) override {
    std::lock_guard<std::mutex> lock(mutex_);
    meter_.charge(bytes, "reserve");
    std::uintptr_t p = 0;
    try {
      p = bytes > SIZE_MAX - kAlignment ? 0 : space_.take(round_up(bytes, kAlignment), kAlignment);
      if (p == 0) {
        throw out_of_memory("terrace: out of memory on device 'null': its fake address space has "
                            "no room for " + describe_bytes(bytes));
      }
      segments_.emplace(p, bytes);
    } catch (...) {  // bad_alloc of a book's node, or no room: the range and its charge go back
      if (p != 0) space_.give(p, round_up(bytes, kAlignment));
      meter_.uncharge(bytes);
      throw;
    }
    return reinterpret_cast<void*>(p);
  }

  void do_release(void* ptr, std::size_t bytes) noexcept override {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto p = reinterpret_cast<std::uintptr_t>(ptr);
    const auto it = segments_.find(p);
    if (it == segments_.end()) {
      contract_violation("null", "release(" + hex_address(p) + "): not a segment from reserve()");
    }
    if (it->second != bytes) {
      contract_violation("null", "release(" + hex_address(p) + ", " + std::to_string(bytes) +
                                     "): the segment was reserved with " +
                                     std::to_string(it->second) + " bytes");
    }
    segments_.erase(it);
    space_.give(p, round_up(bytes, kAlignment));
    meter_.uncharge(bytes);
  }

  // -------------------------------------------------------------- virtual memory

  void* do_reserve_address_range(std::size_t bytes) override {
    vmm_.check_range_size(bytes);
    std::lock_guard<std::mutex> lock(mutex_);
    const std::uintptr_t p = space_.take(bytes, vmm_.granularity());
    if (p == 0) {
      throw out_of_memory("terrace: device 'null': address space exhausted: no room for a range of " +
                          describe_bytes(bytes));
    }
    try {
      vmm_.add_range(p, bytes);
    } catch (...) {  // bad_alloc of the book's node: the range goes back
      space_.give(p, bytes);
      throw;
    }
    return reinterpret_cast<void*>(p);
  }

  void do_release_address_range(void* ptr, std::size_t bytes) noexcept override {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto p = reinterpret_cast<std::uintptr_t>(ptr);
    if (std::string why = vmm_.why_not_releasable(p, bytes); !why.empty()) {
      contract_violation("null", why);
    }
    vmm_.erase_range(p);
    space_.give(p, bytes);
  }

  void do_map(void* ptr, std::size_t bytes) override {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto p = reinterpret_cast<std::uintptr_t>(ptr);
    vmm_.check_map(p, bytes);
    meter_.charge(bytes, "map");
    try {
      vmm_.mark_mapped(p, bytes);  // a new entry in the books: the host may have no memory
    } catch (...) {
      meter_.uncharge(bytes);
      throw;
    }
  }

  void do_unmap(void* ptr, std::size_t bytes) noexcept override {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto p = reinterpret_cast<std::uintptr_t>(ptr);
    if (std::string why = vmm_.why_not_unmappable(p, bytes); !why.empty()) {
      contract_violation("null", why);
    }
    vmm_.mark_unmapped(p, bytes);
    meter_.uncharge(bytes);
  }

  std::size_t do_used_bytes() const noexcept override { return meter_.used(); }

  // -------------------------------------------------------------- streams, events, copies
  // Nothing is ever queued, so everything has always completed. Handles are distinct non-null
  // tokens (never dereferenced), so that callers keying maps by them still see distinct streams.

  stream_ref do_create_stream() override { return stream_ref{next_token()}; }
  void do_destroy_stream(stream_ref) noexcept override {}
  void do_synchronize_stream(stream_ref) override {}
  void do_synchronize_device() override {}
  event_ref do_create_event() override { return event_ref{next_token()}; }
  void do_destroy_event(event_ref) noexcept override {}
  void do_record(event_ref, stream_ref) override {}
  bool do_query(event_ref) override { return true; }
  void do_wait(stream_ref, event_ref) override {}
  void do_synchronize_event(event_ref) override {}
  void do_copy_async(void*, const void*, std::size_t, copy_kind, stream_ref) override {}

  void* next_token() noexcept {
    // Multiples of 16 from 16 up: look like aligned pointers, never collide.
    return reinterpret_cast<void*>((tokens_.fetch_add(1, std::memory_order_relaxed) + 1) << 4);
  }

  std::mutex mutex_;  // guards space_, segments_, vmm_ and meter_'s counts
  fake_address_space space_;
  std::unordered_map<std::uintptr_t, std::size_t> segments_;
  vmm_book vmm_;
  capacity_meter meter_;  // charged and uncharged under mutex_
  std::atomic<std::uintptr_t> tokens_{0};
};

}  // namespace

std::unique_ptr<device_backend> make_null_device(const device_options& options) {
  const std::size_t g = options.map_granularity;
  TERRACE_EXPECTS(g == 0 || (g >= kAlignment && (g & (g - 1)) == 0),
                  "device 'null': map_granularity " + std::to_string(g) +
                      " must be a power of two and at least 512");
  return std::make_unique<null_device>(options);
}

}  // namespace terrace::detail

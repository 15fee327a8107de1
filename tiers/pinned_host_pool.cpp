// SPDX-License-Identifier: Apache-2.0
// The pinned host tier (include/terrace/pinned_pool.hpp): large pinned regions from the device
// backend, each sub-allocated best-fit by its own extent_allocator (offsets within the region).
//
// A child forked without exec (a DataLoader worker) does not inherit the regions (MADV_DONTFORK,
// host_pinning.cpp), but it does inherit the pool's books. There the pool (fork_guard.hpp) refuses
// to allocate, takes a free of the parent's buffers as done, and at its end forgets the regions
// instead of releasing them: the child may have mapped something of its own at those addresses
// since, and a parent's thread may have held the pool's or the device's lock at the fork.
#include "terrace/pinned_pool.hpp"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <unordered_map>
#include <vector>

#include "terrace/error.hpp"
#include "tiers/backends.hpp"
#include "tiers/extent_allocator.hpp"
#include "tiers/fork_guard.hpp"

namespace terrace {
namespace {

constexpr std::size_t KiB = 1024;
constexpr std::size_t MiB = 1024 * KiB;
constexpr std::size_t kDefaultRegion = 256 * MiB;
constexpr std::size_t kDefaultAlignment = 4 * KiB;
// Regions are whole transparent huge pages: the host backs them with 2 MiB pages when it can.
constexpr std::size_t kRegionGranule = 2 * MiB;
// The smallest page any host has: the alignment a region's base is known to have.
constexpr std::size_t kMinPage = 4 * KiB;

std::size_t round_up(std::size_t n, std::size_t to) { return (n + to - 1) / to * to; }

}  // namespace

std::string pinned_pool_stats::to_json() const {
  nlohmann::ordered_json j;
  const auto put = [&](const char* name, const stat& s) {
    const std::string n(name);
    j[n + ".current"] = s.current;
    j[n + ".peak"] = s.peak;
    j[n + ".allocated"] = s.allocated;
    j[n + ".freed"] = s.freed;
  };
  put("allocation", allocation);
  put("allocated_bytes", allocated_bytes);
  put("requested_bytes", requested_bytes);
  put("segment", segment);
  put("reserved_bytes", reserved_bytes);
  j["num_alloc_retries"] = num_alloc_retries;
  j["num_ooms"] = num_ooms;
  j["largest_free_block"] = largest_free_block;
  return j.dump();
}

struct pinned_host_pool::impl : private detail::fork_guard {
  struct region {
    std::uintptr_t base = 0;   // as the backend gave it: page aligned only
    std::size_t size = 0;      // as reserved
    std::size_t start = 0;     // offset of the first `unit`-aligned address: extents count from it
    detail::extent_allocator extents;
    std::size_t live = 0;  // buffers handed out from it
    region(std::uintptr_t b, std::size_t s, std::size_t unit)
        : base(b),
          size(s),
          start(round_up(b, unit) - b),
          extents(start < s ? (s - start) / unit * unit : 0, unit) {}
    std::uintptr_t first() const { return base + start; }
  };
  struct buffer {
    region* owner = nullptr;
    std::size_t size = 0;       // rounded
    std::size_t requested = 0;
  };

  device_backend& device;
  pinned_pool_options options;
  mutable std::mutex mutex;
  std::map<std::uintptr_t, std::unique_ptr<region>> regions;  // by base address
  using live_map = std::unordered_map<std::uintptr_t, buffer>;
  live_map live;
  live_map entry_maker;  // where prepare_entry makes live-table nodes
  pinned_pool_stats counters;
  // Bytes of regions being reserved with the mutex released (grow): they count
  // against the capacity before they exist.
  std::size_t reserving = 0;

  impl(device_backend& d, pinned_pool_options o) : device(d), options(o) {
    if (options.region_size == 0) options.region_size = kDefaultRegion;
    if (options.alignment == 0) options.alignment = kDefaultAlignment;
    const std::size_t a = options.alignment;
    TERRACE_EXPECTS(a >= 64 && a <= kRegionGranule && (a & (a - 1)) == 0,
                    "pinned pool alignment " + std::to_string(a) +
                        " must be a power of two from 64 B to 2 MiB");
    TERRACE_EXPECTS(options.region_size <= SIZE_MAX - kRegionGranule,
                    "pinned pool region_size " + std::to_string(options.region_size) + " is too large");
    options.region_size = round_up(options.region_size, kRegionGranule);
    detail::fork_guard::install();
    register_for_fork();
  }

  using detail::fork_guard::forked_away;

  // The smallest region that holds `rounded` bytes at the pool's alignment. The backend promises
  // page alignment only (cudaHostAlloc, mmap), so an alignment above a page may cost up to one
  // alignment of the region's start.
  std::size_t tight_region(std::size_t rounded, std::size_t granule = kRegionGranule) const {
    const std::size_t slack = options.alignment > kMinPage ? options.alignment - kMinPage : 0;
    return round_up(rounded + slack, granule);
  }

  ~impl() {
    unregister_for_fork();
    if (forked_away()) return;
    for (auto& [base, r] : regions) device.release_pinned_host(reinterpret_cast<void*>(base), r->size);
  }

  // Nothing to close: the regions are already absent from the child, and forked_away() (set by
  // the handler) is what every later call looks at.
  void abandon_after_fork() noexcept override {}

  void refuse_in_forked_child() const {
    if (!forked_away()) return;
    throw device_error(
        "terrace: pinned host pool: not usable in a process forked without exec (a DataLoader "
        "worker): the pinned regions stay with the parent (MADV_DONTFORK); allocate pinned memory "
        "in the parent, or start the child with exec (multiprocessing's 'spawn')");
  }

  std::size_t reserved() const { return static_cast<std::size_t>(counters.reserved_bytes.current); }

  // Best fit inside the first region (in address order) that can hold it.
  void* carve(std::size_t bytes, std::size_t rounded, live_map::node_type& entry) {
    for (auto& [base, r] : regions) {
      if (r->extents.largest_hole() < rounded) continue;
      const auto offset = r->extents.allocate(rounded);
      if (!offset) continue;
      return hand_out(*r, *offset, bytes, rounded, entry);
    }
    return nullptr;
  }

  // The live-table entry of the buffer allocate() is about to hand out, made before any extent is
  // taken: a host out of memory then fails the call having changed nothing, and hand_out
  // allocates nothing. @throws std::bad_alloc.
  live_map::node_type prepare_entry() {
    live.reserve(live.size() + 1);  // the insertion then never rehashes
    entry_maker.emplace(0, buffer{});
    return entry_maker.extract(entry_maker.begin());
  }

  // Takes the extent at `offset` (just allocated) into the live table, in `entry`.
  void* hand_out(region& r, std::uint64_t offset, std::size_t bytes, std::size_t rounded,
                 live_map::node_type& entry) noexcept {
    const std::uintptr_t addr = r.first() + offset;
    entry.key() = addr;
    entry.mapped() = buffer{&r, rounded, bytes};
    live.insert(std::move(entry));
    ++r.live;
    counters.allocation.increase(1);
    counters.allocated_bytes.increase(static_cast<std::int64_t>(rounded));
    counters.requested_bytes.increase(static_cast<std::int64_t>(bytes));
    return reinterpret_cast<void*>(addr);
  }

  // The size of a new region big enough for `rounded`; throws out_of_memory past the capacity.
  // `tight_only`: no region larger than the request needs (the retry after the host refused).
  std::size_t region_size_for(std::size_t rounded, bool tight_only) const {
    const std::size_t tight = tight_region(rounded);
    const std::size_t size = tight_only ? tight : std::max(options.region_size, tight);
    // Compared as what is left, so that a request near SIZE_MAX cannot wrap past the cap.
    const std::size_t committed = reserved() + reserving;
    const std::size_t left = options.capacity - std::min(committed, options.capacity);
    if (options.capacity == 0 || size <= left) return size;
    // A smaller region that still fits the request may be within the cap: all that is left, in
    // whole pages. All, not just the request's own: one region per request, each rounded up to
    // 2 MiB, left a cap of 24 MiB 6.5 MiB short for 3 MiB buffers. Not rounded down to whole
    // 2 MiB either: regions never merge, so the rest became a region of its own that served only
    // requests that fit in it alone (a cap of 21 MiB: a 20 MiB region, then a 1 MiB + 4 KiB
    // buffer refused with 1.3 MiB of the cap unused; a cap of 1 MiB served nothing). The host
    // still backs the region's whole 2 MiB stretches with huge pages where it can.
    const std::size_t all = left / kMinPage * kMinPage;
    if (tight_region(rounded, kMinPage) > all) {
      throw out_of_memory("the pool's capacity of " + detail::describe_bytes(options.capacity) +
                          " would be exceeded" +
                          (reserving == 0 ? std::string()
                                          : " (" + detail::describe_bytes(reserving) +
                                                " of it being reserved by other threads)"));
    }
    return all;
  }

  // A new region big enough for `rounded`, reserved with `lock` released: mmap + mlock populate
  // every page (tens of milliseconds for a default region), and requests that fit the regions
  // already held must not wait for that. Returns with `lock` held again; throws out_of_memory
  // (from the host, or the capacity).
  region& grow(std::unique_lock<std::mutex>& lock, std::size_t rounded, bool tight_only = false) {
    const std::size_t size = region_size_for(rounded, tight_only);
    reserving += size;
    lock.unlock();
    void* p = nullptr;
    try {
      p = device.reserve_pinned_host(size);
    } catch (...) {
      lock.lock();
      reserving -= size;
      throw;
    }
    lock.lock();
    reserving -= size;
    return add_region(p, size);
  }

  // Takes a region the host reserved into the books; gives it back if that fails.
  region& add_region(void* p, std::size_t size) {
    const auto base = reinterpret_cast<std::uintptr_t>(p);
    try {
      auto r = std::make_unique<region>(base, size, options.alignment);
      region& ref = *r;
      regions.emplace(base, std::move(r));
      counters.segment.increase(1);
      counters.reserved_bytes.increase(static_cast<std::int64_t>(size));
      return ref;
    } catch (...) {
      device.release_pinned_host(p, size);
      throw;
    }
  }

  void release_empty_regions() {
    for (auto it = regions.begin(); it != regions.end();) {
      region& r = *it->second;
      if (r.live != 0) {
        ++it;
        continue;
      }
      device.release_pinned_host(reinterpret_cast<void*>(r.base), r.size);
      counters.segment.decrease(1);
      counters.reserved_bytes.decrease(static_cast<std::int64_t>(r.size));
      it = regions.erase(it);
    }
  }

  std::size_t largest_free() const {
    std::uint64_t best = 0;
    for (const auto& [base, r] : regions) best = std::max(best, r->extents.largest_hole());
    return static_cast<std::size_t>(best);
  }

  void* allocate(std::size_t bytes) {
    refuse_in_forked_child();
    if (bytes == 0) return nullptr;
    std::unique_lock lock(mutex);
    if (bytes > SIZE_MAX - 4 * kRegionGranule) {
      // No region can be that large (its size would wrap): the request can never be served,
      // as one the host refuses, not a caller's mistake.
      ++counters.num_ooms;
      throw out_of_memory("terrace: pinned host pool: cannot allocate " +
                          detail::describe_bytes(bytes) + ": no pinned region can be that large");
    }
    const std::size_t rounded = round_up(bytes, options.alignment);
    live_map::node_type entry = prepare_entry();
    if (void* p = carve(bytes, rounded, entry)) return p;
    try {
      region& r = grow(lock, rounded);
      live.reserve(live.size() + 1);  // other threads may have used the room while grow waited
      return hand_out(r, *r.extents.allocate(rounded), bytes, rounded, entry);
    } catch (const out_of_memory&) {
      // fall through to the retry
    }
    // Other threads freed buffers or added regions while this one waited for the host.
    live.reserve(live.size() + 1);
    if (void* p = carve(bytes, rounded, entry)) return p;
    // Free regions may be the wrong shape (too small): give them back and ask once more, for no
    // more than this request needs, since a whole default region may be what the host refused
    // (a locked-memory limit of a few MiB is common).
    ++counters.num_alloc_retries;
    release_empty_regions();
    try {
      region& r = grow(lock, rounded, /*tight_only=*/true);
      live.reserve(live.size() + 1);  // other threads may have used the room while grow waited
      return hand_out(r, *r.extents.allocate(rounded), bytes, rounded, entry);
    } catch (const out_of_memory& e) {
      ++counters.num_ooms;
      throw out_of_memory(
          "terrace: pinned host pool: cannot allocate " + detail::describe_bytes(bytes) +
          " (rounded to " + detail::describe_bytes(rounded) + "): holding " +
          detail::describe_bytes(reserved()) + " in " + std::to_string(regions.size()) +
          " regions, of which " +
          detail::describe_bytes(static_cast<std::size_t>(counters.allocated_bytes.current)) +
          " in " + std::to_string(live.size()) + " live buffers; largest free block " +
          detail::describe_bytes(largest_free()) + ". Cause: " + e.what());
    }
  }

  void deallocate(void* p) {
    // The parent's buffer, freed in the child: its memory is not there, and the books are left as
    // they are (a parent's thread may have held the lock at the fork).
    if (p == nullptr || forked_away()) return;
    std::lock_guard lock(mutex);
    const auto addr = reinterpret_cast<std::uintptr_t>(p);
    const auto it = live.find(addr);
    if (it == live.end()) throw logic_error(describe_bad(addr, "deallocate"));
    const buffer b = it->second;
    // The extent first: with the host out of memory for its hole it throws, and the buffer stays
    // live, to be freed again.
    b.owner->extents.release(addr - b.owner->first(), b.size);
    live.erase(it);
    --b.owner->live;
    counters.allocation.decrease(1);
    counters.allocated_bytes.decrease(static_cast<std::int64_t>(b.size));
    counters.requested_bytes.decrease(static_cast<std::int64_t>(b.requested));
  }

  // REQUIRES: mutex held.
  const region* region_of(std::uintptr_t addr) const {
    auto it = regions.upper_bound(addr);
    if (it == regions.begin()) return nullptr;
    --it;
    return addr < it->first + it->second->size ? it->second.get() : nullptr;
  }

  std::string describe_bad(std::uintptr_t addr, const char* call) const {
    if (region_of(addr) != nullptr) {
      return std::string("terrace: pinned host pool: ") + call + "(" + detail::hex_address(addr) +
             "): inside a pinned region but not a live buffer (a double free, or a pointer into "
             "the middle of a buffer)";
    }
    return std::string("terrace: pinned host pool: ") + call + "(" + detail::hex_address(addr) +
           "): a foreign pointer, not from this pool";
  }

  void check() const {
    std::lock_guard lock(mutex);
    const auto fail = [](const std::string& what) {
      throw logic_error("terrace: pinned host pool invariant: " + what);
    };
    std::int64_t allocated = 0, requested = 0, reserved_sum = 0;
    std::unordered_map<const region*, std::uint64_t> used_in;
    std::unordered_map<const region*, std::size_t> count_in;
    for (const auto& [addr, b] : live) {
      if (region_of(addr) != b.owner) fail("buffer " + detail::hex_address(addr) + " outside its region");
      if (addr + b.size > b.owner->base + b.owner->size) fail("buffer " + detail::hex_address(addr) + " overruns");
      if (addr % options.alignment != 0) fail("buffer " + detail::hex_address(addr) + " misaligned");
      allocated += static_cast<std::int64_t>(b.size);
      requested += static_cast<std::int64_t>(b.requested);
      used_in[b.owner] += b.size;
      ++count_in[b.owner];
    }
    for (const auto& [base, r] : regions) {
      if (!r->extents.consistent()) fail("extent books of region " + detail::hex_address(base));
      if (r->extents.free_bytes() + used_in[r.get()] != r->extents.capacity()) {
        fail("region " + detail::hex_address(base) + ": free + live != size");
      }
      if (count_in[r.get()] != r->live) fail("region " + detail::hex_address(base) + ": live count");
      reserved_sum += static_cast<std::int64_t>(r->size);
    }
    if (allocated != counters.allocated_bytes.current) fail("allocated_bytes does not recount");
    if (requested != counters.requested_bytes.current) fail("requested_bytes does not recount");
    if (reserved_sum != counters.reserved_bytes.current) fail("reserved_bytes does not recount");
    if (static_cast<std::int64_t>(live.size()) != counters.allocation.current) {
      fail("allocation does not recount");
    }
    if (static_cast<std::int64_t>(regions.size()) != counters.segment.current) {
      fail("segment does not recount");
    }
  }
};

pinned_host_pool::pinned_host_pool(device_backend& device, pinned_pool_options options)
    : impl_(std::make_unique<impl>(device, options)) {}

pinned_host_pool::~pinned_host_pool() = default;

void* pinned_host_pool::allocate(std::size_t bytes) { return impl_->allocate(bytes); }
void pinned_host_pool::deallocate(void* p) { impl_->deallocate(p); }

std::size_t pinned_host_pool::allocation_size(const void* p) const {
  std::lock_guard lock(impl_->mutex);
  const auto addr = reinterpret_cast<std::uintptr_t>(p);
  const auto it = impl_->live.find(addr);
  if (it == impl_->live.end()) throw logic_error(impl_->describe_bad(addr, "allocation_size"));
  return it->second.size;
}

bool pinned_host_pool::owns(const void* p) const {
  std::lock_guard lock(impl_->mutex);
  return impl_->region_of(reinterpret_cast<std::uintptr_t>(p)) != nullptr;
}

void pinned_host_pool::empty_cache() {
  if (impl_->forked_away()) return;  // the regions are not this process's to give back
  std::lock_guard lock(impl_->mutex);
  impl_->release_empty_regions();
}

pinned_pool_stats pinned_host_pool::stats() const {
  std::lock_guard lock(impl_->mutex);
  pinned_pool_stats s = impl_->counters;
  s.largest_free_block = impl_->largest_free();
  return s;
}

void pinned_host_pool::reset_peak_stats() {
  std::lock_guard lock(impl_->mutex);
  auto& c = impl_->counters;
  for (stat* s : {&c.allocation, &c.allocated_bytes, &c.requested_bytes, &c.segment,
                  &c.reserved_bytes}) {
    s->reset_peak();
  }
}

const pinned_pool_options& pinned_host_pool::options() const noexcept { return impl_->options; }

void pinned_host_pool::check_invariants() const { impl_->check(); }

}  // namespace terrace

// SPDX-License-Identifier: Apache-2.0
// terrace's C ABI (terrace.h) over the C++ API: one lazily created {device_backend,
// caching_allocator} per device index, and a wall that no exception crosses.
//
// Sections: errors at the boundary / per-device state / the CUDAPluggableAllocator ABI /
// configuration and observability.
#include "terrace/terrace.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "terrace/caching_allocator.hpp"
#include "terrace/config.hpp"
#include "terrace/device.hpp"
#include "terrace/error.hpp"
#include "terrace/stats.hpp"
#include "terrace/trace.hpp"
#include "allocator/c_boundary.hpp"

namespace {

using terrace::allocator_config;
using terrace::caching_allocator;
using terrace::device_backend;
using terrace::stream_ref;

// ==================================================================== errors at the boundary

using terrace::c_boundary::guarded;
using terrace::io_error;
using terrace::c_boundary::range_error;

[[noreturn]] void fail(std::string message) { throw terrace::logic_error(std::move(message)); }

// Failures PyTorch cannot see (void hooks, and a NULL from malloc, which some versions do not
// check): the first failure of each function is also printed, once, so that it is not silent.
// The rest are described by terrace_last_error() only.
void warn_once(std::atomic<bool>& warned, const char* fn) noexcept {
  if (!warned.exchange(true, std::memory_order_relaxed)) {
    std::fprintf(stderr,
                 "terrace: warning: %s (the caller cannot see this failure; later %s failures are "
                 "not printed, see terrace_last_error())\n",
                 terrace::c_boundary::error_text(), fn);
  }
}

// ========================================================================== per-device state

// Device indices are small (CUDA ordinals); a fixed table keeps the hot path to one atomic load.
constexpr int kMaxDevices = 64;
constexpr int kLiveShards = 64;

// Pointer -> size, open addressing with linear probing: no node allocation per entry, which a
// std::unordered_map would add to every terrace_malloc / terrace_free. Key 0 marks a free cell
// (terrace_malloc never records nullptr). Deletion shifts the rest of the probe run back, so no
// tombstones build up. Not thread-safe: each live_table shard guards one with its mutex.
class flat_size_map {
 public:
  // The index of `key`'s cell, or npos.
  std::size_t find(std::uintptr_t key, std::uint64_t hash) const noexcept {
    if (cells_.empty()) return npos;
    for (std::size_t i = hash & mask();; i = (i + 1) & mask()) {
      if (cells_[i].key == key) return i;
      if (cells_[i].key == 0) return npos;
    }
  }
  std::size_t value(std::size_t index) const noexcept { return cells_[index].size; }

  // REQUIRES: key != 0 and not present. Throws std::bad_alloc when growing fails (nothing changed).
  void insert(std::uintptr_t key, std::uint64_t hash, std::size_t size) {
    if ((count_ + 1) * 2 > cells_.size()) grow();
    place(key, hash, size);
    ++count_;
  }

  void erase(std::size_t index) noexcept {
    std::size_t hole = index;
    for (std::size_t j = (index + 1) & mask(); cells_[j].key != 0; j = (j + 1) & mask()) {
      // The entry at j may move into the hole unless its home lies cyclically in (hole, j].
      const std::size_t home = cells_[j].hash & mask();
      const bool stays = hole <= j ? (hole < home && home <= j) : (hole < home || home <= j);
      if (!stays) {
        cells_[hole] = cells_[j];
        hole = j;
      }
    }
    cells_[hole] = cell{};
    --count_;
  }

  static constexpr std::size_t npos = SIZE_MAX;

 private:
  struct cell {
    std::uintptr_t key = 0;
    std::uint64_t hash = 0;
    std::size_t size = 0;
  };
  std::size_t mask() const noexcept { return cells_.size() - 1; }
  void place(std::uintptr_t key, std::uint64_t hash, std::size_t size) noexcept {
    std::size_t i = hash & mask();
    while (cells_[i].key != 0) i = (i + 1) & mask();
    cells_[i] = cell{key, hash, size};
  }
  void grow() {
    std::vector<cell> old(std::max<std::size_t>(64, cells_.size() * 2));  // may throw: unchanged
    old.swap(cells_);
    for (const cell& c : old) {
      if (c.key != 0) place(c.key, c.hash, c.size);
    }
  }
  std::vector<cell> cells_;  // size 0 or a power of two, at most half full
  std::size_t count_ = 0;
};

// The caller's size of every live allocation on one device, which the C++ API does not expose:
// terrace_free checks it (PyTorch passes the size it asked for), and terrace_record_stream, which
// gets no device index, finds the owning device through it. Sharded so that threads freeing
// different blocks rarely meet on a lock.
class live_table {
 public:
  // Throws std::bad_alloc (nothing recorded).
  void insert(void* p, std::size_t size) {
    const auto [key, hash] = hash_of(p);
    shard& s = shards_[hash >> 58];
    std::lock_guard<std::mutex> lock(s.mutex);
    s.sizes.insert(key, hash, size);
  }
  // What a free whose size differs from the allocation's does: refused (the C ABI: the caller
  // can see the error and the block stays allocated), or freed at the allocation's size
  // (PyTorch's hook: PyTorch forgets the pointer before calling free and never retries, so a
  // refusal would leak the block for good).
  enum class size_rule { refuse_mismatch, free_at_recorded };
  struct taken {
    std::optional<std::size_t> recorded;  // nullopt: an unknown pointer
    bool size_mismatch = false;
  };
  // Frees `p` through `free_block` (the allocator's free), then removes it and returns its
  // recorded size; an unknown `p` goes to `free_block` too, which refuses it and says why. Under
  // refuse_mismatch, throws logic_error on a size mismatch. Whatever throws, nothing is removed.
  // The shard stays locked throughout. When the entry was taken before the allocator's free,
  // a second thread freeing the same pointer at once found no entry, reached the allocator
  // first and freed the block; the first free, refused as a double free, put the entry back,
  // and the table named a free block as live.
  template <class Free>
  taken take(void* p, std::size_t size, int device, size_rule rule, Free&& free_block) {
    const auto [key, hash] = hash_of(p);
    shard& s = shards_[hash >> 58];
    std::lock_guard<std::mutex> lock(s.mutex);
    const std::size_t at = s.sizes.find(key, hash);
    if (at == flat_size_map::npos) {
      free_block();
      return {};
    }
    const std::size_t recorded = s.sizes.value(at);
    const bool mismatch = size != 0 && size != recorded;
    if (mismatch && rule == size_rule::refuse_mismatch) {
      fail(size_mismatch(p, size, recorded, device, "the free was refused; the block stays allocated"));
    }
    free_block();
    s.sizes.erase(at);
    return {recorded, mismatch};
  }
  static std::string size_mismatch(void* p, std::size_t size, std::size_t recorded, int device,
                                   const char* outcome) {
    std::ostringstream msg;
    msg << "terrace: free of " << p << " on device " << device << " with size " << size
        << ", but it was allocated with size " << recorded << " (" << outcome << ")";
    return msg.str();
  }
  bool contains(void* p) {
    const auto [key, hash] = hash_of(p);
    shard& s = shards_[hash >> 58];
    std::lock_guard<std::mutex> lock(s.mutex);
    return s.sizes.find(key, hash) != flat_size_map::npos;
  }

 private:
  struct alignas(64) shard {
    std::mutex mutex;
    flat_size_map sizes;
  };
  static std::pair<std::uintptr_t, std::uint64_t> hash_of(void* p) noexcept {
    // Blocks are 512-byte aligned: drop those bits, then mix. The top 6 bits pick the shard
    // (kLiveShards == 64), the low bits the cell. A product's low bits depend only on the key's
    // low bits, so blocks 2 MiB apart (2^12 units) all started probing at one cell, and the
    // probes grew with the live count; folding the high half in spreads them (the shift leaves
    // the shard bits alone).
    const auto key = reinterpret_cast<std::uintptr_t>(p);
    const std::uint64_t h = static_cast<std::uint64_t>(key >> 9) * 0x9E3779B97F4A7C15ull;
    return {key, h ^ (h >> 29)};
  }
  std::array<shard, kLiveShards> shards_;
};
static_assert(kLiveShards == 64, "live_table takes the shard from the top 6 bits of the hash");

struct device_slot {
  // Declared before `allocator`: the allocator is destroyed first (were slots ever destroyed).
  std::unique_ptr<device_backend> backend;
  std::unique_ptr<caching_allocator> allocator;
  live_table live;
};

// The slots are never destroyed: PyTorch (and other embedders) may free tensors during or after
// static destruction, and a freed allocator there would turn a clean exit into a crash. The
// memory stays reachable from this table, so leak checkers do not report it.
std::array<std::atomic<device_slot*>, kMaxDevices> g_slots{};
std::array<std::atomic<std::int64_t>, kMaxDevices> g_bad_frees{};
// Frees through PyTorch's hook whose size was not the allocation's, freed at the allocation's.
std::array<std::atomic<std::int64_t>, kMaxDevices> g_size_mismatched_frees{};

// Guards creation and everything below it.
std::mutex g_mutex;
// From terrace_configure, or frozen at first creation. Never destroyed, like the slots: a first
// malloc on another device during static destruction still reads it.
std::optional<allocator_config>& g_config = *new std::optional<allocator_config>();
bool g_config_frozen = false;              // true once any allocator exists
std::atomic<int> g_device_count{-1};       // from terrace_init; -1 = not told
int g_record_trace = -1;                   // from terrace_record_trace; -1 = as configured

std::atomic<bool> g_warned_malloc{false};
std::atomic<bool> g_warned_free{false};
std::atomic<bool> g_warned_free_size{false};
std::atomic<bool> g_warned_record_stream{false};
std::atomic<bool> g_warned_fraction{false};
std::atomic<bool> g_warned_empty_cache{false};
std::atomic<bool> g_warned_init{false};

// Whether check_device(device) would pass; the fast path of slot_for asks this.
bool device_known(int device) noexcept {
  const int count = g_device_count.load(std::memory_order_relaxed);
  return device >= 0 && device < kMaxDevices && (count < 0 || device < count);
}

void check_device(int device) {
  if (device_known(device)) return;
  if (device < 0 || device >= kMaxDevices) {
    fail("terrace: device index " + std::to_string(device) +
         " is out of range (terrace supports 0.." + std::to_string(kMaxDevices - 1) + ")");
  }
  const int count = g_device_count.load(std::memory_order_relaxed);
  if (count >= 0 && device >= count) {
    fail("terrace: device index " + std::to_string(device) +
         " is out of range: terrace_init was told there are " + std::to_string(count) +
         " device(s)");
  }
}

// The slot of an already validated device if it was created, else nullptr. Never creates.
device_slot* find_slot(int device) noexcept {
  return g_slots[static_cast<std::size_t>(device)].load(std::memory_order_acquire);
}

device_slot& create_slot(int device) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (device_slot* s = g_slots[static_cast<std::size_t>(device)].load(std::memory_order_acquire)) {
    return *s;
  }
  // Every device gets the same config, resolved once: a later change of the environment does
  // not make devices disagree.
  if (!g_config) g_config = terrace::alloc_conf_from_env();
  allocator_config config = *g_config;
  if (g_record_trace >= 0) config.record_trace = g_record_trace != 0;

  terrace::device_options options;
  options.capacity = config.device_capacity;
  options.copy_bandwidth = config.copy_bandwidth;
  options.device_index = device;
  auto slot = std::make_unique<device_slot>();
  // `auto` is the GPU when there is one: the VMM backend if expandable segments need it, so that
  // PyTorch's expandable_segments:True, copied over, is not refused by the plain cuda backend.
  const bool vmm = config.device == "auto" && config.expandable_segments &&
                   terrace::cuda_device_available();
  slot->backend = terrace::make_device(vmm ? "cuda-vmm" : config.device, options);
  slot->allocator = std::make_unique<caching_allocator>(*slot->backend, config);
  g_config_frozen = true;
  device_slot* raw = slot.release();
  g_slots[static_cast<std::size_t>(device)].store(raw, std::memory_order_release);
  return *raw;
}

// The slot of `device`, created on first use. The common case is one acquire load.
device_slot& slot_for(int device) {
  // The fast path checks what check_device checks, so that every entry point agrees on which
  // devices exist (a malloc accepted after terrace_init lowered the count could not be freed).
  if (device_known(device)) {
    if (device_slot* s = find_slot(device)) return *s;
  }
  check_device(device);
  return create_slot(device);
}

template <class Fn>
void for_each_slot(Fn&& fn) {
  for (int d = 0; d < kMaxDevices; ++d) {
    if (device_slot* s = find_slot(d)) fn(d, *s);
  }
}

std::string stats_json_for(int device) {
  check_device(device);
  device_slot* s = find_slot(device);
  // A device never used reports zeros: observing it must not create an allocator.
  const std::string base = terrace::to_json(s ? s->allocator->stats() : terrace::allocator_stats{});
  // terrace's own counter joins the rest, in the same sorted order torch.cuda.memory_stats() has.
  nlohmann::json j = nlohmann::json::parse(base);
  j["num_bad_frees"] =
      g_bad_frees[static_cast<std::size_t>(device)].load(std::memory_order_relaxed);
  j["num_size_mismatched_frees"] =
      g_size_mismatched_frees[static_cast<std::size_t>(device)].load(std::memory_order_relaxed);
  // The planner's figures (policy planned or plan_counterfactual) join as "plan.*" keys.
  if (s != nullptr && s->allocator->plan_stats().enabled) {
    // Named: a range-for over items() of the temporary parse() returns would outlive it.
    const nlohmann::json plan = nlohmann::json::parse(terrace::to_json(s->allocator->plan_stats()));
    for (const auto& [k, v] : plan.items()) j[k] = v;
  }
  return j.dump();
}

void write_file(const char* path, const std::string& text) {
  if (path == nullptr || *path == '\0') fail("terrace: the output path is empty");
  std::FILE* f = std::fopen(path, "wb");
  if (f == nullptr) {
    const int err = errno;
    throw io_error(std::string("terrace: cannot open '") + path +
                   "' for writing: " + std::strerror(err));
  }
  const std::size_t written = std::fwrite(text.data(), 1, text.size(), f);
  const int write_err = written == text.size() ? 0 : errno;
  if (std::fclose(f) != 0 && write_err == 0) {
    const int err = errno;
    throw io_error(std::string("terrace: cannot finish writing '") + path +
                   "': " + std::strerror(err));
  }
  if (write_err != 0) {
    throw io_error(std::string("terrace: cannot write '") + path +
                   "': " + std::strerror(write_err));
  }
}

terrace::memory_snapshot snapshot_for(int device) {
  check_device(device);
  if (device_slot* s = find_slot(device)) return s->allocator->snapshot();
  terrace::memory_snapshot empty;
  empty.device = device;
  return empty;
}

// Names a call and its arguments for the last-error string.
template <class... Args>
std::string describe_call(const char* fn, const Args&... args) {
  std::ostringstream out;
  out << fn << '(';
  const char* sep = "";
  ((out << sep << args, sep = ", "), ...);
  out << ')';
  return out.str();
}

std::string quoted(const char* s) { return s == nullptr ? "NULL" : '"' + std::string(s) + '"'; }

}  // namespace

// ============================================================ the CUDAPluggableAllocator ABI

namespace {

// malloc's body, shared by terrace_malloc and terrace_torch_malloc.
void* allocate_recorded(size_t size, int device, void* stream) {
  if (size == 0) return nullptr;  // PyTorch's convention: no memory, no error
  // PyTorch's hook type is ssize_t, and C callers compute sizes in signed arithmetic too: a size
  // above PTRDIFF_MAX is a negative one converted. It is the caller's bug, not the device running
  // out of memory, which is what the allocator would report (counted in num_ooms, and raised
  // through PyTorch's hook as "CUDA out of memory.", which batch-size finders retry smaller).
  if (size > static_cast<size_t>(PTRDIFF_MAX)) {
    fail("terrace: size " + std::to_string(size) + " is negative as a signed size (" +
         std::to_string(static_cast<std::ptrdiff_t>(size)) + "): refused");
  }
  device_slot& slot = slot_for(device);
  void* p = slot.allocator->allocate(size, stream_ref{stream});
  try {
    slot.live.insert(p, size);
  } catch (...) {
    slot.allocator->deallocate(p, stream_ref{stream});
    throw;
  }
  return p;
}

// free's body, shared by terrace_free and terrace_torch_free. Returns what the live table held
// (a size mismatch only under free_at_recorded).
live_table::taken free_recorded(void* ptr, size_t size, int device, void* stream,
                                live_table::size_rule rule) {
  if (ptr == nullptr) return {};
  // A device that has an allocator takes its frees even after terrace_init lowered the count
  // below it: its blocks were handed out while it existed, and refusing their frees would lose
  // them for good. Only new allocations there are refused.
  device_slot* slot = device >= 0 && device < kMaxDevices ? find_slot(device) : nullptr;
  if (slot == nullptr) check_device(device);
  if (slot == nullptr) {
    std::ostringstream msg;
    msg << "terrace: free of " << ptr << " on device " << device
        << ", where terrace has allocated nothing (foreign pointer or wrong device)";
    fail(msg.str());
  }
  // An unknown pointer still goes to the allocator, which refuses it and says why (double
  // free, interior pointer, foreign pointer) without changing anything. A refused free keeps the
  // block live, and its entry in the table. Another thread's malloc handed `ptr` as soon as the
  // allocator frees it waits for the shard, so it finds the entry gone.
  const live_table::taken taken = slot->live.take(
      ptr, size, device, rule, [&] { slot->allocator->deallocate(ptr, stream_ref{stream}); });
  if (taken.size_mismatch) {
    g_size_mismatched_frees[static_cast<std::size_t>(device)].fetch_add(1, std::memory_order_relaxed);
  }
  return taken;
}

void count_refused_free(int rc, int device) noexcept {
  if (rc == TERRACE_EINVAL && device >= 0 && device < kMaxDevices) {
    g_bad_frees[static_cast<std::size_t>(device)].fetch_add(1, std::memory_order_relaxed);
  }
}

}  // namespace

extern "C" {

TERRACE_API void* terrace_malloc(size_t size, int device, void* stream) {
  void* p = nullptr;
  const auto call = [&] { return describe_call("terrace_malloc", size, device, stream); };
  guarded(call, [&] { p = allocate_recorded(size, device, stream); });
  // A caller that does not check for NULL would use address 0: the first failure is printed too.
  if (p == nullptr && size != 0) warn_once(g_warned_malloc, "terrace_malloc");
  return p;
}

TERRACE_API void terrace_free(void* ptr, size_t size, int device, void* stream) {
  const auto call = [&] { return describe_call("terrace_free", ptr, size, device, stream); };
  const int rc = guarded(call, [&] {
    free_recorded(ptr, size, device, stream, live_table::size_rule::refuse_mismatch);
  });
  if (rc != TERRACE_OK) {
    count_refused_free(rc, device);
    warn_once(g_warned_free, "terrace_free");
  }
}

}  // extern "C"

// PyTorch's CUDAPluggableAllocator stores whatever its malloc hook returns as the tensor's data
// pointer without checking it, so a NULL would become a tensor at address 0. These two hooks are
// for PyTorch's C++ caller alone: the malloc throws, which PyTorch's bindings turn into a Python
// RuntimeError carrying terrace's out-of-memory report (as RMM's PyTorch hook does), and the free
// never refuses a pointer terrace knows (PyTorch never retries a free).
extern "C" TERRACE_API void* terrace_torch_malloc(size_t size, int device, void* stream) {
  void* p = nullptr;
  const auto call = [&] { return describe_call("terrace_torch_malloc", size, device, stream); };
  const int rc = guarded(call, [&] { p = allocate_recorded(size, device, stream); });
  if (rc == TERRACE_ENOMEM) {
    // PyTorch's own words first: code that recovers from running out of memory (a smaller batch,
    // accelerate's find_executable_batch_size, Lightning's batch-size finder) recognises the
    // error by "CUDA out of memory." in a RuntimeError, as it cannot catch torch.OutOfMemoryError
    // from a pluggable allocator.
    throw std::runtime_error(std::string("CUDA out of memory. ") + terrace::c_boundary::error_text());
  }
  if (rc != TERRACE_OK) throw std::runtime_error(terrace::c_boundary::error_text());
  return p;
}

extern "C" TERRACE_API void terrace_torch_free(void* ptr, size_t size, int device, void* stream) {
  const auto call = [&] { return describe_call("terrace_torch_free", ptr, size, device, stream); };
  live_table::taken taken;
  const int rc = guarded(call, [&] {
    taken = free_recorded(ptr, size, device, stream, live_table::size_rule::free_at_recorded);
  });
  if (rc != TERRACE_OK) {
    count_refused_free(rc, device);
    warn_once(g_warned_free, "terrace_torch_free");
  } else if (taken.size_mismatch && !g_warned_free_size.exchange(true, std::memory_order_relaxed)) {
    try {
      const std::string why = live_table::size_mismatch(ptr, size, *taken.recorded, device,
                                                        "freed at the allocation's size");
      std::fprintf(stderr, "terrace: warning: %s; later ones are counted in num_size_mismatched_frees\n",
                   why.c_str());
    } catch (...) {  // no memory for the message: the count still has it
    }
  }
}

extern "C" TERRACE_API void terrace_torch_begin_allocate_to_pool(
    int device, std::pair<unsigned long long, unsigned long long> pool,
    std::function<bool(CUstream_st*)> /*allocates_into_pool*/) {
  std::ostringstream msg;
  msg << "terrace: CUDA graph capture on device " << device << " (memory pool " << pool.first << ","
      << pool.second << ") is not supported: a graph needs a memory pool of its own, since its "
      << "replays write the blocks it freed during capture again, and terrace has none; it would "
      << "hand those blocks to other tensors. Capture in a process that does not install terrace "
      << "(torch.cuda.graph, torch.compile(mode=\"reduce-overhead\"))";
  const std::string text = msg.str();
  terrace::c_boundary::set_error("terrace_torch_begin_allocate_to_pool", "", text.c_str());
  throw std::runtime_error(text);
}

extern "C" {

TERRACE_API void terrace_init(int device_count) {
  const auto call = [&] { return describe_call("terrace_init", device_count); };
  const int rc = guarded(call, [&] {
    if (device_count < 0) fail("terrace: a negative device count is meaningless; ignored");
    g_device_count.store(device_count, std::memory_order_relaxed);
  });
  if (rc != TERRACE_OK) warn_once(g_warned_init, "terrace_init");
}

TERRACE_API void terrace_empty_cache(void) {
  const auto call = [] { return std::string("terrace_empty_cache()"); };
  const int rc = guarded(call, [&] {
    // Every device is tried even when one fails; the first failure is the one reported.
    std::exception_ptr first_failure;
    for_each_slot([&](int, device_slot& s) {
      try {
        s.allocator->empty_cache();
      } catch (...) {
        if (!first_failure) first_failure = std::current_exception();
      }
    });
    if (first_failure) std::rethrow_exception(first_failure);
  });
  if (rc != TERRACE_OK) warn_once(g_warned_empty_cache, "terrace_empty_cache");
}

TERRACE_API void terrace_set_memory_fraction(double fraction, int device) {
  const auto call = [&] { return describe_call("terrace_set_memory_fraction", fraction, device); };
  const int rc = guarded(call, [&] {
    // Checked before the allocator is created: a bad call must not create one. 0 is PyTorch's
    // too (set_per_process_memory_fraction takes 0..1): no new memory at all.
    if (!(fraction >= 0.0 && fraction <= 1.0)) {
      fail("terrace: the memory fraction must be in [0, 1]; the cap is unchanged");
    }
    slot_for(device).allocator->set_memory_fraction(fraction);
  });
  if (rc != TERRACE_OK) warn_once(g_warned_fraction, "terrace_set_memory_fraction");
}

TERRACE_API void terrace_record_stream(void* ptr, void* stream) {
  const auto call = [&] { return describe_call("terrace_record_stream", ptr, stream); };
  const int rc = guarded(call, [&] {
    if (ptr == nullptr) return;  // an empty tensor: PyTorch's own allocator ignores it too
    // PyTorch passes no device: the owner is the device whose live table holds the pointer. Every
    // device is asked: where addresses can coincide across devices (the null backend's fake
    // address space), taking the first holder would make the wrong block wait for `stream` and
    // let the intended one be reused under it.
    device_slot* owner = nullptr;
    int owner_device = -1;
    for_each_slot([&](int d, device_slot& s) {
      if (!s.live.contains(ptr)) return;
      if (owner != nullptr) {
        fail("terrace: record_stream of a pointer that is a live allocation on devices " +
             std::to_string(owner_device) + " and " + std::to_string(d) +
             " (a backend whose devices share addresses); nothing was recorded");
      }
      owner = &s;
      owner_device = d;
    });
    if (owner == nullptr) {
      fail(
          "terrace: record_stream of a pointer that is not a live allocation of terrace on any "
          "device");
    }
    owner->allocator->record_stream(ptr, stream_ref{stream});
  });
  if (rc != TERRACE_OK) warn_once(g_warned_record_stream, "terrace_record_stream");
}

// ========================================================= configuration and observability

TERRACE_API int terrace_configure(const char* conf) {
  const auto call = [&] { return describe_call("terrace_configure", quoted(conf)); };
  return guarded(call, [&] {
    if (conf == nullptr) fail("terrace: the config string is NULL");
    // Parsed first, so that a malformed string is reported as such whatever the state.
    allocator_config parsed = terrace::parse_alloc_conf(conf);
    std::lock_guard<std::mutex> lock(g_mutex);
    if (g_config_frozen) {
      std::string devices;
      for_each_slot([&](int d, device_slot&) {
        devices += (devices.empty() ? "" : ", ") + std::to_string(d);
      });
      fail(
          "terrace: the config can only be set before the first allocation, and allocators "
          "already exist for device(s) " +
          devices + "; call terrace_configure earlier or set TERRACE_ALLOC_CONF before start-up");
    }
    g_config = std::move(parsed);
  });
}

TERRACE_API int terrace_stats_json(int device, char* buf, size_t capacity, size_t* needed) {
  const auto call = [&] { return describe_call("terrace_stats_json", device, capacity); };
  // Zero until the size is known: a refused call (a bad device) must not leave the caller's
  // variable as it was, where a caller sizing its buffer from it would read its own garbage.
  if (needed != nullptr) *needed = 0;
  return guarded(call, [&] {
    const std::string json = stats_json_for(device);
    const std::size_t size = json.size() + 1;
    if (needed != nullptr) *needed = size;
    if (buf == nullptr || capacity < size) {
      // The size query (buf NULL, capacity 0) lands here too.
      throw range_error("terrace: a buffer of " + std::to_string(capacity) +
                        " bytes is too small for the stats JSON, which needs " +
                        std::to_string(size) + " bytes including the NUL (see *needed)");
    }
    std::memcpy(buf, json.c_str(), size);
  });
}

TERRACE_API int terrace_begin_iteration(int device) {
  const auto call = [&] { return describe_call("terrace_begin_iteration", device); };
  return guarded(call, [&] { slot_for(device).allocator->begin_iteration(); });
}

TERRACE_API int terrace_end_iteration(int device) {
  const auto call = [&] { return describe_call("terrace_end_iteration", device); };
  return guarded(call, [&] { slot_for(device).allocator->end_iteration(); });
}

TERRACE_API int terrace_reset_peak_stats(int device) {
  const auto call = [&] { return describe_call("terrace_reset_peak_stats", device); };
  return guarded(call, [&] {
    check_device(device);
    if (device_slot* s = find_slot(device)) s->allocator->reset_peak_stats();
  });
}

TERRACE_API int terrace_reset_accumulated_stats(int device) {
  const auto call = [&] { return describe_call("terrace_reset_accumulated_stats", device); };
  return guarded(call, [&] {
    check_device(device);
    if (device_slot* s = find_slot(device)) s->allocator->reset_accumulated_stats();
  });
}

TERRACE_API int terrace_record_trace(int on) {
  const auto call = [&] { return describe_call("terrace_record_trace", on); };
  return guarded(call, [&] {
    // Remembered for allocators created later, so that recording can start before the first
    // allocation (as a profiler wants).
    std::lock_guard<std::mutex> lock(g_mutex);
    g_record_trace = on != 0 ? 1 : 0;
    for_each_slot([&](int, device_slot& s) { s.allocator->record_trace(on != 0); });
  });
}

TERRACE_API int terrace_dump_snapshot(int device, const char* path) {
  const auto call = [&] { return describe_call("terrace_dump_snapshot", device, quoted(path)); };
  return guarded(call, [&] {
    std::ostringstream out;
    terrace::write_snapshot_json(out, snapshot_for(device));
    write_file(path, out.str());
  });
}

TERRACE_API int terrace_dump_trace(int device, const char* path) {
  const auto call = [&] { return describe_call("terrace_dump_trace", device, quoted(path)); };
  return guarded(call, [&] {
    std::ostringstream out;
    terrace::write_trace_jsonl(out, snapshot_for(device).trace);
    write_file(path, out.str());
  });
}


}  // extern "C"

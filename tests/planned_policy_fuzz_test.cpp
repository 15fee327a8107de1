// SPDX-License-Identifier: Apache-2.0
// A randomized differential fuzzer of the planned policy (allocator/plan_front.cpp), kept as a
// test because it found what the hand-written cases did not: two live blocks at one address (a
// late free before a slot the fallback served) and an arena given back to the device while work
// queued before a stream-ordered free still used it.
//
// Each seed draws a workload (a periodic training iteration on 1-3 streams, deviations injected
// into it; in a quarter of the seeds each iteration's shape drawn from 2-4, half of those alike
// in their first allocations) and a configuration (live plan or plan_counterfactual beside
// caching, split and rounding knobs, a device from roomy to barely larger than the peak), runs it
// over a model device, and checks every allocation against what the program knows, never against
// the allocator's own books:
//   - the pointer lies inside a segment the device handed out and is 512-aligned;
//   - it overlaps no live block;
//   - reuse is stream ordered: a block on stream S over space last used by work on stream T != S
//     is ordered after that work (the host saw it complete, or S waits for it on the device);
//   - a segment given back to the device has no queued work still using it (destruction included:
//     the allocator must wait for it itself, nothing here synchronizes before it is destroyed),
//     and once every block is freed, destroying the allocator gives every segment back;
//   - now and then check_invariants(), and the stats against a shadow count (live requested bytes
//     and count, rounded bytes, reserved bytes and segments against the device, peaks, the
//     allocations and frees since the last reset_accumulated_stats);
//   - in a fifth of the seeds, which record a trace: the trace's segment events (alloc and map
//     less free and unmap) add up to the bytes the device holds, the arena's included.
//
// Environment (nothing set: the default seed range, sized for a few seconds in a Release build):
//   TERRACE_FUZZ_SEED=<n>      run seed n alone (a failure names the seed and says this)
//   TERRACE_FUZZ_SEEDS=<count> run <count> seeds (from TERRACE_FUZZ_SEED, or from 1); more
//                              coverage when changing the planned policy, e.g. 20000
// Every seed's variant (plain, memory pressure, long iterations) follows from the seed itself, so
// one number reproduces a failure exactly.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "fuzz_support.hpp"
#include "stream_order_model.hpp"
#include "terrace/caching_allocator.hpp"
#include "terrace/config.hpp"
#include "terrace/error.hpp"
#include "terrace/planner.hpp"

namespace terrace {
namespace {

using fuzz::fail;
using fuzz::fuzz_failure;
using fuzz::hex;
using fuzz::stream_use;

// ~7 s in a Release build on a 2-core runner (about 7 ms a seed). A sanitized build is several
// times slower per seed, so it runs a quarter of them; the variants come round every 4 seeds, so
// any range covers them all.
constexpr std::uint64_t kDefaultSeeds =
    fuzz::kAddressSanitized || fuzz::kThreadSanitized ? 250 : 1000;

std::size_t round512(std::size_t n) { return (n + 511) / 512 * 512; }

// =============================================================================== model device
// Addresses only (never touched), capacity-limited, and every call returns at once, like the
// null device. What it adds is a model of stream order (stream_order_model.hpp), so that the
// checker can tell whether a block was handed out while work queued on another stream might still
// be using its space.

constexpr int kMaxStreams = 4;  // index 0 is the default stream (stream_ref{})

class model_device final : public device_backend {
 public:
  // `page` 0: no virtual memory; else address ranges mapped in pages of that size.
  model_device(std::size_t capacity, std::size_t page, std::mt19937_64& rng, double query_p)
      : rng_(rng), query_p_(query_p) {
    properties_.name = "model";
    properties_.capacity = capacity;
    properties_.alignment = 512;
    properties_.touches_memory = false;
    properties_.supports_vmm = page != 0;
    properties_.map_granularity = page;
    free_.emplace(std::uintptr_t{1} << 40, std::uintptr_t{1} << 44);
  }

  // Queues one piece of work on stream s (a kernel using some block) and returns its number.
  long launch(int s) { return book_.launch(s); }

  // Inside one reserved segment, or on mapped pages of one address range.
  bool inside_segment(std::uintptr_t p, std::size_t n) const {
    if (auto it = segments_.upper_bound(p); it != segments_.begin()) {
      --it;
      if (p + n <= it->first + it->second) return true;
    }
    auto r = ranges_.upper_bound(p);
    if (r == ranges_.begin()) return false;
    --r;
    const std::uintptr_t base = r->first;
    if (p + n > base + r->second.size() * page()) return false;
    for (std::size_t k = (p - base) / page(); k * page() < p + n - base; ++k) {
      if (!r->second[k]) return false;
    }
    return true;
  }

  std::size_t segment_count() const { return segments_.size(); }
  std::size_t range_count() const { return ranges_.size(); }
  std::size_t used() const { return used_; }

  // A block at [p, p+n) was freed after the uses `u`: those still unfinished stay on its space
  // until a block handed out over it proves itself ordered after them.
  void retire(std::uintptr_t p, std::size_t n, const std::vector<stream_use>& u) {
    book_.retire(p, n, u);
  }

  // REQUIRES: [p, p+n) was just handed out on stream s. Fails unless s is ordered after every
  // unfinished use of that space.
  void check_handout(std::uintptr_t p, std::size_t n, int s) { book_.claim(p, n, s); }

  // The first contract violation the allocator committed inside a device call (those are
  // noexcept or run under the allocator's frames, so they are recorded, not thrown), or none.
  const std::optional<std::string>& violation() const { return book_.violation(); }

  // The memory fraction's cap: the allocator must not ask for memory past it (its segments and
  // the planned arena together).
  void set_cap(std::size_t bytes) { cap_ = bytes; }

 private:
  void* do_reserve(std::size_t bytes) override {
    const std::size_t n = round512(bytes);
    check_cap("reserve", n);
    if (used_ + n > properties_.capacity) throw out_of_memory("model device: full");
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if (it->second - it->first < n) continue;
      const std::uintptr_t p = it->first;
      const std::uintptr_t end = it->second;
      free_.erase(it);
      if (p + n < end) free_.emplace(p + n, end);
      segments_.emplace(p, bytes);
      used_ += n;
      return reinterpret_cast<void*>(p);
    }
    throw out_of_memory("model device: no address space");
  }

  void do_release(void* ptr, std::size_t bytes) noexcept override {
    const auto p = reinterpret_cast<std::uintptr_t>(ptr);
    auto seg = segments_.find(p);
    if (seg == segments_.end() || seg->second != bytes) {
      book_.violate("release of " + hex(p) + " (" + std::to_string(bytes) +
              " bytes), not a segment or not its size");
      return;
    }
    // The contract: no queued work uses it any more.
    if (const stream_use* x = book_.first_unfinished(p, p + bytes)) {
      book_.violate("release of segment " + hex(p) + " with work still queued on it (stream " +
                    std::to_string(x->stream) + " work " + std::to_string(x->work) + ")");
    }
    book_.cut(p, p + bytes);
    segments_.erase(seg);
    const std::size_t n = round512(bytes);
    used_ -= n;
    fuzz::insert_coalesced(free_, p, p + n);
  }

  std::size_t page() const noexcept { return properties_.map_granularity; }

  void* do_reserve_address_range(std::size_t bytes) override {
    if (page() == 0) throw device_error("model device: no virtual memory");
    if (bytes == 0 || bytes % page() != 0) {
      book_.violate("address range of " + std::to_string(bytes) + " bytes, not whole pages");
      throw device_error("model device: bad address range size");
    }
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      const std::uintptr_t p = (it->first + page() - 1) / page() * page();
      if (p + bytes > it->second) continue;
      const std::uintptr_t start = it->first;
      const std::uintptr_t end = it->second;
      free_.erase(it);
      if (start < p) free_.emplace(start, p);
      if (p + bytes < end) free_.emplace(p + bytes, end);
      ranges_.emplace(p, std::vector<bool>(bytes / page(), false));
      return reinterpret_cast<void*>(p);
    }
    throw out_of_memory("model device: address space exhausted");  // the backend contract
  }

  void do_release_address_range(void* ptr, std::size_t bytes) noexcept override {
    const auto p = reinterpret_cast<std::uintptr_t>(ptr);
    auto r = ranges_.find(p);
    if (r == ranges_.end() || r->second.size() * page() != bytes) {
      book_.violate("release of address range " + hex(p) + " (" + std::to_string(bytes) +
                    " bytes), not a range or not its size");
      return;
    }
    if (std::find(r->second.begin(), r->second.end(), true) != r->second.end()) {
      book_.violate("release of address range " + hex(p) + " with pages still mapped");
      return;
    }
    ranges_.erase(r);
    fuzz::insert_coalesced(free_, p, p + bytes);
  }

  // The pages of [p, p + bytes) in their range, or a violation (nullptr).
  std::vector<bool>* pages_of(std::uintptr_t p, std::size_t bytes, const char* what) {
    auto r = ranges_.upper_bound(p);
    if (page() == 0 || r == ranges_.begin() || bytes == 0 || p % page() != 0 ||
        bytes % page() != 0) {
      book_.violate(std::string(what) + " of " + hex(p) + " (" + std::to_string(bytes) +
                    " bytes): unaligned or outside every address range");
      return nullptr;
    }
    --r;
    if (p + bytes > r->first + r->second.size() * page()) {
      book_.violate(std::string(what) + " of " + hex(p) + " runs past its address range");
      return nullptr;
    }
    return &r->second;
  }

  void do_map(void* ptr, std::size_t bytes) override {
    const auto p = reinterpret_cast<std::uintptr_t>(ptr);
    std::vector<bool>* pages = pages_of(p, bytes, "map");
    if (pages == nullptr) throw device_error("model device: bad map");
    const std::uintptr_t base = ranges_.upper_bound(p) == ranges_.begin()
                                    ? 0 : std::prev(ranges_.upper_bound(p))->first;
    const std::size_t first = (p - base) / page();
    for (std::size_t k = first; k < first + bytes / page(); ++k) {
      if ((*pages)[k]) {
        book_.violate("map of " + hex(p) + " over a page already mapped");
        throw device_error("model device: page already mapped");
      }
    }
    check_cap("map", bytes);
    if (used_ + bytes > properties_.capacity) throw out_of_memory("model device: full");
    for (std::size_t k = first; k < first + bytes / page(); ++k) (*pages)[k] = true;
    used_ += bytes;
  }

  void do_unmap(void* ptr, std::size_t bytes) noexcept override {
    const auto p = reinterpret_cast<std::uintptr_t>(ptr);
    std::vector<bool>* pages = pages_of(p, bytes, "unmap");
    if (pages == nullptr) return;
    const std::uintptr_t base = std::prev(ranges_.upper_bound(p))->first;
    const std::size_t first = (p - base) / page();
    for (std::size_t k = first; k < first + bytes / page(); ++k) {
      if (!(*pages)[k]) {
        book_.violate("unmap of " + hex(p) + " over a page not mapped");
        return;
      }
    }
    // The contract: no queued work uses it any more.
    if (const stream_use* x = book_.first_unfinished(p, p + bytes)) {
      book_.violate("unmap of " + hex(p) + " with work still queued on it (stream " +
                    std::to_string(x->stream) + " work " + std::to_string(x->work) + ")");
    }
    book_.cut(p, p + bytes);
    for (std::size_t k = first; k < first + bytes / page(); ++k) (*pages)[k] = false;
    used_ -= bytes;
  }

  std::size_t do_used_bytes() const noexcept override { return used_; }

  stream_ref do_create_stream() override { return book_.create_stream(); }
  void do_destroy_stream(stream_ref) noexcept override {}
  void do_synchronize_stream(stream_ref s) override { book_.synchronize_stream(s); }
  void do_synchronize_device() override { book_.synchronize_device(); }

  event_ref do_create_event() override { return book_.create_event(); }
  void do_destroy_event(event_ref e) noexcept override { book_.destroy_event(e); }
  void do_record(event_ref e, stream_ref s) override { book_.record(e, s); }
  bool do_query(event_ref e) override { return book_.query(e, rng_, query_p_); }
  void do_wait(stream_ref s, event_ref e) override { book_.wait(s, e); }
  void do_synchronize_event(event_ref e) override { book_.synchronize_event(e); }
  void do_copy_async(void*, const void*, std::size_t, copy_kind, stream_ref) override {}

  std::mt19937_64& rng_;
  const double query_p_;
  fuzz::stream_order_book<kMaxStreams> book_;
  std::map<std::uintptr_t, std::size_t> segments_;  // address -> bytes as reserved
  std::map<std::uintptr_t, std::vector<bool>> ranges_;  // address range -> mapped, per page
  std::map<std::uintptr_t, std::uintptr_t> free_;   // free address space: start -> end
  std::size_t used_ = 0;
  std::size_t cap_ = SIZE_MAX;

  void check_cap(const char* what, std::size_t n) {
    if (used_ + n <= cap_) return;
    book_.violate(std::string(what) + " of " + std::to_string(n) + " bytes beside " +
                  std::to_string(used_) + " in use, past the memory fraction's cap of " +
                  std::to_string(cap_));
    throw out_of_memory("model device: past the memory fraction");
  }
};

// ========================================================================= workload generator
// An iteration is a list of ops over block ids local to it. The base shape repeats (that is what
// the planner learns); each iteration may be perturbed from it, or be another shape entirely.
//
// Every random draw is its own statement: two draws in one expression are unsequenced, and a seed
// must mean the same workload under every compiler.

struct op {
  enum kind_t { alloc, free, record_stream, host_sync, empty_cache, reset_accumulated, reset_peak,
                inject_oom, begin_mark, end_mark };
  kind_t kind;
  int id = -1;           // local block id (alloc, free, record_stream)
  std::size_t size = 0;  // alloc
  int stream = 0;        // alloc: the stream; record_stream: the other stream
  int tag = -1;          // alloc: tag number, -1 for none
};

const char* kind_name(op::kind_t k) {
  static constexpr std::array<const char*, 10> names = {
      "alloc", "free", "record_stream", "host_sync", "empty_cache", "reset_accumulated_stats",
      "reset_peak_stats", "inject_oom", "begin_iteration", "end_iteration"};
  return names[static_cast<std::size_t>(k)];
}

// Ids of blocks a deviation adds start here, clear of the shape's own.
constexpr int kExtraId = 10000;

std::size_t random_size(std::mt19937_64& rng, int size_mode) {
  const std::uint64_t r = rng() % 100;
  if (size_mode == 0) {  // small pool only
    const std::size_t pages = rng() % 64 + 1;
    const bool ragged = rng() % 3 == 0;
    return pages * 512 + (ragged ? rng() % 512 : 0);
  }
  if (size_mode == 1) {  // both sides of small_size (1 MiB)
    if (r < 50) return (rng() % 2048 + 1) * 512;
    const std::size_t halves = rng() % 12 + 1;
    return halves * (std::size_t{1} << 19) + 512 * (rng() % 5);
  }
  // large: 20 MiB segments, max_split_size and exact segments
  if (r < 30) return (rng() % 64 + 1) * 4096;
  const std::size_t mib = rng() % 24 + 1;
  return mib * (std::size_t{1} << 20) + 512 * (rng() % 9);
}

// One iteration of `nallocs` blocks: allocated in order, each freed a little later (a quarter of
// them much later), one in twelve crossing into the next iteration, one in six also used on
// another stream (record_stream).
std::vector<op> make_shape(std::mt19937_64& rng, int nstreams, int size_mode, int nallocs) {
  std::vector<std::pair<double, op>> timed;
  for (int i = 0; i < nallocs; ++i) {
    const double a = static_cast<double>(i) + 0.1;
    const bool long_lived = rng() % 4 == 0;
    const double f = a + 0.5 + static_cast<double>(rng() % (long_lived ? nallocs : 6));
    const std::size_t size = random_size(rng, size_mode);
    const int stream = static_cast<int>(rng() % nstreams);
    const bool crosses = rng() % 12 == 0;
    int other = -1;
    if (nstreams > 1 && rng() % 6 == 0) {
      other = static_cast<int>(rng() % nstreams);
      if (other == stream) other = -1;
    }
    timed.push_back({a, op{op::alloc, i, size, stream, i}});
    if (other >= 0) timed.push_back({a + 0.05, op{op::record_stream, i, 0, other}});
    if (!crosses) {
      timed.push_back({std::min(f, static_cast<double>(nallocs) + 0.05), op{op::free, i}});
    }
  }
  std::stable_sort(timed.begin(), timed.end(),
                   [](const auto& x, const auto& y) { return x.first < y.first; });
  std::vector<op> ops;
  for (auto& [t, o] : timed) ops.push_back(o);
  return ops;
}

// Live bytes at the shape's peak: the device's capacity is drawn relative to it.
std::size_t peak_bytes(const std::vector<op>& ops) {
  std::map<int, std::size_t> live;
  std::size_t current = 0;
  std::size_t peak = 0;
  for (const op& o : ops) {
    if (o.kind == op::alloc) {
      live[o.id] = o.size;
      current += o.size;
      peak = std::max(peak, current);
    } else if (o.kind == op::free) {
      current -= live[o.id];
    }
  }
  return peak;
}

// Everything a seed decides before the first op.
struct fuzz_setup {
  enum variant_t { plain, pressure, big };
  variant_t variant = plain;
  int nstreams = 1;
  int size_mode = 0;
  int nallocs = 0;
  bool use_tags = false;
  // Iteration marks: 0, 1 explicit; 2 explicit from a third of the run on; 3 stray ones only.
  int marks_mode = 0;
  bool counterfactual = false;
  double query_p = 0;
  int deviation_rate = 0;  // 0 (none) .. 3
  bool default_stream = false;
  bool inject_ooms = false;
  bool phase_change = false;  // base and other shape swap halfway
  int buckets = 0;  // each iteration's shape drawn from this many (0: the base shape alone)
  int common_start = 0;  // allocations at the start of every bucket's shape that are the base's
  std::size_t capacity = 0;
  std::size_t page = 0;  // the device's virtual memory page; 0: none
  double fraction = 0;   // memory_fraction, when the config sets one
  std::string conf;
  int iterations = 0;
  bool traced = false;  // record_trace: the trace's segment events are checked against the device

  std::string describe() const {
    static constexpr std::array<const char*, 3> variants = {"plain", "pressure", "big"};
    return std::string(variants[variant]) + " streams=" + std::to_string(nstreams) +
           (default_stream ? " (default stream first)" : "") +
           " size_mode=" + std::to_string(size_mode) + " nallocs=" + std::to_string(nallocs) +
           " marks=" + std::to_string(marks_mode) + " buckets=" + std::to_string(buckets) +
           " common_start=" + std::to_string(common_start) +
           " deviations=" + std::to_string(deviation_rate) +
           " query_p=" + std::to_string(query_p).substr(0, 3) +
           " capacity=" + std::to_string(capacity) + " page=" + std::to_string(page) +
           " fraction=" + std::to_string(fraction) + " conf=" + conf;
  }
};

// Every 4th seed (seed % 4 == 1) runs a device barely larger than the peak; every 4th (seed % 4
// == 3) iterations of 40-140 blocks, which is where plans with many slots per lane go wrong.
fuzz_setup::variant_t variant_of(std::uint64_t seed) {
  if (seed % 4 == 1) return fuzz_setup::pressure;
  if (seed % 4 == 3) return fuzz_setup::big;
  return fuzz_setup::plain;
}

// Perturbs one iteration's ops in place: the deviations a real training loop shows (a changed
// size, a skipped or extra tensor, a tensor freed early and allocated again, reordering, a cache
// flush or stats reset mid-iteration, frees delayed to the end).
void deviate(std::mt19937_64& rng, const fuzz_setup& setup, std::vector<op>& ops) {
  const int count = 1 + static_cast<int>(rng() % 3);
  for (int d = 0; d < count && !ops.empty(); ++d) {
    const int kind = static_cast<int>(rng() % 10);
    const std::size_t i = rng() % ops.size();
    const auto at = [&](std::size_t k) { return ops.begin() + static_cast<std::ptrdiff_t>(k); };
    if (kind == 0 && ops[i].kind == op::alloc) {
      ops[i].size += 512 * (1 + rng() % 4);  // a changed size
    } else if (kind == 1 && ops[i].kind == op::alloc) {
      const int id = ops[i].id;  // a skipped block: its alloc and free
      std::erase_if(ops, [&](const op& o) { return o.id == id; });
    } else if (kind == 2) {  // an extra block, freed later in the iteration or left live
      const std::size_t size = random_size(rng, setup.size_mode);
      const bool any_stream = rng() % 4 != 0;  // else one of all three, maybe unused so far
      const int stream = static_cast<int>(rng() % (any_stream ? setup.nstreams : 3));
      ops.insert(at(i), op{op::alloc, kExtraId + d, size, stream, 500 + d});
      if (rng() % 3 != 0) {
        const std::size_t j = i + 1 + rng() % (ops.size() - i);
        ops.insert(at(j), op{op::free, kExtraId + d});
      }
    } else if (kind == 3 && i + 1 < ops.size()) {
      std::swap(ops[i], ops[i + 1]);  // a reordered pair (a free before its alloc is skipped)
    } else if (kind == 4) {
      ops.insert(at(i), op{op::empty_cache});
    } else if (kind == 5) {
      ops.insert(at(i), op{rng() % 2 != 0 ? op::reset_accumulated : op::reset_peak});
    } else if (kind == 6 && setup.nstreams > 1 && ops[i].kind == op::alloc) {
      const int other = static_cast<int>(rng() % setup.nstreams);
      ops.insert(at(i + 1), op{op::record_stream, ops[i].id, 0, other});
    } else if (kind == 9 && ops[i].kind == op::alloc) {
      // A block freed early and allocated again, a few ops later (a tensor dropped and fetched
      // again before its planned free); its own free stays where it was.
      const op again = ops[i];
      const std::size_t j = i + 1 + rng() % 4;
      if (j <= ops.size() &&
          std::none_of(at(i + 1), at(j), [&](const op& o) { return o.id == again.id; })) {
        ops.insert(at(j), again);
        ops.insert(at(j), op{op::free, again.id});
      }
    } else if (kind == 7 || kind == 8) {  // one op moved by up to 10 places either way
      const op moved = ops[i];
      ops.erase(at(i));
      const long j = static_cast<long>(i) + static_cast<long>(rng() % 21) - 10;
      const long to = std::clamp<long>(j, 0, static_cast<long>(ops.size()));
      ops.insert(at(static_cast<std::size_t>(to)), moved);
    }
  }
  if (rng() % 4 == 0) {  // some frees moved to the end of the iteration, shuffled
    std::vector<op> tail;
    std::erase_if(ops, [&](const op& o) {
      if (o.kind != op::free || rng() % 3 != 0) return false;
      tail.push_back(o);
      return true;
    });
    std::shuffle(tail.begin(), tail.end(), rng);
    ops.insert(ops.end(), tail.begin(), tail.end());
  }
}

// ================================================================================== checker
// The program's own books: which blocks are live where, and what the stats must therefore say.
// Every handout is checked against them and the model device; check() compares the allocator's
// view (check_invariants, stats) with them.

struct live_block {
  std::uintptr_t p;
  std::size_t n;
  int stream;  // fuzz::stream_index of the stream it was allocated on
  std::vector<stream_use> uses;
};

class fuzz_checker {
 public:
  fuzz_checker(model_device& dev, bool traced) : dev_(dev), traced_(traced) {}

  // REQUIRES: the allocator just returned p for n bytes on stream s. Checks it, then records one
  // use of it on s (the kernel that writes it). Returns the block's id.
  long handed_out(void* ptr, std::size_t n, int s) {
    const auto p = reinterpret_cast<std::uintptr_t>(ptr);
    if (!dev_.inside_segment(p, n)) {
      fail("block [" + hex(p) + ",+" + std::to_string(n) + ") lies outside every reserved segment");
    }
    if (p % 512 != 0) fail("block " + hex(p) + " is not 512-aligned");
    check_no_overlap(p, n, s);
    dev_.check_handout(p, n, s);
    const long id = next_id_++;
    live_block b{p, n, s, {}};
    b.uses.push_back({s, dev_.launch(s)});
    live_.emplace(id, std::move(b));
    by_address_.emplace(p, id);
    requested_ += static_cast<std::int64_t>(n);
    rounded_ += static_cast<std::int64_t>(round512(n));
    ++allocs_since_reset_;
    requested_since_reset_ += static_cast<std::int64_t>(n);
    peak_requested_ = std::max(peak_requested_, requested_);
    peak_rounded_ = std::max(peak_rounded_, rounded_);
    peak_used_ = std::max(peak_used_, static_cast<std::int64_t>(dev_.used()));
    return id;
  }

  const live_block* find(long id) const {
    auto it = live_.find(id);
    return it == live_.end() ? nullptr : &it->second;
  }

  void used_on(long id, int s) { live_.at(id).uses.push_back({s, dev_.launch(s)}); }

  // The allocator took block `id` back: its unfinished uses stay on its space.
  void freed(long id) {
    auto it = live_.find(id);
    const live_block& b = it->second;
    dev_.retire(b.p, b.n, b.uses);
    by_address_.erase(b.p);
    requested_ -= static_cast<std::int64_t>(b.n);
    rounded_ -= static_cast<std::int64_t>(round512(b.n));
    ++frees_since_reset_;
    requested_freed_since_reset_ += static_cast<std::int64_t>(b.n);
    live_.erase(it);
  }

  std::vector<long> live_ids() const {
    std::vector<long> ids;
    for (const auto& [id, b] : live_) ids.push_back(id);
    return ids;
  }

  // reset_accumulated_stats was called: `allocated` and `freed` count from here.
  void accumulated_reset(const caching_allocator& a) {
    at_reset_ = a.stats();
    allocs_since_reset_ = frees_since_reset_ = 0;
    requested_since_reset_ = requested_freed_since_reset_ = 0;
  }

  void peaks_reset() {
    peak_requested_ = requested_;
    peak_rounded_ = rounded_;
    peak_used_ = static_cast<std::int64_t>(dev_.used());
  }

  // The allocator's own invariants, and its stats against the program's count and the device.
  void check(const caching_allocator& a) const {
    try {
      a.check_invariants();
    } catch (const std::exception& e) {
      fail(std::string("check_invariants: ") + e.what());
    }
    const allocator_stats st = a.stats();
    const auto expect_eq = [](const char* what, std::int64_t got, std::int64_t want,
                              const char* against) {
      if (got != want) {
        fail(std::string(what) + " " + std::to_string(got) + " != " + against + " " +
             std::to_string(want));
      }
    };
    const auto expect_ge = [](const char* what, std::int64_t got, std::int64_t want,
                              const char* against) {
      if (got < want) {
        fail(std::string(what) + " " + std::to_string(got) + " < " + against + " " +
             std::to_string(want));
      }
    };
    expect_eq("requested_bytes.current", st.requested_bytes[0].current, requested_,
              "live requested bytes");
    expect_ge("allocated_bytes.current", st.allocated_bytes[0].current, rounded_,
              "live rounded bytes");
    expect_eq("allocation.current", st.allocation[0].current,
              static_cast<std::int64_t>(live_.size()), "live blocks");
    expect_eq("reserved_bytes.current", st.reserved_bytes[0].current,
              static_cast<std::int64_t>(dev_.used()), "device used bytes");
    expect_eq("segment.current", st.segment[0].current,
              static_cast<std::int64_t>(dev_.segment_count() + dev_.range_count()),
              "device segments and address ranges");
    expect_ge("reserved_bytes.current", st.reserved_bytes[0].current,
              st.allocated_bytes[0].current, "allocated_bytes.current");
    expect_ge("requested_bytes.peak", st.requested_bytes[0].peak, peak_requested_, "observed");
    expect_ge("allocated_bytes.peak", st.allocated_bytes[0].peak, peak_rounded_, "observed");
    expect_ge("reserved_bytes.peak", st.reserved_bytes[0].peak, peak_used_, "observed");
    // Accumulated counts: every allocation and free the program made since the last reset, the
    // arena's included and the claimed holes (the front's, not the program's) left out.
    expect_eq("allocation.allocated", st.allocation[0].allocated, allocs_since_reset_,
              "allocations since the reset");
    expect_eq("allocation.freed", st.allocation[0].freed, frees_since_reset_,
              "frees since the reset");
    expect_eq("requested_bytes.allocated", st.requested_bytes[0].allocated, requested_since_reset_,
              "requested since the reset");
    expect_eq("requested_bytes.freed", st.requested_bytes[0].freed, requested_freed_since_reset_,
              "requested bytes freed since the reset");
    expect_ge("allocation.peak", st.allocation[0].peak, st.allocation[0].current, "current");
    for (std::size_t pool = 0; pool < 3; ++pool) {
      const std::string in = " (pool " + std::to_string(pool) + ")";
      for (stat_array allocator_stats::*f :
           {&allocator_stats::allocation, &allocator_stats::allocated_bytes,
            &allocator_stats::requested_bytes, &allocator_stats::active,
            &allocator_stats::active_bytes}) {
        const stat& now = (st.*f)[pool];
        if (now.current != (at_reset_.*f)[pool].current + now.allocated - now.freed) {
          fail("current != current at the last reset + allocated - freed" + in);
        }
      }
      for (const auto* s : {&st.allocated_bytes, &st.reserved_bytes, &st.requested_bytes}) {
        if ((*s)[pool].peak < (*s)[pool].current) fail("a peak below its current value" + in);
        if ((*s)[pool].current < 0) fail("a negative current byte count" + in);
      }
      if (st.allocation[pool].current < 0) fail("a negative allocation count" + in);
    }
    // Every fourth check: the snapshot copies the whole trace.
    if (traced_ && checks_++ % 4 == 0) check_trace(a);
  }

 private:
  // The device memory the trace shows held (found in review: the planned policy's arena was
  // reserved and given back with no segment event, so a snapshot's memory_viz view and a
  // replayed trace's PyTorch column showed segments that were never there, or not the arena).
  void check_trace(const caching_allocator& a) const {
    const memory_snapshot snap = a.snapshot();
    if (snap.trace_events_dropped != 0 || snap.trace_events_lost != 0) return;  // a window
    std::int64_t held = 0;
    for (const trace_event& e : snap.trace) {
      const auto n = static_cast<std::int64_t>(e.size);
      if (e.action == trace_action::segment_alloc || e.action == trace_action::segment_map) held += n;
      if (e.action == trace_action::segment_free || e.action == trace_action::segment_unmap) held -= n;
    }
    if (held != static_cast<std::int64_t>(dev_.used())) {
      fail("the trace's segment events hold " + std::to_string(held) + " bytes, the device " +
           std::to_string(dev_.used()));
    }
  }

  void check_no_overlap(std::uintptr_t p, std::size_t n, int s) const {
    const auto overlap = [&](long id) {
      const live_block& b = live_.at(id);
      fail("overlap: new block [" + hex(p) + ",+" + std::to_string(n) + ") on stream " +
           std::to_string(s) + " lies on live block [" + hex(b.p) + ",+" + std::to_string(b.n) +
           ") of stream " + std::to_string(b.stream) + " (handout " + std::to_string(id) + ")");
    };
    auto it = by_address_.lower_bound(p);
    if (it != by_address_.end() && it->first < p + n) overlap(it->second);
    if (it != by_address_.begin()) {
      const long prev = std::prev(it)->second;
      const live_block& b = live_.at(prev);
      if (b.p + b.n > p) overlap(prev);
    }
  }

  model_device& dev_;
  bool traced_ = false;
  mutable std::uint64_t checks_ = 0;
  std::map<long, live_block> live_;
  std::map<std::uintptr_t, long> by_address_;
  long next_id_ = 0;
  std::int64_t requested_ = 0;
  std::int64_t rounded_ = 0;
  allocator_stats at_reset_{};  // the stats at the last reset_accumulated_stats
  std::int64_t allocs_since_reset_ = 0, frees_since_reset_ = 0;
  std::int64_t requested_since_reset_ = 0, requested_freed_since_reset_ = 0;
  std::int64_t peak_requested_ = 0;
  std::int64_t peak_rounded_ = 0;
  std::int64_t peak_used_ = 0;
};

// ================================================================================== one seed
// Draws the setup, runs the iterations through the allocator and the checker, and says what went
// wrong first (or nothing). The allocator is destroyed without a synchronize first: its
// destructor must wait for queued work before its segments go back.

class fuzz_run {
 public:
  explicit fuzz_run(std::uint64_t seed) : seed_(seed), rng_(seed * 0x9e3779b97f4a7c15ull + 7) {}

  /// The plan's counters at the end of a seed that passed.
  const planner_stats& plan_stats() const { return plan_; }

  // Runs the seed. Returns the first failure with its context, or nothing.
  std::optional<std::string> run() {
    try {
      draw_setup();
      dev_ = std::make_unique<model_device>(setup_.capacity, setup_.page, rng_, setup_.query_p);
      checker_ = std::make_unique<fuzz_checker>(*dev_, setup_.traced);
      for (int s = 0; s < 3; ++s) {
        streams_[s] = (s == 0 && setup_.default_stream) ? stream_ref{} : dev_->create_stream();
      }
      try {
        alloc_ = std::make_unique<caching_allocator>(*dev_, parse_alloc_conf(setup_.conf));
      } catch (const std::exception& e) {
        fail(std::string("the allocator refused the config: ") + e.what());
      }
      if (setup_.fraction > 0) {  // as the allocator computes its cap
        dev_->set_cap(static_cast<std::size_t>(static_cast<double>(setup_.capacity) *
                                               alloc_->config().memory_fraction));
      }
      for (iteration_ = 0; iteration_ < setup_.iterations; ++iteration_) run_iteration();
      teardown();
      return std::nullopt;
    } catch (const fuzz_failure& f) {
      std::string where = "at iteration " + std::to_string(iteration_);
      if (iteration_ < 0) where = "before the first iteration";
      if (iteration_ >= setup_.iterations) where = "after the last iteration";
      std::string msg = f.what + "\n  setup: " + setup_.describe() + "\n  " + where +
                        ", the last ops (block numbers are the iteration's own):";
      for (const std::string& o : recent_) msg += "\n    " + o;
      // The allocator is destroyed with blocks live (it leaks them to the device, by contract);
      // what the model device records meanwhile is not reported, the first failure is.
      alloc_.reset();
      return msg;
    }
  }

 private:
  void draw_setup() {
    fuzz_setup& s = setup_;
    s.variant = variant_of(seed_);
    s.nstreams = 1 + static_cast<int>(rng_() % 3);
    s.size_mode = static_cast<int>(rng_() % 3);
    s.nallocs = s.variant == fuzz_setup::big ? 40 + static_cast<int>(rng_() % 100)
                                             : 12 + static_cast<int>(rng_() % 40);
    s.use_tags = rng_() % 2 != 0;
    s.marks_mode = static_cast<int>(rng_() % 6);
    explicit_marks_ = s.marks_mode <= 1;
    s.counterfactual = rng_() % 8 == 0;
    s.query_p = std::array<double, 3>{0.0, 0.3, 1.0}[rng_() % 3];
    s.deviation_rate = static_cast<int>(rng_() % 4);
    s.default_stream = rng_() % 3 == 0;
    s.inject_ooms = rng_() % 3 == 0;
    s.phase_change = rng_() % 4 == 0;
    base_ = make_shape(rng_, s.nstreams, s.size_mode, s.nallocs);
    other_ = make_shape(rng_, s.nstreams, s.size_mode, s.nallocs / 2 + 8);

    // From roomy to barely above the base shape's peak (the pressure variant always the latter):
    // the out-of-memory paths, pressure releases and loans of the arena run only there.
    const std::size_t peak = peak_bytes(base_);
    const int cap_mode = s.variant == fuzz_setup::pressure ? 3 : static_cast<int>(rng_() % 4);
    s.capacity = std::size_t{1} << 42;
    if (cap_mode == 1) {
      const std::size_t factor = 2 + rng_() % 3;
      s.capacity = peak * factor + (std::size_t{40} << 20) * (rng_() % 2);
    } else if (cap_mode == 2) {
      s.capacity = peak + peak / 2 + (rng_() % 4) * (std::size_t{2} << 20);
    } else if (cap_mode == 3) {
      const std::size_t divisor = 2 + rng_() % 8;
      s.capacity = peak + peak / divisor + (rng_() % 3) * (std::size_t{2} << 20);
    }
    s.capacity = std::max<std::size_t>(s.capacity, std::size_t{4} << 20);
    // Half the seeds of each variant run a device with virtual memory, where an arena refused
    // whole is mapped page by page. From the seed, not a draw: the other draws stay as they were.
    if (seed_ / 4 % 2 == 1) s.page = seed_ / 8 % 2 == 1 ? std::size_t{64} << 10 : std::size_t{2} << 20;

    s.conf = s.counterfactual ? "policy:caching,plan_counterfactual:true" : "policy:planned";
    s.conf += ",plan_min_period:" + std::to_string(16 + 16 * (rng_() % 4));
    if (rng_() % 4 == 0) s.conf += ",max_split_size_mb:" + std::to_string(21 + rng_() % 30);
    if (rng_() % 5 == 0) {
      s.conf += ",roundup_power2_divisions:" + std::to_string(1 << (rng_() % 3 + 1));
    }
    if (rng_() % 5 == 0) s.conf += ",garbage_collection_threshold:0.6";
    // Small large segments, also beside a max_split_size above: the config accepts both (a
    // refused config fails the seed).
    if (rng_() % 5 == 0) s.conf += ",large_segment_size:4MiB,min_large_alloc:2MiB,large_round:512";
    // A third of the seeds cap the allocator with a memory fraction, between 1.1 and 2 times the
    // base shape's peak (the device checks every reservation against it). From the seed, not a
    // draw: the other draws stay as they were.
    if (seed_ / 2 % 3 == 1) {
      const double cap = static_cast<double>(peak) * (1.1 + 0.15 * static_cast<double>(seed_ / 6 % 7));
      s.fraction = std::min(1.0, cap / static_cast<double>(s.capacity));
      char buf[40];
      std::snprintf(buf, sizeof buf, ",memory_fraction:%.9g", s.fraction);
      s.conf += buf;
    }
    s.iterations = 30 + static_cast<int>(rng_() % 40);
    // From the seed, not a draw: the other draws stay as they were.
    s.traced = seed_ % 5 == 0;
    if (s.traced) s.conf += ",record_trace:true";
    // A quarter of the seeds draw each iteration's shape from 2-4 (sequence-length buckets): the
    // path of a library of plans, switched at iterations' first requests. From the seed and a
    // generator of their own, not a draw: the other draws stay as they were.
    if (seed_ / 16 % 4 == 3) {
      bucket_rng_.seed(seed_ ^ 0x9e3779b97f4a7c15ull);
      s.buckets = 2 + static_cast<int>(bucket_rng_() % 3);
      buckets_.push_back(base_);
      while (static_cast<int>(buckets_.size()) < s.buckets) {
        buckets_.push_back(make_shape(bucket_rng_, s.nstreams, s.size_mode, s.nallocs));
      }
      // Half of them start alike: the first 1-3 blocks of every shape are the base's (a batch
      // of fixed bytes), so the plan is picked at the first request that differs.
      s.common_start = bucket_rng_() % 2 == 0 ? 1 + static_cast<int>(bucket_rng_() % 3) : 0;
      for (std::size_t b = 1; b < buckets_.size(); ++b) {
        for (op& o : buckets_[b]) {
          if (o.kind != op::alloc || o.id >= s.common_start) continue;
          const auto same = std::find_if(base_.begin(), base_.end(), [&](const op& x) {
            return x.kind == op::alloc && x.id == o.id;
          });
          o.size = same->size;
          o.stream = same->stream;
        }
      }
    }
  }

  // The ops of iteration `iteration_`, with its deviations and stray calls.
  std::vector<op> next_ops() {
    const fuzz_setup& s = setup_;
    const int another_odds = s.deviation_rate == 0 ? 1000 : 14 - 3 * s.deviation_rate;
    const bool another = iteration_ > 4 && rng_() % another_odds == 0;
    if (s.phase_change && iteration_ == s.iterations / 2) std::swap(base_, other_);
    if (s.marks_mode == 2 && iteration_ == s.iterations / 3) explicit_marks_ = true;
    std::vector<op> ops = another           ? other_
                          : buckets_.empty() ? base_
                                             : buckets_[bucket_rng_() % buckets_.size()];
    if (iteration_ > 3 && s.deviation_rate > 0 && rng_() % (8 - 2 * s.deviation_rate) == 0) {
      deviate(rng_, s, ops);
    }
    const auto insert_somewhere = [&](op o) {
      const std::size_t i = rng_() % (ops.size() + 1);
      ops.insert(ops.begin() + static_cast<std::ptrdiff_t>(i), o);
    };
    if (s.inject_ooms && rng_() % 6 == 0) insert_somewhere(op{op::inject_oom});
    if (s.marks_mode == 3 && rng_() % 5 == 0) {
      insert_somewhere(op{rng_() % 2 != 0 ? op::begin_mark : op::end_mark});
    }
    if (rng_() % 10 == 0) insert_somewhere(op{op::host_sync});
    return ops;
  }

  void run_iteration() {
    std::vector<op> ops = next_ops();
    if (explicit_marks_) {
      note("begin_iteration (explicit)");
      call("begin_iteration", [&] { alloc_->begin_iteration(); });
    }
    std::map<int, long> local;  // local id -> block id
    // The previous iteration's crossing blocks are freed early in this one.
    std::vector<long> early = std::move(carried_);
    carried_.clear();
    const std::size_t early_at = rng_() % 4;
    for (std::size_t k = 0; k < ops.size(); ++k) {
      if (k == early_at) {
        for (long id : early) free_block(id);
        early.clear();
      }
      run_op(ops[k], local);
      if (rng_() % 16 == 0) check_all();
    }
    for (long id : early) free_block(id);
    // Blocks not freed cross into the next iteration; half the extras stay live longer (leaked).
    for (const auto& [local_id, id] : local) {
      if (local_id >= kExtraId && rng_() % 2 != 0) continue;
      carried_.push_back(id);
    }
    if (explicit_marks_) {
      note("end_iteration (explicit)");
      call("end_iteration", [&] { alloc_->end_iteration(); });
    }
    check_all();
    if (iteration_ % 11 == 10 && !params_.empty() && rng_() % 3 == 0) {
      free_block(params_.back());
      params_.pop_back();
    }
  }

  void run_op(const op& o, std::map<int, long>& local) {
    note(o);
    switch (o.kind) {
      case op::alloc: {
        const std::string tag =
            setup_.use_tags && o.tag >= 0 ? "t" + std::to_string(o.tag) : std::string();
        if (const auto id = allocate(o.size, o.stream, tag)) {
          if (auto old = local.find(o.id); old != local.end()) free_block(old->second);
          local[o.id] = *id;
        }
        // Long-lived "parameters" allocated during the first iterations, between the others.
        if (iteration_ < 3 && rng_() % 5 == 0) {
          const std::size_t size = random_size(rng_, setup_.size_mode);
          const int stream = static_cast<int>(rng_() % setup_.nstreams);
          if (const auto id = allocate(size, stream, "param")) params_.push_back(*id);
        }
        break;
      }
      case op::free:
        if (auto it = local.find(o.id); it != local.end()) {
          free_block(it->second);
          local.erase(it);
        }
        break;
      case op::record_stream:
        if (auto it = local.find(o.id); it != local.end()) record_stream(it->second, o.stream);
        break;
      case op::host_sync:
        dev_->synchronize_device();
        break;
      case op::empty_cache:
        call("empty_cache", [&] { alloc_->empty_cache(); });
        break;
      case op::reset_accumulated:
        alloc_->reset_accumulated_stats();
        checker_->accumulated_reset(*alloc_);
        break;
      case op::reset_peak:
        alloc_->reset_peak_stats();
        checker_->peaks_reset();
        break;
      case op::inject_oom:
        dev_->inject_out_of_memory(1 + static_cast<int>(rng_() % 2));
        check_all();
        break;
      case op::begin_mark:
        call("begin_iteration", [&] { alloc_->begin_iteration(); });
        check_all();
        break;
      case op::end_mark:
        call("end_iteration", [&] { alloc_->end_iteration(); });
        check_all();
        break;
    }
  }

  // One allocator call: anything it throws is a failure, and so is any contract violation the
  // model device recorded during it.
  template <class F>
  void call(const char* what, F&& f) {
    try {
      f();
    } catch (const std::exception& e) {
      fail(std::string(what) + " threw: " + e.what());
    }
    throw_if_violated();
  }

  void throw_if_violated() const {
    if (dev_->violation()) fail(*dev_->violation());
  }

  // Out of memory is an answer, not a failure: the block is then simply not there.
  std::optional<long> allocate(std::size_t n, int s, const std::string& tag) {
    void* p = nullptr;
    try {
      p = alloc_->allocate(n, streams_[s], tag);
    } catch (const out_of_memory&) {
      throw_if_violated();
      return std::nullopt;
    } catch (const std::exception& e) {
      fail(std::string("allocate threw: ") + e.what());
    }
    throw_if_violated();
    return checker_->handed_out(p, n, fuzz::stream_index(streams_[s]));
  }

  void free_block(long id) {
    const live_block* b = checker_->find(id);
    if (b == nullptr) return;
    // Sometimes one more kernel uses it on its own stream just before the free.
    if (rng_() % 2 != 0) checker_->used_on(id, b->stream);
    // Always named with the first stream: the stream argument is informational only.
    call("deallocate", [&] { alloc_->deallocate(reinterpret_cast<void*>(b->p), streams_[0]); });
    checker_->freed(id);
  }

  void record_stream(long id, int s) {
    const live_block* b = checker_->find(id);
    if (b == nullptr) return;
    call("record_stream",
         [&] { alloc_->record_stream(reinterpret_cast<void*>(b->p), streams_[s]); });
    checker_->used_on(id, fuzz::stream_index(streams_[s]));
  }

  void check_all() const {
    throw_if_violated();
    checker_->check(*alloc_);
  }

  void teardown() {
    note("teardown: free every live block");
    std::vector<long> all = checker_->live_ids();
    std::shuffle(all.begin(), all.end(), rng_);
    for (long id : all) free_block(id);
    check_all();
    plan_ = alloc_->plan_stats();
    note("teardown: destroy the allocator (no synchronize before)");
    alloc_.reset();
    throw_if_violated();
    if (dev_->segment_count() != 0 || dev_->range_count() != 0 || dev_->used() != 0) {
      fail("the destroyed allocator left " + std::to_string(dev_->segment_count()) +
           " segments and " + std::to_string(dev_->range_count()) + " address ranges reserved, " +
           std::to_string(dev_->used()) + " bytes in use");
    }
  }

  void note(std::string text) {
    if (recent_.size() == kRecent) recent_.erase(recent_.begin());
    recent_.push_back(std::move(text));
  }
  void note(const op& o) {
    if (recent_.size() == kRecent) recent_.erase(recent_.begin());
    std::string s = kind_name(o.kind);
    if (o.kind == op::alloc || o.kind == op::free || o.kind == op::record_stream) {
      s += " block " + std::to_string(o.id);
    }
    if (o.kind == op::alloc) s += " size " + std::to_string(o.size);
    if (o.kind == op::alloc || o.kind == op::record_stream) {
      s += " stream " + std::to_string(fuzz::stream_index(streams_[o.stream]));
    }
    recent_.push_back(std::move(s));
  }

  static constexpr std::size_t kRecent = 8;

  const std::uint64_t seed_;
  std::mt19937_64 rng_;
  fuzz_setup setup_;
  std::vector<op> base_;
  std::vector<op> other_;
  std::vector<std::vector<op>> buckets_;  // fuzz_setup::buckets shapes, base_ first
  std::mt19937_64 bucket_rng_;
  bool explicit_marks_ = false;
  // Declared in this order so that the allocator goes before the device it uses.
  std::unique_ptr<model_device> dev_;
  std::unique_ptr<fuzz_checker> checker_;
  std::unique_ptr<caching_allocator> alloc_;
  std::array<stream_ref, 3> streams_{};
  int iteration_ = -1;
  std::vector<long> params_;   // long-lived blocks from the first iterations
  std::vector<long> carried_;  // blocks crossing into the next iteration
  std::vector<std::string> recent_;
  planner_stats plan_;
};

// ==================================================================================== the test

TEST(PlannedPolicyFuzz, RandomWorkloadsGetDisjointStreamOrderedBlocksAndExactStats) {
  const std::optional<fuzz::seed_range> seeds = fuzz::seeds_from_environment(kDefaultSeeds);
  if (!seeds) return;
  // How often the rarer paths ran: a fuzzer whose workloads stopped reaching them would pass
  // without testing them.
  int lazy_seeds = 0, unmap_seeds = 0, refusal_seeds = 0, widen_seeds = 0, narrow_seeds = 0;
  int library_seeds = 0, undecided_seeds = 0;
  for (std::uint64_t seed = seeds->first; seed < seeds->end(); ++seed) {
    fuzz_run run(seed);
    if (const std::optional<std::string> failure = run.run()) {
      FAIL() << "seed " << seed << ": " << *failure << "\nReproduce with TERRACE_FUZZ_SEED="
             << seed << " tests/planned_policy_fuzz_test (later seeds were not run)";
    }
    lazy_seeds += run.plan_stats().lazy_arenas > 0 ? 1 : 0;
    unmap_seeds += run.plan_stats().pressure_unmaps > 0 ? 1 : 0;
    refusal_seeds += run.plan_stats().map_refusals > 0 ? 1 : 0;
    widen_seeds += run.plan_stats().widenings > 0 ? 1 : 0;
    narrow_seeds += run.plan_stats().narrowings > 0 ? 1 : 0;
    library_seeds += run.plan_stats().plan_switches > 0 ? 1 : 0;
    undecided_seeds += run.plan_stats().undecided_requests > 0 ? 1 : 0;
  }
  fuzz::print_passed(*seeds);
  std::printf("[          ] arenas mapped page by page in %d seeds, idle pages unmapped under "
              "pressure in %d, a page refused in %d; plans widened for later frees in %d, narrowed "
              "for want of room in %d; a library of plans switched in %d, chose after its first "
              "request in %d\n",
              lazy_seeds, unmap_seeds, refusal_seeds, widen_seeds, narrow_seeds, library_seeds,
              undecided_seeds);
  if (seeds->count >= kDefaultSeeds) {
    EXPECT_GT(lazy_seeds, 0) << "no seed reached a lazily mapped arena";
    EXPECT_GT(library_seeds, 0) << "no seed switched between plans of a library";
    EXPECT_GT(undecided_seeds, 0) << "no seed chose a plan of a library after its first request";
  }
}

}  // namespace
}  // namespace terrace

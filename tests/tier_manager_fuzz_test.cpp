// SPDX-License-Identifier: Apache-2.0
// A randomized differential fuzzer of the tier manager (tiers/tier_manager.cpp) over the sim
// device, with and without a pinned host budget over an NVMe tensor store. Data integrity is the
// point: the defects found in review here were all data loss under reordering (an eviction
// copying down an update still running on another stream; fences ordered by eviction rather than
// by copy; a failed write acquire leaving an empty home buffer), which hand-written cases find
// only once someone has already imagined them.
//
// Each seed draws tensors of odd sizes, a device budget that holds two or three of them (so
// evictions to host, and under a host budget on to NVMe, happen all the time), 2-3 compute
// streams, and a workload: a repeating access sequence (recorded by begin_iteration or given by
// set_schedule) followed with deviations, plus pins held across other operations, flushes and
// offloads, host reads and writes, synchronizations, checkpoints, restarts from the last
// checkpoint, an optimizer thread reading home copies beside the training loop, and injected NVMe
// faults. A
// reference model (tensor -> expected bytes) is the only judge:
//   - every use on the device checks the bytes in stream order (a host function on the stream
//     stands in for a kernel) and writes fresh random bytes (write: all of them; update: a random
//     range), by a host function or by the device's own copy_async, which takes time under the
//     bandwidth model and so overlaps the manager's copies;
//   - host_data, read_home and a final pass read every tensor back byte for byte;
//   - a pinned tensor stays on the device at the same address, and its bytes are checked again
//     while other tensors push through the budget;
//   - the device and host budgets (stats, peaks included) are never exceeded; check_invariants
//     passes after every operation;
//   - out_of_memory only when the pinned tensors really leave no room; misuse is logic_error; in
//     a third of the NVMe seeds the pinned pool holds fewer home copies than the host budget
//     allows, and its refusal reaches the caller only when acquired tensors hold all its slots;
//     in a quarter the host budget is below the device budget, and its refusal reaches the caller
//     only when the homes of acquired tensors leave no room;
//   - an io_error only after a fault was injected (a failed transfer or checkpoint sync); after
//     it, nothing committed is lost and the manager goes on working: once the faults are
//     disarmed, each tensor reads back after at most one more error (a read already in flight);
//   - an optimizer thread's read_home (offload_engine's delayed update) returns, on every pass,
//     the bytes its tensors had when it started, while the loop evicts and prefetches around it
//     (the loop leaves those tensors alone meanwhile, and uses no host_data pointer under a host
//     budget, which that thread's calls may invalidate);
//   - a restart (a new manager over the store reopened, every tensor added again without
//     contents) resumes each tensor with its bytes at the last committed checkpoint; a failed
//     checkpoint (a put or the sync) commits nothing.
// The program it drives is a correct one: a stream that uses a tensor is first ordered after the
// other streams that used it (an event), as a training loop orders its own streams.
//
// Environment (nothing set: the default seed range, a few seconds in a Release build):
//   TERRACE_FUZZ_SEED=<n>      run seed n alone (a failure names the seed)
//   TERRACE_FUZZ_SEEDS=<count> run <count> seeds (from TERRACE_FUZZ_SEED, or from 1)
// The variant (bandwidth model or not, NVMe store or not) follows from the seed: any 4
// consecutive seeds cover all four.
//
// Found by this test (seed numbers of the workload as it was then; they move when it changes):
//   - seed 14: a demand for host room failed with out_of_memory while a read ahead held the room;
//   - seed 99: a failed write acquire left a block without its tensor's data as the device copy;
//   - seeds 2 and 6 under TSan: a checkpoint that threw left its puts reading home buffers;
//   - seed 491: a failed read ahead failed the next call about any tensor, once per failed read,
//     after the store had recovered.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "fuzz_support.hpp"
#include "scratch_dir.hpp"
#include "terrace/caching_allocator.hpp"
#include "terrace/device.hpp"
#include "terrace/error.hpp"
#include "terrace/pinned_pool.hpp"
#include "terrace/sim_device.hpp"
#include "terrace/tensor_store.hpp"
#include "terrace/tier_manager.hpp"

namespace terrace {
namespace {

using fuzz::fail;
using fuzz::fuzz_failure;

// A seed's time goes mostly to waiting on modelled copies, so ASan costs little (about 7 s for
// 120 seeds, as in Release); TSan is about five times slower per seed (every access between the
// stream, I/O and optimizer threads is tracked), so it runs fewer. The variants come round every
// 4 seeds.
constexpr std::uint64_t kDefaultSeeds = fuzz::kThreadSanitized ? 24 : 120;

using bytes_t = std::vector<unsigned char>;
using version = std::shared_ptr<const bytes_t>;  // immutable: a check holds the one it expects

// What the checks running on stream worker threads found. They must not throw there (the sim
// device would turn it into a device_error of some later synchronize), so they write it down.
class device_findings {
 public:
  void add(std::string what) {
    std::lock_guard lock(mutex_);
    if (first_.empty()) first_ = std::move(what);
  }
  std::string first() const {
    std::lock_guard lock(mutex_);
    return first_;
  }

 private:
  mutable std::mutex mutex_;
  std::string first_;
};

// The index of the first byte of `got` that differs from `want`, or nullopt.
std::optional<std::size_t> first_difference(const unsigned char* got, const bytes_t& want) {
  const auto m = std::mismatch(want.begin(), want.end(), got);
  if (m.first == want.end()) return std::nullopt;
  return static_cast<std::size_t>(m.first - want.begin());
}

std::string describe_difference(const unsigned char* got, const bytes_t& want, std::size_t at) {
  char buf[96];
  std::snprintf(buf, sizeof buf, "byte %zu of %zu is 0x%02x, expected 0x%02x", at, want.size(),
                got[at], want[at]);
  return buf;
}

// Adds the event counters of `s` (not the levels: bytes now and peaks) to `into`.
void add_counts(tier_stats& into, const tier_stats& s) {
  into.evictions += s.evictions;
  into.host_evictions += s.host_evictions;
  into.host_evictions_ahead += s.host_evictions_ahead;
  into.prefetches += s.prefetches;
  into.prefetch_hits += s.prefetch_hits;
  into.nvme_prefetches += s.nvme_prefetches;
  into.fence_waits += s.fence_waits;
  into.schedule_misses += s.schedule_misses;
  into.failed_puts += s.failed_puts;
  into.device_to_host_copies += s.device_to_host_copies;
}

struct held_pin {
  tensor_id id;
  int stream;
  access mode;
  unsigned char* ptr;
};

struct use {
  tensor_id id;
  access mode;
};

class fuzz_run {
 public:
  explicit fuzz_run(std::uint64_t seed) : seed_(seed), rng_(seed * 0x9E3779B97F4A7C15ull + 7) {}

  // Runs the seed; the first failure, or nothing.
  std::optional<std::string> run() {
    try {
      setup();
      const int ops = 250 + static_cast<int>(draw(250));
      for (op_ = 0; op_ < ops; ++op_) {
        step();
        if (reader_.joinable() && --reader_ops_left_ <= 0) join_reader();
        after_step();
      }
      join_reader();
      op_ = -1;
      call_ = "final check";
      finish();
    } catch (const fuzz_failure& f) {
      const std::string books = books_now();
      teardown_quietly();
      return where() + f.what + books;
    } catch (const std::exception& e) {
      const std::string books = books_now();
      teardown_quietly();
      return where() + "unexpected exception from " + call_ + ": " + e.what() + books;
    }
    teardown_quietly();
    return std::nullopt;
  }

  // The event counters of every manager the run had (a restart starts another).
  tier_stats counts() const {
    tier_stats c = earlier_counts_;
    add_counts(c, stats_);
    return c;
  }
  int io_errors() const { return io_errors_; }
  int restarts() const { return restarts_; }
  int reader_windows() const { return reader_windows_; }
  std::int64_t pool_refusals() const { return pool_refusals_; }
  bool host_below_device() const { return host_budget_ != 0 && host_budget_ < budget_; }
  int host_budget_refusals() const { return host_budget_refusals_; }
  bool with_nvme() const { return nvme_; }

 private:
  // Every random draw is its own statement, so that a seed means the same run under every
  // compiler (two draws in one expression are unsequenced).
  std::uint64_t draw(std::uint64_t n) { return rng_() % n; }
  bool chance(int percent) { return static_cast<int>(draw(100)) < percent; }

  // Keeps the latest calls and what they returned: most failures show only several calls after
  // the one that caused them.
  void note(std::string what) {
    history_.push_back("op " + std::to_string(op_) + ": " + std::move(what));
    if (history_.size() > kHistory) history_.pop_front();
  }
  static constexpr std::size_t kHistory = 40;

  // The manager's own counts where it failed: where its books and the model's part ways.
  std::string books_now() const {
    if (!tm_) return {};
    std::string out = "\n  latest calls:";
    for (const std::string& h : history_) out += "\n    " + h;
    out += "\n  manager: ";
    try {
      const tier_stats s = tm_->stats();
      out += "device bytes " + std::to_string(s.device_bytes) + ", host bytes " +
             std::to_string(s.host_bytes) + "; tensors:";
      for (tensor_id id = 0; id < size_.size(); ++id) {
        out += " t" + std::to_string(id) + "(" + std::to_string(size_[id]) +
               (tm_->on_device(id) ? " dev" : "") + (tm_->on_host(id) ? " host" : "") +
               (held(id) ? " pinned" : "") + ")";
      }
    } catch (const std::exception& e) {
      out += e.what();
    }
    return out;
  }

  std::string where() const {
    return (op_ >= 0 ? "op " + std::to_string(op_) : std::string("final check")) + " (" + variant_ +
           "): ";
  }

  // ------------------------------------------------------------------------------- setup

  void setup() {
    bandwidth_ = seed_ % 2 == 1;
    nvme_ = seed_ % 4 >= 2;
    const int tensors = 6 + static_cast<int>(draw(8));
    std::vector<std::size_t> sizes;
    for (int i = 0; i < tensors; ++i) {
      const std::uint64_t r = draw(100);
      std::size_t n = 0;
      if (r < 10) {
        n = 1 + draw(64);  // tiny
      } else if (r < 25) {
        n = 4096 * (1 + draw(8)) + draw(3) - 1;  // around page multiples
      } else {
        n = 1000 + draw(60000);
      }
      sizes.push_back(n);
    }
    std::vector<std::size_t> sorted = sizes;
    std::sort(sorted.rbegin(), sorted.rend());
    // Room for the two largest and then some: the three largest may not fit, so pins can fill it.
    budget_ = sorted[0] + sorted[1] + draw(sorted[0] + 1);
    streams_ = 2 + static_cast<int>(draw(2));

    device_options dopt;
    dopt.capacity = 64 << 20;
    // 200 MB/s: a 60 KB copy takes ~0.3 ms, long enough for the manager's copies, the "kernels'"
    // copies and the checks to overlap across streams.
    dopt.copy_bandwidth = bandwidth_ ? 200e6 : 0.0;
    dev_ = make_device("sim", dopt);
    memory_ = std::make_unique<caching_allocator>(*dev_);
    pinned_pool_options po;
    po.region_size = 4 << 20;
    if (nvme_ && chance(33)) {
      // A pool that holds fewer home copies than the host budget allows (each takes 256 KiB): it
      // refuses buffers the budget has room for, and the manager must make room for its sake.
      po.region_size = 2 << 20;
      po.capacity = 2 << 20;
      po.alignment = 256 << 10;
      pool_slots_ = 8;  // every tensor (< 64 KB) takes one slot
    }
    host_ = std::make_unique<pinned_host_pool>(*dev_, po);
    tier_manager_options& to = options_;
    to.device_budget = budget_;
    to.prefetch_window = chance(50) ? 0 : 1 + draw(budget_);
    to.resync_distance = 1 + draw(16);
    to.prefetch_across_iterations = chance(70);
    if (nvme_) {
      dir_ = std::make_unique<testing::scratch_dir>("tm-fuzz");
      tensor_store_options& so = store_options_;
      so.capacity = 16 << 20;
      so.block_size = 4096 * (1 + draw(4));  // several blocks a tensor: faults hit mid-transfer
      so.queue_depth = 4 + static_cast<unsigned>(draw(12));
      store_ = std::make_unique<tensor_store>(tensor_store::create(dir_->path(), so));
      // The device's tensors keep their home copies here, so it must hold the budget's worth and
      // one more tensor; the rest of the tensors live on NVMe.
      // In a quarter of the seeds the host budget is below the device budget (at least the largest
      // tensor): the homes of the device's copies then fill it, and room for a home copy is made
      // by evicting device copies, until only acquired tensors' homes are left.
      host_budget_ = chance(25) ? sorted[0] + draw(budget_ - sorted[0]) : budget_ + sorted[0] * (1 + draw(3));
      to.host_budget = host_budget_;
    }
    variant_ = std::string(bandwidth_ ? "bandwidth" : "no bandwidth") + ", " +
               (nvme_ ? "NVMe, host budget " + std::to_string(host_budget_) : "no NVMe") +
               ", device budget " + std::to_string(budget_) + ", " + std::to_string(streams_) +
               " streams, " + std::to_string(tensors) + " tensors";
    tm_ = std::make_unique<tier_manager>(*dev_, *memory_, *host_, to, store_.get());
    for (int s = 0; s < streams_; ++s) {
      stream_.push_back(dev_->create_stream());
      order_event_.push_back(dev_->create_event());
    }
    for (int i = 0; i < tensors; ++i) {
      const bool initial = chance(80);
      version v;
      if (initial) v = fresh(sizes[i]);
      const tensor_id id = tm_->add("t" + std::to_string(i), sizes[i], initial ? v->data() : nullptr);
      if (id != static_cast<tensor_id>(i)) fail("add returned id " + std::to_string(id));
      size_.push_back(sizes[i]);
      want_.push_back(v);
      committed_.emplace_back();  // the new store's generation 0 holds nothing
      touched_.emplace_back();
    }
    make_sequence();
  }

  version fresh(std::size_t n) {
    auto v = std::make_shared<bytes_t>(n);
    for (auto& b : *v) b = static_cast<unsigned char>(rng_());
    return v;
  }

  // One iteration's accesses: each tensor at least once in some order, some twice, in the modes a
  // training step uses (mostly reads, writes for the gradient-like ones, some updates).
  void make_sequence() {
    sequence_.clear();
    std::vector<tensor_id> order(size_.size());
    for (std::size_t i = 0; i < order.size(); ++i) order[i] = static_cast<tensor_id>(i);
    std::shuffle(order.begin(), order.end(), rng_);
    for (tensor_id id : order) {
      const std::uint64_t m = draw(10);
      sequence_.push_back({id, m < 6 ? access::read : m < 8 ? access::update : access::write});
      if (chance(25)) {
        const std::uint64_t r = draw(2);
        sequence_.push_back({static_cast<tensor_id>(draw(size_.size())), r == 0 ? access::read : access::update});
      }
    }
    cursor_ = 0;
  }

  // ------------------------------------------------------------------------------- the ops

  void step() {
    const std::uint64_t r = draw(100);
    const auto op = [this](const char* name, void (fuzz_run::*f)()) {
      call_ = name;
      (this->*f)();
    };
    if (r < 40) {
      op("use", &fuzz_run::next_use);
    } else if (r < 50) {
      op("release", &fuzz_run::release_one);
    } else if (r < 56) {
      op("pin check", &fuzz_run::check_pin);
    } else if (r < 62) {
      op("host read", &fuzz_run::host_read);
    } else if (r < 67) {
      op("host write", &fuzz_run::host_write);
    } else if (r < 71) {
      op("flush", &fuzz_run::flush_one);
    } else if (r < 76) {
      op("synchronize", &fuzz_run::synchronize);
    } else if (r < 80) {
      op("iteration boundary", &fuzz_run::iteration_boundary);
    } else if (r < 83) {
      op("misuse", &fuzz_run::misuse);
    } else if (r < 86 && nvme_) {
      op("checkpoint", &fuzz_run::checkpoint);
    } else if (r < 90 && nvme_) {
      op("fault injection", &fuzz_run::inject_fault);
    } else if (r < 92) {
      op("optimizer thread", &fuzz_run::start_reader);
    } else if (r < 94 && nvme_) {
      op("restart", &fuzz_run::restart);
    } else {
      op("use", &fuzz_run::next_use);
    }
  }

  // The next access of the sequence, or a deviation from it.
  void next_use() {
    use u = sequence_[cursor_];
    if (chance(15)) {  // deviation: another tensor, another mode, or a skip ahead
      const std::uint64_t d = draw(3);
      if (d == 0) {
        u.id = static_cast<tensor_id>(draw(size_.size()));
      } else if (d == 1) {
        u.mode = static_cast<access>(draw(3));
      } else {
        cursor_ = (cursor_ + 1 + draw(3)) % sequence_.size();
        u = sequence_[cursor_];
      }
    }
    cursor_ = (cursor_ + 1) % sequence_.size();
    if (cursor_ == 0 && chance(80)) iteration_boundary();
    acquire(u.id, static_cast<int>(draw(streams_)), u.mode, /*keep=*/chance(20));
  }

  // Orders stream s after every other stream that used `id` since the host last synchronized
  // with it: the program's own duty, not the manager's.
  void order_for(tensor_id id, int s) {
    for (int other : touched_[id]) {
      if (other == s) continue;
      dev_->record(order_event_[other], stream_[other]);
      dev_->wait(stream_[s], order_event_[other]);
    }
    touched_[id].insert(s);
  }

  // Device-side check of `id` at `p` against `want` (nothing to check for a never-written one).
  void enqueue_check(int s, tensor_id id, const unsigned char* p, const version& want,
                     std::string what) {
    if (!want) return;
    what = "op " + std::to_string(op_) + ": " + what + " of t" + std::to_string(id) +
           " on stream " + std::to_string(s) + ": ";
    enqueue_host_function(*dev_, stream_[s], [this, p, want, what = std::move(what)] {
      if (const auto at = first_difference(p, *want)) {
        findings_.add(what + describe_difference(p, *want, *at));
      }
    });
  }

  // Device-side write of want[off, off + len) into p, by a host function or the device's copy.
  void enqueue_write(int s, unsigned char* p, const version& want, std::size_t off, std::size_t len) {
    if (chance(50)) {
      dev_->copy_async(p + off, want->data() + off, len, copy_kind::host_to_device, stream_[s]);
      keep_alive_.push_back(want);  // until the device is synchronized
    } else {
      enqueue_host_function(*dev_, stream_[s], [p, want, off, len] {
        std::memcpy(p + off, want->data() + off, len);
      });
    }
  }

  std::size_t pinned_bytes() const {
    std::set<tensor_id> ids;
    for (const held_pin& h : held_) ids.insert(h.id);
    std::size_t sum = 0;
    for (tensor_id id : ids) sum += size_[id];
    return sum;
  }

  bool held(tensor_id id) const {
    return std::any_of(held_.begin(), held_.end(), [&](const held_pin& h) { return h.id == id; });
  }

  void acquire(tensor_id id, int s, access mode, bool keep) {
    if (frozen(id)) return;  // the optimizer thread is reading it: the training loop leaves it
    if (mode == access::update && !want_[id]) mode = access::write;  // nothing to update yet
    // A pinned tensor may be acquired again; the manager does not order its users' streams.
    const bool fits = held(id) || pinned_bytes() + size_[id] <= budget_;
    unsigned char* p = nullptr;
    const char* name = mode == access::read ? "read" : mode == access::update ? "update" : "write";
    note("acquire t" + std::to_string(id) + " " + name + " on stream " + std::to_string(s));
    try {
      p = static_cast<unsigned char*>(tm_->acquire(id, stream_[s], mode));
    } catch (const out_of_memory& e) {
      note("  out_of_memory");
      if (fits && !pool_refusal_allowed(id, e) && !host_budget_refusal_allowed(id, e)) {
        fail("acquire of t" + std::to_string(id) + " (" + std::to_string(size_[id]) +
             " bytes) threw out_of_memory with " + std::to_string(pinned_bytes()) +
             " bytes pinned in a budget of " + std::to_string(budget_) + ": " + e.what());
      }
      expect_not_pinned(id);
      return;
    } catch (const io_error& e) {
      note("  io_error");
      io_error_allowed("acquire of t" + std::to_string(id), e);
      expect_not_pinned(id);
      return;
    }
    if (!fits) {
      fail("acquire of t" + std::to_string(id) + " succeeded with " + std::to_string(pinned_bytes()) +
           " bytes pinned (budget " + std::to_string(budget_) + ")");
    }
    if (p == nullptr) fail("acquire returned nullptr");
    for (const held_pin& h : held_) {
      if (h.id == id && h.ptr != p) {
        fail("t" + std::to_string(id) + " is pinned at " + fuzz::hex(reinterpret_cast<std::uintptr_t>(h.ptr)) +
             " but acquire returned " + fuzz::hex(reinterpret_cast<std::uintptr_t>(p)));
      }
    }
    note("  at " + fuzz::hex(reinterpret_cast<std::uintptr_t>(p)) + (keep ? ", kept" : ""));
    order_for(id, s);
    if (mode != access::write) enqueue_check(s, id, p, want_[id], std::string(name) + " acquire");
    if (mode == access::write) {
      want_[id] = fresh(size_[id]);
      enqueue_write(s, p, want_[id], 0, size_[id]);
    } else if (mode == access::update) {
      auto next = std::make_shared<bytes_t>(*want_[id]);
      const std::size_t off = draw(size_[id]);
      const std::size_t len = 1 + draw(size_[id] - off);
      for (std::size_t k = off; k < off + len; ++k) (*next)[k] = static_cast<unsigned char>(rng_());
      want_[id] = next;
      enqueue_write(s, p, want_[id], off, len);
    }
    held_.push_back({id, s, mode, p});
    if (!keep || held_.size() > 3) release_at(held_.size() - 1);
  }

  void expect_not_pinned(tensor_id id) {
    // A failed acquire pins nothing: unless the program holds it, a release is misuse.
    if (!held(id)) {
      try {
        tm_->release(id, stream_[0]);
      } catch (const logic_error&) {
        return;
      }
      fail("a failed acquire left t" + std::to_string(id) + " pinned");
    }
  }

  // The pinned pool may refuse `id` a home buffer only when each of its slots holds the home of
  // another acquired tensor: any other home can move to NVMe (a device copy's after the copy is
  // evicted) to make room.
  bool pool_refusal_allowed(tensor_id id, const out_of_memory& e) {
    if (pool_slots_ == 0 || std::string(e.what()).find("pinned host pool") == std::string::npos) return false;
    std::set<tensor_id> acquired;
    for (const held_pin& h : held_) {
      if (h.id != id) acquired.insert(h.id);
    }
    return acquired.size() >= pool_slots_;
  }

  // Under a host budget below the device budget, the homes of acquired tensors (which cannot leave
  // while their device copies are pinned) may leave no room for another's.
  bool host_budget_refusal_allowed(tensor_id id, const out_of_memory& e) {
    if (!host_below_device()) return false;
    if (std::string(e.what()).find("host budget") == std::string::npos) return false;
    if (pinned_bytes() + size_[id] <= host_budget_) return false;
    ++host_budget_refusals_;
    return true;
  }

  void io_error_allowed(const std::string& call, const io_error& e) {
    if (!faults_injected_) fail(call + " threw io_error with no fault injected: " + e.what());
    if (std::string(e.what()).empty()) fail(call + " threw an io_error that says nothing");
    ++io_errors_;
  }

  void release_at(std::size_t i) {
    const held_pin h = held_[i];
    held_.erase(held_.begin() + static_cast<std::ptrdiff_t>(i));
    note("release t" + std::to_string(h.id) + " on stream " + std::to_string(h.stream));
    tm_->release(h.id, stream_[h.stream]);
  }

  void release_one() {
    if (held_.empty()) return;
    release_at(draw(held_.size()));
  }

  // A pinned tensor's device copy stays put while others push through the budget: it is still on
  // the device, and its bytes, checked on the stream that holds it, are what the model says.
  void check_pin() {
    if (held_.empty()) return;
    const held_pin& h = held_[draw(held_.size())];
    note("check pinned t" + std::to_string(h.id) + " on stream " + std::to_string(h.stream));
    if (!tm_->on_device(h.id)) fail("pinned t" + std::to_string(h.id) + " is not on the device");
    order_for(h.id, h.stream);
    enqueue_check(h.stream, h.id, h.ptr, want_[h.id], "pinned");
  }

  // The home copy, by host_data(read) or read_home, against the model.
  void host_read() {
    const auto id = static_cast<tensor_id>(draw(size_.size()));
    if (held(id)) return;
    bytes_t got(size_[id]);
    note("host read t" + std::to_string(id));
    try {
      if (chance(50) && !(nvme_ && reader_.joinable())) {  // host_data: see host_write
        const auto* h = static_cast<const unsigned char*>(tm_->host_data(id, access::read));
        std::memcpy(got.data(), h, size_[id]);
      } else {
        tm_->read_home(id, got.data());
      }
    } catch (const io_error& e) {
      note("  io_error");
      io_error_allowed("host read of t" + std::to_string(id), e);
      return;
    } catch (const out_of_memory& e) {  // a home buffer was needed (not only on NVMe)
      if (!host_budget_refusal_allowed(id, e)) fail(std::string("host read threw out_of_memory: ") + e.what());
      note("  out_of_memory (the host budget)");
      return;
    }
    if (want_[id]) {
      if (const auto at = first_difference(got.data(), *want_[id])) {
        fail("host read of t" + std::to_string(id) + ": " + describe_difference(got.data(), *want_[id], *at));
      }
    }
  }

  // The optimizer's side: the home copy replaced whole (host_data(write)) or changed in part
  // (host_data(update) + host_modified).
  void host_write() {
    const auto id = static_cast<tensor_id>(draw(size_.size()));
    if (held(id) || frozen(id)) return;
    // Under a host budget the optimizer thread's read_home may move any other home copy to NVMe,
    // which leaves a host_data() pointer dangling: a program that runs one does not use host_data
    // meanwhile (its own optimizer uses read_home).
    if (nvme_ && reader_.joinable()) return;
    const bool whole = !want_[id] || chance(50);
    unsigned char* h = nullptr;
    note(std::string("host ") + (whole ? "write" : "update") + " t" + std::to_string(id));
    try {
      h = static_cast<unsigned char*>(tm_->host_data(id, whole ? access::write : access::update));
    } catch (const io_error& e) {
      note("  io_error");
      io_error_allowed("host write of t" + std::to_string(id), e);
      return;
    } catch (const out_of_memory& e) {
      if (!pool_refusal_allowed(id, e) && !host_budget_refusal_allowed(id, e))
        fail(std::string("host_data for writing threw out_of_memory: ") + e.what());
      note("  out_of_memory (the pinned pool or the host budget)");
      return;
    }
    if (whole) {
      want_[id] = fresh(size_[id]);
      std::memcpy(h, want_[id]->data(), size_[id]);
    } else {
      if (const auto at = first_difference(h, *want_[id])) {
        fail("host_data(update) of t" + std::to_string(id) + ": " + describe_difference(h, *want_[id], *at));
      }
      auto next = std::make_shared<bytes_t>(*want_[id]);
      const std::size_t off = draw(size_[id]);
      const std::size_t len = 1 + draw(size_[id] - off);
      for (std::size_t k = off; k < off + len; ++k) (*next)[k] = static_cast<unsigned char>(rng_());
      std::memcpy(h + off, next->data() + off, len);
      want_[id] = next;
      tm_->host_modified(id);
    }
  }

  // flush, or offload (flush and give the device block back: offload_engine's gradients).
  void flush_one() {
    const auto id = static_cast<tensor_id>(draw(size_.size()));
    if (held(id)) return;
    if (chance(50)) {
      note("offload t" + std::to_string(id));
      tm_->offload(id);
      if (tm_->on_device(id)) fail("offloaded t" + std::to_string(id) + " is still on the device");
      return;
    }
    note("flush t" + std::to_string(id));
    tm_->flush(id);
  }

  void synchronize() {
    if (chance(30)) {
      note("synchronize the device");
      dev_->synchronize_device();
      keep_alive_.clear();
      for (auto& t : touched_) t.clear();
    } else {
      const int s = static_cast<int>(draw(streams_));
      note("synchronize stream " + std::to_string(s));
      dev_->synchronize(stream_[s]);
      for (auto& t : touched_) t.erase(s);
    }
  }

  void iteration_boundary() {
    if (chance(10) && !schedule_given_) {
      // Now and then the schedule is given instead of recorded: the sequence's order, or a
      // stale one (the sequence changes below), which the manager must follow as deviations.
      std::vector<tensor_id> order;
      for (const use& u : sequence_) order.push_back(u.id);
      note("set_schedule");
      tm_->set_schedule(order);
      schedule_given_ = true;
    }
    if (chance(5)) make_sequence();  // the workload changes shape under a recorded schedule
    note("begin_iteration");
    try {
      tm_->begin_iteration();
    } catch (const io_error& e) {
      note("  io_error");
      io_error_allowed("begin_iteration", e);
    }
  }

  // Calls the contract refuses, which must refuse them without changing anything.
  void misuse() {
    if (chance(20)) {
      // An id never added: refused before anything moves (the schedule above all).
      const auto id = static_cast<tensor_id>(size_.size() + draw(3));
      const std::vector<tensor_id> before = tm_->schedule();
      const std::uint64_t k = draw(4);
      note("misuse of unknown t" + std::to_string(id));
      try {
        if (k == 0) tm_->acquire(id, stream_[0], access::read);
        if (k == 1) tm_->set_schedule({0, id});
        if (k == 2) tm_->host_data(id, access::read);
        if (k == 3) tm_->on_device(id);
      } catch (const logic_error&) {
        if (tm_->schedule() != before) fail("a refused call on unknown t" + std::to_string(id) + " changed the schedule");
        return;
      }
      fail("a call on unknown t" + std::to_string(id) + " was not refused");
    }
    if (!held_.empty()) {
      const held_pin& h = held_[draw(held_.size())];
      const std::uint64_t k = draw(6);
      bytes_t out(size_[h.id]);
      try {
        if (k == 0) tm_->host_data(h.id, access::read);
        if (k == 1) tm_->host_data(h.id, access::write);
        if (k == 2) tm_->flush(h.id);
        if (k == 3) tm_->host_modified(h.id);
        if (k == 4) tm_->read_home(h.id, out.data());
        if (k == 5) tm_->offload(h.id);
      } catch (const logic_error&) {
        return;
      }
      fail("a host call on pinned t" + std::to_string(h.id) + " was not refused");
    }
    const auto id = static_cast<tensor_id>(draw(size_.size()));
    if (held(id)) return;
    try {
      tm_->release(id, stream_[0]);
    } catch (const logic_error&) {
      return;
    }
    fail("release of t" + std::to_string(id) + ", which is not acquired, was not refused");
  }

  void checkpoint() {
    if (!held_.empty()) {
      // Refused before it starts anything, so never with an I/O error (which would propagate).
      try {
        tm_->checkpoint();
      } catch (const logic_error&) {
        return;
      }
      fail("checkpoint with a pinned tensor was not refused");
    }
    note("checkpoint");
    try {
      tm_->checkpoint();
    } catch (const io_error& e) {
      note("  io_error");
      io_error_allowed("checkpoint", e);
      return;  // the last committed checkpoint stays
    }
    committed_ = want_;
  }

  void inject_fault() {
    io_fault f;
    const std::uint64_t k = draw(20);
    f.what = k < 8    ? io_fault::kind::eio
             : k < 10 ? io_fault::kind::enospc
             : k < 14 ? io_fault::kind::short_io
             : k < 18 ? io_fault::kind::eagain
             : k < 19 ? io_fault::kind::sync_eio  // every later checkpoint fails, until a restart
                      : io_fault::kind::none;
    f.reads = chance(70);
    f.writes = !f.reads || chance(50);
    f.skip = static_cast<int>(draw(6));
    f.count = 1 + static_cast<int>(draw(3));
    if (f.what == io_fault::kind::eio || f.what == io_fault::kind::enospc ||
        f.what == io_fault::kind::sync_eio) {
      faults_injected_ = true;
    }
    note("fault " + std::to_string(static_cast<int>(f.what)) + (f.reads ? " reads" : "") +
         (f.writes ? " writes" : "") + " skip " + std::to_string(f.skip) + " count " +
         std::to_string(f.count));
    store_->inject_fault(f);
  }

  // ------------------------------------------------------------------------------- threads

  bool frozen(tensor_id id) const { return frozen_.count(id) != 0; }

  // The optimizer's side as offload_engine's delayed update runs it: another thread reads home
  // copies with read_home while the training loop goes on with the other tensors (evicting,
  // prefetching, moving home copies to NVMe and back under the same lock). The tensors it reads
  // are frozen for the window: the loop neither acquires nor rewrites them, so their bytes must
  // read back as the model had them at the start, on every pass.
  void start_reader() {
    if (reader_.joinable()) return;
    std::vector<std::pair<tensor_id, version>> reads;
    const int n = 1 + static_cast<int>(draw(3));
    for (int i = 0; i < n; ++i) {
      const auto id = static_cast<tensor_id>(draw(size_.size()));
      if (held(id) || frozen(id)) continue;
      frozen_.insert(id);
      reads.emplace_back(id, want_[id]);
    }
    if (reads.empty()) return;
    reader_ops_left_ = 2 + static_cast<int>(draw(20));
    ++reader_windows_;
    std::string what = "optimizer thread started at op " + std::to_string(op_) + " reads";
    for (const auto& r : reads) what += " t" + std::to_string(r.first);
    note(what + " for " + std::to_string(reader_ops_left_) + " ops");
    stop_reader_ = false;
    reader_failure_.clear();
    reader_io_error_.clear();
    reader_ = std::thread([this, reads = std::move(reads)] {
      // At least one full pass, then on until the window closes.
      for (bool first = true; first || !stop_reader_.load(); first = false) {
        for (const auto& [id, want] : reads) {
          bytes_t got(size_[id]);
          try {
            tm_->read_home(id, got.data());
          } catch (const io_error& e) {
            if (reader_io_error_.empty()) reader_io_error_ = e.what();
            continue;
          } catch (const std::exception& e) {
            reader_failure_ = "read_home of t" + std::to_string(id) + " on the optimizer thread threw: " + e.what();
            return;
          }
          if (!want) continue;  // never written: nothing to compare
          if (const auto at = first_difference(got.data(), *want)) {
            reader_failure_ = "read_home of t" + std::to_string(id) + " on the optimizer thread: " +
                              describe_difference(got.data(), *want, *at);
            return;
          }
        }
        std::this_thread::yield();  // two cores: let the training thread take the lock
      }
    });
  }

  // Closes the optimizer thread's window and judges what it found.
  void join_reader() {
    if (!reader_.joinable()) return;
    stop_reader_ = true;
    reader_.join();
    frozen_.clear();
    note("optimizer thread joined");
    if (!reader_failure_.empty()) fail(reader_failure_);
    if (!reader_io_error_.empty()) {
      io_error_allowed("read_home on the optimizer thread", io_error(reader_io_error_));
    }
  }

  // The process dies and comes back: a new manager over the store reopened at its last committed
  // checkpoint, every tensor added again without contents. Those the checkpoint holds resume from
  // NVMe with its bytes (whatever was written since is forgotten); the others are undefined.
  void restart() {
    if (!held_.empty() || reader_.joinable()) return;
    note("restart from the last committed checkpoint");
    dev_->synchronize_device();
    keep_alive_.clear();
    if (const std::string f = findings_.first(); !f.empty()) fail(f);
    add_counts(earlier_counts_, tm_->stats());
    stats_ = tier_stats{};
    tm_.reset();
    store_.reset();
    call_ = "restart: tensor_store::open";
    store_ = std::make_unique<tensor_store>(tensor_store::open(dir_->path(), store_options_));
    call_ = "restart: tier_manager";
    tm_ = std::make_unique<tier_manager>(*dev_, *memory_, *host_, options_, store_.get());
    for (tensor_id i = 0; i < size_.size(); ++i) {
      call_ = "restart: add";
      const tensor_id id = tm_->add("t" + std::to_string(i), size_[i]);
      if (id != i) fail("add after the restart returned id " + std::to_string(id));
    }
    want_ = committed_;
    ++restarts_;
    for (auto& t : touched_) t.clear();
    schedule_given_ = false;
  }

  // ------------------------------------------------------------------------------- checks

  void after_step() {
    if (const std::string f = findings_.first(); !f.empty()) fail(f);
    tm_->check_invariants();
    stats_ = tm_->stats();
    const auto b = static_cast<std::int64_t>(budget_);
    if (stats_.device_bytes > b || stats_.device_bytes_peak > b) {
      fail("device bytes " + std::to_string(stats_.device_bytes) + " (peak " +
           std::to_string(stats_.device_bytes_peak) + ") over the budget of " + std::to_string(budget_));
    }
    if (nvme_) {
      const auto hb = static_cast<std::int64_t>(host_budget_);
      if (stats_.host_bytes > hb || stats_.host_bytes_peak > hb) {
        fail("host bytes " + std::to_string(stats_.host_bytes) + " (peak " +
             std::to_string(stats_.host_bytes_peak) + ") over the host budget of " +
             std::to_string(host_budget_));
      }
    }
    for (const held_pin& h : held_) {
      if (!tm_->on_device(h.id)) fail("pinned t" + std::to_string(h.id) + " left the device");
    }
  }

  // Everything released, faults disarmed: every tensor reads back right on the device and at
  // home, and the books still add up.
  void finish() {
    while (!held_.empty()) release_at(held_.size() - 1);
    if (store_) store_->inject_fault({});
    for (tensor_id id = 0; id < size_.size(); ++id) {
      const int s = static_cast<int>(draw(streams_));
      unsigned char* p = nullptr;
      // A read that failed before the fault was disarmed may still report once.
      for (int attempt = 0;; ++attempt) {
        try {
          p = static_cast<unsigned char*>(tm_->acquire(id, stream_[s], access::read));
          break;
        } catch (const io_error& e) {
          if (attempt > 0) fail("t" + std::to_string(id) + " stays unreadable: " + e.what());
          io_error_allowed("final acquire of t" + std::to_string(id), e);
        }
      }
      order_for(id, s);
      enqueue_check(s, id, p, want_[id], "final acquire");
      tm_->release(id, stream_[s]);
    }
    dev_->synchronize_device();
    keep_alive_.clear();
    if (const std::string f = findings_.first(); !f.empty()) fail(f);
    for (tensor_id id = 0; id < size_.size(); ++id) {
      if (!want_[id]) continue;
      bytes_t got(size_[id]);
      for (int attempt = 0;; ++attempt) {
        try {
          tm_->read_home(id, got.data());
          break;
        } catch (const io_error& e) {
          if (attempt > 0) fail("t" + std::to_string(id) + " stays unreadable at home: " + e.what());
          io_error_allowed("final read_home of t" + std::to_string(id), e);
        }
      }
      if (const auto at = first_difference(got.data(), *want_[id])) {
        fail("final read_home of t" + std::to_string(id) + ": " + describe_difference(got.data(), *want_[id], *at));
      }
    }
    tm_->check_invariants();
    stats_ = tm_->stats();
  }

  // Destroys in dependency order, whatever state a failure left: the manager waits for its own
  // copies; the streams may still run this run's checks, which use `findings_` and the model.
  void teardown_quietly() {
    if (reader_.joinable()) {
      stop_reader_ = true;
      reader_.join();
    }
    if (dev_) {
      try {
        dev_->synchronize_device();
      } catch (...) {
      }
    }
    tm_.reset();
    for (stream_ref s : stream_) dev_->destroy_stream(s);
    for (event_ref e : order_event_) dev_->destroy_event(e);
    stream_.clear();
    order_event_.clear();
    store_.reset();
    dir_.reset();
    if (host_) pool_refusals_ = host_->stats().num_ooms;
    host_.reset();
    memory_.reset();
    dev_.reset();
  }

  const std::uint64_t seed_;
  std::mt19937_64 rng_;
  int op_ = 0;
  const char* call_ = "setup";  // the operation under way, for an unexpected exception
  std::deque<std::string> history_;  // the latest calls, for the failure message
  std::string variant_;
  bool bandwidth_ = false, nvme_ = false;
  std::size_t pool_slots_ = 0;  // home copies the pinned pool holds, when fewer than the budget's
  std::size_t budget_ = 0, host_budget_ = 0;
  int streams_ = 0;

  std::unique_ptr<device_backend> dev_;
  std::unique_ptr<caching_allocator> memory_;
  std::unique_ptr<pinned_host_pool> host_;
  std::unique_ptr<testing::scratch_dir> dir_;
  std::unique_ptr<tensor_store> store_;
  tier_manager_options options_;
  tensor_store_options store_options_;
  std::unique_ptr<tier_manager> tm_;
  std::vector<stream_ref> stream_;
  std::vector<event_ref> order_event_;  // per stream, for order_for

  std::vector<std::size_t> size_;
  std::vector<version> want_;                // the model: nullptr until first written
  std::vector<version> committed_;           // want_ at the store's last committed checkpoint
  std::vector<std::set<int>> touched_;       // per tensor: streams that used it, not yet synced
  std::vector<held_pin> held_;
  std::vector<use> sequence_;
  std::size_t cursor_ = 0;
  bool schedule_given_ = false;
  bool faults_injected_ = false;
  int io_errors_ = 0;
  std::vector<version> keep_alive_;  // sources of copy_async writes, until synchronized
  device_findings findings_;
  tier_stats stats_;           // the manager's, after the latest op
  tier_stats earlier_counts_;  // the counters of the managers before the latest restart
  int restarts_ = 0;
  int reader_windows_ = 0;

  // The optimizer thread (start_reader): the tensors it reads, how many ops its window has left,
  // and what it found (written by it, read after the join).
  std::set<tensor_id> frozen_;
  std::thread reader_;
  std::atomic<bool> stop_reader_{false};
  int reader_ops_left_ = 0;
  std::int64_t pool_refusals_ = 0;
  int host_budget_refusals_ = 0;  // out_of_memory for want of host budget, judged allowed
  std::string reader_failure_;
  std::string reader_io_error_;
};

TEST(TierManagerFuzz, RandomWorkloadsKeepEveryByteAcrossTiersStreamsAndFaults) {
  const std::optional<fuzz::seed_range> seeds = fuzz::seeds_from_environment(kDefaultSeeds);
  if (!seeds) return;
  tier_stats total;
  int io_errors = 0, restarts = 0, reader_windows = 0, host_below_device = 0, host_budget_refusals = 0;
  std::int64_t pool_refusals = 0;
  for (std::uint64_t seed = seeds->first; seed < seeds->end(); ++seed) {
    fuzz_run run(seed);
    if (const std::optional<std::string> failure = run.run()) {
      FAIL() << "seed " << seed << ": " << *failure << "\nReproduce with TERRACE_FUZZ_SEED="
             << seed << " tests/tier_manager_fuzz_test (later seeds were not run)";
    }
    add_counts(total, run.counts());
    io_errors += run.io_errors();
    restarts += run.restarts();
    reader_windows += run.reader_windows();
    pool_refusals += run.pool_refusals();
    host_below_device += run.host_below_device() ? 1 : 0;
    host_budget_refusals += run.host_budget_refusals();
  }
  std::printf("[          ] evictions %lld (to NVMe %lld, ahead %lld), prefetches %lld (hits %lld, "
              "from NVMe %lld), fence waits %lld, schedule misses %lld, copies down %lld, "
              "failed puts %lld, io errors surfaced %d, restarts %d, optimizer thread windows %d, "
              "pinned pool refusals %lld, seeds with a host budget below the device budget %d (host "
              "budget refusals %d)\n",
              static_cast<long long>(total.evictions), static_cast<long long>(total.host_evictions),
              static_cast<long long>(total.host_evictions_ahead), static_cast<long long>(total.prefetches),
              static_cast<long long>(total.prefetch_hits), static_cast<long long>(total.nvme_prefetches),
              static_cast<long long>(total.fence_waits), static_cast<long long>(total.schedule_misses),
              static_cast<long long>(total.device_to_host_copies),
              static_cast<long long>(total.failed_puts), io_errors, restarts, reader_windows,
              static_cast<long long>(pool_refusals), host_below_device, host_budget_refusals);
  // The default range must reach what it is for (a narrower one, from the environment, need not).
  if (seeds->count >= 8) {
    EXPECT_GT(total.evictions, 0);
    EXPECT_GT(total.host_evictions, 0);
    EXPECT_GT(total.prefetches, 0);
    EXPECT_GT(total.schedule_misses, 0);
    EXPECT_GT(restarts, 0);
    EXPECT_GT(reader_windows, 0);
    EXPECT_GT(host_below_device, 0);
  }
  fuzz::print_passed(*seeds);
}

}  // namespace
}  // namespace terrace

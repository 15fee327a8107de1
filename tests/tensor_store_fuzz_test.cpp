// SPDX-License-Identifier: Apache-2.0
// A randomized model-based fuzzer of the NVMe tensor store (tiers/tensor_store.cpp over
// tiers/io_uring_engine.cpp): one thread, real files under the scratch directory (O_DIRECT), and
// faults from the engine's seam at random points.
//
// Each seed draws a geometry (block size, one or two striped files, a capacity small enough to
// fill, a queue depth) and runs a few hundred operations over a handful of ids, so that puts
// replace, erase and re-put the same names: put (odd sizes from 0 bytes up to several blocks, odd
// source addresses, some left in flight while later operations run), get (odd destinations, spare
// room behind the data, sometimes a buffer too small, some left in flight while their tensor is
// erased or replaced and other puts want its space), erase, checkpoint, close and reopen, and
// fault injection (EIO, ENOSPC, short transfers, EAGAIN, a failed fdatasync). A reference model
// written from the header's contract alone (tensor_store.hpp), never from the store's own books,
// checks:
//   - every get's bytes, as the tensor was when the get was issued, and that nothing is written
//     past them;
//   - every error's kind: out_of_memory only when the store is full (used_bytes() then equals the
//     model's count, and with enough bytes free the message's largest hole is too small),
//     io_error ENOENT for unknown ids (a failed put's id included), logic_error for a small
//     buffer, a failed transfer only where a fault injected before it explains it (its direction
//     and errno, each fault once: the engine applies a fault to whichever transfer completes
//     next, so it may hit a put issued before it), never reported as corruption; a failed
//     fdatasync refuses every later checkpoint until a reopen;
//   - that a refused operation changes nothing observable (the old version stays readable);
//   - contains / size_of / ids / generation after every operation, and used_bytes() against the
//     model's count of extents (live tensors, failed puts not yet dropped, and the committed
//     checkpoint's extents freed since it, which only the next checkpoint gives back; a put that
//     finds the store full drops the failed puts, so their share is a range);
//   - that the store is still usable after each error (a get of another tensor right after it);
//   - that reopening recovers exactly the last checkpoint's set, bytes included.
// It prints how often the rarer paths were taken (a full store, fragmentation, faults that fired,
// gets outliving their tensor), so that a change which starves one of them shows.
//
// Environment (nothing set: the default seed range, a few seconds in a Release build):
//   TERRACE_FUZZ_SEED=<n>      run seed n alone (a failure names the seed and says this)
//   TERRACE_FUZZ_SEEDS=<count> run <count> seeds (from TERRACE_FUZZ_SEED, or from 1)
// A seed replays its draws, but which transfer a fault hits, and whether a get is still reading,
// depend on timing: a failure may need a few runs of its seed to come back.
#include <gtest/gtest.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <exception>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "fuzz_support.hpp"
#include "scratch_dir.hpp"
#include "terrace/error.hpp"
#include "terrace/tensor_store.hpp"

namespace terrace {
namespace {

using fuzz::fail;
using fuzz::fuzz_failure;
using testing::scratch_dir;

// A sanitized build is several times slower per operation, and every checkpoint syncs real files.
constexpr std::uint64_t kDefaultSeeds = fuzz::kAddressSanitized || fuzz::kThreadSanitized ? 12 : 60;
constexpr int kOperations = 300;
constexpr std::uint64_t kKiB = 1024;
// The store's extent granule (4 KiB, for O_DIRECT): a tensor of n bytes holds round_up(n) of it,
// a 0-byte one a whole granule.
constexpr std::uint64_t kGranule = 4096;

std::uint64_t extent(std::uint64_t n) { return n == 0 ? kGranule : (n + kGranule - 1) / kGranule * kGranule; }

using bytes = std::vector<unsigned char>;

// A put's source, kept alive and unchanged until its handle is ready.
struct source {
  bytes storage;
  std::size_t at = 0;  // the data begins here (an odd address sometimes)
  std::size_t size = 0;
  const unsigned char* data() const { return storage.data() + at; }
};

// ============================================================================ the model

// What the store holds under one id, as the contract says it must look.
struct model_entry {
  enum class state {
    live,     // put done: readable, these bytes
    pending,  // put issued, its handle not yet seen: present until it fails
    failed,   // its handle reported an error: absent, its extent charged until the store drops it
  };
  state is = state::live;
  bytes data;
  bool pinned = false;  // in the last committed (or committing) checkpoint, unchanged since
  std::uint64_t version = 0;  // tells this put's tensor from the id's earlier and later ones
  io_handle put;        // pending: the put
  std::shared_ptr<source> src;
};

// A get left in flight while later operations run: it must return the bytes the tensor held when
// it was issued, even once the tensor is erased or replaced and other puts want its space.
struct inflight_get {
  std::string id;
  io_handle read;
  bytes into;  // moved in, so its buffer (where the store writes) stays put
  std::size_t at = 0;
  bytes want;
  std::uint64_t version = 0;  // the model_entry's
  bool dropped = false;  // its tensor was erased or replaced since: the read holds the extent
  bool pinned = false;   // that tensor was pinned when dropped (the model holds it in held_ then)
};

// A put whose id was replaced or erased while it was in flight: the store no longer knows it,
// but its handle still reports, and only an injected fault may make it fail.
struct orphan {
  io_handle put;
  std::shared_ptr<source> src;
};

// How often the paths that only some draws reach were taken, over all seeds: printed, so that a
// change which starves one of them (a store that never fills, faults that never fire) shows.
struct coverage {
  std::uint64_t full = 0;          // puts refused as full
  std::uint64_t fragmented = 0;    // of them, with enough bytes free in pieces
  std::uint64_t fault_errors = 0;  // transfers failed by an injected fault
  std::uint64_t sync_failures = 0;
  std::uint64_t reopens = 0;
  std::uint64_t outlived = 0;  // gets whose tensor was erased or replaced while they were in flight
  std::uint64_t still_reading = 0;  // of them, still reading as their tensor was dropped
};

class fuzz_run {
 public:
  fuzz_run(std::uint64_t seed, coverage& seen) : seed_(seed), rng_(seed * 0x9E3779B97F4A7C15ull + seed), seen_(seen) {}

  // Runs the seed; the failure's description, or nothing.
  std::optional<std::string> run() {
    scratch_dir dir("tensor_store_fuzz");
    dir_ = &dir;
    std::optional<std::string> failure;
    try {
      setup();
      for (op_ = 0; op_ < kOperations; ++op_) {
        step();
        check_queries();
      }
      finish();
    } catch (const fuzz_failure& f) {
      failure = describe(f.what);
    } catch (const std::exception& e) {
      failure = describe(std::string("an unexpected exception escaped: ") + e.what());
    }
    // After a failed check puts and gets may still be in flight: the store drains them as it
    // closes, while their sources and buffers (held here) are still alive, and before the
    // directory goes.
    store_.reset();
    return failure;
  }

 private:
  // ---------------------------------------------------------------- draws

  std::uint64_t below(std::uint64_t n) { return std::uniform_int_distribution<std::uint64_t>(0, n - 1)(rng_); }
  bool chance(double p) { return std::bernoulli_distribution(p)(rng_); }

  std::string draw_id() { return "t" + std::to_string(below(kIds)); }

  std::size_t draw_size() {
    const std::size_t block = options_.block_size;
    switch (below(8)) {
      case 0: return below(3);                                  // 0, 1, 2 bytes
      case 1: return kGranule - 1 + below(3);                   // around one granule
      case 2: return block - 1 + below(3);                      // around one block
      case 3: return 2 * block + below(2 * kGranule) - kGranule;  // around two blocks
      case 4: return 1 + below(4 * block);                      // anything up to 4 blocks
      default: return 1 + below(block);
    }
  }

  // ---------------------------------------------------------------- setup and the end

  void setup() {
    const std::size_t blocks[] = {4 * kKiB, 16 * kKiB, 64 * kKiB};
    options_.block_size = blocks[below(3)];
    options_.files = chance(0.3) ? 2 : 1;
    // Room for a few of the largest tensors: puts run the store full now and then.
    options_.capacity = options_.block_size * (12 + below(40));
    options_.queue_depth = static_cast<unsigned>(1 + below(8));
    config_ = "block " + std::to_string(options_.block_size) + ", files " + std::to_string(options_.files) +
              ", capacity " + std::to_string(options_.capacity) + ", queue depth " +
              std::to_string(options_.queue_depth);
    store_ = std::make_unique<tensor_store>(tensor_store::create(dir_->path(), options_));
    capacity_ = store_->capacity();
    if (capacity_ < options_.capacity) fail("capacity() " + std::to_string(capacity_) + " is less than asked");
  }

  void finish() {
    op_ = kOperations;
    disarm();
    settle_all();
    settle_reads();
    if (!poisoned_) checkpoint();
    reopen();
    for (const auto& [id, e] : entries_) expect_get(id, e.data);
  }

  // ---------------------------------------------------------------- one operation

  void step() {
    const std::uint64_t r = below(100);
    if (r < 34) return put();
    if (r < 58) return get();
    if (r < 68) return erase();
    if (r < 75) return checkpoint();
    if (r < 79) return reopen();
    if (r < 90) return inject();
    return settle_some();
  }

  void put() {
    const std::string id = draw_id();
    auto src = std::make_shared<source>();
    src->size = draw_size();
    src->at = chance(0.5) ? 0 : 1 + below(15);
    src->storage.resize(src->at + src->size);
    for (auto& b : src->storage) b = static_cast<unsigned char>(rng_());
    log("put " + id + " (" + std::to_string(src->size) + " bytes at +" + std::to_string(src->at) + ")");
    // Puts that failed, or are in flight and will, may be dropped by this put (if it finds the
    // store full without their space): the most it can find free.
    std::uint64_t free = capacity_ - (used() - failed_bytes() - pending_bytes());
    io_handle h;
    try {
      h = store_->put(id, src->data(), src->size);
    } catch (const out_of_memory& e) {
      // Refused only when full: too few bytes free, or (free space in pieces) no hole large enough.
      // Before refusing, the store waits for the transfers in flight and drops the puts that
      // failed, so its count is the model's exactly once the model has done the same, and the
      // message's largest hole must be too small.
      for (auto& [other, entry] : entries_) settle(other);
      std::erase_if(entries_, [](const auto& kv) { return kv.second.is == model_entry::state::failed; });
      free = capacity_ - used();
      if (store_->used_bytes() != used()) {
        fail("put refused with used_bytes() " + std::to_string(store_->used_bytes()) + ", the model counts " +
             std::to_string(used()));
      }
      const std::optional<double> hole = bytes_after(e.what(), "largest hole ");
      if (!hole) fail(std::string("a full store's message names no largest hole: ") + e.what());
      if (free >= extent(src->size) && *hole >= static_cast<double>(extent(src->size))) {
        fail("put of " + std::to_string(src->size) + " bytes was refused with " + std::to_string(free) +
             " bytes free and a hole large enough: " + e.what());
      }
      log("  refused: full");
      ++seen_.full;
      if (free >= extent(src->size)) ++seen_.fragmented;
      // Nothing changed: the old version, if any, is still there (get checks its bytes later).
      const auto it = entries_.find(id);
      if (it != entries_.end() && it->second.is == model_entry::state::live &&
          store_->size_of(id) != it->second.data.size()) {
        fail("a refused put of " + id + " changed its old version");
      }
      after_error("");
      return;
    }
    if (free < extent(src->size)) {
      fail("put of " + std::to_string(src->size) + " bytes (extent " + std::to_string(extent(src->size)) +
           ") was taken with only " + std::to_string(free) + " bytes free by the model");
    }
    drop(id);
    model_entry e;
    e.is = model_entry::state::pending;
    e.version = ++versions_;
    e.data.assign(src->data(), src->data() + src->size);
    e.put = h;
    e.src = src;
    entries_[id] = std::move(e);
    if (chance(0.7)) settle(id);  // else it stays in flight while later operations run
  }

  void get() {
    const std::string id = draw_id();
    const auto it = entries_.find(id);
    if (it == entries_.end()) {
      log("get " + id + " (unknown)");
      expect_io_error([&] { store_->get(id, nullptr, 0); }, ENOENT, "get of unknown " + id);
      return;
    }
    model_entry& e = it->second;
    if (e.is == model_entry::state::failed) {
      log("get " + id + " (its put failed)");
      bytes into(e.data.size() + 1);
      expect_io_error([&] { store_->get(id, into.data(), into.size()); }, 0, "get of " + id + " whose put failed");
      entries_.erase(it);  // the store drops it as it reports the failure
      return;
    }
    if (e.is == model_entry::state::pending) {
      // get waits for the put first: it must then agree with the put's handle.
      log("get " + id + " (its put in flight)");
      bytes into(e.data.size());
      io_handle read;
      bool refused = false;
      try {
        read = store_->get(id, into.data(), into.size());
      } catch (const checksum_error& x) {
        fail(std::string("get of " + id + " behind its put: ") + "a checksum error: " + x.what());
      } catch (const io_error& x) {
        refused = true;
      }
      settle(id);
      const auto now = entries_.find(id);
      if (refused) {
        if (now == entries_.end() || now->second.is != model_entry::state::failed) {
          fail("get of " + id + " said its put failed, but the put's handle reports success");
        }
        entries_.erase(now);  // dropped as the get reported it
        return;
      }
      if (now->second.is != model_entry::state::live) {
        fail("get of " + id + " was issued over a put whose handle reports failure");
      }
      finish_get(id, read, into, 0, now->second.data);
      return;
    }
    expect_get(id, e.data, /*may_leave_in_flight=*/true);
  }

  // A get of a live tensor: odd destinations, room behind it that must stay untouched, now and
  // then a buffer one byte too small; when allowed, sometimes left in flight.
  void expect_get(const std::string& id, const bytes& want, bool may_leave_in_flight = false) {
    if (!want.empty() && chance(0.05)) {
      log("get " + id + " into a buffer 1 byte short");
      bytes small(want.size() - 1);
      try {
        store_->get(id, small.data(), small.size());
        fail("get of " + id + " (" + std::to_string(want.size()) + " bytes) into " +
             std::to_string(small.size()) + " was accepted");
      } catch (const logic_error&) {
      }
      return;
    }
    const std::size_t at = chance(0.5) ? 0 : 1 + below(15);
    const std::size_t spare = chance(0.5) ? 0 : 1 + below(2 * kGranule);
    log("get " + id + " (" + std::to_string(want.size()) + " bytes, at +" + std::to_string(at) + ", " +
        std::to_string(spare) + " spare)");
    bytes into(at + want.size() + spare, 0xA5);
    io_handle read;
    try {
      read = store_->get(id, into.data() + at, want.size() + spare);
    } catch (const std::exception& x) {
      fail("get of " + id + " refused: " + x.what());
    }
    if (may_leave_in_flight && chance(0.3)) {
      log("  left in flight");
      reads_.push_back({id, read, std::move(into), at, want, entries_.at(id).version});
      return;
    }
    finish_get(id, read, into, at, want);
  }

  // Waits for a get and checks its bytes against `want` (the tensor as it was when the get was
  // issued) and the buffer around them against the fill.
  void finish_get(const std::string& id, const io_handle& read, const bytes& into, std::size_t at, const bytes& want) {
    try {
      read.wait();
    } catch (const checksum_error& x) {
      fail("get of " + id + " reported corruption nobody made: " + std::string(x.what()));
    } catch (const io_error& x) {
      explain(x, /*write=*/false, "get of " + id);
      after_error(id);
      return;
    }
    if (!want.empty() && std::memcmp(into.data() + at, want.data(), want.size()) != 0) {
      std::size_t first = 0;
      while (into[at + first] == want[first]) ++first;
      fail("get of " + id + " returned other bytes (first difference at byte " + std::to_string(first) + " of " +
           std::to_string(want.size()) + ")");
    }
    for (std::size_t i = 0; i < into.size(); ++i) {
      if ((i < at || i >= at + want.size()) && into[i] != 0xA5) {
        fail("get of " + id + " wrote byte " + std::to_string(i) + " of its buffer, outside the tensor [" +
             std::to_string(at) + ", " + std::to_string(at + want.size()) + ")");
      }
    }
  }

  void erase() {
    const std::string id = draw_id();
    const auto it = entries_.find(id);
    if (it == entries_.end() || it->second.is == model_entry::state::failed) {
      log("erase " + id + (it == entries_.end() ? " (unknown)" : " (its put failed)"));
      expect_io_error([&] { store_->erase(id); }, ENOENT, "erase of absent " + id);
      if (it != entries_.end()) entries_.erase(it);  // dropped as absent
      return;
    }
    const bool pending = it->second.is == model_entry::state::pending;
    log("erase " + id + (pending ? " (its put in flight)" : ""));
    try {
      store_->erase(id);
    } catch (const io_error& x) {
      // A put in flight may have failed by now, which makes its id unknown; its handle must agree.
      if (!pending || x.code() != ENOENT) fail("erase of " + id + " refused: " + x.what());
      settle(id);
      const auto now = entries_.find(id);
      if (now->second.is != model_entry::state::failed) {
        fail("erase of " + id + " said its put failed, but the put's handle reports success");
      }
      entries_.erase(now);  // dropped as absent
      return;
    } catch (const std::exception& x) {
      fail("erase of " + id + " refused: " + x.what());
    }
    drop(id);
  }

  void checkpoint() {
    log("checkpoint");
    const std::uint64_t before = store_->generation();
    if (poisoned_) {
      expect_io_error([&] { store_->checkpoint(); }, EIO, "checkpoint after a failed fdatasync");
      return;
    }
    std::uint64_t got = 0;
    bool failed = false;
    try {
      got = store_->checkpoint();
    } catch (const io_error& x) {
      if (!sync_armed_ || x.code() != EIO) fail(std::string("checkpoint failed unexplained: ") + x.what());
      failed = true;
    } catch (const std::exception& x) {
      fail(std::string("checkpoint threw ") + x.what());
    }
    if (sync_armed_ && !failed) fail("checkpoint succeeded over a failed fdatasync");
    // Either way every put issued before it has finished and the failed ones are gone; what
    // remains was snapshotted (pinned: a committing index may reference it).
    settle_all();
    for (auto it = entries_.begin(); it != entries_.end();) {
      if (it->second.is == model_entry::state::failed) {
        it = entries_.erase(it);
      } else {
        it->second.pinned = true;
        ++it;
      }
    }
    if (failed) {
      log("  failed: fdatasync");
      ++seen_.sync_failures;
      sync_armed_ = false;
      poisoned_ = true;
      if (store_->generation() != before) fail("a failed checkpoint moved the generation");
      after_error("");
      return;
    }
    if (got != before + 1) fail("checkpoint returned generation " + std::to_string(got) + " after " + std::to_string(before));
    generation_ = got;
    committed_.clear();
    for (const auto& [id, e] : entries_) committed_[id] = e.data;
    held_ = 0;
  }

  void reopen() {
    log("close and reopen");
    ++seen_.reopens;
    store_.reset();  // waits for every transfer
    // Their handles are all done: any error still needs a fault to explain it.
    for (auto& [id, e] : entries_) {
      if (e.is == model_entry::state::pending) {
        if (!e.put.ready()) fail("a put of " + id + " is still in flight after the store closed");
        try {
          e.put.wait();
        } catch (const io_error& x) {
          explain(x, true, "put of " + id + " (seen after close)");
        }
      }
    }
    settle_orphans();
    for (const inflight_get& g : reads_) {
      if (!g.read.ready()) fail("a get of " + g.id + " is still in flight after the store closed");
    }
    settle_reads();
    tensor_store_options o = options_;
    o.queue_depth = static_cast<unsigned>(1 + below(8));  // not a layout field: may change
    try {
      store_ = std::make_unique<tensor_store>(tensor_store::open(dir_->path(), o));
    } catch (const std::exception& x) {
      fail(std::string("reopen failed: ") + x.what());
    }
    entries_.clear();
    for (const auto& [id, data] : committed_) {
      model_entry e;
      e.data = data;
      e.pinned = true;
      e.version = ++versions_;
      entries_[id] = std::move(e);
    }
    held_ = 0;
    poisoned_ = false;
    sync_armed_ = false;
    faults_.clear();  // a new engine: nothing armed, nothing in flight to hit
    errors_.clear();
    may_retire_ = false;
    if (store_->generation() != generation_) {
      fail("reopened at generation " + std::to_string(store_->generation()) + ", the last commit was " +
           std::to_string(generation_));
    }
    // Exactly the last checkpoint's set, bytes included (a few gets here; the rest come later).
    for (const auto& [id, data] : committed_) {
      if (chance(0.3)) expect_get(id, data);
    }
  }

  void inject() {
    io_fault f;
    const io_fault::kind kinds[] = {io_fault::kind::eio, io_fault::kind::enospc, io_fault::kind::short_io,
                                    io_fault::kind::eagain, io_fault::kind::sync_eio};
    f.what = kinds[below(5)];
    if (f.what == io_fault::kind::sync_eio) {
      log("inject sync_eio");
      store_->inject_fault(f);
      if (!poisoned_) sync_armed_ = true;  // a poisoned store refuses before it syncs
      return;
    }
    f.reads = chance(0.6);
    f.writes = !f.reads || chance(0.5);
    f.skip = static_cast<int>(below(4));
    f.count = 1;
    static const char* names[] = {"none", "eio", "enospc", "short_io", "eagain"};
    log(std::string("inject ") + names[static_cast<int>(f.what)] + (f.reads ? " reads" : "") +
        (f.writes ? " writes" : "") + " skip " + std::to_string(f.skip));
    store_->inject_fault(f);
    // It replaces any armed fault, but one that has fired stays behind on its transfer's handle.
    if (f.what == io_fault::kind::eio || f.what == io_fault::kind::enospc) {
      faults_.push_back({f.what == io_fault::kind::eio ? EIO : ENOSPC, f.reads, f.writes, std::nullopt});
    }
  }

  // Nothing fires from here on; faults that have fired are still to be seen on their handles.
  void disarm() { store_->inject_fault(io_fault{}); }

  void settle_some() {
    if (chance(0.3)) {
      log("wait_all");
      store_->wait_all();
      for (const inflight_get& g : reads_) {
        if (!g.read.ready()) fail("a get of " + g.id + " is still in flight after wait_all()");
      }
      settle_all();
      settle_reads();
      return;
    }
    if (!reads_.empty() && chance(0.5)) {
      inflight_get g = std::move(reads_.front());
      reads_.pop_front();
      log("wait for a get of " + g.id + (g.dropped ? " (erased or replaced since)" : ""));
      finish_inflight(g);
      return;
    }
    for (auto& [id, e] : entries_) {
      if (e.is == model_entry::state::pending) {
        log("wait for the put of " + id);
        settle(id);
        return;
      }
    }
  }

  // ---------------------------------------------------------------- model bookkeeping

  bool present(const std::string& id) const {
    const auto it = entries_.find(id);
    return it != entries_.end() && it->second.is != model_entry::state::failed;
  }

  // The store forgets `id` (a new put replaces it, or erase).
  void drop(const std::string& id) {
    const auto it = entries_.find(id);
    if (it == entries_.end()) return;
    model_entry& e = it->second;
    if (e.pinned) held_ += extent(e.data.size());
    if (e.is == model_entry::state::pending) {
      orphans_.push_back({e.put, e.src});
      may_retire_ = true;
    }
    for (inflight_get& g : reads_) {
      if (g.id == id && !g.dropped) {
        g.dropped = true;
        g.pinned = e.pinned;
        if (!g.read.ready()) ++seen_.still_reading;
      }
    }
    entries_.erase(it);
  }

  // Waits for the put of `id` and records what its handle says.
  void settle(const std::string& id) {
    model_entry& e = entries_.at(id);
    if (e.is != model_entry::state::pending) return;
    try {
      e.put.wait();
      e.is = model_entry::state::live;
    } catch (const checksum_error& x) {
      fail("put of " + id + " reported a checksum error: " + std::string(x.what()));
    } catch (const io_error& x) {
      explain(x, /*write=*/true, "put of " + id);
      e.is = model_entry::state::failed;
      log("  put of " + id + " failed");
      e.put = io_handle();
      e.src.reset();
      after_error(id);
      return;
    }
    e.put = io_handle();
    e.src.reset();
  }

  void settle_all() {
    for (auto& [id, e] : entries_) {
      if (e.is == model_entry::state::pending) settle(id);
    }
    settle_orphans();
  }

  void settle_reads() {
    while (!reads_.empty()) {
      inflight_get g = std::move(reads_.front());
      reads_.pop_front();
      finish_inflight(g);
    }
  }

  void finish_inflight(const inflight_get& g) {
    if (g.dropped) {
      ++seen_.outlived;
      may_retire_ = true;  // the extent it held comes back at the store's next wait_all
    }
    finish_get(g.id, g.read, g.into, g.at, g.want);
  }

  void settle_orphans() {
    while (!orphans_.empty()) {
      orphan o = std::move(orphans_.front());
      orphans_.pop_front();
      try {
        o.put.wait();
      } catch (const checksum_error& x) {
        fail(std::string("a replaced put reported a checksum error: ") + x.what());
      } catch (const io_error& x) {
        explain(x, true, "a put replaced or erased in flight");
      }
    }
  }

  // Extents the store must account for: every entry it still holds (failed puts until dropped)
  // and the committed checkpoint's extents freed since it.
  std::uint64_t used() const {
    std::uint64_t n = held_;
    for (const auto& [id, e] : entries_) n += extent(e.data.size());
    return n;
  }

  // Of used(): the failed puts', which a put that found the store full without them may have
  // dropped already (which of them depends on when each failed): used_bytes() may be that much
  // less.
  std::uint64_t failed_bytes() const { return bytes_of(model_entry::state::failed); }
  std::uint64_t pending_bytes() const { return bytes_of(model_entry::state::pending); }
  std::uint64_t bytes_of(model_entry::state state) const {
    std::uint64_t n = 0;
    for (const auto& [id, e] : entries_)
      if (e.is == state) n += extent(e.data.size());
    return n;
  }

  // ---------------------------------------------------------------- errors

  // A transfer error must come from a fault injected into this engine before it was seen, in its
  // direction, with its errno; each fault (count 1) explains one error at most. The engine applies
  // a fault to whichever transfer completes next, so a put issued before the fault, or a fault
  // replaced since, may be the one it hit: which error took which fault is a matching, kept whole
  // by augmenting paths, and every error seen so far must stay matched.
  void explain(const io_error& x, bool write, const std::string& what) {
    error_seen e;
    for (std::size_t f = 0; f < faults_.size(); ++f) {
      if (faults_[f].code == x.code() && (write ? faults_[f].writes : faults_[f].reads)) e.candidates.push_back(f);
    }
    if (e.candidates.empty()) {
      fail(what + " failed with errno " + std::to_string(x.code()) + " (" + x.what() +
           "), which no injected fault explains");
    }
    errors_.push_back(std::move(e));
    std::vector<bool> visited(faults_.size(), false);
    if (!match(errors_.size() - 1, visited)) {
      fail(what + " failed with errno " + std::to_string(x.code()) + " (" + x.what() + "), one error more than " +
           "the faults injected so far can explain (each fires once)");
    }
    log("  " + what + " failed as injected (errno " + std::to_string(x.code()) + ")");
    ++seen_.fault_errors;
  }

  // Kuhn's augmenting path from error `e`: true when it (and every error matched before) can hold
  // a fault of its own.
  bool match(std::size_t e, std::vector<bool>& visited) {
    for (const std::size_t f : errors_[e].candidates) {
      if (visited[f]) continue;
      visited[f] = true;
      if (!faults_[f].explains || match(*faults_[f].explains, visited)) {
        faults_[f].explains = e;
        return true;
      }
    }
    return false;
  }

  template <class Fn>
  void expect_io_error(Fn&& fn, int code, const std::string& what) {
    try {
      fn();
    } catch (const checksum_error& x) {
      fail(what + ": a checksum error: " + x.what());
    } catch (const io_error& x) {
      if (code != 0 && x.code() != code) {
        fail(what + ": errno " + std::to_string(x.code()) + ", expected " + std::to_string(code) + ": " + x.what());
      }
      after_error("");
      return;
    } catch (const std::exception& x) {
      fail(what + ": threw another kind of error: " + x.what());
    }
    fail(what + ": no error");
  }

  // Right after an error the store must still serve: a get of another live tensor.
  void after_error(const std::string& not_this) {
    // Errors seen while the store is closed (reopen checks the handles it drained) have no store
    // to ask.
    if (in_after_error_ || !store_) return;
    in_after_error_ = true;
    for (const auto& [id, e] : entries_) {
      if (id != not_this && e.is == model_entry::state::live) {
        if (chance(0.5)) continue;
        log("  after the error: get " + id);
        const bytes want = e.data;
        expect_get(id, want);
        break;
      }
    }
    in_after_error_ = false;
  }

  // The size that follows `label` in a message, as human_bytes() writes it ("12 B", "1.50 MiB"),
  // at its lower bound: the two decimals round, by half a hundredth of the unit at most.
  static std::optional<double> bytes_after(const std::string& message, const std::string& label) {
    const std::size_t at = message.find(label);
    if (at == std::string::npos) return std::nullopt;
    double v = 0;
    char unit[8] = {};
    if (std::sscanf(message.c_str() + at + label.size(), "%lf %7s", &v, unit) != 2) return std::nullopt;
    const std::string u(unit);
    const double scale = u.rfind("B", 0) == 0     ? 1.0
                         : u.rfind("KiB", 0) == 0 ? 1024.0
                         : u.rfind("MiB", 0) == 0 ? 1024.0 * 1024.0
                         : u.rfind("GiB", 0) == 0 ? 1024.0 * 1024.0 * 1024.0
                                                  : 0.0;
    if (scale == 0.0) return std::nullopt;
    return scale == 1.0 ? v : (v - 0.005) * scale;
  }

  // ---------------------------------------------------------------- queries

  void check_queries() {
    if (store_->generation() != generation_) fail("generation() moved without a checkpoint");
    bool pending = false;
    std::vector<std::string> want_ids;
    for (const auto& [id, e] : entries_) {
      if (e.is == model_entry::state::pending) {
        pending = true;
        continue;  // present until its put fails: either answer may be right
      }
      const bool live = e.is == model_entry::state::live;
      if (live) want_ids.push_back(id);
      if (store_->contains(id) != live) fail("contains(" + id + ") is " + (live ? "false" : "true"));
      const std::optional<std::size_t> size = store_->size_of(id);
      if (live ? size != e.data.size() : size.has_value()) fail("size_of(" + id + ") is wrong");
    }
    for (std::uint64_t k = 0; k < kIds; ++k) {
      const std::string id = "t" + std::to_string(k);
      if (!entries_.count(id) && store_->contains(id)) fail("contains(" + id + ") of an absent id");
    }
    if (pending) return;
    if (store_->ids() != want_ids) fail("ids() differs from the model's");
    // Extents of tensors dropped while a put or get of them was in flight come back once those
    // transfers are done, at the next wait_all (or erase, put, checkpoint) after.
    if (may_retire_) {
      settle_orphans();
      store_->wait_all();
      may_retire_ = false;
    }
    // So do those of tensors dropped with a get in flight. Half the time they stay out, so that
    // a later put can want that space while the get still reads it.
    bool reads_hold = false, reads_running = false;
    for (const inflight_get& g : reads_) {
      reads_hold = reads_hold || g.dropped;
      reads_running = reads_running || (g.dropped && !g.read.ready());
    }
    if (reads_hold) {
      if (chance(0.5)) {
        // While a get of a dropped tensor still reads, its extent must stay taken: a put given
        // it would write under the read. The store lets extents go only in its own calls, so one
        // whose get is still reading now is counted in the used_bytes() that follows.
        std::uint64_t reading = 0;
        std::set<std::uint64_t> counted;  // a dropped version, once however many gets read it
        for (const inflight_get& g : reads_) {
          if (g.dropped && !g.pinned && !g.read.ready() && counted.insert(g.version).second) {
            reading += extent(g.want.size());
          }
        }
        const std::uint64_t used_now = store_->used_bytes();
        if (used_now < used() - failed_bytes() + reading) {
          fail("used_bytes() is " + std::to_string(used_now) + " while gets of dropped tensors still read " +
               std::to_string(reading) + " bytes of extents beside the model's " + std::to_string(used()) +
               ": their space was let go under a transfer");
        }
        return;
      }
      store_->wait_all();
    }
    const std::uint64_t used_now = store_->used_bytes();
    if (used_now > used() || used_now < used() - failed_bytes()) {
      fail("used_bytes() is " + std::to_string(used_now) + ", the model counts " + std::to_string(used()) +
           " (of which " + std::to_string(held_) + " held for the committed checkpoint and " +
           std::to_string(failed_bytes()) + " by failed puts, which a full store may have dropped)");
    }
  }

  // ---------------------------------------------------------------- reporting

  void log(std::string line) {
    history_.push_back("  " + std::to_string(op_) + ": " + std::move(line));
    if (history_.size() > 30) history_.pop_front();
  }

  std::string describe(const std::string& what) const {
    std::string out = "seed " + std::to_string(seed_) + " (" + config_ + "), operation " + std::to_string(op_) +
                      ": " + what + "\nlast operations:\n";
    for (const std::string& line : history_) out += line + "\n";
    return out + "run it alone: TERRACE_FUZZ_SEED=" + std::to_string(seed_);
  }

  static constexpr std::uint64_t kIds = 8;

  std::uint64_t seed_;
  std::mt19937_64 rng_;
  coverage& seen_;
  scratch_dir* dir_ = nullptr;
  tensor_store_options options_;
  std::string config_;
  std::uint64_t capacity_ = 0;
  std::unique_ptr<tensor_store> store_;
  int op_ = -1;
  std::map<std::string, model_entry> entries_;
  std::map<std::string, bytes> committed_;  // the last checkpoint's set
  std::deque<orphan> orphans_;
  std::deque<inflight_get> reads_;
  std::uint64_t versions_ = 0;
  std::uint64_t held_ = 0;        // committed extents freed since the last commit
  std::uint64_t generation_ = 0;  // of the last commit
  // An erroring fault injected into the current engine, and the error it has been matched to.
  struct fault_injected {
    int code;
    bool reads, writes;
    std::optional<std::size_t> explains;  // index into errors_
  };
  struct error_seen {
    std::vector<std::size_t> candidates;  // faults_ injected before it, of its errno and direction
  };
  std::vector<fault_injected> faults_;
  std::vector<error_seen> errors_;
  bool sync_armed_ = false;
  bool poisoned_ = false;  // an fdatasync failed: checkpoints refuse until a reopen
  bool may_retire_ = false;
  bool in_after_error_ = false;
  std::deque<std::string> history_;
};

TEST(TensorStoreFuzz, RandomOperationsWithFaultsMatchTheModel) {
  const std::optional<fuzz::seed_range> seeds = fuzz::seeds_from_environment(kDefaultSeeds);
  if (!seeds) return;
  coverage seen;
  for (std::uint64_t seed = seeds->first; seed < seeds->end(); ++seed) {
    if (const std::optional<std::string> failure = fuzz_run(seed, seen).run()) {
      FAIL() << *failure;
    }
  }
  fuzz::print_passed(*seeds);
  std::printf("[          ] puts refused as full %llu (%llu with the bytes free in pieces), transfers failed "
              "by a fault %llu, failed fdatasyncs %llu, reopens %llu, gets outliving their tensor %llu (%llu still "
              "reading as it went)\n",
              static_cast<unsigned long long>(seen.full), static_cast<unsigned long long>(seen.fragmented),
              static_cast<unsigned long long>(seen.fault_errors), static_cast<unsigned long long>(seen.sync_failures),
              static_cast<unsigned long long>(seen.reopens), static_cast<unsigned long long>(seen.outlived),
              static_cast<unsigned long long>(seen.still_reading));
}

}  // namespace
}  // namespace terrace

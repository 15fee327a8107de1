// SPDX-License-Identifier: Apache-2.0
// The simulated device ("sim"): host memory behind a capacity limit, streams that are ordered
// queues run by one worker thread each, events as positions in those queues, and an optional copy
// bandwidth. It is the device of every CPU test, so it is strict: misuse of the virtual-memory
// calls is refused, unknown handles are refused, and copies really move bytes.
//
// Semantics worth knowing:
//   - The default stream (stream_ref{}) is a queue like any other, created on first use. It does
//     not synchronize implicitly with other streams (as a cudaStreamNonBlocking stream would not).
//   - Every item a stream runs has a ticket (1, 2, 3, ... in queue order) and the stream publishes
//     how many it has finished. An event is the (stream, ticket) of its latest record(): complete
//     once that stream has finished that many items. wait() copies the pair into the waiting
//     stream's queue, so, as in CUDA, it refers to the record before it and a later record (say on
//     a faster stream) cannot release it early. record() itself queues nothing.
//   - With a copy bandwidth, the device has one link per direction (host to device, device to
//     host), shared by all its streams, as a GPU has one copy engine each way
//     (tiers/sim_copy_link.hpp). A copy books its direction's link for bytes / bandwidth seconds
//     from when it was queued or its stream's previous item ended, or when the link's previous
//     booking ends, whichever is latest; its stream is held that long (or as long as the memcpy
//     takes, if longer). So copies of two streams in one direction take turns, while opposite
//     directions overlap. Device-to-device and host-to-host copies cross no such link and take
//     their memcpy's time. Deadlines come from a steady clock and chain from one copy to the
//     next, so a timer's oversleep on one small copy is made up by the next and a run of small
//     copies keeps the modelled rate.
//   - destroy_stream drains the stream: its queued copies still hold their link for their
//     modelled time before their completion can be seen, as a destroyed CUDA stream's work
//     completes as usual. Only the device's destructor cuts modelled time short.
//   - Freeing memory that a queued (or running) copy still reads or writes follows the CUDA call
//     it stands for: release() is cudaFree, which synchronises, so it waits for those copies;
//     unmap() is cuMemUnmap, which does not, so it is refused as a contract violation (the caller
//     must synchronize first, as PyTorch does before unmapping).
//   - A child forked without exec (a DataLoader worker) inherits the streams but not their workers.
//     There, work finished before the fork is still finished, a wait for any other is a
//     device_error (as every CUDA call in such a child fails), and destroying a stream or the
//     device lets go of its worker instead of joining a thread that does not exist.
#include <pthread.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <system_error>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include <unistd.h>

#include "terrace/error.hpp"
#include "terrace/sim_device.hpp"
#include "tiers/backends.hpp"
#include "tiers/capacity_meter.hpp"
#include "tiers/fork_guard.hpp"
#include "tiers/sim_copy_link.hpp"
#include "tiers/vmm_book.hpp"

namespace terrace {
namespace detail {
namespace {

constexpr std::size_t kMiB = std::size_t{1} << 20;
constexpr std::size_t kDefaultCapacity = std::size_t{8} << 30;
constexpr std::size_t kDefaultGranularity = 2 * kMiB;
constexpr std::size_t kAlignment = 512;
// Segments from here up come from mmap, so that untouched memory costs nothing; smaller ones come
// from the C++ heap, where AddressSanitizer sees overruns.
constexpr std::size_t kMmapThreshold = 1 * kMiB;

using clock_type = std::chrono::steady_clock;

std::string errno_text(int err) { return std::error_code(err, std::generic_category()).message(); }

// ---------------------------------------------------------------- streams

class sim_stream;

// The stream whose worker this thread is (null on every other thread): a host function's
// synchronize must know which stream it holds up.
thread_local sim_stream* tls_worker_of = nullptr;

// One queued operation. A plain struct rather than a closure per item, so that copies and waits
// cost no heap allocation; only host functions carry a std::function.
struct work_item {
  enum class kind : std::uint8_t { copy, host_function, wait };
  kind what = kind::copy;
  void* dst = nullptr;
  const void* src = nullptr;
  std::size_t bytes = 0;
  copy_kind transfer = copy_kind::host_to_host;  // kind::copy: which link, if any, it books
  std::shared_ptr<sim_stream> waits_for;  // kind::wait: run on once it has finished `ticket` items
  std::uint64_t ticket = 0;
  std::function<void()> fn;
  std::chrono::steady_clock::time_point queued_at{};  // copies, with a bandwidth model only
};

// A fork_guard: in a child forked without exec (a DataLoader worker) the stream's worker does not
// exist, and forked_away() tells every call so.
class sim_stream : public std::enable_shared_from_this<sim_stream>, private detail::fork_guard {
 public:
  sim_stream(std::shared_ptr<sim_copy_links> links, std::string label)
      : label_(std::move(label)), links_(std::move(links)) {
    detail::fork_guard::install();
    // Registered before the worker starts: a fork from then on is seen, whenever it comes.
    register_for_fork();
    worker_ = std::thread([this] { run(); });
  }

  ~sim_stream() {
    unregister_for_fork();  // forked_away() keeps its answer
    stop_and_join();
    // In a forked child the condition variables still count the parent's waiters (the worker
    // waiting for items when the process forked), who never leave there: destroying them would
    // wait for those forever (glibc's pthread_cond_destroy). Let go of them instead.
    if (forked_away()) (void)wakeups_.release();
  }

  sim_stream(const sim_stream&) = delete;
  sim_stream& operator=(const sim_stream&) = delete;

  const std::string& label() const noexcept { return label_; }

  /// @throws logic_error if the stream was destroyed (a use racing with destroy_stream).
  void push(work_item&& item) {
    {
      std::lock_guard<std::mutex> lock(m_);
      if (stopping_) {
        throw logic_error("terrace: device 'sim': work queued on " + label_ +
                          " while it is being destroyed");
      }
      if (links_->modelled() && item.what == work_item::kind::copy) item.queued_at = clock_type::now();
      queue_.push_back(std::move(item));
      ++pushed_;
    }
    work_cv_.notify_one();
  }

  /// The ticket of the last item queued so far: an event recorded now completes when reached(it).
  std::uint64_t ticket() {
    std::lock_guard<std::mutex> lock(m_);
    return pushed_;
  }

  /// True once the first `ticket` items have run. The acquire pairs with the worker's release, so
  /// the caller then sees everything those items wrote.
  bool reached(std::uint64_t ticket) const noexcept {
    return finished_.load(std::memory_order_acquire) >= ticket;
  }

  /// Blocks until reached(ticket); returns whether it had to block.
  /// @throws logic_error when called from this stream's own worker for work not yet run.
  /// @throws logic_error too when the caller is a host function on another stream that this
  /// stream's work up to `ticket` waits for (through events, maybe via more streams).
  bool wait_until(std::uint64_t ticket) {
    if (reached(ticket)) return false;
    if (forked_away()) {
      throw device_error("terrace: device 'sim': waiting for work on " + label_ + " that had not run "
                         "when this process was forked: a child forked without exec has no stream "
                         "workers (as CUDA, the device is not usable there)");
    }
    {
      std::lock_guard<std::mutex> lock(m_);
      refuse_waiting_for_itself(ticket);
    }
    const blocked_worker caller(*this, ticket);
    block_until(ticket);
    return true;
  }

  /// Blocks until everything pushed before the call has run; returns (and clears) the first error
  /// a host function raised, if any.
  /// @throws logic_error when called from this stream's own worker (a host function on it).
  std::string drain() {
    wait_until(ticket());
    std::lock_guard<std::mutex> lock(m_);
    return std::exchange(error_, std::string{});
  }

  /// True on this stream's worker thread, i.e. inside one of its host functions.
  bool on_worker() {
    std::lock_guard<std::mutex> lock(m_);
    return worker_id_ == std::this_thread::get_id();
  }

  /// The ticket of the newest copy queued or running here that reads or writes [begin, end), or
  /// 0 if none. Allocates nothing (unmap is noexcept). In a forked child always 0: no worker will
  /// ever run what was queued.
  std::uint64_t newest_copy_touching(std::uintptr_t begin, std::uintptr_t end) noexcept {
    if (forked_away()) return 0;  // m_ may be held by a thread of the parent
    std::lock_guard<std::mutex> lock(m_);
    std::uint64_t found = running_copy_.touches(begin, end) ? running_copy_.ticket : 0;
    std::uint64_t ticket = pushed_ - queue_.size();
    for (const work_item& item : queue_) {
      ++ticket;
      if (item.what == work_item::kind::copy && copy_span::of(item, 0).touches(begin, end)) found = ticket;
    }
    return found;
  }

  /// Takes the first error a host function raised, if any, without waiting for queued work.
  std::string take_error() {
    std::lock_guard<std::mutex> lock(m_);
    return std::exchange(error_, std::string{});
  }

  /// Tells the worker to stop once the queue is empty, without waiting for it. Queued copies
  /// still take their modelled time. Idempotent.
  void request_stop() noexcept { stop(/*cut_short=*/false); }

  /// request_stop for the device's end: queued work still runs, but copies skip what is left of
  /// their modelled time, so that the destructor does not sit out a pathological bandwidth's
  /// century (or a stream waiting on such a copy). Idempotent.
  void abandon() noexcept { stop(/*cut_short=*/true); }

  /// stop_and_join for destroy_stream, which may come from a host function on another stream.
  /// @throws logic_error, stopping nothing, when this stream's queued work waits for work queued
  /// behind that host function (blocked_worker).
  void stop_and_join_checked() {
    const blocked_worker caller(*this, ticket());
    stop_and_join();
  }

  /// Runs what is queued, then stops the worker. Idempotent.
  void stop_and_join() noexcept {
    request_stop();
    if (!worker_.joinable()) return;
    // In a forked child the worker does not exist: join() would wait for it forever.
    if (forked_away()) {
      worker_.detach();
    } else {
      worker_.join();
    }
  }

 private:
  using detail::fork_guard::forked_away;

  // Nothing to close: forked_away() (set by the fork handler) is what every later call looks at.
  void abandon_after_fork() noexcept override {}

  void stop(bool cut_short) noexcept {
    if (forked_away()) return;  // no worker to tell; m_ may be held by a thread of the parent
    {
      std::lock_guard<std::mutex> lock(m_);
      stopping_ = true;
      cut_short_ = cut_short_ || cut_short;
    }
    work_cv_.notify_one();
  }

  void run() {
    pthread_setname_np(pthread_self(), "terrace-sim");
    tls_worker_of = this;
    std::unique_lock<std::mutex> lock(m_);
    worker_id_ = std::this_thread::get_id();
    for (;;) {
      if (queue_.empty()) {
        if (stopping_) return;
        work_cv_.wait(lock, [&] { return !queue_.empty() || stopping_; });
        continue;
      }
      {
        work_item item = std::move(queue_.front());
        queue_.pop_front();
        // Published with the pop, so that a cycle check never misses this wait between the two,
        // and a release or unmap never misses this copy.
        if (item.what == work_item::kind::wait) blocked_on_ = {item.waits_for, item.ticket};
        if (item.what == work_item::kind::copy) {
          running_copy_ = copy_span::of(item, finished_.load(std::memory_order_relaxed) + 1);
        }
        lock.unlock();
        execute(item);
        // Time spent in anything but a modelled copy (a "kernel", a wait, a device-to-device
        // copy) is no credit for the next copy.
        if (links_->modelled() && !(item.what == work_item::kind::copy && links_->of(item.transfer))) {
          ready_at_ = clock_type::now();
        }
        // `item` dies here, before the work counts as finished: whoever synchronizes may then
        // destroy what a host function captured.
      }
      lock.lock();
      blocked_on_ = {};
      running_copy_ = {};
      finished_.store(finished_.load(std::memory_order_relaxed) + 1, std::memory_order_release);
      done_cv_.notify_all();
    }
  }

  void execute(work_item& item) {
    switch (item.what) {
      case work_item::kind::copy:
        copy(item);
        break;
      case work_item::kind::host_function:
        try {
          item.fn();
        } catch (const std::exception& e) {
          set_error(std::string("a host function on ") + label_ + " threw: " + e.what());
        } catch (...) {
          set_error("a host function on " + label_ + " threw a non-standard exception");
        }
        break;
      case work_item::kind::wait:
        // Never refused: waits alone cannot form a cycle (each refers to work queued before it),
        // and a host function that closes one is refused at its own synchronize instead.
        item.waits_for->block_until(item.ticket);
        break;
    }
  }

  void copy(const work_item& item) {
    sim_copy_link* link = links_->of(item.transfer);
    if (link == nullptr) {
      std::memcpy(item.dst, item.src, item.bytes);
      return;
    }
    // The copy is ready when it was queued or when this stream's previous item ended, whichever
    // is later -- not when this thread got round to it; the shared link may start it later still.
    const sim_copy_link::booking slot = link->book(std::max(ready_at_, item.queued_at), item.bytes);
    const clock_type::time_point copy_began = clock_type::now();
    std::memcpy(item.dst, item.src, item.bytes);
    const clock_type::duration took = clock_type::now() - copy_began;
    // The stream is held for the modelled time, or for as long as the memcpy really took (the
    // host's speed, which holds this stream but not the link). The end is reckoned from the
    // booking's start, not from now, so a late wakeup of this thread (a timer's oversleep on the
    // previous copy) is made up here.
    ready_at_ = sim_copy_link::saturating_add(slot.start, std::max(slot.length, took));
    // The bytes have moved; what is left is modelled time. A destroyed stream's copies sit it out
    // too (their completion must not be seen early); only the device's end cuts it short.
    std::unique_lock<std::mutex> lock(m_);
    work_cv_.wait_until(lock, ready_at_, [&] { return cut_short_; });
  }

  // A host function that synchronizes its own stream (synchronize, synchronize_device, or
  // synchronize(event) of work queued behind it) would wait for itself forever: a hang with no
  // message. Refused instead; the host function's error then says why.
  // REQUIRES: m_ held.
  void refuse_waiting_for_itself(std::uint64_t ticket) const {
    if (worker_id_ != std::this_thread::get_id() || reached(ticket)) return;
    throw logic_error("terrace: device 'sim': a host function on " + label_ +
                      " waits for work queued behind it on its own stream (synchronize, "
                      "synchronize_device or synchronize of an event recorded after it): it would "
                      "wait for itself forever");
  }

  // Blocks until reached(ticket), with no checks: a queued wait.
  void block_until(std::uint64_t ticket) {
    if (reached(ticket)) return;
    std::unique_lock<std::mutex> lock(m_);
    done_cv_.wait(lock, [&] { return reached(ticket); });
  }

  // ------------------------------------------------------------ waits through other streams
  // A host function on stream X that synchronizes stream Y (or an event on it, or the device)
  // while Y's work up to the awaited ticket waits -- through events, maybe via further streams --
  // for work queued on X behind that host function, waits for itself: X's worker is the caller,
  // so X cannot move on. CUDA rules this out by forbidding API calls in host functions; sim
  // refuses it with a message instead of hanging. Each waiting worker publishes what it waits for
  // (blocked_on_) before it looks for a cycle, so of two workers closing one the later sees it.

  // While a host function on another stream waits for this one: what that stream waits for.
  class blocked_worker {
   public:
    blocked_worker(sim_stream& target, std::uint64_t ticket) : caller_(tls_worker_of) {
      if (caller_ == nullptr || caller_ == &target) return;  // the host; or refused already
      {
        std::lock_guard<std::mutex> lock(caller_->m_);
        caller_->blocked_on_ = {target.shared_from_this(), ticket};
      }
      if (target.waits_for_worker_of(*caller_, ticket)) {
        const std::string caller = caller_->label_;
        clear();
        throw logic_error("terrace: device 'sim': a host function on " + caller + " synchronizes " +
                          target.label_ + ", whose work waits (through events) for work queued "
                          "behind that host function on its own stream: it would wait for itself "
                          "forever");
      }
    }
    ~blocked_worker() { clear(); }
    blocked_worker(const blocked_worker&) = delete;
    blocked_worker& operator=(const blocked_worker&) = delete;

   private:
    void clear() noexcept {
      if (caller_ == nullptr) return;
      std::lock_guard<std::mutex> lock(caller_->m_);
      caller_->blocked_on_ = {};
      caller_ = nullptr;
    }
    sim_stream* caller_;
  };

  // Whether reaching `ticket` here needs `caller`, whose worker is blocked in a host function,
  // to finish more than it has. Locks one stream at a time.
  bool waits_for_worker_of(const sim_stream& caller, std::uint64_t ticket) {
    const std::uint64_t caller_done = caller.finished_.load(std::memory_order_acquire);
    std::vector<std::pair<std::shared_ptr<sim_stream>, std::uint64_t>> todo{{shared_from_this(), ticket}};
    std::unordered_map<const sim_stream*, std::uint64_t> explored;  // up to which ticket
    while (!todo.empty()) {
      auto [s, t] = std::move(todo.back());
      todo.pop_back();
      if (s.get() == &caller) {
        if (t > caller_done) return true;
        continue;
      }
      auto [it, fresh] = explored.try_emplace(s.get(), t);
      if (!fresh) {
        if (it->second >= t) continue;
        it->second = t;
      }
      // Under the lock, so that blocked_on_ belongs to the item after the finished ones (<= t).
      std::lock_guard<std::mutex> lock(s->m_);
      if (s->reached(t)) continue;
      if (s->blocked_on_.first) todo.push_back(s->blocked_on_);
      std::uint64_t item_ticket = s->pushed_ - s->queue_.size();
      for (const work_item& item : s->queue_) {
        if (++item_ticket > t) break;
        if (item.what == work_item::kind::wait) todo.emplace_back(item.waits_for, item.ticket);
      }
    }
    return false;
  }

  void set_error(std::string message) {
    std::lock_guard<std::mutex> lock(m_);
    if (error_.empty()) error_ = std::move(message);
  }

  const std::string label_;
  const std::shared_ptr<sim_copy_links> links_;  // the device's, shared by all its streams

  std::mutex m_;
  struct condition_variables {
    std::condition_variable work;  // the worker waits for items
    std::condition_variable done;  // drain() and wait_until() wait for the worker
  };
  // On the heap so that a forked child can leak them (~sim_stream).
  std::unique_ptr<condition_variables> wakeups_ = std::make_unique<condition_variables>();
  std::condition_variable& work_cv_ = wakeups_->work;
  std::condition_variable& done_cv_ = wakeups_->done;
  std::deque<work_item> queue_;
  std::uint64_t pushed_ = 0;
  std::atomic<std::uint64_t> finished_{0};  // written by the worker under m_; read without it
  bool stopping_ = false;
  bool cut_short_ = false;  // abandon(): copies skip what is left of their modelled time
  std::string error_;
  std::thread::id worker_id_;  // set by the worker before its first item
  // The memory a copy touches, both sides whatever its kind: sim device memory is host memory,
  // and a freed host buffer is as bad as a freed segment.
  struct copy_span {
    std::uint64_t ticket = 0;  // 0: no copy
    std::uintptr_t dst = 0;
    std::uintptr_t src = 0;
    std::size_t bytes = 0;

    static copy_span of(const work_item& item, std::uint64_t ticket) noexcept {
      return {ticket, reinterpret_cast<std::uintptr_t>(item.dst),
              reinterpret_cast<std::uintptr_t>(item.src), item.bytes};
    }
    bool touches(std::uintptr_t begin, std::uintptr_t end) const noexcept {
      const auto overlaps = [&](std::uintptr_t p) { return p < end && begin < p + bytes; };
      return bytes > 0 && (overlaps(dst) || overlaps(src));
    }
  };
  copy_span running_copy_;  // the copy the worker runs now (ticket 0 if none); under m_

  // What the worker waits for now (a queued wait, or a host function's synchronize); null if none.
  std::pair<std::shared_ptr<sim_stream>, std::uint64_t> blocked_on_;

  // The worker's own: when, in modelled time, the previous item ended.
  clock_type::time_point ready_at_{};

  std::thread worker_;  // started at the end of the constructor
};

// ---------------------------------------------------------------- events

// The latest record(): which stream, and how many of its items had been queued then.
struct sim_event {
  std::mutex m;
  std::shared_ptr<sim_stream> stream;  // null until the first record(): complete
  std::uint64_t ticket = 0;

  std::pair<std::shared_ptr<sim_stream>, std::uint64_t> latest() {
    std::lock_guard<std::mutex> lock(m);
    return {stream, ticket};
  }
};

// ---------------------------------------------------------------- the device

class sim_device final : public device_backend {
 public:
  explicit sim_device(const device_options& options)
      : links_(std::make_shared<sim_copy_links>(options.copy_bandwidth)),
        vmm_("sim", options.map_granularity ? options.map_granularity : kDefaultGranularity),
        meter_("sim", options.capacity ? options.capacity : kDefaultCapacity) {
    properties_.name = "sim";
    properties_.capacity = meter_.capacity();
    properties_.alignment = kAlignment;
    properties_.touches_memory = true;
    properties_.supports_vmm = true;
    properties_.map_granularity = vmm_.granularity();
    properties_.device_index = options.device_index;
  }

  ~sim_device() override {
    // Queued work may still touch the memory: stop every worker before anything is freed.
    std::vector<std::shared_ptr<sim_stream>> streams;
    {
      std::lock_guard<std::mutex> lock(handles_mutex_);
      if (default_stream_) streams.push_back(std::move(default_stream_));
      for (auto& [key, s] : streams_) streams.push_back(std::move(s));
      streams_.clear();
      events_.clear();
    }
    // Every stream is told first, then joined: a stream draining a wait on another stream's copy
    // would otherwise sit out that copy's modelled time, up to a century, before the other stream
    // heard it should stop.
    for (auto& s : streams) s->abandon();
    for (auto& s : streams) s->stop_and_join();
    // What the owner leaked goes back to the host.
    for (const auto& [p, bytes] : segments_) free_segment(reinterpret_cast<void*>(p), bytes);
    for (const auto& [base, bytes] : vmm_.ranges()) ::munmap(reinterpret_cast<void*>(base), bytes);
  }

  void enqueue_host_function(stream_ref s, std::function<void()> fn) {
    TERRACE_EXPECTS(static_cast<bool>(fn), "enqueue_host_function with an empty function");
    work_item item;
    item.what = work_item::kind::host_function;
    item.fn = std::move(fn);
    stream_of(s)->push(std::move(item));
  }

 private:
  // -------------------------------------------------------------- segments

  void* do_reserve(std::size_t bytes) override {
    std::lock_guard<std::mutex> lock(memory_mutex_);
    meter_.charge(bytes, "reserve");
    void* p = nullptr;
    int err = ENOMEM;
    if (bytes >= kMmapThreshold) {
      p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                 -1, 0);
      if (p == MAP_FAILED) {
        err = errno;
        p = nullptr;
      }
    } else {
      p = ::operator new(bytes, std::align_val_t{kAlignment}, std::nothrow);
    }
    if (p == nullptr) {
      meter_.uncharge(bytes);
      throw out_of_memory("terrace: out of memory on device 'sim': the host refused " +
                          describe_bytes(bytes) + " (" + errno_text(err) + ")");
    }
    try {
      segments_.emplace(reinterpret_cast<std::uintptr_t>(p), bytes);
    } catch (...) {  // bad_alloc of the book's node: the segment and its charge go back
      free_segment(p, bytes);
      meter_.uncharge(bytes);
      throw;
    }
    return p;
  }

  // release() stands for cudaFree, which synchronises: copies still queued that touch the
  // segment are waited for, so the worker never reads or writes freed memory. Only those: cudaFree
  // waits for the whole device, but what keeps the memory safe is these copies, and a policy that
  // counts on a release to order unrelated work has a bug this device should not hide.
  void do_release(void* p, std::size_t bytes) noexcept override {
    const auto a = reinterpret_cast<std::uintptr_t>(p);
    std::unique_lock<std::mutex> lock(memory_mutex_);
    wait_for_copies_touching(lock, a, bytes, "release");
    const auto it = segments_.find(a);
    if (it == segments_.end()) {
      contract_violation("sim", "release(" + hex_address(a) + "): not a segment from reserve()");
    }
    if (it->second != bytes) {
      contract_violation("sim", "release(" + hex_address(it->first) + ", " + std::to_string(bytes) +
                                    "): the segment was reserved with " +
                                    std::to_string(it->second) + " bytes");
    }
    segments_.erase(it);
    free_segment(p, bytes);
    meter_.uncharge(bytes);
  }

  // release_pinned_host() stands for cudaFreeHost, which synchronises as cudaFree does: the
  // region is unmapped only once no queued copy reads or writes it.
  void do_release_pinned_host(void* p, std::size_t bytes) noexcept override {
    {
      std::unique_lock<std::mutex> lock(memory_mutex_);
      wait_for_copies_touching(lock, reinterpret_cast<std::uintptr_t>(p), bytes, "release_pinned_host");
    }
    device_backend::do_release_pinned_host(p, bytes);
  }

  // Waits until no copy queued or running on any stream touches [a, a + bytes), with `lock` (on
  // memory_mutex_) released while it waits; returns with it held, so that no copy_async can
  // queue one before the caller frees the memory.
  void wait_for_copies_touching(std::unique_lock<std::mutex>& lock, std::uintptr_t a,
                                std::size_t bytes, const char* call) noexcept {
    for (;;) {
      const auto [stream, ticket] = queued_copy_touching(a, a + bytes);
      if (!stream) return;
      lock.unlock();
      try {
        stream->wait_until(ticket);
      } catch (const std::exception& e) {
        // A host function freeing memory that a copy queued behind it touches, say.
        contract_violation("sim", std::string(call) + "(" + hex_address(a) + ") must wait for a copy on " +
                                      stream->label() + " that touches the memory, and cannot: " +
                                      e.what());
      }
      lock.lock();
    }
  }

  static void free_segment(void* p, std::size_t bytes) noexcept {
    if (bytes >= kMmapThreshold) {
      ::munmap(p, bytes);
    } else {
      ::operator delete(p, std::align_val_t{kAlignment});
    }
  }

  // -------------------------------------------------------------- virtual memory

  void* do_reserve_address_range(std::size_t bytes) override {
    vmm_.check_range_size(bytes);
    const std::size_t g = vmm_.granularity();
    if (bytes > SIZE_MAX - g) {
      // As large as the address space: exhausted, as for any size mmap refuses with ENOMEM below
      // (a device_error would tell the allocator that the device broke, not that it missed).
      throw out_of_memory("terrace: device 'sim': reserving an address range of " +
                          describe_bytes(bytes) + " failed: address space exhausted");
    }
    // Over-reserve by one granule and trim, so that the range starts on a granule boundary (as
    // cuMemAddressReserve's does).
    void* raw = ::mmap(nullptr, bytes + g, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                       -1, 0);
    if (raw == MAP_FAILED) {
      const int e = errno;
      const std::string what = "terrace: device 'sim': reserving an address range of " +
                               describe_bytes(bytes) + " failed (" + errno_text(e) + ")";
      if (e == ENOMEM) throw out_of_memory(what + ": address space exhausted");
      throw device_error(what);
    }
    const auto raw_base = reinterpret_cast<std::uintptr_t>(raw);
    const std::uintptr_t base = (raw_base + g - 1) / g * g;
    if (base > raw_base) ::munmap(raw, base - raw_base);
    const std::uintptr_t tail = raw_base + bytes + g - (base + bytes);
    if (tail > 0) ::munmap(reinterpret_cast<void*>(base + bytes), tail);
    std::lock_guard<std::mutex> lock(memory_mutex_);
    vmm_.add_range(base, bytes);
    return reinterpret_cast<void*>(base);
  }

  void do_release_address_range(void* p, std::size_t bytes) noexcept override {
    std::lock_guard<std::mutex> lock(memory_mutex_);
    const auto base = reinterpret_cast<std::uintptr_t>(p);
    if (std::string why = vmm_.why_not_releasable(base, bytes); !why.empty()) {
      contract_violation("sim", why);
    }
    vmm_.erase_range(base);
    ::munmap(p, bytes);
  }

  void do_map(void* p, std::size_t bytes) override {
    std::lock_guard<std::mutex> lock(memory_mutex_);
    const auto a = reinterpret_cast<std::uintptr_t>(p);
    vmm_.check_map(a, bytes);
    meter_.charge(bytes, "map");
    // The pages are fresh: never touched, or dropped by the MADV_DONTNEED of an earlier unmap.
    if (::mprotect(p, bytes, PROT_READ | PROT_WRITE) != 0) {
      const int err = errno;
      meter_.uncharge(bytes);
      throw device_error("terrace: device 'sim': map(" + hex_address(a) + ", " +
                         describe_bytes(bytes) + ") failed: mprotect: " + errno_text(err));
    }
    try {
      vmm_.mark_mapped(a, bytes);  // a new entry in the books: the host may have no memory
    } catch (...) {
      ::mprotect(p, bytes, PROT_NONE);
      meter_.uncharge(bytes);
      throw;
    }
  }

  void do_unmap(void* p, std::size_t bytes) noexcept override {
    std::lock_guard<std::mutex> lock(memory_mutex_);
    const auto a = reinterpret_cast<std::uintptr_t>(p);
    if (std::string why = vmm_.why_not_unmappable(a, bytes); !why.empty()) {
      contract_violation("sim", why);
    }
    // unmap() stands for cuMemUnmap, which, unlike cudaFree, does not wait for queued work: on a
    // GPU the copy would fault or corrupt whatever is mapped there next. A policy bug, reported.
    if (const auto [stream, ticket] = queued_copy_touching(a, a + bytes); stream) {
      contract_violation("sim", "unmap(" + hex_address(a) + ", " + describe_bytes(bytes) +
                                    "): a copy queued on " + stream->label() +
                                    " still touches these pages (cuMemUnmap does not wait for "
                                    "queued work: synchronize first)");
    }
    vmm_.mark_unmapped(a, bytes);  // allocates nothing: map() made its nodes ready
    // Then drop the contents: the physical pages go back to the host and the next map of these
    // addresses reads zeros, as fresh physical memory would.
    ::madvise(p, bytes, MADV_DONTNEED);
    ::mprotect(p, bytes, PROT_NONE);
    meter_.uncharge(bytes);
  }

  std::size_t do_used_bytes() const noexcept override { return meter_.used(); }

  // -------------------------------------------------------------- handles

  std::shared_ptr<sim_stream> stream_of(stream_ref s) {
    std::lock_guard<std::mutex> lock(handles_mutex_);
    if (s.native == nullptr) {
      if (!default_stream_) default_stream_ = new_stream("the default stream");
      return default_stream_;
    }
    const auto it = streams_.find(s.native);
    if (it == streams_.end()) {
      throw logic_error("terrace: device 'sim': unknown stream " +
                        hex_address(reinterpret_cast<std::uintptr_t>(s.native)) +
                        " (not created by this device, or destroyed)");
    }
    return it->second;
  }

  std::shared_ptr<sim_event> event_of(event_ref e) {
    std::lock_guard<std::mutex> lock(handles_mutex_);
    const auto it = events_.find(e.native);
    if (it == events_.end()) {
      throw logic_error("terrace: device 'sim': unknown event " +
                        hex_address(reinterpret_cast<std::uintptr_t>(e.native)) +
                        " (not created by this device, or destroyed)");
    }
    return it->second;
  }

  std::shared_ptr<sim_stream> new_stream(std::string label) {
    try {
      return std::make_shared<sim_stream>(links_, std::move(label));
    } catch (const std::system_error& e) {
      throw device_error(std::string("terrace: device 'sim': cannot start a stream worker: ") +
                         e.what());
    }
  }

  // -------------------------------------------------------------- streams

  stream_ref do_create_stream() override {
    auto s = new_stream("stream " + std::to_string(++streams_created_));
    void* key = s.get();
    std::lock_guard<std::mutex> lock(handles_mutex_);
    // Room for every stream to be draining at once: destroy_stream, noexcept, must not allocate.
    draining_.reserve(streams_.size() + draining_.size() + 1);
    streams_.emplace(key, std::move(s));
    return stream_ref{key};
  }

  void do_destroy_stream(stream_ref s) noexcept override {
    std::shared_ptr<sim_stream> stream;
    {
      std::lock_guard<std::mutex> lock(handles_mutex_);
      const auto it = s.native ? streams_.find(s.native) : streams_.end();
      if (it == streams_.end()) {
        contract_violation("sim", s.native ? "destroy_stream of an unknown stream " +
                                                 hex_address(reinterpret_cast<std::uintptr_t>(s.native))
                                           : std::string("destroy_stream of the default stream"));
      }
      if (it->second->on_worker()) {
        // join() would throw std::system_error out of this noexcept call: say what happened.
        contract_violation("sim", "destroy_stream from a host function on that stream (it would "
                                  "wait for itself)");
      }
      stream = std::move(it->second);
      streams_.erase(it);
      // Unknown to every call from now on, but synchronize_device() still waits for its work.
      // The room was made when it was created.
      draining_.push_back(stream);
    }
    try {
      stream->stop_and_join_checked();  // drains: queued work still runs
    } catch (const std::exception& e) {
      contract_violation("sim", std::string("destroy_stream from a host function that would wait "
                                            "for itself: ") + e.what());
    }
    // An error no synchronize() took would die with the stream: the device keeps it for the next
    // synchronize_device(), as the contract promises (a failed checking "kernel" must not pass).
    // Taken with the stream's leaving draining_, so that synchronize_device() sees it either way.
    std::lock_guard<std::mutex> lock(handles_mutex_);
    draining_.erase(std::find(draining_.begin(), draining_.end(), stream));
    try {
      if (std::string error = stream->take_error(); !error.empty()) {
        orphaned_errors_ += (orphaned_errors_.empty() ? "" : "; ") + error;
      }
    } catch (...) {
      // Out of memory for the message: destroy_stream may not throw, and the stream is gone.
    }
  }

  void do_synchronize_stream(stream_ref s) override {
    const auto stream = stream_of(s);
    if (std::string error = stream->drain(); !error.empty()) {
      throw device_error("terrace: device 'sim': " + error);
    }
  }

  void do_synchronize_device() override {
    std::vector<std::shared_ptr<sim_stream>> streams;
    std::string errors;  // those of destroyed streams first: they were raised earlier
    {
      std::lock_guard<std::mutex> lock(handles_mutex_);
      if (default_stream_) streams.push_back(default_stream_);
      for (const auto& [key, s] : streams_) streams.push_back(s);
      streams.insert(streams.end(), draining_.begin(), draining_.end());
      errors = std::exchange(orphaned_errors_, std::string{});
    }
    // drain() hands each stream's error over once: every one goes into the exception (keeping
    // only the first lost the others for good, and their streams then synchronised clean).
    for (const auto& s : streams) {
      std::string error = s->drain();
      if (error.empty()) continue;
      errors += (errors.empty() ? "" : "; ") + error;
    }
    if (!errors.empty()) throw device_error("terrace: device 'sim': " + errors);
  }

  // -------------------------------------------------------------- events

  event_ref do_create_event() override {
    auto e = std::make_shared<sim_event>();
    void* key = e.get();
    std::lock_guard<std::mutex> lock(handles_mutex_);
    events_.emplace(key, std::move(e));
    return event_ref{key};
  }

  void do_destroy_event(event_ref e) noexcept override {
    std::lock_guard<std::mutex> lock(handles_mutex_);
    // Queued waits hold the stream and ticket, not the event: destroying early is allowed, as in
    // CUDA.
    if (events_.erase(e.native) == 0) {
      contract_violation("sim", "destroy_event of an unknown event " +
                                    hex_address(reinterpret_cast<std::uintptr_t>(e.native)));
    }
  }

  void do_record(event_ref e, stream_ref s) override {
    const auto event = event_of(e);
    auto stream = stream_of(s);
    const std::uint64_t ticket = stream->ticket();
    std::lock_guard<std::mutex> lock(event->m);
    event->stream = std::move(stream);
    event->ticket = ticket;
  }

  bool do_query(event_ref e) override {
    const auto event = event_of(e);
    std::lock_guard<std::mutex> lock(event->m);
    return !event->stream || event->stream->reached(event->ticket);
  }

  void do_wait(stream_ref s, event_ref e) override {
    auto [target, ticket] = event_of(e)->latest();
    const auto stream = stream_of(s);
    if (!target || target->reached(ticket)) return;  // nothing left to wait for
    work_item item;
    item.what = work_item::kind::wait;
    item.waits_for = std::move(target);  // keeps a destroyed stream's counters readable
    item.ticket = ticket;
    stream->push(std::move(item));
  }

  void do_synchronize_event(event_ref e) override {
    const auto [target, ticket] = event_of(e)->latest();
    if (target) target->wait_until(ticket);
  }

  // -------------------------------------------------------------- copies

  void do_copy_async(void* dst, const void* src, std::size_t bytes, copy_kind kind,
                     stream_ref s) override {
    TERRACE_EXPECTS(dst != nullptr && src != nullptr, "copy_async with a null pointer on device 'sim'");
    const auto stream = stream_of(s);
    // Checked and queued under one lock: a release or unmap either finds the copy queued or has
    // already taken the memory, which the check then refuses.
    std::lock_guard<std::mutex> lock(memory_mutex_);
    check_copy(dst, src, bytes, kind);
    work_item item;
    item.what = work_item::kind::copy;
    item.dst = dst;
    item.src = src;
    item.bytes = bytes;
    item.transfer = kind;
    stream->push(std::move(item));
  }

  // The newest copy, queued or running on any stream (destroyed ones still draining included),
  // that touches [begin, end); {null, 0} if none. Allocates nothing (unmap is noexcept).
  // REQUIRES: memory_mutex_ held, so that no copy_async queues one meanwhile.
  std::pair<std::shared_ptr<sim_stream>, std::uint64_t> queued_copy_touching(std::uintptr_t begin,
                                                                             std::uintptr_t end) {
    std::lock_guard<std::mutex> lock(handles_mutex_);
    const auto in = [&](const std::shared_ptr<sim_stream>& s) -> std::uint64_t {
      return s ? s->newest_copy_touching(begin, end) : 0;
    };
    if (const std::uint64_t t = in(default_stream_)) return {default_stream_, t};
    for (const auto& [key, s] : streams_) {
      if (const std::uint64_t t = in(s)) return {s, t};
    }
    for (const auto& s : draining_) {
      if (const std::uint64_t t = in(s)) return {s, t};
    }
    return {};
  }

  /// The strict device refuses at the call what a GPU would turn into corruption or a fault
  /// later, on a worker thread: device bytes outside every live segment and mapped page (past a
  /// segment's end, a released segment), and overlapping ranges (memcpy's, and CUDA's, undefined
  /// case). Host pointers are the caller's to vouch for.
  /// REQUIRES: memory_mutex_ held.
  void check_copy(const void* dst, const void* src, std::size_t bytes, copy_kind kind) const {
    const auto d = reinterpret_cast<std::uintptr_t>(dst);
    const auto s = reinterpret_cast<std::uintptr_t>(src);
    if (bytes == 0) return;
    if (d < s + bytes && s < d + bytes) {
      throw logic_error("terrace: copy_async on device 'sim': the source [" + hex_address(s) + ", +" +
                        std::to_string(bytes) + ") and the destination [" + hex_address(d) +
                        ", +" + std::to_string(bytes) + ") overlap");
    }
    const bool dst_on_device = kind == copy_kind::host_to_device || kind == copy_kind::device_to_device;
    const bool src_on_device = kind == copy_kind::device_to_host || kind == copy_kind::device_to_device;
    if (dst_on_device) check_device_bytes("destination", d, bytes);
    if (src_on_device) check_device_bytes("source", s, bytes);
  }

  /// REQUIRES: memory_mutex_ held.
  void check_device_bytes(const char* which, std::uintptr_t p, std::size_t bytes) const {
    if (p + bytes < p) {
      throw logic_error("terrace: copy_async on device 'sim': the " + std::string(which) +
                        " range wraps the address space");
    }
    auto seg = segments_.upper_bound(p);
    if (seg != segments_.begin() && std::prev(seg)->first + std::prev(seg)->second >= p + bytes) return;
    if (vmm_.is_mapped(p, bytes)) return;
    throw logic_error("terrace: copy_async on device 'sim': the " + std::string(which) + " [" +
                      hex_address(p) + ", +" + std::to_string(bytes) +
                      ") is not inside one live segment or mapped pages (past a segment's end, or "
                      "released memory)");
  }

  const std::shared_ptr<sim_copy_links> links_;  // one per direction, shared by every stream

  // Guards segments_, vmm_ and meter_'s counts. Lock order: memory_mutex_, then handles_mutex_,
  // then a stream's own.
  mutable std::mutex memory_mutex_;
  std::map<std::uintptr_t, std::size_t> segments_;  // ordered: a copy's bounds check finds its segment
  vmm_book vmm_;
  capacity_meter meter_;  // charged and uncharged under memory_mutex_

  std::mutex handles_mutex_;  // guards the five below
  std::shared_ptr<sim_stream> default_stream_;
  std::unordered_map<void*, std::shared_ptr<sim_stream>> streams_;
  std::vector<std::shared_ptr<sim_stream>> draining_;  // in destroy_stream, not yet joined
  std::unordered_map<void*, std::shared_ptr<sim_event>> events_;
  std::string orphaned_errors_;  // raised on streams destroyed before a synchronize() took them
  std::atomic<std::uint64_t> streams_created_{0};  // names streams in error messages
};

std::size_t page_size() noexcept {
  const long n = ::sysconf(_SC_PAGESIZE);
  return n > 0 ? static_cast<std::size_t>(n) : 4096;
}

}  // namespace

std::unique_ptr<device_backend> make_sim_device(const device_options& options) {
  const std::size_t g = options.map_granularity;
  const std::size_t page = page_size();
  TERRACE_EXPECTS(g == 0 || (g >= page && (g & (g - 1)) == 0),
                  "device 'sim': map_granularity " + std::to_string(g) +
                      " must be a power of two and at least the host page size (" +
                      std::to_string(page) + ")");
  TERRACE_EXPECTS(std::isfinite(options.copy_bandwidth) && options.copy_bandwidth >= 0.0,
                  "device 'sim': copy_bandwidth must be a finite number of bytes per second >= 0 "
                  "(0 = unlimited)");
  return std::make_unique<sim_device>(options);
}

}  // namespace detail

// ---------------------------------------------------------------- the public sim-only calls

bool is_sim_device(const device_backend& device) noexcept {
  return dynamic_cast<const detail::sim_device*>(&device) != nullptr;
}

void enqueue_host_function(device_backend& device, stream_ref s, std::function<void()> fn) {
  auto* sim = dynamic_cast<detail::sim_device*>(&device);
  if (sim == nullptr) {
    throw logic_error("terrace: enqueue_host_function needs a sim device, not '" +
                      device.properties().name + "'");
  }
  sim->enqueue_host_function(s, std::move(fn));
}

}  // namespace terrace

// SPDX-License-Identifier: Apache-2.0
// The io_uring engine: the only file in terrace that calls io_uring_*. See io_engine.hpp for the
// contract. One thread owns the ring. Submitters append to an inbox and poke an eventfd whose read
// is always pending in the ring, so the engine thread sleeps in exactly one place
// (io_uring_wait_cqe) and wakes for either a completion or new work (or, while a refused piece
// waits out its pause, that pause's end). A second thread runs the
// per-block hooks (the tensor store's CRC32C): the ring thread never computes over data, so a
// completion is answered by a refill at once rather than after a checksum of 1 MiB (measured
// 2026-11-23: CRCs were 60% of the ring thread's CPU time on 256 MiB transfers).
#include <liburing.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <limits>
#include <list>
#include <system_error>
#include <thread>

#include "terrace/error.hpp"
#include "tiers/fork_guard.hpp"
#include "tiers/io_engine.hpp"

namespace terrace::detail {
namespace {

// A piece the kernel refuses (EAGAIN: out of request slots or memory for the moment) is tried
// again after a pause that doubles from 50 us to 50 ms, so that a refusal lasting a while neither
// spins the engine thread nor fails the transfer at once; after engine_options::max_refusals in a
// row it fails with that error. A short transfer made progress: its rest goes out at once.
constexpr std::chrono::microseconds kFirstBackoff{50};
constexpr std::chrono::microseconds kMaxBackoff{50'000};
constexpr int kMaxShortTransfers = 10000;  // resubmissions of a piece's rest, each with progress
constexpr int kMaxInterruptions = 10000;   // EINTRs of one piece in a row, each resubmitted at once
constexpr std::uint64_t kWakeTag = 0;
// What apply_fault returns for a completion the lost_completion fault drops.
constexpr int kLostCompletion = std::numeric_limits<int>::min();

std::size_t round_up(std::size_t n, std::size_t a) { return (n + a - 1) / a * a; }

std::string errno_text(int e) { return std::string(std::strerror(e)) + " (errno " + std::to_string(e) + ")"; }

// A forked child (fork_guard.hpp) lets go of the ring: it unmaps it and closes its descriptor and
// the eventfd, and submit() refuses from then on. An engine must not be destroyed in such a child
// (its threads cannot be joined there); the tensor store never does.
class uring_engine final : public io_engine, private fork_guard {
 public:
  uring_engine(const engine_options& options, std::vector<engine_file> files)
      : opt_(options), files_(std::move(files)) {
    fork_guard::install();
    TERRACE_EXPECTS(!files_.empty(), "the engine needs at least one file");
    TERRACE_EXPECTS(opt_.block_size >= kDirectAlign && opt_.block_size % kDirectAlign == 0 &&
                        opt_.block_size <= kMaxBlockSize,
                    "block_size must be a positive multiple of 4 KiB, at most 256 MiB");
    TERRACE_EXPECTS(opt_.queue_depth >= 1 && opt_.queue_depth <= 4096, "queue_depth must be 1..4096");
    TERRACE_EXPECTS(opt_.max_refusals >= 0, "max_refusals must be >= 0");
    for (const auto& f : files_) any_direct_ = any_direct_ || f.direct;

    io_uring_params params{};
    if (opt_.sqpoll) {
      params.flags |= IORING_SETUP_SQPOLL;
      params.sq_thread_idle = 100;  // ms before the kernel thread sleeps
    }
    // A block may straddle a stripe boundary (two pieces), plus the wake read: headroom of 4.
    unsigned entries = 1;
    while (entries < opt_.queue_depth + 4) entries <<= 1;
    if (int rc = io_uring_queue_init_params(entries, &ring_, &params); rc < 0) {
      throw io_error(std::string("terrace: io_uring setup failed") + (opt_.sqpoll ? " (SQPOLL)" : "") +
                         ": " + errno_text(-rc),
                     -rc);
    }
    // Before Linux 5.11 an SQPOLL ring takes only registered files: the wake read on the eventfd
    // would fail with EBADF at once, again and again, and the ring thread would spin for good.
    if (opt_.sqpoll && (params.features & IORING_FEAT_SQPOLL_NONFIXED) == 0) {
      io_uring_queue_exit(&ring_);
      throw io_error("terrace: SQPOLL needs Linux 5.11 or newer (IORING_FEAT_SQPOLL_NONFIXED); "
                     "open the store without sqpoll",
                     EOPNOTSUPP);
    }

    overflow_seen_ = io_uring_smp_load_acquire(ring_.cq.koverflow);

    // Registered files save a file-table lookup and reference count per I/O.
    std::vector<int> fds;
    for (const auto& f : files_) fds.push_back(f.fd);
    fixed_files_ = io_uring_register_files(&ring_, fds.data(), static_cast<unsigned>(fds.size())) == 0;

    // Bounce buffers, only for blocks whose memory or length breaks O_DIRECT's alignment. They are
    // registered (the kernel pins them once rather than on every transfer). 64 MiB at most, or
    // two blocks when a block is larger than 32 MiB (two keep the queue moving).
    if (any_direct_) {
      // As many as the queue holds (at least 2 when it holds more), within the cap.
      std::size_t slots = std::max<std::size_t>((std::size_t{64} << 20) / opt_.block_size, 2);
      slots = std::min<std::size_t>(slots, opt_.queue_depth);
      bounce_ = static_cast<std::byte*>(std::aligned_alloc(kDirectAlign, slots * opt_.block_size));
      if (!bounce_) {
        io_uring_queue_exit(&ring_);
        throw io_error("terrace: cannot allocate the engine's bounce buffers", ENOMEM);
      }
      std::vector<iovec> iov(slots);
      for (std::size_t i = 0; i < slots; ++i) {
        iov[i] = {bounce_ + i * opt_.block_size, opt_.block_size};
        free_slots_.push_back(static_cast<int>(i));
      }
      fixed_buffers_ = io_uring_register_buffers(&ring_, iov.data(), static_cast<unsigned>(slots)) == 0;
    }

    wake_fd_ = eventfd(0, EFD_CLOEXEC);
    if (wake_fd_ < 0) {
      const int e = errno;
      io_uring_queue_exit(&ring_);
      std::free(bounce_);
      throw io_error("terrace: eventfd failed: " + errno_text(e), e);
    }
    // Either thread may fail to start (EAGAIN at the process's or cgroup's thread limit). The
    // destructor does not run for a constructor that throws: what was made goes back here, the
    // registered files first (as in the destructor), or the leaked ring would hold the store's
    // swap files, and with them their locks, for the life of the process.
    try {
      thread_ = std::thread([this] { run(); });
      hook_thread_ = std::thread([this] { run_hooks(); });
    } catch (const std::system_error& e) {
      if (thread_.joinable()) stop_engine_thread();
      if (fixed_files_) (void)io_uring_unregister_files(&ring_);
      io_uring_queue_exit(&ring_);
      ::close(wake_fd_);
      std::free(bounce_);
      const int code = e.code().value();
      throw io_error("terrace: cannot start the io_uring engine's threads: " + errno_text(code), code);
    }
    register_for_fork();
  }

  ~uring_engine() override {
    unregister_for_fork();
    stop_engine_thread();  // every transfer has drained; hooks may still be queued
    {
      std::lock_guard lock(hook_mutex_);
      hook_stop_ = true;
    }
    hook_cv_.notify_all();
    hook_thread_.join();  // runs what is queued first
    // The registered files go back at once (nothing is in flight any more): the ring's own
    // teardown is asynchronous and keeps them, and with them the store's swap-file locks, for a
    // while after this returns, which a reopen in this process would wait out (40 seeds of the
    // store's fuzzer, which reopens often, took 18 s instead of 2). A killed process runs no
    // destructor: its ring keeps the files until its writes are done, which is the point.
    if (fixed_files_) (void)io_uring_unregister_files(&ring_);
    io_uring_queue_exit(&ring_);
    ::close(wake_fd_);
    std::free(bounce_);
  }

  std::shared_ptr<io_completion> submit(io_request request) override {
    if (forked_away()) {
      throw io_error("terrace: " + request.what + ": the io_uring engine belongs to the parent of this " +
                         "process, which was forked from it without exec; a forked child cannot use it",
                     EBADF);
    }
    const std::uint64_t limit = opt_.file_size * files_.size();
    TERRACE_EXPECTS(request.offset <= limit && request.size <= limit - request.offset,
                    "I/O request past the end of the store's files");
    auto completion = std::make_shared<io_completion>();
    if (request.size == 0) {
      completion->finish(nullptr);
      return completion;
    }
    auto state = std::make_shared<request_state>();
    state->blocks = (request.size + opt_.block_size - 1) / opt_.block_size;
    state->req = std::move(request);
    state->completion = completion;
    {
      std::lock_guard lock(inbox_mutex_);
      inbox_.push_back(std::move(state));
    }
    poke();
    return completion;
  }

  void inject(const io_fault& fault) override {
    std::lock_guard lock(fault_mutex_);
    fault_ = fault;
    fault_armed_.store(fault.what != io_fault::kind::none && fault.count > 0, std::memory_order_release);
  }

  std::string describe() const override {
    std::string s = "io_uring qd=" + std::to_string(opt_.queue_depth) +
                    " block=" + std::to_string(opt_.block_size >> 10) + " KiB files=" +
                    std::to_string(files_.size());
    if (opt_.sqpoll) s += " sqpoll";
    if (fixed_files_) s += " fixed-files";
    if (fixed_buffers_) s += " fixed-bounce-buffers";
    s += any_direct_ ? " O_DIRECT" : " buffered";
    return s;
  }

  // In the child, its only thread: munmap and close only.
  void abandon_after_fork() noexcept override {
    io_uring_queue_exit(&ring_);
    ::close(wake_fd_);
    wake_fd_ = -1;
  }

 private:
  // Shared by the engine thread (its transfers) and the hook thread (its hooks): the completion is
  // finished by whichever drops `pending` to zero, so never before every hook has returned.
  struct request_state {
    io_request req;
    std::shared_ptr<io_completion> completion;
    std::size_t blocks = 0;      // engine thread: blocks to start (cut short by a failure)
    std::size_t next_block = 0;  // engine thread
    std::size_t finished = 0;    // engine thread: blocks whose transfer ended (ok or not)
    bool io_done = false;        // engine thread: nothing in flight or left to start
    std::atomic<bool> failed{false};  // any thread: start nothing more, skip remaining hooks
    std::atomic<std::size_t> pending{1};  // the transfers (one count) + one per queued hook
    std::mutex error_mutex;
    std::exception_ptr error;  // guarded by error_mutex: the first failure
  };
  struct hook_job {
    std::shared_ptr<request_state> r;
    std::size_t offset;  // within the request
    std::size_t size;
  };
  struct block_state {
    std::shared_ptr<request_state> r;
    std::size_t offset = 0;  // within the request
    std::size_t size = 0;    // caller bytes
    int slot = -1;           // bounce slot, or -1 when transferred in place
    int pieces_left = 0;
  };
  struct piece {
    block_state* b = nullptr;
    unsigned file = 0;
    std::uint64_t file_offset = 0;
    std::byte* buf = nullptr;
    std::size_t len = 0;  // still to transfer
    int refusals = 0;       // EAGAIN in a row
    int interruptions = 0;  // EINTR in a row
    int short_transfers = 0;
    piece* ring_prev = nullptr;  // in_ring_'s links, while submitted and not completed
    piece* ring_next = nullptr;
  };

  // The pieces submitted and not yet completed (engine thread only), for failing them when their
  // completions are lost or their submission is withdrawn. Intrusive: the completion path links
  // and unlinks a piece without allocating.
  struct ring_list {
    piece* head = nullptr;
    unsigned size = 0;
    void link(piece* p) noexcept {
      p->ring_prev = nullptr;
      p->ring_next = head;
      if (head != nullptr) head->ring_prev = p;
      head = p;
      ++size;
    }
    void unlink(piece* p) noexcept {
      (p->ring_prev != nullptr ? p->ring_prev->ring_next : head) = p->ring_next;
      if (p->ring_next != nullptr) p->ring_next->ring_prev = p->ring_prev;
      p->ring_prev = p->ring_next = nullptr;
      --size;
    }
  };

  void stop_engine_thread() {
    {
      std::lock_guard lock(inbox_mutex_);
      stop_ = true;
    }
    poke();
    thread_.join();
  }

  void poke() {
    const std::uint64_t one = 1;
    // A full counter (2^64-2 pokes) cannot happen; EINTR is retried.
    while (::write(wake_fd_, &one, sizeof one) < 0 && errno == EINTR) {
    }
  }

  io_uring_sqe* get_sqe() {
    io_uring_sqe* sqe;
    while ((sqe = io_uring_get_sqe(&ring_)) == nullptr) submit_pending();
    return sqe;
  }

  // Submits every prepared SQE. The kernel may take fewer than were queued (memory pressure, or
  // an entry that fails setup ends the batch): what is left would otherwise wait in the ring until
  // the next submission, which may never come if the ring thread then sleeps on a completion.
  // Under SQPOLL the kernel's thread takes them as it runs (the ring's head moves later), so
  // there the published entries are enough.
  //
  // A refusal for the moment (EAGAIN, EBUSY, or ENOMEM: the kernel allocates a context for the
  // ring's first user) is tried again after a pause that grows as a refused piece's does; after
  // max_refusals in a row, or at once for an error that will not pass (EOWNERDEAD: the SQPOLL
  // thread is gone), the entries the kernel has not taken are withdrawn and their requests fail
  // with that error: the training process goes on, the store with it. (Under SQPOLL the kernel's
  // thread may be reading them while it lives, so there only its death lets them be withdrawn.)
  // Abort is kept for the errors that say the ring is not the one set up here (EBADF, EFAULT,
  // EINVAL, EOPNOTSUPP, EBADFD): its descriptor or its memory has been overwritten or closed under
  // the engine, and the kernel could take entries that send transfers to any offset from any
  // buffer; stopping the process is the only way to keep such writes off the swap files.
  void submit_pending() {
    int refusals = 0;
    for (;;) {
      const int rc = io_uring_sq_ready(&ring_) > 0 && submit_fault() ? -ENOMEM : io_uring_submit(&ring_);
      if (rc >= 0) {
        if (opt_.sqpoll || io_uring_sq_ready(&ring_) == 0) return;
        if (rc == 0) std::this_thread::yield();
        continue;
      }
      if (rc == -EINTR) continue;
      const int e = -rc;
      if (e == EBADF || e == EFAULT || e == EINVAL || e == EOPNOTSUPP || e == EBADFD) {
        std::fprintf(stderr, "terrace: io_uring_submit failed fatally (the ring is not the one the engine set up): %s\n",
                     errno_text(e).c_str());
        std::abort();
      }
      const bool for_the_moment = e == EAGAIN || e == EBUSY || e == ENOMEM;
      if (for_the_moment && (opt_.sqpoll || ++refusals <= opt_.max_refusals)) {
        std::this_thread::sleep_for(backoff(std::max(refusals, 1)));
        continue;
      }
      if (opt_.sqpoll && e != EOWNERDEAD && e != ENXIO) {
        std::fprintf(stderr, "terrace: io_uring_submit failed fatally under SQPOLL: %s\n", errno_text(e).c_str());
        std::abort();
      }
      withdraw_unsubmitted(e, refusals);
      return;
    }
  }

  static std::chrono::microseconds backoff(int refusals) {
    return std::min(kMaxBackoff, kFirstBackoff * (1 << std::min(refusals - 1, 10)));
  }

  // Takes back the entries the kernel has not consumed (it reads the submission queue only inside
  // io_uring_enter, on this thread, or on the SQPOLL thread, which is gone when this is called)
  // and fails their requests with `e`: none of their transfers started, so nothing of the
  // kernel's still uses their buffers. The queue's fields are liburing's own (<liburing.h>): it
  // maps slot i to sqes[i & ring_mask] and publishes its tail in ktail.
  void withdraw_unsubmitted(int e, int refusals) {
    io_uring_sq& sq = ring_.sq;
    const unsigned head = io_uring_smp_load_acquire(sq.khead);
    std::vector<piece*> withdrawn;
    for (unsigned i = head; i != sq.sqe_tail; ++i) {
      const std::uint64_t tag = sq.sqes[i & sq.ring_mask].user_data;
      if (tag == kWakeTag) {
        wake_armed_ = false;
      } else {
        withdrawn.push_back(reinterpret_cast<piece*>(static_cast<std::uintptr_t>(tag)));
      }
    }
    sq.sqe_head = sq.sqe_tail = head;
    io_uring_smp_store_release(sq.ktail, head);
    const std::string why = "the kernel refused to take it: " + errno_text(e) +
                            (refusals > opt_.max_refusals ? ", " + std::to_string(refusals) + " times in a row" : "");
    for (piece* p : withdrawn) {
      in_ring_.unlink(p);
      fail_piece(p, why, e);
    }
    // Their places in queue_depth and their bounce slots are free again: requests waiting for
    // them must be started before the ring thread sleeps, or, with the wake read already in the
    // kernel and nothing else in flight, nothing would wake it and their handles would never
    // complete.
    refill_ = true;
  }

  // The wake read is always pending, into wake_buf_, a member: under SQPOLL it belongs to the
  // kernel's thread, which could complete it after the engine is freed. Before the ring thread
  // leaves, the read is completed (a poke of our own) and its completion reaped.
  void land_wake_read() {
    if (!wake_armed_) return;
    poke();
    for (;;) {
      io_uring_cqe* cqe = nullptr;
      const int rc = io_uring_wait_cqe(&ring_, &cqe);
      if (rc == -EINTR || rc == -EAGAIN) continue;
      if (rc < 0) return;  // the ring is gone: nothing of ours is pending
      const bool wake = cqe->user_data == kWakeTag;
      io_uring_cqe_seen(&ring_, cqe);
      if (wake) return;
    }
  }

  void arm_wake() {
    io_uring_sqe* sqe = get_sqe();
    io_uring_prep_read(sqe, wake_fd_, &wake_buf_, sizeof wake_buf_, 0);
    io_uring_sqe_set_data64(sqe, kWakeTag);
    wake_armed_ = true;
  }

  // The kernel drops completions it has no memory to queue, counts them in the completion ring's
  // overflow counter, and the next wait reports EBADR: the transfers they belonged to have
  // finished, but which ones is not known. Failing the requests of all the pieces in flight could
  // let the kernel go on using a buffer or an extent the caller then reuses; so no new piece is
  // started, the wake read is completed (a poke), and as the completions that were not lost come
  // in, the entries still outstanding shrink to the number lost: all of them lost theirs, and
  // their requests fail with EBADR. (IOSQE_IO_DRAIN would be the kernel's own barrier for this;
  // with a first version that used it, requests submitted after the drain now and then never
  // completed on Linux 6.18 (the store's test hung about one run in thirty), which was not
  // understood, so it is not relied on.)
  void find_lost_completions() {
    finding_lost_ = true;
    poke();
    attribute_lost_completions();
  }

  void attribute_lost_completions() {
    const unsigned overflow = io_uring_smp_load_acquire(ring_.cq.koverflow);
    lost_ += overflow - overflow_seen_;
    overflow_seen_ = overflow;
    if (in_ring_.size + (wake_armed_ ? 1 : 0) > lost_) return;  // some are still running
    std::vector<piece*> lost;
    while (in_ring_.head != nullptr) {
      lost.push_back(in_ring_.head);
      in_ring_.unlink(in_ring_.head);
    }
    wake_armed_ = false;  // armed again at the top of the loop
    lost_ = 0;
    finding_lost_ = false;
    for (piece* p : lost) {
      fail_piece(p, "its completion was lost: the kernel had no memory to queue it (EBADR)", EBADR);
    }
  }

  // Fails the request of a piece whose transfer is over or never started, and ends the piece.
  void fail_piece(piece* p, const std::string& why, int e) {
    const engine_file& f = files_[p->file];
    const std::shared_ptr<request_state> r = p->b->r;
    const bool write = r->req.op == io_op::write;
    fail(r.get(), std::make_exception_ptr(io_error("terrace: " + r->req.what + ": " + (write ? "write" : "read") +
                                                       " of " + std::to_string(p->len) + " bytes at offset " +
                                                       std::to_string(p->file_offset) + " of " + f.name +
                                                       " failed: " + why,
                                                   e)));
    end_piece(p);
  }

  void queue_piece(piece* p) {
    if (finding_lost_) {  // held back until the lost completions are found (find_lost_completions)
      backoff_.push_back({std::chrono::steady_clock::now(), p});
      return;
    }
    io_uring_sqe* sqe = get_sqe();
    const engine_file& f = files_[p->file];
    const int fd = fixed_files_ ? static_cast<int>(p->file) : f.fd;
    const bool write = p->b->r->req.op == io_op::write;
    const auto len = static_cast<unsigned>(short_fault(p) ? p->len / 2 / kDirectAlign * kDirectAlign : p->len);
    if (p->b->slot >= 0 && fixed_buffers_) {
      if (write)
        io_uring_prep_write_fixed(sqe, fd, p->buf, len, p->file_offset, p->b->slot);
      else
        io_uring_prep_read_fixed(sqe, fd, p->buf, len, p->file_offset, p->b->slot);
    } else if (write) {
      io_uring_prep_write(sqe, fd, p->buf, len, p->file_offset);
    } else {
      io_uring_prep_read(sqe, fd, p->buf, len, p->file_offset);
    }
    if (fixed_files_) sqe->flags |= IOSQE_FIXED_FILE;
    io_uring_sqe_set_data(sqe, p);
    in_ring_.link(p);
  }

  // Starts the next block of `r`. Returns false when it cannot start now (no bounce slot free).
  bool start_block(const std::shared_ptr<request_state>& r) {
    const std::size_t off = r->next_block * opt_.block_size;
    const std::size_t size = std::min(opt_.block_size, r->req.size - off);
    std::byte* user = r->req.buffer + off;
    const std::uint64_t logical = r->req.offset + off;
    // Pieces: split at stripe boundaries. A block touching a direct file needs aligned memory and
    // length; otherwise it goes through a bounce slot, padded with zeros to 4 KiB.
    bool direct = false;
    for (std::uint64_t l = logical; l < logical + size; l = (l / opt_.block_size + 1) * opt_.block_size)
      direct = direct || files_[(l / opt_.block_size) % files_.size()].direct;
    const bool aligned = reinterpret_cast<std::uintptr_t>(user) % kDirectAlign == 0 && size % kDirectAlign == 0;
    int slot = -1;
    if (direct && !aligned) {
      if (free_slots_.empty()) return false;
      slot = free_slots_.back();
      free_slots_.pop_back();
    }
    ++r->next_block;
    std::byte* io_buf = slot >= 0 ? bounce_ + static_cast<std::size_t>(slot) * opt_.block_size : user;
    const std::size_t io_len = direct ? round_up(size, kDirectAlign) : size;
    if (r->req.op == io_op::write && slot >= 0) {
      std::memcpy(io_buf, user, size);
      std::memset(io_buf + size, 0, io_len - size);
    }
    auto* b = new block_state{r, off, size, slot, 0};
    std::vector<piece*> pieces;
    for (std::size_t done = 0; done < io_len;) {
      const std::uint64_t l = logical + done;
      const std::uint64_t stripe = l / opt_.block_size;
      const std::size_t in_stripe = l % opt_.block_size;
      const std::size_t n = std::min(io_len - done, opt_.block_size - in_stripe);
      auto* p = new piece{b, static_cast<unsigned>(stripe % files_.size()),
                          (stripe / files_.size()) * opt_.block_size + in_stripe, io_buf + done, n, 0};
      pieces.push_back(p);
      done += n;
    }
    b->pieces_left = static_cast<int>(pieces.size());
    for (piece* p : pieces) queue_piece(p);
    // A write's checksum is taken on the hook thread while the block is in flight: the caller's
    // buffer must not change until the completion is done, so it is the same bytes either way.
    if (r->req.op == io_op::write && r->req.hook) queue_hook(r, off, size);
    return true;
  }

  void queue_hook(const std::shared_ptr<request_state>& r, std::size_t offset, std::size_t size) {
    r->pending.fetch_add(1, std::memory_order_relaxed);
    hooks_out_.push_back({r, offset, size});
  }

  // Hands the hooks collected in this turn of the loop to the hook thread (after the ring has been
  // given its work).
  void flush_hooks() {
    if (hooks_out_.empty()) return;
    {
      std::lock_guard lock(hook_mutex_);
      for (auto& j : hooks_out_) hook_queue_.push_back(std::move(j));
    }
    hooks_out_.clear();
    hook_cv_.notify_one();
  }

  void run_hooks() {
    std::vector<hook_job> batch;
    for (;;) {
      {
        std::unique_lock lock(hook_mutex_);
        hook_cv_.wait(lock, [&] { return hook_stop_ || !hook_queue_.empty(); });
        if (hook_queue_.empty()) return;  // stopping, and all run
        batch.swap(hook_queue_);
      }
      for (auto& j : batch) {
        request_state* r = j.r.get();
        if (!r->failed.load(std::memory_order_acquire)) {
          try {
            r->req.hook(j.offset, r->req.buffer + j.offset, j.size);
          } catch (...) {
            fail(r, std::current_exception());
          }
        }
        release(r);
      }
      batch.clear();
    }
  }

  // Drops one count of `r`; the last one finishes the completion. Any thread.
  static void release(request_state* r) {
    if (r->pending.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
    std::exception_ptr e;
    {
      std::lock_guard lock(r->error_mutex);
      e = r->error;
    }
    r->completion->finish(std::move(e));
  }

  void release_slot(int slot) {
    if (slot >= 0) free_slots_.push_back(slot);
  }

  // Records the request's first failure; the engine thread then starts nothing more of it and
  // drains what is in flight. Any thread.
  static void fail(request_state* r, std::exception_ptr e) {
    {
      std::lock_guard lock(r->error_mutex);
      if (!r->error) r->error = std::move(e);
    }
    r->failed.store(true, std::memory_order_release);
  }

  // Engine thread: ends the transfer side of `r` once nothing of it is in flight or left to start.
  void maybe_finish(request_state* r) {
    if (r->io_done) return;
    if (r->failed.load(std::memory_order_acquire)) r->blocks = r->next_block;
    if (r->finished != r->next_block || r->next_block != r->blocks) return;
    r->io_done = true;  // swept from active_ by run(), never while fill() walks the list
    release(r);         // the hooks still queued hold their own counts
  }

  // Applies the fault seam to a completion result.
  int apply_fault(const piece* p, int res) {
    if (!fault_armed_.load(std::memory_order_acquire)) return res;
    std::lock_guard lock(fault_mutex_);
    const bool write = p->b->r->req.op == io_op::write;
    // Applied at submission (short_fault) or to the ring as a whole (submit_fault), which count
    // their own skips: before the skip below, or each transfer would spend two of them.
    if (fault_.what == io_fault::kind::short_io || fault_.what == io_fault::kind::submit_enomem) return res;
    if (fault_.count <= 0 || (write ? !fault_.writes : !fault_.reads)) return res;
    if (fault_.skip > 0) {
      --fault_.skip;
      return res;
    }
    if (--fault_.count == 0) fault_armed_.store(false, std::memory_order_release);
    switch (fault_.what) {
      case io_fault::kind::eio: return -EIO;
      case io_fault::kind::enospc: return -ENOSPC;
      case io_fault::kind::eagain: return -EAGAIN;
      case io_fault::kind::eintr: return -EINTR;
      case io_fault::kind::lost_completion: return kLostCompletion;
      case io_fault::kind::none:
      case io_fault::kind::short_io:
      case io_fault::kind::submit_enomem:
      case io_fault::kind::sync_eio:
      case io_fault::kind::index_sync_eio: break;  // the store's, never armed here
    }
    return res;
  }

  // The short_io fault: whether this piece goes to the kernel with half its length (whole 4 KiB
  // units, so O_DIRECT still takes it), for a transfer that is really short. Why not by rewriting
  // the completion's count, as before: the kernel had moved every byte by then, so an engine that
  // took a short transfer for a whole one still stored and returned the right bytes, and no test
  // could tell (found in review: such a mutant passed them all).
  bool short_fault(const piece* p) {
    if (!fault_armed_.load(std::memory_order_acquire) || p->len < 2 * kDirectAlign) return false;
    std::lock_guard lock(fault_mutex_);
    const bool write = p->b->r->req.op == io_op::write;
    if (fault_.what != io_fault::kind::short_io || fault_.count <= 0 || (write ? !fault_.writes : !fault_.reads))
      return false;
    if (fault_.skip > 0) {
      --fault_.skip;
      return false;
    }
    if (--fault_.count == 0) fault_armed_.store(false, std::memory_order_release);
    return true;
  }

  // The submit_enomem fault: whether this submission fails.
  bool submit_fault() {
    if (!fault_armed_.load(std::memory_order_acquire)) return false;
    std::lock_guard lock(fault_mutex_);
    if (fault_.what != io_fault::kind::submit_enomem || fault_.count <= 0) return false;
    if (fault_.skip > 0) {
      --fault_.skip;
      return false;
    }
    if (--fault_.count == 0) fault_armed_.store(false, std::memory_order_release);
    return true;
  }

  // `res` has been through apply_fault.
  void complete(piece* p, int res) {
    const std::shared_ptr<request_state> r = p->b->r;
    const bool write = r->req.op == io_op::write;
    std::string gave_up;
    if (res == -EINTR) {  // interrupted, not refused: nothing to wait for
      if (++p->interruptions <= kMaxInterruptions) {
        queue_piece(p);
        return;
      }
      gave_up = ", " + std::to_string(kMaxInterruptions + 1) + " times in a row";
    } else if (res == -EAGAIN) {
      p->interruptions = 0;
      if (++p->refusals <= opt_.max_refusals) {
        const auto pause = std::min(kMaxBackoff, kFirstBackoff * (1 << std::min(p->refusals - 1, 10)));
        backoff_.push_back({std::chrono::steady_clock::now() + pause, p});
        return;
      }
      gave_up = ", " + std::to_string(opt_.max_refusals + 1) + " times in a row";
    } else if (res > 0 && static_cast<std::size_t>(res) < p->len) {
      p->buf += res;
      p->file_offset += static_cast<std::uint64_t>(res);
      p->len -= static_cast<std::size_t>(res);
      p->refusals = p->interruptions = 0;
      if (++p->short_transfers <= kMaxShortTransfers) {
        queue_piece(p);
        return;
      }
      res = -EIO;
      gave_up = " (" + std::to_string(kMaxShortTransfers) + " short transfers of one block)";
    }
    if (res <= 0) {
      const engine_file& f = files_[p->file];
      std::string msg = "terrace: " + r->req.what + ": " + (write ? "write" : "read") + " of " +
                        std::to_string(p->len) + " bytes at offset " + std::to_string(p->file_offset) +
                        " of " + f.name + " failed: ";
      msg += res < 0 ? errno_text(-res) : (write ? "the device accepted no bytes" : "unexpected end of file");
      msg += gave_up;
      fail(r.get(), std::make_exception_ptr(io_error(msg, res < 0 ? -res : 0)));
    }
    end_piece(p);
  }

  // A piece is done with (transferred, failed, or dropped because its request failed); the last
  // one of its block ends the block.
  void end_piece(piece* p) {
    block_state* b = p->b;
    const std::shared_ptr<request_state> r = b->r;  // outlives `b`
    const bool write = r->req.op == io_op::write;
    delete p;
    if (--b->pieces_left > 0) return;
    // The block is whole: hand read data to the caller and queue the hook that checks it.
    if (!write && !r->failed.load(std::memory_order_acquire)) {
      std::byte* user = r->req.buffer + b->offset;
      if (b->slot >= 0) std::memcpy(user, bounce_ + static_cast<std::size_t>(b->slot) * opt_.block_size, b->size);
      if (r->req.hook) queue_hook(r, b->offset, b->size);
    }
    release_slot(b->slot);
    delete b;
    ++r->finished;
    maybe_finish(r.get());
  }

  void fill() {
    for (auto& r : active_) {
      if (finding_lost_) return;  // see find_lost_completions
      // A hook that failed (on the hook thread) stops the request; with none of its blocks in
      // flight, no completion would end it, so it ends here.
      if (r->failed.load(std::memory_order_acquire)) maybe_finish(r.get());
      while (r->next_block < r->blocks && busy() < opt_.queue_depth) {
        if (!start_block(r)) return;  // out of bounce slots: wait for completions
      }
      if (busy() >= opt_.queue_depth) return;
    }
  }

  static __kernel_timespec to_timespec(std::chrono::steady_clock::duration d) {
    const auto ns = std::max<std::int64_t>(
        0, std::chrono::duration_cast<std::chrono::nanoseconds>(d).count());
    return {ns / 1'000'000'000, ns % 1'000'000'000};
  }

  std::chrono::steady_clock::time_point next_backoff() const {
    auto first = backoff_.front().at;
    for (const refused& r : backoff_) first = std::min(first, r.at);
    return first;
  }

  // Pieces in the ring and pieces waiting out a refusal: a refused piece still holds its place in
  // the queue depth, or a refused drive would be sent every block of every request at once.
  std::size_t busy() const { return in_ring_.size + backoff_.size(); }

  // Puts the refused pieces whose pause is over back in the ring, and drops at once those whose
  // request has failed meanwhile (nothing would use their data).
  void resubmit_refused() {
    if (backoff_.empty()) return;
    const auto now = std::chrono::steady_clock::now();
    std::vector<piece*> dropped;
    std::erase_if(backoff_, [&](const refused& r) {
      if (r.p->b->r->failed.load(std::memory_order_acquire)) {
        dropped.push_back(r.p);
        return true;
      }
      if (r.at > now || finding_lost_) return false;
      queue_piece(r.p);
      return true;
    });
    for (piece* p : dropped) end_piece(p);
  }

  void run() {
    arm_wake();
    submit_pending();
    for (;;) {
      // Withdrawn with a failed submission, or landed while lost completions were looked for.
      if (!wake_armed_ && !finding_lost_) arm_wake();
      bool stop;
      {
        std::lock_guard lock(inbox_mutex_);
        for (auto& r : inbox_) active_.push_back(std::move(r));
        inbox_.clear();
        stop = stop_;
      }
      resubmit_refused();
      fill();
      submit_pending();  // the ring first, then the hooks: a refill never waits for a checksum
      flush_hooks();
      active_.remove_if([](const std::shared_ptr<request_state>& r) { return r->io_done; });
      if (stop && active_.empty() && in_ring_.size == 0) {
        land_wake_read();
        break;
      }

      io_uring_cqe* cqe = nullptr;
      int rc;
      if (lost_completion_faked_) {  // the lost_completion fault: as the kernel would say it
        lost_completion_faked_ = false;
        rc = -EBADR;
      } else if (backoff_.empty() && wake_armed_ && !finding_lost_ && !refill_) {
        rc = io_uring_wait_cqe(&ring_, &cqe);
      } else {  // wake for the first refused piece's retry, or without a wake read in the ring
        // After a withdrawal, what waited for its places goes first: reap what is there, no sleep.
        const auto wait = refill_ ? std::chrono::steady_clock::duration::zero()
                          : backoff_.empty() || finding_lost_ ? std::chrono::steady_clock::duration(kMaxBackoff)
                                                              : next_backoff() - std::chrono::steady_clock::now();
        refill_ = false;
        __kernel_timespec until = to_timespec(wait);
        rc = io_uring_wait_cqe_timeout(&ring_, &cqe, &until);
      }
      // Errors that can happen to a sound ring are dealt with; the others mean that the ring's
      // descriptor or memory is not the one set up here (see submit_pending): abort.
      if (rc == -EINTR || rc == -EAGAIN || rc == -ETIME) continue;
      if (rc == -ENOMEM) {  // for the moment (not documented for waits, but harmless to wait out)
        std::this_thread::sleep_for(kMaxBackoff);
        continue;
      }
      if (rc == -EBADR) {
        find_lost_completions();  // those that were not lost are reaped below
      } else if (rc < 0 && rc != -EBUSY) {  // EBUSY: completions wait in an overflowing ring
        std::fprintf(stderr, "terrace: io_uring_wait_cqe failed fatally (the ring is not the one the engine set up): %s\n",
                     errno_text(-rc).c_str());
        std::abort();
      }
      unsigned head;
      unsigned seen = 0;
      auto& batch = cqe_batch_;
      batch.clear();
      io_uring_for_each_cqe(&ring_, head, cqe) {
        // A kernel without IORING_FEAT_EXT_ARG gets io_uring_wait_cqe_timeout's timeout as an
        // entry of liburing's own, which completes here too.
        if (cqe->user_data != LIBURING_UDATA_TIMEOUT) batch.emplace_back(cqe->user_data, cqe->res);
        ++seen;
      }
      io_uring_cq_advance(&ring_, seen);
      for (auto [tag, res] : batch) {
        if (tag == kWakeTag) {
          wake_armed_ = false;
          if (!finding_lost_) arm_wake();  // the wake read fired (or failed): keep one pending
          continue;
        }
        auto* p = reinterpret_cast<piece*>(static_cast<std::uintptr_t>(tag));
        res = apply_fault(p, res);
        if (res == kLostCompletion) {  // left counted in the ring, as a lost completion is
          lost_completion_faked_ = true;
          ++lost_;
          continue;
        }
        in_ring_.unlink(p);
        complete(p, res);
      }
      if (finding_lost_) attribute_lost_completions();
      active_.remove_if([](const std::shared_ptr<request_state>& r) { return r->io_done; });
    }
  }

  const engine_options opt_;
  const std::vector<engine_file> files_;
  bool any_direct_ = false;
  io_uring ring_{};
  bool fixed_files_ = false;
  bool fixed_buffers_ = false;
  std::byte* bounce_ = nullptr;
  std::vector<int> free_slots_;  // engine thread only
  int wake_fd_ = -1;
  std::uint64_t wake_buf_ = 0;

  std::mutex inbox_mutex_;
  std::vector<std::shared_ptr<request_state>> inbox_;  // guarded by inbox_mutex_
  bool stop_ = false;                                  // guarded by inbox_mutex_

  std::list<std::shared_ptr<request_state>> active_;  // engine thread only, oldest first
  std::vector<hook_job> hooks_out_;                   // engine thread only: for flush_hooks()
  std::vector<std::pair<std::uint64_t, int>> cqe_batch_;  // engine thread only
  ring_list in_ring_;                   // engine thread only: pieces submitted, not yet completed
  bool wake_armed_ = false;             // engine thread only: the wake read is in the ring
  bool finding_lost_ = false;           // engine thread only: see find_lost_completions
  unsigned lost_ = 0;                   // engine thread only: completions lost, not yet attributed
  unsigned overflow_seen_ = 0;          // engine thread only: the ring's overflow counter, last read
  bool lost_completion_faked_ = false;  // engine thread only: the lost_completion fault fired
  bool refill_ = false;                 // engine thread only: withdraw_unsubmitted freed places
  struct refused {
    std::chrono::steady_clock::time_point at;  // when to try again
    piece* p;
  };
  std::vector<refused> backoff_;  // engine thread only: refused pieces waiting out their pause

  std::mutex hook_mutex_;
  std::condition_variable hook_cv_;
  std::vector<hook_job> hook_queue_;  // guarded by hook_mutex_
  bool hook_stop_ = false;            // guarded by hook_mutex_
  std::thread hook_thread_;

  std::mutex fault_mutex_;
  io_fault fault_;  // guarded by fault_mutex_
  std::atomic<bool> fault_armed_{false};

  std::thread thread_;
};

}  // namespace

std::unique_ptr<io_engine> make_io_uring_engine(const engine_options& options,
                                                std::vector<engine_file> files) {
  return std::make_unique<uring_engine>(options, std::move(files));
}

}  // namespace terrace::detail

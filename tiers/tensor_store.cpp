// SPDX-License-Identifier: Apache-2.0
// The tensor store: index and free space over the io_uring engine (io_engine.hpp), checksums on
// every block, and checkpoints that survive kill -9.
//
// Crash consistency rests on one rule: an extent that a committed (or committing) index references
// is never written until an index that no longer references it has committed. Such extents are
// "pinned"; when their tensor is erased or replaced they wait in held_ (or retiring_, while a
// transfer of them is still in flight) instead of returning to the allocator. Every free is stamped
// with a sequence number; a checkpoint stamps its snapshot, and once it commits every extent freed
// before that snapshot is released. New data therefore only ever lands in space no committed index
// points at, so a crash at any moment leaves the committed generation's bytes intact. A version a
// put replaces while a checkpoint waits for earlier puts is parked until the snapshot, which takes
// it if the new put is still in flight (a snapshot holds every tensor in some whole version).
// Each swap file is locked on the engine's own descriptor, so a new opener also waits for the
// writes a killed owner left in flight.
#include "terrace/stats.hpp"
#include "terrace/tensor_store.hpp"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>

#include "terrace/error.hpp"
#include "tiers/crc32c.hpp"
#include "tiers/extent_allocator.hpp"
#include "tiers/io_engine.hpp"
#include "tiers/store_index.hpp"

namespace terrace {

// ---------------------------------------------------------------------------------- io_handle

bool io_handle::ready() const noexcept {
  return !state_ || state_->done.load(std::memory_order_acquire);
}

void io_handle::wait() const {
  if (!state_) return;
  std::unique_lock lock(state_->mutex);
  state_->cv.wait(lock, [&] { return state_->done.load(std::memory_order_acquire); });
  if (!state_->error) return;
  // Each waiter gets an exception object of its own: rethrowing the stored one would share it
  // (and its message) between threads that wait on the same transfer, whose last holder frees it
  // through reference counts that ThreadSanitizer cannot see (libstdc++'s own, not instrumented).
  try {
    std::rethrow_exception(state_->error);
  } catch (const checksum_error& e) {
    throw checksum_error(std::string(e.what()), e.code());
  } catch (const io_error& e) {
    throw io_error(std::string(e.what()), e.code());
  }
}

void wait_all(std::span<const io_handle> handles, std::exception_ptr& first_failure) noexcept {
  for (const io_handle& h : handles) {
    try {
      h.wait();
    } catch (...) {
      if (!first_failure) first_failure = std::current_exception();
    }
  }
}

namespace detail {
namespace {

using completion_ptr = std::shared_ptr<io_completion>;

std::string sys(const std::string& what, int e) {
  return "terrace: " + what + ": " + std::strerror(e) + " (errno " + std::to_string(e) + ")";
}


bool is_ready(const completion_ptr& c) { return !c || c->done.load(std::memory_order_acquire); }
void wait_quietly(const completion_ptr& c) {
  if (!c) return;
  std::unique_lock lock(c->mutex);
  c->cv.wait(lock, [&] { return c->done.load(std::memory_order_acquire); });
}
std::exception_ptr error_of(const completion_ptr& c) {
  std::lock_guard lock(c->mutex);
  return c->error;
}

struct fd_guard {
  int fd = -1;
  ~fd_guard() {
    if (fd >= 0) ::close(fd);
  }
};

int open_directory(const std::filesystem::path& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) {
    const int e = errno;
    if (e == ENOENT) throw io_error("terrace: tensor store directory " + dir.string() + " does not exist", e);
    throw io_error(sys("cannot open tensor store directory " + dir.string(), e), e);
  }
  return fd;
}

// Turns on O_DIRECT, or explains once why not.
bool enable_direct(int fd, const std::string& path) {
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags >= 0 && ::fcntl(fd, F_SETFL, flags | O_DIRECT) == 0) return true;
  std::fprintf(stderr, "terrace: warning: %s does not support O_DIRECT (ramfs, or tmpfs before Linux 6.6?); the tensor store uses buffered I/O\n",
               path.c_str());
  return false;
}

void disable_direct(int fd, const std::string& path) {
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags < 0 || ::fcntl(fd, F_SETFL, flags & ~O_DIRECT) != 0) {
    const int e = errno;
    throw io_error(sys("cannot turn O_DIRECT off for " + path, e), e);
  }
}

}  // namespace

// ------------------------------------------------------------------------------ the store itself

class tensor_store_impl {
 public:
  struct entry {
    std::uint64_t offset = 0;
    std::uint64_t size = 0;
    std::shared_ptr<std::vector<std::uint32_t>> crcs;
    completion_ptr write;                // the put; null once known good
    std::vector<completion_ptr> reads;   // gets possibly in flight
    bool pinned = false;                 // referenced by a committed or committing index
  };
  struct freed_extent {
    std::uint64_t offset, size;
    bool pinned;
    std::uint64_t seq;
    std::vector<completion_ptr> inflight;
  };

  tensor_store_impl(const std::filesystem::path& dir, const tensor_store_options& opt, bool create)
      : dir_(dir.string()) {
    TERRACE_EXPECTS(opt.files >= 1 && opt.files <= 256, "files must be 1..256");
    TERRACE_EXPECTS(opt.block_size >= kDirectAlign && opt.block_size % kDirectAlign == 0 &&
                        opt.block_size <= kMaxBlockSize,
                    "block_size must be a multiple of 4 KiB, at most 256 MiB");
    dirfd_.fd = open_directory(dir);
    lock_store();
    store_index index;
    if (create) {
      TERRACE_EXPECTS(opt.capacity > 0, "capacity must be positive");
      index.block_size = opt.block_size;
      index.files = opt.files;
      const std::uint64_t per_file = (opt.capacity + opt.files - 1) / opt.files;
      index.file_size = (per_file + opt.block_size - 1) / opt.block_size * opt.block_size;
      if (::faccessat(dirfd_.fd, kIndexName, F_OK, AT_SYMLINK_NOFOLLOW) == 0)
        throw io_error("terrace: " + dir_ + " already holds a tensor store; open it instead", EEXIST);
    } else {
      ::unlinkat(dirfd_.fd, kIndexTempName, 0);  // an uncommitted checkpoint
      index = read_index(dirfd_.fd, dir_);
      if (index.block_size < kDirectAlign || index.block_size % kDirectAlign ||
          index.block_size > kMaxBlockSize || index.files == 0 ||
          index.file_size % index.block_size)
        throw io_error("terrace: index " + dir_ + "/index is malformed: bad geometry");
    }
    block_size_ = index.block_size;
    generation_ = index.generation;
    try {
      open_and_start(dir, opt, index, create);
    } catch (...) {
      // The destructor does not run for a constructor that throws: close what was opened, and
      // remove what a failed create made, so that the same create can be tried again.
      engine_.reset();
      for (int fd : fds_) ::close(fd);
      fds_.clear();
      for (auto& [dfd, base] : created_) ::unlinkat(dfd >= 0 ? dfd : dirfd_.fd, base.c_str(), 0);
      forget_created();
      throw;
    }
    forget_created();
  }

  ~tensor_store_impl() {
    engine_.reset();  // drains every transfer before the files close
    for (int fd : fds_) ::close(fd);
  }

 private:
  void open_and_start(const std::filesystem::path& dir, const tensor_store_options& opt,
                      store_index& index, bool create) {
    open_files(dir, opt, index, create);
    alloc_ = std::make_unique<extent_allocator>(index.file_size * index.files, kDirectAlign);
    for (auto& e : index.entries) {
      const std::uint64_t blocks = (e.size + block_size_ - 1) / block_size_;
      if (e.crcs.size() != blocks || !alloc_->reserve(e.offset, e.size) || entries_.count(e.id))
        throw io_error("terrace: index " + dir_ + "/index is malformed: entry '" + e.id +
                       "' overlaps another, lies past the end or repeats an id");
      entry en;
      en.offset = e.offset;
      en.size = e.size;
      en.crcs = std::make_shared<std::vector<std::uint32_t>>(std::move(e.crcs));
      en.pinned = true;
      entries_.emplace(std::move(e.id), std::move(en));
    }
    engine_options eo;
    eo.block_size = block_size_;
    eo.queue_depth = opt.queue_depth;
    eo.sqpoll = opt.sqpoll;
    eo.file_size = index.file_size;
    std::vector<engine_file> files;
    for (std::size_t i = 0; i < fds_.size(); ++i) files.push_back({fds_[i], direct_, names_[i]});
    engine_ = make_io_uring_engine(eo, std::move(files));
    if (create) {
      index.generation = 0;
      write_index_atomically(dirfd_.fd, dir_, index);
    }
  }

  // The swap files a create made, each with a descriptor of its directory (-1: the store's own).
  void forget_created() {
    for (auto& [dfd, base] : created_)
      if (dfd >= 0) ::close(dfd);
    created_.clear();
  }

 public:
  // ---- operations

  io_handle put(const std::string& id, const void* data, std::size_t size) {
    TERRACE_EXPECTS(data != nullptr || size == 0, "put of a null buffer");
    std::unique_lock lock(mutex_);
    std::optional<std::uint64_t> offset = alloc_->allocate(size);
    if (!offset && !retiring_.empty()) {
      // Space may be waiting on transfers of erased tensors: let them finish.
      auto pending = retiring_inflight();
      lock.unlock();
      for (auto& c : pending) wait_quietly(c);
      lock.lock();
      reap_retiring();
      offset = alloc_->allocate(size);
    }
    if (!offset) {
      std::uint64_t held = 0;
      for (auto& h : held_) held += h.size;
      throw out_of_memory("terrace: tensor store " + dir_ + " is full: put of tensor '" + id + "' needs " +
                          human_bytes(alloc_->extent_size(size)) + " but " + human_bytes(alloc_->free_bytes()) +
                          " of " + human_bytes(alloc_->capacity()) + " is free (largest hole " +
                          human_bytes(alloc_->largest_hole()) + "); " + human_bytes(held) +
                          " is held for the committed checkpoint until the next checkpoint()");
    }
    entry e;
    e.offset = *offset;
    e.size = size;
    const std::size_t blocks = (size + block_size_ - 1) / block_size_;
    e.crcs = std::make_shared<std::vector<std::uint32_t>>(blocks);
    io_request r;
    r.op = io_op::write;
    r.offset = *offset;
    r.buffer = static_cast<std::byte*>(const_cast<void*>(data));  // read only: it is a write
    r.size = size;
    r.what = "put of tensor '" + id + "'";
    r.hook = [crcs = e.crcs, bs = block_size_](std::size_t off, const std::byte* p, std::size_t n) {
      (*crcs)[off / bs] = crc32c(0, p, n);
    };
    try {
      e.write = engine_->submit(std::move(r));
    } catch (...) {
      alloc_->release(*offset, size);
      throw;
    }
    // Only now is the old version let go: a put that could not be issued leaves it readable.
    // While a checkpoint waits for the puts issued before it, the version this put replaces is
    // parked instead: should this put still be in flight at the snapshot, the checkpoint takes
    // the parked version, as the tensor stood when the checkpoint began. Dropped, the tensor
    // would be in neither version, and a crash after the commit would lose it.
    if (auto it = entries_.find(id); it != entries_.end()) {
      if (checkpointing_ && !parked_.contains(id)) {
        parked_.emplace(id, std::move(it->second));
        entries_.erase(it);
      } else {
        drop(it);
      }
    }
    io_handle h(e.write);
    entries_.emplace(id, std::move(e));
    return h;
  }

  io_handle get(const std::string& id, void* into, std::size_t capacity) {
    std::unique_lock lock(mutex_);
    auto it = find(id);
    while (it->second.write && !is_ready(it->second.write)) {
      auto pending = it->second.write;
      lock.unlock();
      wait_quietly(pending);
      lock.lock();
      it = find(id);
    }
    settle(it);  // throws when the put failed
    entry& e = it->second;
    TERRACE_EXPECTS(capacity >= e.size, "get of tensor '" + id + "' (" + std::to_string(e.size) +
                                            " bytes) into a buffer of " + std::to_string(capacity));
    TERRACE_EXPECTS(into != nullptr || e.size == 0, "get into a null buffer");
    io_request r;
    r.op = io_op::read;
    r.offset = e.offset;
    r.buffer = static_cast<std::byte*>(into);
    r.size = e.size;
    r.what = "get of tensor '" + id + "'";
    r.hook = [crcs = e.crcs, bs = block_size_, id](std::size_t off, const std::byte* p, std::size_t n) {
      const std::uint32_t got = crc32c(0, p, n);
      const std::uint32_t want = (*crcs)[off / bs];
      if (got != want) {
        char buf[160];
        std::snprintf(buf, sizeof buf, ": block %zu (bytes %zu..%zu) has CRC32C %08x, stored %08x", off / bs, off,
                      off + n, got, want);
        throw checksum_error("terrace: tensor '" + id + "' is corrupt on disk" + buf, EBADMSG);
      }
    };
    std::erase_if(e.reads, is_ready);
    e.reads.push_back(engine_->submit(std::move(r)));
    return io_handle(e.reads.back());
  }

  void erase(const std::string& id) {
    std::lock_guard lock(mutex_);
    auto it = find(id);
    // A failed put left its id absent (contains() says so): erasing it is erasing an unknown id.
    // Its extent goes all the same, rather than waiting for a get or checkpoint to settle it.
    const bool failed = !present(it->second);
    drop(it);
    if (failed) throw io_error("terrace: tensor store " + dir_ + " has no tensor '" + id + "': its put failed", ENOENT);
  }

  std::uint64_t checkpoint() {
    std::lock_guard serial(checkpoint_mutex_);  // one checkpoint at a time
    if (sync_failed_) {
      throw io_error("terrace: tensor store " + dir_ + ": an earlier fdatasync failed, so tensors " +
                         "written since generation " + std::to_string(generation()) +
                         " may not be on disk; no checkpoint can be made over them (reopen the " +
                         "store to recover that generation)",
                     EIO);
    }
    // 1. Let every put issued so far finish (outside the lock: puts and gets go on meanwhile;
    // a put that replaces a tensor from here to the snapshot parks the version it replaces).
    std::vector<completion_ptr> writes;
    {
      std::lock_guard lock(mutex_);
      checkpointing_ = true;
      for (auto& [id, e] : entries_)
        if (e.write) writes.push_back(e.write);
    }
    struct end_window {  // whatever happens, the parked versions go once the snapshot is taken
      tensor_store_impl* store;
      ~end_window() {
        std::lock_guard lock(store->mutex_);
        try {
          store->unpark();
        } catch (...) {  // out of memory for the held list: their extents stay used, never reused
        }
      }
    } window{this};
    for (auto& c : writes) wait_quietly(c);
    // 2. Snapshot the finished tensors and pin them: from here their extents stay untouched. A
    // tensor whose put is still in flight (or failed) is taken as it stood when the checkpoint
    // began, if a put since parked that version and it was whole.
    store_index index;
    std::uint64_t snapshot_seq;
    {
      std::lock_guard lock(mutex_);
      const auto take = [&](const std::string& id, entry& e) {
        e.write.reset();
        e.pinned = true;
        index.entries.push_back({id, e.offset, e.size, *e.crcs});
      };
      const auto whole = [](const entry& e) { return !e.write || (is_ready(e.write) && !error_of(e.write)); };
      std::map<std::string, entry> taken_parked;
      for (auto it = entries_.begin(); it != entries_.end();) {
        auto next = std::next(it);
        // Asked once: a put in flight may complete at any moment, and one asked again after the
        // first answer was dropped as failed though it had succeeded (found under ASan: the
        // tensor was gone from the store).
        const completion_ptr write = it->second.write;
        const bool finished = is_ready(write);  // no write: finished
        if (finished && (!write || !error_of(write))) {
          take(it->first, it->second);
        } else {
          if (auto p = parked_.find(it->first); p != parked_.end() && whole(p->second)) {
            take(p->first, p->second);
            taken_parked.insert(parked_.extract(p));
          }
          // a failed put: reported on its handle, absent from now on
          if (finished) drop(it);
        }
        it = next;
      }
      unpark();  // the versions this index does not take: released by its commit
      snapshot_seq = ++seq_;
      // One past any generation an index has carried, committed or not (written_generation_).
      index.generation = std::max(generation_, written_generation_) + 1;
      // Stamped after the snapshot, the parked versions it took stay until the next commit.
      for (auto& [id, e] : taken_parked) retire(e);
    }
    index.block_size = block_size_;
    index.files = static_cast<std::uint32_t>(fds_.size());
    index.file_size = file_size_;
    // 3. The data first, then the index that points at it.
    // A failed fdatasync poisons the store for checkpoints: Linux may mark the lost pages clean
    // and report success on the next call, which would then commit an index over lost data.
    for (std::size_t i = 0; i < fds_.size(); ++i) {
      const int rc = fake_sync_failure_.exchange(false) ? (errno = EIO, -1) : ::fdatasync(fds_[i]);
      if (rc != 0) {
        const int e = errno;
        sync_failed_ = true;
        throw io_error(sys("cannot fdatasync " + names_[i], e), e);
      }
    }
    index_write w;
    w.fake_dir_sync_failure = fake_index_sync_failure_.exchange(false);
    try {
      write_index_atomically(dirfd_.fd, dir_, index, &w);
    } catch (...) {
      // Renamed but not known durable: a crash may still recover this generation, so its number
      // is never given to other contents (the next checkpoint takes the one after).
      if (w.renamed) written_generation_ = index.generation;
      throw;
    }
    // 4. Committed: what was freed before the snapshot is no longer referenced by any index.
    std::lock_guard lock(mutex_);
    generation_ = index.generation;
    committed_seq_ = snapshot_seq;
    std::erase_if(held_, [&](const freed_extent& f) {
      if (f.seq >= committed_seq_) return false;
      alloc_->release(f.offset, f.size);
      return true;
    });
    reap_retiring();
    return generation_;
  }

  void wait_all() {
    std::vector<completion_ptr> all;
    {
      std::lock_guard lock(mutex_);
      for (const auto* versions : {&entries_, &parked_}) {
        for (auto& [id, e] : *versions) {
          if (e.write) all.push_back(e.write);
          all.insert(all.end(), e.reads.begin(), e.reads.end());
        }
      }
      auto r = retiring_inflight();
      all.insert(all.end(), r.begin(), r.end());
    }
    for (auto& c : all) wait_quietly(c);
    std::lock_guard lock(mutex_);
    reap_retiring();
  }

  // ---- queries

  // A put that finished in error counts as absent even before settle() drops it.
  static bool present(const entry& e) { return !e.write || !is_ready(e.write) || !error_of(e.write); }
  bool contains(const std::string& id) const {
    std::lock_guard lock(mutex_);
    auto it = entries_.find(id);
    return it != entries_.end() && present(it->second);
  }
  std::optional<std::size_t> size_of(const std::string& id) const {
    std::lock_guard lock(mutex_);
    auto it = entries_.find(id);
    if (it == entries_.end() || !present(it->second)) return std::nullopt;
    return it->second.size;
  }
  std::vector<std::string> ids() const {
    std::lock_guard lock(mutex_);
    std::vector<std::string> out;
    for (auto& [id, e] : entries_)
      if (present(e)) out.push_back(id);
    return out;
  }
  std::uint64_t generation() const {
    std::lock_guard lock(mutex_);
    return generation_;
  }
  std::uint64_t capacity() const { return alloc_->capacity(); }
  std::uint64_t used_bytes() const {
    std::lock_guard lock(mutex_);
    return alloc_->capacity() - alloc_->free_bytes();
  }
  bool direct() const { return direct_; }
  std::string describe() const { return engine_->describe(); }
  void inject_fault(const io_fault& f) {
    if (f.what == io_fault::kind::sync_eio) {
      fake_sync_failure_.store(true);
    } else if (f.what == io_fault::kind::index_sync_eio) {
      fake_index_sync_failure_.store(true);
    } else {
      engine_->inject(f);
    }
  }

 private:
  // REQUIRES: mutex_ held (for all below).
  std::map<std::string, entry>::iterator find(const std::string& id) {
    auto it = entries_.find(id);
    if (it == entries_.end()) throw io_error("terrace: tensor store " + dir_ + " has no tensor '" + id + "'", ENOENT);
    return it;
  }

  // Drops an entry whose put has finished in error, and rethrows that error for the caller.
  void settle(std::map<std::string, entry>::iterator it) {
    entry& e = it->second;
    if (!e.write) return;
    if (auto err = error_of(e.write)) {
      const std::string id = it->first;
      drop(it);
      try {
        std::rethrow_exception(err);
      } catch (const std::exception& ex) {
        throw io_error("terrace: tensor '" + id + "' is not stored: its put failed: " + ex.what(), EIO);
      }
    }
    e.write.reset();
  }

  // Removes an entry; its extent goes back once no transfer of it is in flight and no committed
  // index references it.
  void drop(std::map<std::string, entry>::iterator it) {
    entry e = std::move(it->second);
    entries_.erase(it);
    retire(e);
  }

  // The versions puts parked during a checkpoint's wait (put) leave once its snapshot is taken
  // (or the checkpoint failed before it), as a dropped version does: stamped after the snapshot,
  // one that the snapshot took (pinned) is held until the next commit.
  void unpark() {
    checkpointing_ = false;
    for (auto& [id, e] : parked_) retire(e);
    parked_.clear();
  }

  void retire(const entry& e) {
    freed_extent f{e.offset, e.size, e.pinned, ++seq_, {}};
    if (e.write && !is_ready(e.write)) f.inflight.push_back(e.write);
    for (auto& r : e.reads)
      if (!is_ready(r)) f.inflight.push_back(r);
    if (f.inflight.empty())
      release(std::move(f));
    else
      retiring_.push_back(std::move(f));
    reap_retiring();
  }

  void release(freed_extent f) {
    if (f.pinned && f.seq >= committed_seq_)
      held_.push_back(std::move(f));
    else
      alloc_->release(f.offset, f.size);
  }

  void reap_retiring() {
    for (auto it = retiring_.begin(); it != retiring_.end();) {
      if (std::all_of(it->inflight.begin(), it->inflight.end(), is_ready)) {
        it->inflight.clear();
        release(std::move(*it));
        it = retiring_.erase(it);
      } else {
        ++it;
      }
    }
  }

  std::vector<completion_ptr> retiring_inflight() const {
    std::vector<completion_ptr> out;
    for (auto& f : retiring_) out.insert(out.end(), f.inflight.begin(), f.inflight.end());
    return out;
  }

  // ---- setup

  void lock_store() {
    // One process per store: a second opener would allocate over the first one's extents.
    lock_fd_.fd = ::openat(dirfd_.fd, "lock", O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (lock_fd_.fd < 0) throw io_error(sys("cannot open " + dir_ + "/lock", errno), errno);
    if (::flock(lock_fd_.fd, LOCK_EX | LOCK_NB) != 0) {
      const int e = errno;
      if (e == EWOULDBLOCK) throw io_error("terrace: tensor store " + dir_ + " is open in another process", e);
      throw io_error(sys("cannot lock " + dir_ + "/lock", e), e);
    }
  }

  // The lock file says no live process has the store open; a killed one may still have writes in
  // flight, which the kernel finishes after its exit released that lock. io_uring holds the swap
  // file's open file description until they complete, and with it this lock, taken on the
  // descriptor the engine writes through: waiting for it keeps a new opener from allocating space
  // those writes may still land in (a committed tensor written there would read back corrupt).
  void lock_swap_file(int fd, const std::string& path) {
    using namespace std::chrono_literals;
    const auto deadline = std::chrono::steady_clock::now() + 30s;
    while (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
      const int e = errno;
      if (e == EINTR) continue;
      if (e != EWOULDBLOCK) throw io_error(sys("cannot lock " + path, e), e);
      if (std::chrono::steady_clock::now() > deadline) {
        throw io_error("terrace: " + path + " is still locked after 30 s: a process that had the " +
                           "store open is still writing it",
                       e);
      }
      std::this_thread::sleep_for(1ms);
    }
  }

  void open_files(const std::filesystem::path& dir, const tensor_store_options& opt, const store_index& index,
                  bool create) {
    file_size_ = index.file_size;
    direct_ = opt.direct;
    for (std::uint32_t i = 0; i < index.files; ++i) {
      std::filesystem::path d = opt.stripe_directories.empty() ? dir : opt.stripe_directories[i % opt.stripe_directories.size()];
      fd_guard local;
      int dfd = dirfd_.fd;
      if (!opt.stripe_directories.empty()) {
        local.fd = open_directory(d);
        dfd = local.fd;
      }
      const std::string base = "swap." + std::to_string(i);
      const std::string path = (d / base).string();
      const int flags = O_RDWR | O_NOFOLLOW | O_CLOEXEC | (create ? O_CREAT | O_EXCL : 0);
      const int fd = ::openat(dfd, base.c_str(), flags, 0600);
      if (fd < 0) {
        const int e = errno;
        if (e == EEXIST) throw io_error("terrace: " + path + " already exists; refusing to overwrite it", e);
        throw io_error(sys("cannot " + std::string(create ? "create " : "open ") + path, e), e);
      }
      fds_.push_back(fd);
      names_.push_back(path);
      lock_swap_file(fd, path);
      if (create) {
        created_.emplace_back(opt.stripe_directories.empty() ? -1 : ::dup(dfd), base);
        // Preallocated: a write inside the file never meets ENOSPC, so a full disk is reported
        // here, once, rather than in the middle of a training step.
        int rc = ::fallocate(fd, 0, 0, static_cast<off_t>(index.file_size));
        if (rc != 0 && (errno == EOPNOTSUPP || errno == ENOSYS)) rc = ::ftruncate(fd, static_cast<off_t>(index.file_size));
        if (rc != 0) {
          const int e = errno;
          throw io_error(sys("cannot preallocate " + human_bytes(index.file_size) + " for " + path, e), e);
        }
        // Its size durable before the index that names it commits (generation 0, just below),
        // whatever the file system orders on its own: a lost size would make the store unopenable.
        if (::fsync(fd) != 0) throw io_error(sys("cannot fsync " + path, errno), errno);
        if (::fsync(dfd) != 0) throw io_error(sys("cannot fsync directory " + d.string(), errno), errno);
      } else {
        struct ::stat st {};
        if (::fstat(fd, &st) != 0) throw io_error(sys("cannot stat " + path, errno), errno);
        if (static_cast<std::uint64_t>(st.st_size) != index.file_size)
          throw io_error("terrace: " + path + " is " + std::to_string(st.st_size) + " bytes; the index says " +
                         std::to_string(index.file_size));
      }
      if (direct_ && !enable_direct(fd, path)) {
        // Buffered from here on, for every file: the engine drives them all one way, and an
        // earlier file left with O_DIRECT would get unaligned transfers without a bounce buffer.
        direct_ = false;
        for (std::size_t k = 0; k + 1 < fds_.size(); ++k) disable_direct(fds_[k], names_[k]);
      }
    }
  }

  const std::string dir_;
  fd_guard dirfd_;
  fd_guard lock_fd_;
  std::vector<int> fds_;
  std::vector<std::string> names_;
  std::vector<std::pair<int, std::string>> created_;  // during the constructor only
  bool sync_failed_ = false;                 // under checkpoint_mutex_
  std::atomic<bool> fake_sync_failure_{false};  // the sync_eio seam
  std::atomic<bool> fake_index_sync_failure_{false};  // the index_sync_eio seam
  std::uint64_t written_generation_ = 0;     // the last generation renamed into place; under checkpoint_mutex_
  std::uint64_t file_size_ = 0;
  std::uint64_t block_size_ = 0;
  bool direct_ = true;
  std::unique_ptr<io_engine> engine_;

  mutable std::mutex mutex_;
  std::mutex checkpoint_mutex_;
  std::unique_ptr<extent_allocator> alloc_;       // guarded by mutex_
  std::map<std::string, entry> entries_;           // guarded by mutex_
  // From a checkpoint's first step to its snapshot: the versions puts replaced meanwhile (put).
  bool checkpointing_ = false;
  std::map<std::string, entry> parked_;
  std::vector<freed_extent> held_;                 // pinned extents freed since the last commit
  std::vector<freed_extent> retiring_;             // freed, but with transfers in flight
  std::uint64_t seq_ = 0;                          // stamps frees and snapshots
  std::uint64_t committed_seq_ = 0;                // snapshot stamp of the last commit
  std::uint64_t generation_ = 0;
};

}  // namespace detail

// ------------------------------------------------------------------------------- public wrapper

tensor_store::tensor_store(std::unique_ptr<detail::tensor_store_impl> impl) : impl_(std::move(impl)) {}
tensor_store::tensor_store(tensor_store&&) noexcept = default;
tensor_store& tensor_store::operator=(tensor_store&&) noexcept = default;
tensor_store::~tensor_store() = default;

tensor_store tensor_store::create(const std::filesystem::path& directory, const tensor_store_options& options) {
  return tensor_store(std::make_unique<detail::tensor_store_impl>(directory, options, true));
}
tensor_store tensor_store::open(const std::filesystem::path& directory, const tensor_store_options& options) {
  return tensor_store(std::make_unique<detail::tensor_store_impl>(directory, options, false));
}

io_handle tensor_store::put(const std::string& id, const void* data, std::size_t size) { return impl_->put(id, data, size); }
io_handle tensor_store::get(const std::string& id, void* into, std::size_t capacity) { return impl_->get(id, into, capacity); }
void tensor_store::erase(const std::string& id) { impl_->erase(id); }
std::uint64_t tensor_store::checkpoint() { return impl_->checkpoint(); }
void tensor_store::wait_all() { impl_->wait_all(); }
bool tensor_store::contains(const std::string& id) const { return impl_->contains(id); }
std::optional<std::size_t> tensor_store::size_of(const std::string& id) const { return impl_->size_of(id); }
std::vector<std::string> tensor_store::ids() const { return impl_->ids(); }
std::uint64_t tensor_store::generation() const { return impl_->generation(); }
std::uint64_t tensor_store::capacity() const { return impl_->capacity(); }
std::uint64_t tensor_store::used_bytes() const { return impl_->used_bytes(); }
bool tensor_store::direct() const { return impl_->direct(); }
std::string tensor_store::describe() const { return impl_->describe(); }
void tensor_store::inject_fault(const io_fault& fault) { impl_->inject_fault(fault); }

}  // namespace terrace

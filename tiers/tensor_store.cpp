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

#include <dirent.h>
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
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <thread>

#include "terrace/error.hpp"
#include "tiers/crc32c.hpp"
#include "tiers/extent_allocator.hpp"
#include "tiers/fork_guard.hpp"
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
constexpr const char* kLockName = "lock";

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

// The most a create() may be asked to hold: each swap file's data, in whole blocks, and its trailer
// must fit in an off_t, and all files' data in 64 bits. Beyond it the rounding up to whole blocks
// wrapped (2^64 - 1 made a store of 0 bytes).
std::uint64_t largest_capacity(unsigned files, std::uint64_t block_size) {
  const std::uint64_t per_file =
      (static_cast<std::uint64_t>(std::numeric_limits<off_t>::max()) - kSwapTrailerBytes) / block_size * block_size;
  const std::uint64_t per_file_in_64_bits = std::numeric_limits<std::uint64_t>::max() / files / block_size * block_size;
  // The index counts a tensor's block checksums in 32 bits: no tensor, so no store, may have more
  // blocks (16 TiB at 4 KiB blocks; a larger block_size allows more).
  const std::uint64_t indexable = std::uint64_t{std::numeric_limits<std::uint32_t>::max()} * block_size;
  return std::min(std::min(per_file, per_file_in_64_bits) * files, indexable);
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

// A forked child (fork_guard.hpp) closes the store's descriptors; every call there throws.
class tensor_store_impl : private fork_guard {
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
    TERRACE_EXPECTS(!create || opt.capacity > 0, "capacity must be positive");
    TERRACE_EXPECTS(!create || opt.capacity <= largest_capacity(opt.files, opt.block_size),
                    "capacity " + std::to_string(opt.capacity) + " is more than " + std::to_string(opt.files) +
                        " swap file(s) of " + std::to_string(opt.block_size) + "-byte blocks can hold and index (" +
                        std::to_string(largest_capacity(opt.files, opt.block_size)) +
                        " bytes at most; a larger block_size indexes more)");
    fork_guard::install();
    dirfd_.fd = open_directory(dir);
    try {
      store_index index = create ? prepare_create(opt) : prepare_open();
      block_size_ = index.block_size;
      generation_ = index.generation;
      identity_ = index.identity;
      open_and_start(dir, opt, index, create);
      if (create) remove_create_marker();
    } catch (...) {
      undo_failed_constructor();
      throw;
    }
    forget_created();
    register_for_fork();
  }

  ~tensor_store_impl() {
    unregister_for_fork();
    engine_.reset();  // drains every transfer before the files close
    for (int fd : fds_) ::close(fd);
  }

 private:
  // ---- create and open
  //
  // Neither touches a file the store did not write. open() creates or removes nothing before it
  // has found an index, and removes only the leftovers of a crash that carry the store's own
  // records (origin_of). create() writes the marker kCreatingName first and removes it once its
  // index has committed: a create killed in between leaves a directory that open() explains and
  // that the next create() cleans up, recognising the swap files by the identity in the marker.

  store_index prepare_open() {
    refuse_unless_store();
    lock_store();
    store_index index = read_index(dirfd_.fd, dir_);
    if (index.block_size < kDirectAlign || index.block_size % kDirectAlign || index.block_size > kMaxBlockSize ||
        index.files == 0 || index.file_size % index.block_size)
      throw io_error("terrace: index " + dir_ + "/index is malformed: bad geometry");
    // What a crash may leave: the temporary of an uncommitted checkpoint, or the marker of a
    // create killed after its index committed. Another file of the temporary's name would make
    // every checkpoint fail: refused now, rather than after a training step.
    if (!remove_if_ours(kIndexTempName, kIndexMagic))
      throw io_error("terrace: " + dir_ + "/" + kIndexTempName + " is not a tensor store index; refusing " +
                         "to remove it (move it away and open the store again)",
                     EEXIST);
    remove_if_ours(kCreatingName, kCreateMarkerMagic);
    return index;
  }

  void refuse_unless_store() const {
    struct ::stat st {};
    if (::fstatat(dirfd_.fd, kIndexName, &st, AT_SYMLINK_NOFOLLOW) == 0) return;
    const int e = errno;
    if (e != ENOENT) throw io_error(sys("cannot stat " + dir_ + "/" + kIndexName, e), e);
    if (::fstatat(dirfd_.fd, kCreatingName, &st, AT_SYMLINK_NOFOLLOW) == 0) {
      throw io_error("terrace: " + dir_ + " holds no tensor store: a create() was interrupted before " +
                         "committing it (the file '" + kCreatingName + "' is left from it, and no index); " +
                         "call create() again: it removes what the interrupted one left and creates the store",
                     ENOENT);
    }
    throw io_error("terrace: " + dir_ + " holds no tensor store (no file 'index')", ENOENT);
  }

  store_index prepare_create(const tensor_store_options& opt) {
    lock_store();
    if (::faccessat(dirfd_.fd, kIndexName, F_OK, AT_SYMLINK_NOFOLLOW) == 0)
      throw io_error("terrace: " + dir_ + " already holds a tensor store; open it instead", EEXIST);
    // Refused before anything is made: the commit would have to remove it.
    if (origin_of(dirfd_.fd, kIndexTempName, dir_, kIndexMagic) == file_origin::foreign)
      throw io_error("terrace: " + dir_ + "/" + kIndexTempName + " is not a tensor store index; refusing " +
                         "to remove it (move it away and create the store again)",
                     EEXIST);
    remove_interrupted_create(opt);
    store_index index;
    index.block_size = opt.block_size;
    index.files = opt.files;
    // Rounded up without a sum that could wrap (the capacity is at most largest_capacity()).
    const std::uint64_t per_file = opt.capacity / opt.files + (opt.capacity % opt.files != 0);
    index.file_size = per_file / opt.block_size * opt.block_size + (per_file % opt.block_size != 0 ? opt.block_size : 0);
    index.identity = new_store_identity();
    write_create_marker(*index.identity);
    return index;
  }

  // A create killed before its index committed left its marker, maybe swap files and an
  // index.tmp. The swap files are recognised by the identity the marker carries (in their
  // trailer), or by being empty (killed between a file's creation and its trailer, the first
  // thing written to it); any other file of such a name stays, and the create's O_EXCL refuses it.
  // Swap files are looked for where this create puts them (the options' stripe directories).
  void remove_interrupted_create(const tensor_store_options& opt) {
    std::optional<store_identity> identity;
    switch (origin_of(dirfd_.fd, kCreatingName, dir_, kCreateMarkerMagic)) {
      case file_origin::absent: return;
      case file_origin::foreign:
        throw io_error("terrace: " + dir_ + "/" + kCreatingName + " is not a tensor store's create marker; " +
                           "refusing to remove it (move it away and create the store again)",
                       EEXIST);
      case file_origin::ours: identity = read_create_marker(); break;
    }
    // An empty or damaged marker: its create had made no swap file yet (they come after the
    // marker is durable), or its identity is lost and nothing can be told to be its.
    if (identity) {
      std::vector<std::filesystem::path> dirs = opt.stripe_directories;
      if (dirs.empty()) dirs.push_back(dir_);
      std::sort(dirs.begin(), dirs.end());
      dirs.erase(std::unique(dirs.begin(), dirs.end()), dirs.end());
      for (const auto& d : dirs) remove_swap_files_of(d, *identity);
    }
    remove_if_ours(kIndexTempName, kIndexMagic);
    if (::unlinkat(dirfd_.fd, kCreatingName, 0) != 0 && errno != ENOENT)
      throw io_error(sys("cannot remove " + dir_ + "/" + kCreatingName, errno), errno);
    sync_directory(dirfd_.fd, dir_);
  }

  std::optional<store_identity> read_create_marker() const {
    fd_guard f;
    f.fd = ::openat(dirfd_.fd, kCreatingName, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    if (f.fd < 0) throw io_error(sys("cannot open " + dir_ + "/" + kCreatingName, errno), errno);
    unsigned char buf[64];
    const ssize_t n = ::pread(f.fd, buf, sizeof buf, 0);
    if (n < 0) throw io_error(sys("cannot read " + dir_ + "/" + kCreatingName, errno), errno);
    return decode_create_marker(buf, static_cast<std::size_t>(n));
  }

  void remove_swap_files_of(const std::filesystem::path& d, const store_identity& identity) {
    fd_guard dfd;
    dfd.fd = open_directory(d);
    std::vector<std::string> names;
    {
      const int scan_fd = ::dup(dfd.fd);
      DIR* scan = scan_fd >= 0 ? ::fdopendir(scan_fd) : nullptr;
      if (scan == nullptr) {
        const int e = errno;
        if (scan_fd >= 0) ::close(scan_fd);
        throw io_error(sys("cannot list " + d.string(), e), e);
      }
      while (const dirent* entry = ::readdir(scan)) {
        const std::string name = entry->d_name;
        if (name.size() > 5 && name.compare(0, 5, "swap.") == 0 &&
            std::all_of(name.begin() + 5, name.end(), [](char c) { return c >= '0' && c <= '9'; }))
          names.push_back(name);
      }
      ::closedir(scan);
    }
    bool removed = false;
    for (const auto& name : names) {
      if (!is_swap_file_of(dfd.fd, name, identity)) continue;
      if (::unlinkat(dfd.fd, name.c_str(), 0) != 0 && errno != ENOENT)
        throw io_error(sys("cannot remove " + (d / name).string(), errno), errno);
      removed = true;
    }
    if (removed) sync_directory(dfd.fd, d.string());
  }

  static bool is_swap_file_of(int dfd, const std::string& name, const store_identity& identity) {
    fd_guard f;
    f.fd = ::openat(dfd, name.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    struct ::stat st {};
    if (f.fd < 0 || ::fstat(f.fd, &st) != 0 || !S_ISREG(st.st_mode)) return false;
    if (st.st_size == 0) return true;
    if (st.st_size < static_cast<off_t>(kSwapTrailerBytes)) return false;
    std::vector<unsigned char> buf(kSwapTrailerBytes);
    if (::pread(f.fd, buf.data(), buf.size(), st.st_size - static_cast<off_t>(kSwapTrailerBytes)) !=
        static_cast<ssize_t>(buf.size()))
      return false;
    const auto trailer = decode_swap_trailer(buf.data(), buf.size());
    return trailer && trailer->identity == identity;
  }

  void write_create_marker(const store_identity& identity) {
    const std::string path = dir_ + "/" + kCreatingName;
    fd_guard f;
    f.fd = ::openat(dirfd_.fd, kCreatingName, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (f.fd < 0) throw io_error(sys("cannot create " + path, errno), errno);
    marker_created_ = true;
    const auto bytes = encode_create_marker(identity);
    const ssize_t n = ::write(f.fd, bytes.data(), bytes.size());
    if (n != static_cast<ssize_t>(bytes.size())) {
      const int e = n < 0 ? errno : ENOSPC;
      throw io_error(sys("cannot write " + path, e), e);
    }
    // Durable before the first swap file exists, so a crash never leaves one without it.
    if (::fsync(f.fd) != 0) throw io_error(sys("cannot fsync " + path, errno), errno);
    sync_directory(dirfd_.fd, dir_);
  }

  // The store is committed: a failure to remove the marker leaves one beside an index, which
  // open() removes, so it is not reported.
  void remove_create_marker() noexcept {
    if (::unlinkat(dirfd_.fd, kCreatingName, 0) == 0) ::fsync(dirfd_.fd);
    marker_created_ = false;
  }

  // Removes removable leftovers named `name`: returns false, touching nothing, when the file is
  // not the store's (origin_of).
  bool remove_if_ours(const char* name, const char (&magic)[8]) {
    const file_origin origin = origin_of(dirfd_.fd, name, dir_, magic);
    if (origin == file_origin::foreign) return false;
    if (origin == file_origin::ours) {
      if (::unlinkat(dirfd_.fd, name, 0) != 0 && errno != ENOENT)
        throw io_error(sys("cannot remove " + dir_ + "/" + name, errno), errno);
      sync_directory(dirfd_.fd, dir_);
    }
    return true;
  }

  static void sync_directory(int dfd, const std::string& path) {
    if (::fsync(dfd) != 0) throw io_error(sys("cannot fsync directory " + path, errno), errno);
  }

  // The destructor does not run for a constructor that throws: closes what was opened and removes
  // what this constructor made, so that the same create (or open) can be tried again and a
  // directory that holds no store is left as it was. The index before the swap files and those
  // before the marker: a crash in here leaves an interrupted create that the next one cleans up.
  void undo_failed_constructor() noexcept {
    engine_.reset();
    for (int fd : fds_) ::close(fd);
    fds_.clear();
    if (index_created_) ::unlinkat(dirfd_.fd, kIndexName, 0);
    for (auto& [dfd, base] : created_) ::unlinkat(dfd >= 0 ? dfd : dirfd_.fd, base.c_str(), 0);
    forget_created();
    if (marker_created_) ::unlinkat(dirfd_.fd, kCreatingName, 0);
    // Safe while held: lock_store() checks that the file it locked is still the one named "lock".
    if (lock_created_) ::unlinkat(dirfd_.fd, kLockName, 0);
    if (index_created_ || marker_created_ || lock_created_) ::fsync(dirfd_.fd);
  }

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
      index_write w;
      try {
        write_index_atomically(dirfd_.fd, dir_, index, &w);
      } catch (...) {
        index_created_ = w.renamed;  // its directory fsync failed: removed with the rest
        throw;
      }
    }
  }

  // The swap files a create made, each with a descriptor of its directory (-1: the store's own).
  void forget_created() {
    for (auto& [dfd, base] : created_)
      if (dfd >= 0) ::close(dfd);
    created_.clear();
  }

 public:
  // ---- a child forked without exec
  //
  // Such a child (a PyTorch DataLoader worker) inherits the lock file's and the swap files'
  // descriptors, and with their open file descriptions their flocks: the store would stay locked
  // until it exited. It cannot use the store anyway: only the thread that forked exists in it, so
  // the engine's threads are gone, and another thread of the parent may have held mutex_. So the
  // child lets go of every descriptor at once (fork_guard's handler; the engine closes its ring
  // there too), and every later call in it throws (usable()) before touching the store: nothing
  // in the child can write a swap file or the index.

  // In the child, the only thread: no lock may be taken (another parent thread may have held it).
  void abandon_after_fork() noexcept override {
    for (fd_guard* g : {&lock_fd_, &dirfd_}) {
      if (g->fd >= 0) ::close(g->fd);
      g->fd = -1;
    }
    for (int& fd : fds_) {
      if (fd >= 0) ::close(fd);
      fd = -1;
    }
  }
  using fork_guard::forked_away;

  tensor_store_impl& usable() {
    if (forked_away()) {
      throw io_error("terrace: tensor store " + dir_ + " was opened by the parent of this process, which " +
                         "was forked from it without exec: a forked child cannot use the store (open it " +
                         "in the child, once the parent has closed it)",
                     EBADF);
    }
    return *this;
  }
  const tensor_store_impl& usable() const { return const_cast<tensor_store_impl*>(this)->usable(); }

  // ---- operations

  io_handle put(const std::string& id, const void* data, std::size_t size) {
    TERRACE_EXPECTS(data != nullptr || size == 0, "put of a null buffer");
    TERRACE_EXPECTS(id.size() <= tensor_store::max_id_bytes,
                    "put of an id of " + std::to_string(id.size()) + " bytes (at most " +
                        std::to_string(tensor_store::max_id_bytes) + "): '" + id.substr(0, 64) + "...'");
    std::unique_lock lock(mutex_);
    std::optional<std::uint64_t> offset = alloc_->allocate(size);
    if (!offset) {
      // Space may be waiting on transfers of erased tensors, or held by puts that failed or are
      // about to: let the transfers in flight finish, drop the failed puts, and try again. So a
      // put is refused only for want of space that nothing in flight or failed would give back,
      // and the message's figures are exact.
      auto pending = retiring_inflight();
      for (auto& [other, e] : entries_)
        if (e.write && !is_ready(e.write)) pending.push_back(e.write);
      if (!pending.empty()) {
        lock.unlock();
        for (auto& c : pending) wait_quietly(c);
        lock.lock();
        reap_retiring();
      }
      settle_failed_puts();
      offset = alloc_->allocate(size);
    }
    if (!offset) {
      throw out_of_memory("terrace: tensor store " + dir_ + " is full: put of tensor '" + id + "' needs " +
                          human_bytes(alloc_->extent_size(size)) + " but " + human_bytes(alloc_->free_bytes()) +
                          " of " + human_bytes(alloc_->capacity()) + " is free (largest hole " +
                          human_bytes(alloc_->largest_hole()) + "); in use: " + space_in_use());
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
    index.identity = identity_;
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

  // Drops every put that has finished in error, as a get or erase of its id would: its extent
  // would otherwise stay allocated, unseen by ids(), until one came. Not one whose id has a version
  // parked by a running checkpoint: dropped before the snapshot, it would leave that version out
  // of the index; the snapshot drops it instead.
  void settle_failed_puts() {
    for (auto it = entries_.begin(); it != entries_.end();) {
      auto next = std::next(it);
      const entry& e = it->second;
      if (e.write && is_ready(e.write) && error_of(e.write) && !parked_.contains(it->first)) drop(it);
      it = next;
    }
  }

  // What the allocated space holds, for a full store's message: every extent is counted in one of
  // these, so the figures add up to capacity - free.
  std::string space_in_use() const {
    std::uint64_t live = 0, writing = 0, failed = 0, parked = 0, held = 0, retiring = 0;
    std::size_t live_count = 0;
    for (const auto& [id, e] : entries_) {
      const std::uint64_t bytes = alloc_->extent_size(e.size);
      if (!present(e)) {
        failed += bytes;
      } else {
        ++live_count;
        (is_ready(e.write) ? live : writing) += bytes;
      }
    }
    for (const auto& [id, e] : parked_) parked += alloc_->extent_size(e.size);
    for (const auto& f : held_) held += alloc_->extent_size(f.size);
    for (const auto& f : retiring_) retiring += alloc_->extent_size(f.size);
    std::string out = human_bytes(live + writing) + " by " + std::to_string(live_count) + " tensor" +
                      (live_count == 1 ? "" : "s");
    if (writing) out += " (" + human_bytes(writing) + " of it by puts in flight)";
    out += ", " + human_bytes(held) + " held for the committed checkpoint until the next checkpoint()";
    if (parked) out += ", " + human_bytes(parked) + " by replaced versions the running checkpoint may take";
    if (failed) out += ", " + human_bytes(failed) + " by failed puts a running checkpoint has yet to drop";
    if (retiring) out += ", " + human_bytes(retiring) + " by erased or replaced tensors with transfers in flight";
    return out;
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

  // One process per store: a second opener would allocate over the first one's extents.
  void lock_store() {
    const std::string path = dir_ + "/" + kLockName;
    for (;;) {
      bool created = true;
      int fd = ::openat(dirfd_.fd, kLockName, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
      if (fd < 0 && errno == EEXIST) {
        created = false;
        fd = ::openat(dirfd_.fd, kLockName, O_RDWR | O_NOFOLLOW | O_CLOEXEC);
        if (fd < 0 && errno == ENOENT) continue;  // removed meanwhile by a failed opener
      }
      if (fd < 0) throw io_error(sys("cannot open " + path, errno), errno);
      lock_fd_.fd = fd;
      if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
        const int e = errno;
        if (e == EWOULDBLOCK) {
          throw io_error("terrace: tensor store " + dir_ + " is open in another process, or in a child " +
                             "process forked (without exec) from one that had it open, which holds its " +
                             "lock until it exits or calls exec",
                         e);
        }
        throw io_error(sys("cannot lock " + path, e), e);
      }
      // A failed opener that had created the file removes it while holding it: the file locked
      // here may be one it removed since this call opened it. Only the file that bears the name
      // is the lock.
      struct ::stat held {}, named {};
      if (::fstat(fd, &held) != 0) throw io_error(sys("cannot stat " + path, errno), errno);
      if (::fstatat(dirfd_.fd, kLockName, &named, AT_SYMLINK_NOFOLLOW) == 0 && named.st_dev == held.st_dev &&
          named.st_ino == held.st_ino) {
        lock_created_ = created;
        return;
      }
      ::close(lock_fd_.fd);
      lock_fd_.fd = -1;
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
                           "store open is still writing it, or a child process forked from it (without " +
                           "exec) holds it",
                       e);
      }
      std::this_thread::sleep_for(1ms);
    }
  }

  // Each swap file ends with a trailer (encode_swap_trailer) naming the store's identity, which the
  // index also carries, and the file's place in the stripe: open() refuses a swap file of another
  // store (a stripe directory of another store, whose committed tensors this one's puts would
  // overwrite) and swap files out of order. Why a trailer past the data, not a header block at
  // the start: the striped layout (logical offset to file offset, the engine's contract) and the
  // allocator stay as they were, so a store created before identities opens unchanged, and no
  // transfer can reach it (the engine's range ends at file_size). Why in the file's bytes: it
  // survives copying the directory for a backup (cp, rsync, tar), as inode numbers would not, and
  // needs nothing of the file system, as extended attributes would (plain cp drops them too).
  // A store with no identity in its index (created before) is opened unchecked.
  void open_files(const std::filesystem::path& dir, const tensor_store_options& opt, const store_index& index,
                  bool create) {
    file_size_ = index.file_size;
    direct_ = opt.direct;
    const std::uint64_t bytes_on_disk = index.file_size + (index.identity ? kSwapTrailerBytes : 0);
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
      if (create) created_.emplace_back(opt.stripe_directories.empty() ? -1 : ::dup(dfd), base);
      lock_swap_file(fd, path);
      swap_trailer trailer;
      if (index.identity) trailer = {*index.identity, i, index.files, index.file_size};
      if (create) {
        // The trailer first: a create killed from here on leaves a file its identity names (one
        // killed before is empty), which the next create() can tell from a file of its own.
        const auto bytes = encode_swap_trailer(trailer);
        const ssize_t n = ::pwrite(fd, bytes.data(), bytes.size(), static_cast<off_t>(index.file_size));
        if (n != static_cast<ssize_t>(bytes.size())) {
          const int e = n < 0 ? errno : ENOSPC;
          throw io_error(sys("cannot preallocate " + human_bytes(bytes_on_disk) + " for " + path, e), e);
        }
        // Preallocated: a write inside the file never meets ENOSPC, so a full disk is reported
        // here, once, rather than in the middle of a training step. (Without fallocate, the
        // trailer's write has given the file its size.)
        if (::fallocate(fd, 0, 0, static_cast<off_t>(bytes_on_disk)) != 0 && errno != EOPNOTSUPP && errno != ENOSYS) {
          const int e = errno;
          throw io_error(sys("cannot preallocate " + human_bytes(bytes_on_disk) + " for " + path, e), e);
        }
        // Its size durable before the index that names it commits (generation 0, just below),
        // whatever the file system orders on its own: a lost size would make the store unopenable.
        if (::fsync(fd) != 0) throw io_error(sys("cannot fsync " + path, errno), errno);
        if (::fsync(dfd) != 0) throw io_error(sys("cannot fsync directory " + d.string(), errno), errno);
      } else {
        struct ::stat st {};
        if (::fstat(fd, &st) != 0) throw io_error(sys("cannot stat " + path, errno), errno);
        if (static_cast<std::uint64_t>(st.st_size) != bytes_on_disk)
          throw io_error("terrace: " + path + " is " + std::to_string(st.st_size) + " bytes; the index of " + dir_ +
                         " says " + std::to_string(bytes_on_disk) + ": not this store's swap file?");
        if (index.identity) check_trailer(fd, path, trailer);
      }
      if (direct_ && !enable_direct(fd, path)) {
        // Buffered from here on, for every file: the engine drives them all one way, and an
        // earlier file left with O_DIRECT would get unaligned transfers without a bounce buffer.
        direct_ = false;
        for (std::size_t k = 0; k + 1 < fds_.size(); ++k) disable_direct(fds_[k], names_[k]);
      }
    }
  }

  // Read before O_DIRECT is turned on (the buffer is not aligned).
  void check_trailer(int fd, const std::string& path, const swap_trailer& want) const {
    std::vector<unsigned char> buf(kSwapTrailerBytes);
    const ssize_t n = ::pread(fd, buf.data(), buf.size(), static_cast<off_t>(want.file_size));
    if (n < 0) throw io_error(sys("cannot read the trailer of " + path, errno), errno);
    const auto got = decode_swap_trailer(buf.data(), static_cast<std::size_t>(n));
    if (!got) {
      throw io_error("terrace: " + path + " does not end with a tensor store swap-file trailer: it is not a " +
                         "swap file of the store in " + dir_ + " (check stripe_directories)",
                     EINVAL);
    }
    if (got->identity != want.identity) {
      throw io_error("terrace: " + path + " is a swap file of another tensor store (identity " +
                         to_hex(got->identity) + "; the store in " + dir_ + " is " + to_hex(want.identity) +
                         "): do stripe_directories name another store's directories?",
                     EINVAL);
    }
    if (got->file != want.file || got->files != want.files || got->file_size != want.file_size) {
      throw io_error("terrace: " + path + " is swap file " + std::to_string(got->file) + " of " +
                         std::to_string(got->files) + " of the store in " + dir_ + ", expected here as file " +
                         std::to_string(want.file) + " of " + std::to_string(want.files) +
                         ": are stripe_directories in the order the store was created with?",
                     EINVAL);
    }
  }

  const std::string dir_;
  fd_guard dirfd_;
  fd_guard lock_fd_;
  std::vector<int> fds_;
  std::vector<std::string> names_;
  std::optional<store_identity> identity_;   // absent for a store created before identities
  std::vector<std::pair<int, std::string>> created_;  // during the constructor only
  bool lock_created_ = false;    // during the constructor only: what a failure removes
  bool marker_created_ = false;  // during the constructor only
  bool index_created_ = false;   // during the constructor only
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

// In a forked child the store is left as it is, never torn down: its destructor would join engine
// threads that do not exist in the child, and destroy condition variables on which parent
// threads were waiting at the fork (glibc's pthread_cond_destroy then waits for them forever).
tensor_store& tensor_store::operator=(tensor_store&& other) noexcept {
  if (impl_ && impl_->forked_away()) (void)impl_.release();
  impl_ = std::move(other.impl_);
  return *this;
}
tensor_store::~tensor_store() {
  if (impl_ && impl_->forked_away()) (void)impl_.release();
}

tensor_store tensor_store::create(const std::filesystem::path& directory, const tensor_store_options& options) {
  return tensor_store(std::make_unique<detail::tensor_store_impl>(directory, options, true));
}
tensor_store tensor_store::open(const std::filesystem::path& directory, const tensor_store_options& options) {
  return tensor_store(std::make_unique<detail::tensor_store_impl>(directory, options, false));
}

io_handle tensor_store::put(const std::string& id, const void* data, std::size_t size) { return impl_->usable().put(id, data, size); }
io_handle tensor_store::get(const std::string& id, void* into, std::size_t capacity) { return impl_->usable().get(id, into, capacity); }
void tensor_store::erase(const std::string& id) { impl_->usable().erase(id); }
std::uint64_t tensor_store::checkpoint() { return impl_->usable().checkpoint(); }
void tensor_store::wait_all() { impl_->usable().wait_all(); }
bool tensor_store::contains(const std::string& id) const { return impl_->usable().contains(id); }
std::optional<std::size_t> tensor_store::size_of(const std::string& id) const { return impl_->usable().size_of(id); }
std::vector<std::string> tensor_store::ids() const { return impl_->usable().ids(); }
std::uint64_t tensor_store::generation() const { return impl_->usable().generation(); }
std::uint64_t tensor_store::capacity() const { return impl_->usable().capacity(); }
std::uint64_t tensor_store::used_bytes() const { return impl_->usable().used_bytes(); }
bool tensor_store::direct() const { return impl_->usable().direct(); }
std::string tensor_store::describe() const { return impl_->usable().describe(); }
void tensor_store::inject_fault(const io_fault& fault) { impl_->usable().inject_fault(fault); }

}  // namespace terrace

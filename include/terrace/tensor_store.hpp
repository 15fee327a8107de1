// SPDX-License-Identifier: Apache-2.0
/// @file tensor_store.hpp
/// @brief The NVMe tier: a checksummed, crash-consistent tensor store over io_uring and O_DIRECT.
///
/// Tensors are byte strings named by a string id, stored in extents of one or more preallocated
/// swap files in a directory the user names. put/get are asynchronous and return an io_handle;
/// checkpoint() makes the current set durable: after a crash (kill -9 at any moment) open()
/// recovers exactly the last committed checkpoint. See docs/nvme.md for the knobs and numbers.
///
/// Thread safety: every member of tensor_store may be called from any thread.
///
/// fork(): a child forked without exec (a PyTorch DataLoader worker) cannot use a store its parent
/// opened: every member called there throws io_error (EBADF). The child lets go of the store's
/// files at the fork, so the store stays openable by the parent or another process while the
/// child lives. Handles inherited by the child never complete there.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <exception>
#include <memory>
#include <span>
#include <optional>
#include <string>
#include <vector>

namespace terrace {

namespace detail {
struct io_completion;
class tensor_store_impl;
}  // namespace detail

/// @brief A handle on one asynchronous read or write: poll it or wait for it. Copyable; all copies
/// see the same operation. A default-constructed handle is already complete.
class io_handle {
 public:
  io_handle() = default;
  explicit io_handle(std::shared_ptr<detail::io_completion> state) : state_(std::move(state)) {}

  /// @brief Whether the operation has finished (successfully or not). Never blocks, never throws.
  bool ready() const noexcept;
  /// @brief Blocks until the operation has finished.
  /// @throws io_error (EIO, ENOSPC, ...) or checksum_error (a get whose data failed its CRC32C,
  /// naming the tensor) when it failed; every wait on a failed handle throws again.
  void wait() const;

 private:
  std::shared_ptr<detail::io_completion> state_;
};

/// @brief Waits for every handle, even after one has failed (a transfer left running would go on
/// using its buffer); the first failure goes to `first_failure` unless that already holds one.
void wait_all(std::span<const io_handle> handles, std::exception_ptr& first_failure) noexcept;

/// @brief A failure the engine fakes, for tests of the error paths (a seam, not a feature).
struct io_fault {
  enum class kind {
    none,
    eio,        ///< the transfer completes with -EIO
    enospc,     ///< the transfer completes with -ENOSPC
    short_io,   ///< the transfer goes to the kernel with half its length (a real short transfer);
                ///< the engine must carry on with the rest
    eagain,     ///< the transfer completes with -EAGAIN; the engine must resubmit it
    /// the next checkpoint's fdatasync fails with EIO (faked by the store; reads, writes, skip
    /// and count do not apply)
    sync_eio,
    /// the next checkpoint's directory fsync, after its index was renamed into place, fails with
    /// EIO (faked by the store; reads, writes, skip and count do not apply)
    index_sync_eio,
    /// the ring's submissions fail with ENOMEM, `count` of them in a row (reads and writes do not
    /// apply): the engine pauses and tries again, and after about 10 s of refusals fails the
    /// requests whose transfers it could not submit, with ENOMEM
    submit_enomem,
    /// the transfer's completion is dropped, as the kernel drops one it has no memory to queue,
    /// and the ring's next wait reports EBADR: the engine fails the request that lost it with
    /// EBADR, once everything submitted before has finished
    lost_completion,
    /// the transfer completes with -EINTR; the engine resubmits it at once, and fails the request
    /// with EINTR when one piece is interrupted more than 10,000 times in a row
    eintr,
  };
  kind what = kind::none;
  bool reads = true;    ///< applies to reads
  bool writes = true;   ///< applies to writes
  int skip = 0;         ///< transfers that pass untouched before the first faulty one
  int count = 1;        ///< faulty transfers, then the seam disarms itself
};

/// @brief How a store is laid out and driven. Layout fields (capacity, files, block_size) are fixed
/// at create() and read back from the index by open(); the others may change between runs.
struct tensor_store_options {
  /// Bytes of tensor data the store can hold; rounded up to whole blocks in every file. create() only.
  std::uint64_t capacity = std::uint64_t{1} << 30;
  /// Swap files striped together (one per drive pays; several on one drive do not). create() only.
  unsigned files = 1;
  /// Where swap file i lives: stripe_directories[i % size], or the store's directory when empty.
  /// The index always lives in the store's directory.
  std::vector<std::filesystem::path> stripe_directories;
  /// Transfer unit, stripe unit and checksum unit (a multiple of 4 KiB). create() only.
  std::size_t block_size = std::size_t{1} << 20;
  /// Transfers kept in flight at once, across all requests.
  unsigned queue_depth = 16;
  /// Let a kernel thread poll the submission queue (IORING_SETUP_SQPOLL): fewer syscalls, one core spent.
  bool sqpoll = false;
  /// O_DIRECT (bypass the page cache). A file system without it (ramfs, tmpfs before Linux 6.6) falls back to buffered
  /// I/O with a one-line warning on stderr.
  bool direct = true;
};

/// @brief An asynchronous tensor store on NVMe (see the file comment).
class tensor_store {
 public:
  /// The longest id put() takes. Ids are names (a tensor's, a chunk's); the index keeps each with
  /// its length, and a bound keeps a runaway name from growing every checkpoint's index.
  static constexpr std::size_t max_id_bytes = 4096;

  /// @brief Creates a new, empty store in `directory`, which must exist; commits generation 0.
  /// Files are created 0600 with O_EXCL|O_NOFOLLOW; nothing outside the directory (and the
  /// stripe directories) is touched, and no file the store did not write is removed. A create
  /// interrupted before its commit (kill -9) leaves a directory that the next create() with the
  /// same stripe directories cleans up.
  /// @throws io_error when the directory is missing or already holds a store, holds a file named
  /// as one of the store's that the store did not write, or a swap file cannot be created or
  /// preallocated (ENOSPC: what() says how much was asked); logic_error for bad options.
  static tensor_store create(const std::filesystem::path& directory,
                             const tensor_store_options& options = {});

  /// @brief Opens an existing store at its last committed checkpoint; anything written after it is
  /// forgotten and its space reused. In a directory without a store it creates and removes
  /// nothing.
  /// @throws io_error for a missing directory, no store in it (what() says when a create() was
  /// interrupted: create() again), a missing swap file or one of another store or out of its
  /// place (stripe_directories naming the wrong directories or in the wrong order), a store
  /// locked by another process, or a truncated index; checksum_error for a corrupt index.
  static tensor_store open(const std::filesystem::path& directory,
                           const tensor_store_options& options = {});

  tensor_store(tensor_store&&) noexcept;
  tensor_store& operator=(tensor_store&&) noexcept;
  /// Waits for every transfer in flight, then closes. Does not checkpoint.
  ~tensor_store();

  /// @brief Stores `size` bytes from `data` under `id`, replacing any tensor of that id at once.
  /// `data` must stay valid and unchanged until the handle is ready. A put whose handle reports an
  /// error leaves `id` absent. Space is allocated before any write is issued.
  /// @throws out_of_memory when the store cannot hold `size` more bytes, even once the transfers
  /// in flight have finished and the puts that failed are dropped (what() gives what is free, the
  /// largest hole, and what holds the rest: live tensors, what only the next checkpoint() will
  /// release, and any other use); nothing observable changes then. logic_error for an id longer
  /// than max_id_bytes, before anything changes.
  io_handle put(const std::string& id, const void* data, std::size_t size);

  /// @brief Reads tensor `id` into `into` (at least size_of(id) bytes), verifying every block's
  /// CRC32C. Waits first if a put of `id` is still in flight.
  /// @throws io_error when `id` is unknown or its put failed; logic_error when `capacity` is too
  /// small. The handle reports checksum_error naming the tensor for corrupt data, io_error for EIO.
  io_handle get(const std::string& id, void* into, std::size_t capacity);

  /// @brief Forgets `id`. Its space is reused once no transfer of it is in flight and, if the
  /// committed checkpoint references it, after the next checkpoint() commits.
  /// @throws io_error (ENOENT) when `id` is unknown, a failed put's id included (its space is let
  /// go all the same).
  void erase(const std::string& id);

  /// @brief Waits for all transfers, makes the data durable (fdatasync) and commits a new index
  /// atomically (write, fsync, rename, fsync directory). Puts that failed are not in it. A put
  /// issued while it waits is in it if it finished before the snapshot; one still in flight is
  /// not, and a tensor such a put replaces is taken as it stood when the checkpoint began.
  /// @returns the new generation (one more than the last).
  /// @throws io_error when the data cannot be made durable or the index cannot be written; the
  /// last committed checkpoint stays. After a failed fdatasync every later checkpoint() throws
  /// too (io_error, EIO): the kernel may have dropped the unwritten pages and report success on
  /// the next sync, so nothing written since the last commit can be vouched for. Gets go on;
  /// reopening the store recovers the last committed generation.
  std::uint64_t checkpoint();

  /// @brief Waits until every transfer issued so far has finished (errors stay on their handles).
  void wait_all();

  bool contains(const std::string& id) const;
  /// Bytes of `id`, or nullopt when unknown.
  std::optional<std::size_t> size_of(const std::string& id) const;
  std::vector<std::string> ids() const;
  /// The generation of the last committed checkpoint.
  std::uint64_t generation() const;
  std::uint64_t capacity() const;
  /// Bytes of extents in use, including those held for the committed checkpoint until the next.
  std::uint64_t used_bytes() const;
  /// Whether the files are driven with O_DIRECT (false after the buffered fallback).
  bool direct() const;
  /// The engine's setup, e.g. "io_uring qd=16 block=1 MiB files=1 fixed-files fixed-buffers".
  std::string describe() const;

  /// @brief Test seam: makes the engine fake the given failure on its next transfers.
  void inject_fault(const io_fault& fault);

 private:
  explicit tensor_store(std::unique_ptr<detail::tensor_store_impl> impl);
  std::unique_ptr<detail::tensor_store_impl> impl_;
};

}  // namespace terrace

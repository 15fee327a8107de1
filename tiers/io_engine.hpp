// SPDX-License-Identifier: Apache-2.0
// Internal to tiers/: the contract of the NVMe I/O engine. The only implementation,
// io_uring_engine.cpp, is the one file in terrace that calls io_uring_* (as liburing routes every
// kernel entry through src/syscall.h); the tensor store sees only this header.
//
// The engine presents N files as one logical byte range striped in units of `block_size`: logical
// offset L lives in file (L / B) % N at offset (L / B / N) * B + L % B. A request is cut into
// blocks of `block_size` bytes (counted from the request's start); up to `queue_depth` pieces are
// in flight at once across all requests. One engine thread owns the ring: it submits, reaps, retries
// short transfers and EINTR at once and EAGAIN after a growing pause; a second engine thread runs
// the per-block hooks (checksums), so the ring thread never computes over data; submitters only
// enqueue, so they never block on the device.
//
// REQUIRES (direct files): logical offsets are multiples of kDirectAlign. Buffers and lengths may be
// anything: blocks whose memory or length is not aligned go through registered bounce buffers.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "terrace/tensor_store.hpp"

namespace terrace::detail {

inline constexpr std::size_t kDirectAlign = 4096;
/// The largest transfer block: an SQE's length is 32 bits, and the engine's bounce buffers hold
/// two blocks at least.
inline constexpr std::size_t kMaxBlockSize = std::size_t{256} << 20;

/// The shared state behind terrace::io_handle. Set once by the engine thread.
struct io_completion {
  std::atomic<bool> done{false};
  std::mutex mutex;
  std::condition_variable cv;
  std::exception_ptr error;  // guarded by mutex; read after done

  void finish(std::exception_ptr e) {
    {
      std::lock_guard lock(mutex);
      error = std::move(e);
      done.store(true, std::memory_order_release);
    }
    cv.notify_all();
  }
};

struct engine_file {
  int fd = -1;          // owned by the caller; must outlive the engine
  bool direct = false;  // opened with O_DIRECT: alignment rules apply
  std::string name;     // for error messages
};

struct engine_options {
  std::size_t block_size = std::size_t{1} << 20;  // multiple of kDirectAlign
  unsigned queue_depth = 16;
  bool sqpoll = false;
  std::uint64_t file_size = 0;  // bytes per file, a multiple of block_size
  // Refusals (EAGAIN) of one piece in a row, each after a pause doubling from 50 us to 50 ms,
  // before the transfer fails with that error: 200 is about 10 s. (EINTR is not a refusal: it
  // is resubmitted at once, up to 10,000 times in a row.)
  int max_refusals = 200;
};

enum class io_op { read, write };

/// Runs on the engine's hook thread for each block, with the block's bytes as the caller sees them
/// (`offset` counts from the request's start). Writes: while the block is in flight (the buffer
/// must not change until the completion is done, so the hook sees the bytes the device gets).
/// Reads: after the block has fully arrived in the caller's buffer. The completion is finished only
/// after every hook of the request has returned. Throwing fails the request with that exception
/// (no further blocks start; those in flight are drained, never abandoned; the request's remaining
/// hooks are skipped). Hooks of one request may run concurrently with its transfers, never with
/// each other.
using block_hook = std::function<void(std::size_t offset, const std::byte* data, std::size_t size)>;

struct io_request {
  io_op op = io_op::read;
  std::uint64_t offset = 0;  // logical
  std::byte* buffer = nullptr;
  std::size_t size = 0;
  block_hook hook;         // may be empty
  std::string what;        // "put of tensor 'x'", for error messages
};

class io_engine {
 public:
  virtual ~io_engine() = default;

  /// Queues a request and returns at once. The buffer must stay valid (and, for a write, unchanged)
  /// until the completion is done.
  virtual std::shared_ptr<io_completion> submit(io_request request) = 0;

  /// Arms the fault seam (see terrace::io_fault). Thread-safe.
  virtual void inject(const io_fault& fault) = 0;

  /// Whether SQPOLL, registered files and registered bounce buffers are in use (for tests/bench).
  virtual std::string describe() const = 0;
};

/// Starts an io_uring engine over `files` (all of options.file_size bytes).
/// @throws io_error when the ring cannot be set up (with SQPOLL: EPERM when not allowed).
std::unique_ptr<io_engine> make_io_uring_engine(const engine_options& options,
                                                std::vector<engine_file> files);

}  // namespace terrace::detail

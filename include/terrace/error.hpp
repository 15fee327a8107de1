// SPDX-License-Identifier: Apache-2.0
/// @file error.hpp
/// @brief The exception hierarchy of terrace's C++ API.
///
/// Every public C++ call documents which of these it throws. The C ABI (terrace.h) catches all of
/// them and turns them into return codes plus a last-error string.
#pragma once

#include <cstddef>
#include <new>
#include <stdexcept>
#include <string>
#include <string_view>

namespace terrace {

/// @brief A caller broke a precondition: a bad argument, a double free, a foreign pointer, a bad
/// configuration. The object stays usable; nothing was changed.
class logic_error : public std::logic_error {
 public:
  using std::logic_error::logic_error;
};

/// @brief A device backend call failed for a reason other than running out of memory (a CUDA error,
/// a missing driver entry point, an unsupported operation).
class device_error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// @brief A file or I/O operation failed: open, fallocate, a read or write through the NVMe
/// engine, fsync, rename. what() names the file or tensor and the operation; code() is the errno
/// (EIO, ENOSPC, ...), or 0 when the failure has none (a truncated index, an unexpected end of file).
class io_error : public std::runtime_error {
 public:
  explicit io_error(const std::string& message, int code = 0)
      : std::runtime_error(message), code_(code) {}
  int code() const noexcept { return code_; }

 private:
  int code_;
};

/// @brief Stored data failed its CRC32C check: a corrupt extent (what() names the tensor) or a
/// corrupt index. Data is never returned silently wrong. An io_error, so one handler can take both.
class checksum_error : public io_error {
 public:
  using io_error::io_error;
};

/// @brief The request could not be satisfied even after releasing cached memory.
///
/// what() carries the full report: what was asked, what is reserved but unused, the largest free
/// block, the fragmentation ratio and the largest live allocations.
class out_of_memory : public std::bad_alloc {
 public:
  explicit out_of_memory(std::string message) : message_(std::move(message)) {}
  const char* what() const noexcept override { return message_.c_str(); }

 private:
  std::string message_;
};

/// @brief The message of a terrace exception without its leading "terrace: ", for a caller that
/// puts its own name and context in front ("terrace replay: error: trace.json: ...").
inline std::string_view message_without_origin(const std::exception& e) noexcept {
  constexpr std::string_view origin = "terrace: ";
  std::string_view what = e.what();
  if (what.substr(0, origin.size()) == origin) what.remove_prefix(origin.size());
  return what;
}

}  // namespace terrace

/// Throws terrace::logic_error with the failed condition and location unless `cond` holds.
#define TERRACE_EXPECTS(cond, msg)                                                         \
  do {                                                                                     \
    if (!(cond)) {                                                                         \
      throw ::terrace::logic_error(std::string("terrace: ") + (msg) + " (expected " #cond \
                                   ")");                                                   \
    }                                                                                      \
  } while (0)

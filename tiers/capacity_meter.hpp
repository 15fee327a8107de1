// SPDX-License-Identifier: Apache-2.0
// Internal to tiers/: the capacity accounting of the host-side backends (sim and null). Both
// promise the same thing: a reserve or map that would pass the capacity fails with out_of_memory
// naming the backend, what was asked and what is left, and used_bytes() is readable without a lock.
//
// REQUIRES: the owner serializes charge/uncharge (the backends hold their memory mutex around
// them); used() may be read from any thread.
#pragma once

#include <atomic>
#include <cstddef>
#include <string>
#include <utility>

#include "terrace/error.hpp"
#include "tiers/backends.hpp"

namespace terrace::detail {

class capacity_meter {
 public:
  capacity_meter(std::string backend, std::size_t capacity)
      : backend_(std::move(backend)), capacity_(capacity) {}

  /// Counts `bytes` as used. @throws out_of_memory (nothing counted) when they do not fit.
  void charge(std::size_t bytes, const char* what) {
    const std::size_t used = used_.load(std::memory_order_relaxed);
    if (bytes > capacity_ - used) {
      throw out_of_memory("terrace: out of memory on device '" + backend_ + "': " +
                          std::string(what) + " of " + describe_bytes(bytes) + ", but only " +
                          describe_bytes(capacity_ - used) + " of the capacity of " +
                          describe_bytes(capacity_) + " is free");
    }
    used_.store(used + bytes, std::memory_order_relaxed);
  }

  void uncharge(std::size_t bytes) noexcept {
    used_.store(used_.load(std::memory_order_relaxed) - bytes, std::memory_order_relaxed);
  }

  std::size_t used() const noexcept { return used_.load(std::memory_order_relaxed); }
  std::size_t capacity() const noexcept { return capacity_; }

 private:
  const std::string backend_;
  const std::size_t capacity_;
  std::atomic<std::size_t> used_{0};
};

}  // namespace terrace::detail

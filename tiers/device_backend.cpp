// SPDX-License-Identifier: Apache-2.0
// The non-virtual front of device_backend: argument checks and fault injection, which every
// backend shares, plus the "no virtual memory" defaults for backends without VMM.
#include <cstdio>
#include <cstdlib>
#include <string>

#include "terrace/device.hpp"
#include "terrace/error.hpp"
#include "tiers/backends.hpp"

namespace terrace {
namespace {

// Takes one unit from `counter` if it is positive. A CAS loop rather than fetch_sub, so that a
// counter at zero stays at zero when several threads race past it.
bool consume_one(std::atomic<int>& counter) noexcept {
  int n = counter.load(std::memory_order_relaxed);
  while (n > 0) {
    if (counter.compare_exchange_weak(n, n - 1, std::memory_order_relaxed)) return true;
  }
  return false;
}

}  // namespace

// ---------------------------------------------------------------- fault injection

void device_backend::throw_if_injected(std::size_t bytes, const char* what) {
  if (consume_one(injected_oom_)) {
    throw out_of_memory("terrace: out of memory on device '" + properties_.name + "' (injected): " +
                        what + " of " + detail::describe_bytes(bytes));
  }
  if (consume_one(injected_error_)) {
    throw device_error("terrace: device error on '" + properties_.name + "' (injected): " + what +
                       " of " + detail::describe_bytes(bytes) + " failed");
  }
}

// ---------------------------------------------------------------- the checked entry points

void* device_backend::reserve(std::size_t bytes) {
  TERRACE_EXPECTS(bytes > 0, "reserve of 0 bytes on device '" + properties_.name + "'");
  throw_if_injected(bytes, "reserve");
  return do_reserve(bytes);
}

void* device_backend::reserve_address_range(std::size_t bytes) {
  TERRACE_EXPECTS(bytes > 0,
                  "reserve_address_range of 0 bytes on device '" + properties_.name + "'");
  return do_reserve_address_range(bytes);
}

void device_backend::map(void* p, std::size_t bytes) {
  TERRACE_EXPECTS(bytes > 0, "map of 0 bytes on device '" + properties_.name + "'");
  throw_if_injected(bytes, "map");
  do_map(p, bytes);
}

void* device_backend::reserve_pinned_host(std::size_t bytes) {
  TERRACE_EXPECTS(bytes > 0, "reserve_pinned_host of 0 bytes on device '" + properties_.name + "'");
  throw_if_injected(bytes, "reserve_pinned_host");
  void* p = do_reserve_pinned_host(bytes);
  try {
    std::lock_guard<std::mutex> lock(pinned_mutex_);
    pinned_regions_.emplace(reinterpret_cast<std::uintptr_t>(p), bytes);
  } catch (...) {
    do_release_pinned_host(p, bytes);
    throw;
  }
  return p;
}

void device_backend::release_pinned_host(void* p, std::size_t bytes) noexcept {
  {
    std::lock_guard<std::mutex> lock(pinned_mutex_);
    const auto it = pinned_regions_.find(reinterpret_cast<std::uintptr_t>(p));
    const auto call = [&] {
      return "release_pinned_host(" + detail::hex_address(reinterpret_cast<std::uintptr_t>(p)) +
             ", " + std::to_string(bytes) + "): ";
    };
    if (it == pinned_regions_.end()) {
      detail::contract_violation(
          properties_.name, call() + "not a live region from reserve_pinned_host (released twice?)");
    }
    if (it->second != bytes) {
      detail::contract_violation(properties_.name, call() + "the region was reserved with " +
                                                       std::to_string(it->second) + " bytes");
    }
    pinned_regions_.erase(it);
  }
  do_release_pinned_host(p, bytes);
}

// ---------------------------------------------------------------- defaults: no virtual memory

void* device_backend::do_reserve_address_range(std::size_t) {
  throw device_error("terrace: device '" + properties_.name +
                     "' does not support virtual memory (reserve_address_range)");
}

void device_backend::do_release_address_range(void*, std::size_t) noexcept {}

void device_backend::do_map(void*, std::size_t) {
  throw device_error("terrace: device '" + properties_.name +
                     "' does not support virtual memory (map)");
}

void device_backend::do_unmap(void*, std::size_t) noexcept {}

// ---------------------------------------------------------------- helpers shared by the backends

namespace detail {

std::string describe_bytes(std::size_t bytes) {
  static constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  double v = static_cast<double>(bytes);
  int unit = 0;
  while (v >= 1024.0 && unit < 6) {
    v /= 1024.0;
    ++unit;
  }
  char buf[96];
  if (unit == 0) {
    std::snprintf(buf, sizeof buf, "%zu bytes", bytes);
  } else {
    std::snprintf(buf, sizeof buf, "%.2f %s (%zu bytes)", v, kUnits[unit], bytes);
  }
  return buf;
}

void contract_violation(std::string_view backend, std::string_view message) noexcept {
  std::fprintf(stderr, "terrace: fatal: device '%.*s': %.*s\n", static_cast<int>(backend.size()),
               backend.data(), static_cast<int>(message.size()), message.data());
  std::fflush(stderr);
  std::abort();
}

}  // namespace detail
}  // namespace terrace

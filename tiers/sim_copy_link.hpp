// SPDX-License-Identifier: Apache-2.0
// Internal to tiers/sim_device.cpp: the sim device's modelled copy links. A GPU has one copy
// engine, and one PCIe direction, each way: copies of different streams in the same direction
// take turns on it, while a host-to-device and a device-to-host copy overlap. So the device has
// one link per direction, shared by all its streams, and a copy books its direction's link for
// bytes / bandwidth from when both it and the link are ready.
//
// Device-to-device and host-to-host copies book no link: the first runs over the device's own
// memory (hundreds of GB/s, well above PCIe) and the second over the host's, so neither crosses
// the link copy_bandwidth describes; charging them its time would also delay the real transfers
// queued behind them on the link. They take as long as their memcpy.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <mutex>

#include "terrace/device.hpp"

namespace terrace::detail {

class sim_copy_link {
 public:
  using clock_type = std::chrono::steady_clock;

  struct booking {
    clock_type::time_point start;
    clock_type::duration length;
  };

  explicit sim_copy_link(double bandwidth) noexcept : bandwidth_(bandwidth) {}

  /// Books `bytes` on the link for a copy that could start at `ready`: it starts then or when
  /// the link's previous booking ends, whichever is later, and holds the link for the modelled
  /// time. REQUIRES: bandwidth > 0.
  booking book(clock_type::time_point ready, std::size_t bytes) {
    const clock_type::duration length = modelled_time(bytes);
    std::lock_guard<std::mutex> lock(m_);
    const clock_type::time_point start = std::max(ready, free_at_);
    free_at_ = saturating_add(start, length);
    return {start, length};
  }

  /// t + d, held at the clock's end: copies queued back to back on a vanishing bandwidth add up
  /// centuries, past the clock's range.
  static clock_type::time_point saturating_add(clock_type::time_point t,
                                               clock_type::duration d) noexcept {
    return d > clock_type::time_point::max() - t ? clock_type::time_point::max() : t + d;
  }

 private:
  clock_type::duration modelled_time(std::size_t bytes) const noexcept {
    // Clamped to a century: a bandwidth far below a byte per second would otherwise overflow the
    // clock's 64-bit nanoseconds and, wrapped, make the slowest link the fastest.
    constexpr double kLongestCopySeconds = 100.0 * 365 * 24 * 3600;
    return std::chrono::duration_cast<clock_type::duration>(std::chrono::duration<double>(
        std::min(static_cast<double>(bytes) / bandwidth_, kLongestCopySeconds)));
  }

  const double bandwidth_;
  std::mutex m_;
  clock_type::time_point free_at_{};  // when the latest booking ends
};

// The device's two links; a stream keeps them alive while it may still book them.
class sim_copy_links {
 public:
  explicit sim_copy_links(double bandwidth) noexcept
      : bandwidth_(bandwidth), host_to_device_(bandwidth), device_to_host_(bandwidth) {}

  /// Whether copies are modelled at all (copy_bandwidth > 0).
  bool modelled() const noexcept { return bandwidth_ > 0.0; }

  /// The link a copy of this kind books, or null: none is modelled for it (see the file comment).
  sim_copy_link* of(copy_kind kind) noexcept {
    if (!modelled()) return nullptr;
    switch (kind) {
      case copy_kind::host_to_device:
        return &host_to_device_;
      case copy_kind::device_to_host:
        return &device_to_host_;
      default:
        return nullptr;
    }
  }

 private:
  const double bandwidth_;
  sim_copy_link host_to_device_;
  sim_copy_link device_to_host_;
};

}  // namespace terrace::detail

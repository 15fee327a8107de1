// SPDX-License-Identifier: Apache-2.0
// What a free does about the other streams that used a block (record_stream): both the caching
// allocator and the planned front end mark their queued work with events, reusing the block only
// once those complete.
#pragma once

#include <cstdint>
#include <vector>

#include "terrace/device.hpp"

namespace terrace::detail {

/// @brief Records an event (from `acquire`) on each of `streams`, marking the work queued there.
/// If the device refuses one (a stream destroyed since record_stream named it, or one of another
/// device, on which this device's events cannot be recorded), the events taken go back through
/// `give_back` and the host waits for every such stream instead (for the whole device where the
/// stream itself is refused): none is returned and the block is free at once. Refusing the free
/// would keep the block live, and a caller that never retries a free (PyTorch) would leak it.
/// @throws whatever the device throws if it cannot even be synchronized (nothing recorded).
template <class Acquire, class GiveBack>
std::vector<event_ref> mark_stream_uses(device_backend& device,
                                        const std::vector<std::uintptr_t>& streams,
                                        Acquire&& acquire, GiveBack&& give_back) {
  std::vector<event_ref> events;
  try {
    events.reserve(streams.size());
    for (const std::uintptr_t s : streams) {
      events.push_back(acquire());
      device.record(events.back(), stream_ref{reinterpret_cast<void*>(s)});
    }
    return events;
  } catch (...) {
    for (const event_ref e : events) give_back(e);
  }
  for (const std::uintptr_t s : streams) {
    try {
      device.synchronize(stream_ref{reinterpret_cast<void*>(s)});
    } catch (...) {
      device.synchronize_device();
    }
  }
  return {};
}

}  // namespace terrace::detail

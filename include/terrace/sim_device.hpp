// SPDX-License-Identifier: Apache-2.0
/// @file sim_device.hpp
/// @brief What only the simulated device ("sim") offers: host callbacks queued in stream order.
///
/// Tests and tools use them to stand in for kernels: a callback that writes a buffer is a kernel
/// that produces it, one that checks it is a kernel that consumes it, one that blocks on a flag is a
/// long-running kernel that holds the stream back.
#pragma once

#include <functional>

#include "terrace/device.hpp"

namespace terrace {

/// @brief True when `device` is a "sim" backend (as made by make_device("sim") or "auto" without a
/// GPU), so that enqueue_host_function accepts it.
bool is_sim_device(const device_backend& device) noexcept;

/// @brief Queues `fn` on stream `s` of the sim device: it runs on that stream's worker thread after
/// all work queued on `s` before it, and work queued after it waits for it to return.
///
/// An exception thrown by `fn` is caught on the worker; the next synchronize() of that stream (or
/// synchronize_device()) throws it as terrace::device_error, once; if the stream is destroyed
/// first, the next synchronize_device() does. Later work on the stream still runs. `fn` must not
/// synchronize the stream it runs on (it would wait for itself), nor a stream or event whose work
/// waits (through events, maybe via further streams) for work queued behind `fn` on its stream:
/// such a synchronize throws terrace::logic_error inside `fn`; destroying that stream, or such a
/// stream, from `fn` aborts with a message.
/// @throws terrace::logic_error if `device` is not a sim device, `s` is not one of its streams, or
///         `fn` is empty.
void enqueue_host_function(device_backend& device, stream_ref s, std::function<void()> fn);

}  // namespace terrace

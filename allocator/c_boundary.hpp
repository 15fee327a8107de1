// SPDX-License-Identifier: Apache-2.0
// Internal to libterrace.so: where C++ exceptions stop. Every extern "C" entry point (allocator/
// c_api.cpp, optimizer/c_api.cpp) runs its body inside guarded(), which turns whatever it throws
// into a terrace_status and the calling thread's last-error string (terrace_last_error()), the
// way faiss's CATCH_AND_HANDLE does. One mechanism, so that every part of the C ABI reports
// errors the same way.
#pragma once

#include <new>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "terrace/error.hpp"
#include "terrace/terrace.h"

namespace terrace::c_boundary {

/// An output buffer is too small: TERRACE_ERANGE.
class range_error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Trivially initialised, so that clearing it on the hot path (terrace_malloc) needs no TLS guard.
extern thread_local bool t_has_error;

/// Stores "<call>: <prefix><what>" as the thread's last error. Never throws.
void set_error(const char* call, const char* prefix, const char* what) noexcept;
/// The thread's last error text (valid until its next failing call; at most 4 KiB, longer ones
/// cut with "...").
const char* error_text() noexcept;

/// Runs `body`; returns TERRACE_OK, or the status of what it threw with the message stored.
/// `call` names the C function: a const char*, or a callable returning std::string that runs
/// only on failure (for messages that format the arguments).
template <class Call, class Body>
int guarded(Call&& call, Body&& body) noexcept {
  t_has_error = false;
  const auto fail = [&](const char* prefix, const char* what) noexcept {
    if constexpr (std::is_invocable_v<Call>) {
      try {
        const std::string name = call();
        set_error(name.c_str(), prefix, what);
      } catch (...) {
        set_error("terrace", prefix, what);
      }
    } else {
      set_error(call, prefix, what);
    }
  };
  // Each handler copies the message while the exception object is alive.
  try {
    body();
    return TERRACE_OK;
  } catch (const out_of_memory& e) {
    fail("", e.what());
    return TERRACE_ENOMEM;
  } catch (const logic_error& e) {
    fail("", e.what());
    return TERRACE_EINVAL;
  } catch (const device_error& e) {
    fail("", e.what());
    return TERRACE_EDEVICE;
  } catch (const io_error& e) {
    fail("", e.what());
    return TERRACE_EIO;
  } catch (const range_error& e) {
    fail("", e.what());
    return TERRACE_ERANGE;
  } catch (const std::bad_alloc& e) {
    fail("terrace: out of host memory: ", e.what());
    return TERRACE_ENOMEM;
  } catch (const std::exception& e) {
    fail("terrace: internal error: ", e.what());
    return TERRACE_EINTERNAL;
  } catch (...) {
    fail("terrace: internal error: ", "an exception that is not a std::exception");
    return TERRACE_EINTERNAL;
  }
}

}  // namespace terrace::c_boundary

// SPDX-License-Identifier: Apache-2.0
#include "allocator/c_boundary.hpp"

#include <cstddef>

namespace terrace::c_boundary {

thread_local bool t_has_error = false;

namespace {
// A plain array, not a std::string: a thread's thread_local objects are destroyed before the
// process's static destructors run, and embedders free (and fail) from those destructors too. A
// buffer without a destructor stays writable, and the pointer terrace_last_error() returned stays
// valid, for the thread's whole life. Only overwritten, never cleared: t_has_error says whether it
// is current. Longer messages are cut with "...".
constexpr std::size_t kErrorCapacity = 4096;
// The call's description quotes its arguments (a config string, a path), which may be as long as
// the buffer: it gets at most this much, so that the reason of the failure always has room.
constexpr std::size_t kCallCapacity = 1024;
thread_local char t_error[kErrorCapacity];

// Appends `s` at t_error[at], up to t_error[end] (exclusive; the default keeps room for the
// terminator); returns the new end. A cut is marked with "...".
std::size_t append(std::size_t at, const char* s, std::size_t end = kErrorCapacity - 1) noexcept {
  while (*s != '\0' && at < end) t_error[at++] = *s++;
  if (*s != '\0') {  // cut: mark it
    for (std::size_t i = end - 3; i < end; ++i) t_error[i] = '.';
    at = end;
  }
  return at;
}
}  // namespace

void set_error(const char* call, const char* prefix, const char* what) noexcept {
  std::size_t at = append(0, call, kCallCapacity);
  at = append(at, ": ");
  at = append(at, prefix);
  at = append(at, what);
  t_error[at] = '\0';
  t_has_error = true;
}

const char* error_text() noexcept { return t_error; }

}  // namespace terrace::c_boundary

TERRACE_API const char* terrace_last_error(void) {
  return terrace::c_boundary::t_has_error ? terrace::c_boundary::error_text() : "";
}

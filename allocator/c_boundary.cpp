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
thread_local char t_error[kErrorCapacity];

// Appends `s` at t_error[at]; returns the new end. Keeps room for the terminator.
std::size_t append(std::size_t at, const char* s) noexcept {
  while (*s != '\0' && at + 1 < kErrorCapacity) t_error[at++] = *s++;
  if (*s != '\0') {  // cut: mark it
    for (std::size_t i = kErrorCapacity - 4; i + 1 < kErrorCapacity; ++i) t_error[i] = '.';
    at = kErrorCapacity - 1;
  }
  return at;
}
}  // namespace

void set_error(const char* call, const char* prefix, const char* what) noexcept {
  std::size_t at = append(0, call);
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

// SPDX-License-Identifier: Apache-2.0
#include "allocator/c_boundary.hpp"

namespace terrace::c_boundary {

thread_local bool t_has_error = false;

namespace {
// Only overwritten, never cleared: t_has_error says whether it is current.
thread_local std::string t_error;
}  // namespace

void set_error(const char* call, const char* prefix, const char* what) noexcept {
  try {
    t_error.assign(call).append(": ").append(prefix).append(what);
  } catch (...) {
    t_error.clear();  // without host memory the status code alone must do
  }
  t_has_error = true;
}

const std::string& error_text() noexcept { return t_error; }

}  // namespace terrace::c_boundary

TERRACE_API const char* terrace_last_error(void) {
  return terrace::c_boundary::t_has_error ? terrace::c_boundary::error_text().c_str() : "";
}

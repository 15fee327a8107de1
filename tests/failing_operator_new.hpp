// SPDX-License-Identifier: Apache-2.0
// A host out of memory on demand, for the host-OOM tests: replaces the global operator new (every
// form the plain operator delete below may free: std::stable_sort's buffer comes from the nothrow
// form, and a runtime's own form paired with this delete is a mismatch to ASan) with one that
// fails as the calling thread asks. Only that thread's allocations fail: the sim device's stream
// workers allocate too, and failing them would test the device, not the code under test.
//
// Include it in exactly one translation unit of a test executable.
#pragma once

#include <cstdlib>
#include <new>

namespace terrace::testing {

inline thread_local long allocations_until_failure = -1;  // -1: never; N: the (N+1)-th fails
inline thread_local bool host_full = false;                // every allocation fails
inline thread_local bool injected = false;  // a failure was injected (set, never cleared here)

inline void* counted_allocation(std::size_t n) {
  if (host_full || (allocations_until_failure >= 0 && allocations_until_failure-- == 0)) {
    injected = true;
    throw std::bad_alloc();
  }
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}

/// While it lives, every allocation of this thread fails.
class host_out_of_memory {
 public:
  host_out_of_memory() { host_full = true; }
  ~host_out_of_memory() { host_full = false; }
  host_out_of_memory(const host_out_of_memory&) = delete;
  host_out_of_memory& operator=(const host_out_of_memory&) = delete;
};

}  // namespace terrace::testing

void* operator new(std::size_t n) { return terrace::testing::counted_allocation(n); }
void* operator new[](std::size_t n) { return terrace::testing::counted_allocation(n); }
void* operator new(std::size_t n, const std::nothrow_t&) noexcept {
  try {
    return terrace::testing::counted_allocation(n);
  } catch (const std::bad_alloc&) {
    return nullptr;
  }
}
void* operator new[](std::size_t n, const std::nothrow_t&) noexcept {
  return operator new(n, std::nothrow);
}
void operator delete(void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }

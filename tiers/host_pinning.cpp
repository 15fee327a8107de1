// SPDX-License-Identifier: Apache-2.0
// Pinned host memory without CUDA (the default of device_backend, used by sim and null): an
// anonymous mapping, asked for transparent huge pages, then populated and locked with mlock.
//
// Why huge pages first: on this project's machines 1 GiB populates at ~3.3 GB/s with 4 KiB pages
// and ~11 GB/s with THP (../shared/MISSION.md), and locking populates every page. Regions are
// reserved once and sub-allocated (pinned_host_pool), so this cost is paid once per region.
// Regions are not inherited by a forked child (MADV_DONTFORK, as RDMA libraries do with memory
// they register).
#include <sys/mman.h>
#include <sys/resource.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "terrace/device.hpp"
#include "terrace/error.hpp"
#include "tiers/backends.hpp"

namespace terrace {
namespace {

// What to do about a refused mlock: raise a finite limit; under an unlimited one (root, or
// CAP_IPC_LOCK) the host itself had no memory to lock.
std::string memlock_advice() {
  rlimit limit{};
  const bool known = ::getrlimit(RLIMIT_MEMLOCK, &limit) == 0;
  if (known && limit.rlim_cur == RLIM_INFINITY) {
    return "the locked-memory limit is unlimited, so the host had no memory to lock and populate "
           "that many pages: ask for a smaller pinned pool or free host memory";
  }
  const std::string now =
      known ? detail::describe_bytes(static_cast<std::size_t>(limit.rlim_cur)) : "unknown";
  return "the locked-memory limit (ulimit -l, RLIMIT_MEMLOCK) is " + now +
         ": raise it (e.g. `ulimit -l unlimited`, or memlock in /etc/security/limits.conf) or ask "
         "for a smaller pinned pool";
}

}  // namespace

void* device_backend::do_reserve_pinned_host(std::size_t bytes) {
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    const int err = errno;
    throw out_of_memory("terrace: pinned host memory for device '" + properties_.name +
                        "': mmap of " + detail::describe_bytes(bytes) + " failed: " +
                        std::strerror(err));
  }
  (void)::madvise(p, bytes, MADV_HUGEPAGE);  // advisory: without THP the region still works
  // A child forked without exec (a DataLoader worker) gets no copy of the region. Shared, its
  // pages would be copy-on-write, and the parent's next write to each one would copy it (0.45 s
  // more for the first write to 512 MiB after one fork, on this project's machines); nothing of
  // the tiers can be used in such a child anyway (fork_guard.hpp). Cannot fail on an anonymous
  // mapping (EINVAL is for device and PFN mappings).
  (void)::madvise(p, bytes, MADV_DONTFORK);
  if (::mlock(p, bytes) != 0) {
    const int err = errno;
    ::munmap(p, bytes);
    if (err == ENOMEM || err == EPERM || err == EAGAIN) {
      throw out_of_memory(
          "terrace: pinned host memory for device '" + properties_.name + "': mlock of " +
          detail::describe_bytes(bytes) + " refused (" + std::strerror(err) + "); " +
          memlock_advice());
    }
    throw device_error("terrace: pinned host memory for device '" + properties_.name +
                       "': mlock of " + detail::describe_bytes(bytes) + " failed: " +
                       std::strerror(err));
  }
  return p;
}

void device_backend::do_release_pinned_host(void* p, std::size_t bytes) noexcept {
  // munmap also unlocks.
  if (::munmap(p, bytes) != 0) {
    detail::contract_violation(properties_.name, "release_pinned_host of a range that is not "
                                                 "a reserved pinned region");
  }
}

}  // namespace terrace

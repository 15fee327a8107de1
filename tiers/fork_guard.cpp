// tiers/fork_guard.cpp: the registry of fork_guard objects and the pthread_atfork handlers.
#include "tiers/fork_guard.hpp"

#include <pthread.h>

#include <cstring>
#include <mutex>
#include <string>

#include "terrace/error.hpp"

namespace terrace::detail {

namespace {
// The prepare handler holds the mutex across fork(), so the child finds the list whole and the
// mutex held by its only thread.
std::mutex registry_mutex;
fork_guard* registry_first = nullptr;  // guarded by registry_mutex
}  // namespace

struct fork_handlers {
  static void prepare() { registry_mutex.lock(); }
  static void parent() { registry_mutex.unlock(); }
  static void child() {
    for (fork_guard* g = registry_first; g != nullptr; g = g->next_) {
      g->forked_away_.store(true, std::memory_order_relaxed);
      g->abandon_after_fork();
    }
    registry_mutex.unlock();
  }
};

void fork_guard::install() {
  static const int rc = ::pthread_atfork(fork_handlers::prepare, fork_handlers::parent, fork_handlers::child);
  if (rc != 0) {
    throw io_error("terrace: cannot install the fork handler that tells a forked child to let go of the "
                   "store's files and the optimizer's threads (pthread_atfork): " + std::string(std::strerror(rc)) +
                   " (errno " + std::to_string(rc) + ")",
                   rc);
  }
}

fork_guard::~fork_guard() { unregister_for_fork(); }

void fork_guard::register_for_fork() noexcept {
  std::lock_guard lock(registry_mutex);
  if (registered_) return;
  next_ = registry_first;
  if (registry_first != nullptr) registry_first->prev_ = this;
  registry_first = this;
  registered_ = true;
}

void fork_guard::unregister_for_fork() noexcept {
  std::lock_guard lock(registry_mutex);
  if (!registered_) return;
  if (prev_ != nullptr) prev_->next_ = next_;
  else registry_first = next_;
  if (next_ != nullptr) next_->prev_ = prev_;
  prev_ = next_ = nullptr;
  registered_ = false;
}

}  // namespace terrace::detail

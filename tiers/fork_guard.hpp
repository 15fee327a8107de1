// tiers/fork_guard.hpp: lets go of a process's I/O resources in a child forked without exec.
//
// A child forked without exec (a PyTorch DataLoader worker) inherits every descriptor of its
// parent, and with them the flocks of the tensor store's files and the io_uring ring, which holds
// the swap files registered in it: alive in the child, they keep the store locked after the
// parent closed it or was killed. Nothing of the store can be used in the child (the engine's
// threads do not exist there), so a child handler of pthread_atfork closes them at once.
//
// The optimizer's thread pool uses the same mechanism to know it is in such a child, where its
// workers do not exist (it then runs every part on the calling thread).
//
// One mechanism for every such object: it derives from fork_guard, and its registration lasts
// from the end of its construction to the start of its destruction, so the child handler sees
// only objects whose descriptors are all open and constant. The list is intrusive, so that
// registering an object once built cannot fail.
#pragma once

#include <atomic>

namespace terrace::detail {

class fork_guard {
 public:
  /// Installs the process's fork handlers (once; later calls do nothing).
  /// @throws io_error when pthread_atfork refuses. Call it before the object acquires anything.
  static void install();

  fork_guard() = default;
  fork_guard(const fork_guard&) = delete;
  fork_guard& operator=(const fork_guard&) = delete;

  /// Whether this process is a child forked from the one that registered this object.
  bool forked_away() const noexcept { return forked_away_.load(std::memory_order_relaxed); }

 protected:
  ~fork_guard();  // unregisters, if registered

  /// Registers the object: from now on, a fork's child calls abandon_after_fork() on it.
  void register_for_fork() noexcept;
  /// Unregisters it; call it first in the derived destructor, before anything is torn down.
  void unregister_for_fork() noexcept;

  /// In the child, on its only thread, with no lock of the object's held: close descriptors and
  /// unmap memory only, nothing that could wait for a thread of the parent.
  virtual void abandon_after_fork() noexcept = 0;

 private:
  friend struct fork_handlers;
  std::atomic<bool> forked_away_{false};  // set only in a forked child, by its only thread
  bool registered_ = false;               // guarded by the registry's mutex
  fork_guard* prev_ = nullptr;            // guarded by the registry's mutex
  fork_guard* next_ = nullptr;
};

}  // namespace terrace::detail

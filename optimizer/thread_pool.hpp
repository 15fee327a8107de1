// SPDX-License-Identifier: Apache-2.0
// A fixed team of threads that runs one job at a time, each member on its own index.
//
// Why our own pool and not OpenMP: (1) libgomp is not built with ThreadSanitizer, so every
// OpenMP region reports false races and the `concurrent` tests could not run under TSan;
// (2) this library is loaded into PyTorch processes, which bring their own OpenMP runtime
// (libgomp or Intel's libiomp): two runtimes in one process oversubscribe the cores or abort, and
// torch.set_num_threads would silently change our thread count; (3) an optimizer step is one
// static split of a streaming loop, which needs nothing of OpenMP but a barrier. A step of 100M
// parameters takes tens of milliseconds; the condition-variable wake-up (~10 us) is noise there.
#pragma once

#include <cfenv>
#include <climits>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "tiers/fork_guard.hpp"

namespace terrace::detail {

class thread_pool : private fork_guard {
 public:
  /// `threads` counts the caller: 1 starts no thread. REQUIRES: threads >= 1.
  /// @throws out_of_memory, with every thread it started joined, when the host refuses a thread.
  explicit thread_pool(unsigned threads);
  ~thread_pool();
  thread_pool(const thread_pool&) = delete;
  thread_pool& operator=(const thread_pool&) = delete;

  unsigned size() const noexcept { return size_; }

  /// Runs fn(i) for every i in [0, size()): i == 0 on the calling thread, the rest on the pool.
  /// Returns when all have returned. Calls from several threads are serialised. With `parts` 1,
  /// only fn(0) runs, on the calling thread, and no worker is woken (a job too small to split
  /// would otherwise pay a wake-up and a wait per worker). Every fn(i) runs in the caller's
  /// floating-point environment (rounding mode, and on x86 MXCSR's flush-to-zero and
  /// denormals-are-zero), not the one the worker was started with.
  /// In a child forked without exec, which has none of the workers, every fn(i) runs on the
  /// calling thread, one after another (same parts, same results); the pool can be destroyed there.
  /// A fork while another thread of the parent was inside run() is not supported.
  /// If an fn(i) throws, run() rethrows the first exception caught, once every part it started
  /// has returned (fn and what it refers to stay alive until then); the pool stays usable.
  /// A run() from inside an fn(i) of the same pool runs its parts on that thread, one after
  /// another (its workers are busy with the outer run: waiting for them would never end).
  /// REQUIRES: fn(i) for i >= parts does nothing.
  template <class Fn>
  void run(Fn&& fn, unsigned parts = UINT_MAX) {
    auto* target = &fn;
    run_erased([](void* f, unsigned i) { (*static_cast<decltype(target)>(f))(i); }, target, parts);
  }

 private:
  void run_erased(void (*call)(void*, unsigned), void* fn, unsigned parts);
  void run_inline(void (*call)(void*, unsigned), void* fn, unsigned parts);
  void work(unsigned index);
  // Calls call(fn, index), keeping the job's first exception in error_.
  void call_part(void (*call)(void*, unsigned), void* fn, unsigned index) noexcept;
  void stop_and_join() noexcept;

  // Nothing to let go of at a fork: forked_away() is all the child needs (run, stop_and_join).
  void abandon_after_fork() noexcept override {}

  unsigned size_;
  std::mutex run_mutex_;  // one job at a time
  std::mutex mutex_;
  // On the heap so that a forked child can leave it alone: glibc's pthread_cond_broadcast and
  // pthread_cond_destroy wait for the workers waiting on it, which do not exist there.
  std::unique_ptr<std::condition_variable> start_ = std::make_unique<std::condition_variable>();
  std::condition_variable done_;
  std::uint64_t generation_ = 0;
  unsigned pending_ = 0;
  bool stop_ = false;
  void (*call_)(void*, unsigned) = nullptr;
  void* fn_ = nullptr;
  std::exception_ptr error_;  // the job's first exception, rethrown by run()
  // The caller's floating-point environment, for the workers to take on. A thread inherits its
  // creator's at creation only: a caller that set flush-to-zero afterwards (torch's
  // set_flush_denormal, -ffast-math's startup code in a later-loaded library) had its part of a
  // step flushed and the workers' parts not, so the results depended on the thread count.
  std::fenv_t env_{};
  std::vector<std::thread> workers_;
};

}  // namespace terrace::detail

// SPDX-License-Identifier: Apache-2.0
#include "optimizer/thread_pool.hpp"

#include <algorithm>
#include <exception>
#include <string>

#include "terrace/error.hpp"

namespace terrace::detail {

thread_pool::thread_pool(unsigned threads) : size_(threads < 1 ? 1 : threads) {
  fork_guard::install();
  try {
    workers_.reserve(size_ - 1);
    for (unsigned i = 1; i < size_; ++i) workers_.emplace_back([this, i] { work(i); });
  } catch (const std::exception& e) {
    // The threads already started must be joined before workers_ is destroyed (a joinable
    // std::thread's destructor terminates the process); the error then goes to the caller.
    stop_and_join();
    throw out_of_memory("terrace: cannot start " + std::to_string(size_ - 1) +
                        " optimizer worker threads (started " + std::to_string(workers_.size()) +
                        "): " + e.what());
  }
  register_for_fork();
}

thread_pool::~thread_pool() {
  unregister_for_fork();
  stop_and_join();
}

void thread_pool::stop_and_join() noexcept {
  if (forked_away()) {
    // A forked child, where the workers do not exist: joining one waits forever, and so do
    // waking them and destroying the condition variable they wait on in the parent (glibc waits
    // for its waiters). Their std::thread objects need only stop being joinable; the condition
    // variable is left behind (a few bytes, once per pool per child).
    for (auto& t : workers_) t.detach();
    static_cast<void>(start_.release());
    return;
  }
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  start_->notify_all();
  for (auto& t : workers_) t.join();
}

void thread_pool::run_erased(void (*call)(void*, unsigned), void* fn, unsigned parts) {
  std::lock_guard run_lock(run_mutex_);
  if (size_ == 1 || parts <= 1) {
    call(fn, 0);
    return;
  }
  if (forked_away()) {
    // A child forked without exec (multiprocessing's fork, a DataLoader worker) inherits the
    // pool but none of its threads: woken workers that do not exist never finished, and the
    // step waited forever. The child runs the parts itself, the same parts, so the same bits.
    for (unsigned i = 0; i < std::min(parts, size_); ++i) call(fn, i);
    return;
  }
  {
    std::lock_guard lock(mutex_);
    call_ = call;
    fn_ = fn;
    std::fegetenv(&env_);
    pending_ = size_ - 1;
    ++generation_;
  }
  start_->notify_all();
  call(fn, 0);
  std::unique_lock lock(mutex_);
  done_.wait(lock, [this] { return pending_ == 0; });
}

void thread_pool::work(unsigned index) {
  std::uint64_t seen = 0;
  for (;;) {
    void (*call)(void*, unsigned);
    void* fn;
    std::fenv_t env;
    {
      std::unique_lock lock(mutex_);
      start_->wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      call = call_;
      fn = fn_;
      env = env_;
    }
    std::fesetenv(&env);
    call(fn, index);
    bool last;
    {
      std::lock_guard lock(mutex_);
      last = --pending_ == 0;
    }
    if (last) done_.notify_one();
  }
}

}  // namespace terrace::detail

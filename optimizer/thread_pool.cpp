// SPDX-License-Identifier: Apache-2.0
#include "optimizer/thread_pool.hpp"

#include <algorithm>
#include <exception>
#include <string>
#include <utility>

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

namespace {

// The pool whose part this thread is running (workers: their own pool, always), so that a run()
// from inside a part is recognised: it would wait on run_mutex_, which this thread holds, or for
// workers busy with the outer job.
thread_local const thread_pool* running_part_of = nullptr;

class running_part_scope {
 public:
  explicit running_part_scope(const thread_pool* pool) noexcept : outer_(running_part_of) {
    running_part_of = pool;
  }
  ~running_part_scope() { running_part_of = outer_; }
  running_part_scope(const running_part_scope&) = delete;
  running_part_scope& operator=(const running_part_scope&) = delete;

 private:
  const thread_pool* outer_;
};

}  // namespace

void thread_pool::run_inline(void (*call)(void*, unsigned), void* fn, unsigned parts) {
  const running_part_scope scope(this);
  for (unsigned i = 0; i < std::min(std::max(parts, 1u), size_); ++i) call(fn, i);
}

void thread_pool::run_erased(void (*call)(void*, unsigned), void* fn, unsigned parts) {
  if (running_part_of == this) {
    run_inline(call, fn, parts);
    return;
  }
  std::lock_guard run_lock(run_mutex_);
  if (size_ == 1 || parts <= 1) {
    run_inline(call, fn, 1);
    return;
  }
  if (forked_away()) {
    // A child forked without exec (multiprocessing's fork, a DataLoader worker) inherits the
    // pool but none of its threads: woken workers that do not exist never finished, and the
    // step waited forever. The child runs the parts itself, the same parts, so the same bits.
    run_inline(call, fn, parts);
    return;
  }
  {
    std::lock_guard lock(mutex_);
    call_ = call;
    fn_ = fn;
    error_ = nullptr;
    std::fegetenv(&env_);
    pending_ = size_ - 1;
    ++generation_;
  }
  start_->notify_all();
  {
    const running_part_scope scope(this);
    call_part(call, fn, 0);
  }
  // Wait for the workers even when part 0 threw: they are still running fn, which lives in the
  // caller's frame.
  std::unique_lock lock(mutex_);
  done_.wait(lock, [this] { return pending_ == 0; });
  if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
}

void thread_pool::call_part(void (*call)(void*, unsigned), void* fn, unsigned index) noexcept {
  try {
    call(fn, index);
  } catch (...) {
    std::lock_guard lock(mutex_);
    if (!error_) error_ = std::current_exception();
  }
}

void thread_pool::work(unsigned index) {
  const running_part_scope scope(this);
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
    call_part(call, fn, index);
    bool last;
    {
      std::lock_guard lock(mutex_);
      last = --pending_ == 0;
    }
    if (last) done_.notify_one();
  }
}

}  // namespace terrace::detail

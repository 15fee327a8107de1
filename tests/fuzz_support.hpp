// SPDX-License-Identifier: Apache-2.0
// What the randomized fuzz tests (planned_policy_fuzz_test, allocator_threads_fuzz_test) share
// around their own workloads: which sanitizer the build runs under (they size their default seed
// range by it), the failure a check throws, the coalescing of their model devices' address
// intervals, and the seed range the environment names:
//   TERRACE_FUZZ_SEED=<n>      run seed n alone
//   TERRACE_FUZZ_SEEDS=<count> run <count> seeds (from TERRACE_FUZZ_SEED, or from 1)
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <iterator>
#include <map>
#include <optional>
#include <string>
#include <utility>

namespace terrace::fuzz {

#if defined(__SANITIZE_THREAD__)
inline constexpr bool kThreadSanitized = true;
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
inline constexpr bool kThreadSanitized = true;
#else
inline constexpr bool kThreadSanitized = false;
#endif
#else
inline constexpr bool kThreadSanitized = false;
#endif

#if defined(__SANITIZE_ADDRESS__)
inline constexpr bool kAddressSanitized = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
inline constexpr bool kAddressSanitized = true;
#else
inline constexpr bool kAddressSanitized = false;
#endif
#else
inline constexpr bool kAddressSanitized = false;
#endif

// A check that failed. Thrown only by the test's own code, never from inside a device callback
// (the allocator would see a foreign exception), and not a std::exception, so that the handlers
// around allocator calls cannot swallow it.
struct fuzz_failure {
  std::string what;
};

[[noreturn]] inline void fail(std::string what) { throw fuzz_failure{std::move(what)}; }

inline std::string hex(std::uintptr_t p) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%#llx", static_cast<unsigned long long>(p));
  return buf;
}

// Adds [lo, hi) to a set of disjoint address intervals (start -> end), merged with the intervals
// it touches: a model device's free address space or mapped pages.
// REQUIRES: [lo, hi) overlaps no interval of m.
inline void insert_coalesced(std::map<std::uintptr_t, std::uintptr_t>& m, std::uintptr_t lo,
                             std::uintptr_t hi) {
  auto next = m.lower_bound(hi);
  if (next != m.end() && next->first == hi) {
    hi = next->second;
    next = m.erase(next);
  }
  if (next != m.begin() && std::prev(next)->second == lo) {
    lo = std::prev(next)->first;
    m.erase(std::prev(next));
  }
  m.emplace(lo, hi);
}

// A number from the environment, or nothing when unset. A value that is not a number fails the
// test rather than quietly running the default range.
inline std::optional<std::uint64_t> env_number(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return std::nullopt;
  char* end = nullptr;
  const unsigned long long n = std::strtoull(v, &end, 10);
  if (*end != '\0' || *v == '-') {
    ADD_FAILURE() << name << "=" << v << " is not a seed number";
    return std::nullopt;
  }
  return n;
}

// Seeds first .. first + count - 1.
struct seed_range {
  std::uint64_t first = 1;
  std::uint64_t count = 0;
  std::uint64_t end() const { return first + count; }
};

// The seeds the environment names, or `default_count` seeds from 1 when it names none. Nothing
// when a variable is not a number: env_number has failed the test, and no seed should run.
inline std::optional<seed_range> seeds_from_environment(std::uint64_t default_count) {
  const std::optional<std::uint64_t> one = env_number("TERRACE_FUZZ_SEED");
  const std::optional<std::uint64_t> count = env_number("TERRACE_FUZZ_SEEDS");
  if (::testing::Test::HasFailure()) return std::nullopt;
  return seed_range{one.value_or(1), count.value_or(one ? 1 : default_count)};
}

inline void print_passed(const seed_range& seeds) {
  std::printf("[          ] seeds %llu..%llu passed\n",
              static_cast<unsigned long long>(seeds.first),
              static_cast<unsigned long long>(seeds.end() - 1));
}

}  // namespace terrace::fuzz

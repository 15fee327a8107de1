// SPDX-License-Identifier: Apache-2.0
// What the planned policy's files (plan_front*.cpp) share: its tuning constants, each with the
// reason for its value, and the token hash. Internal to allocator/.
#pragma once

#include <cstddef>
#include <cstdint>

namespace terrace::detail::plan_tuning {

// Request sizes are rounded to this in tokens and slots (the caching allocator's rounding).
inline constexpr std::size_t kRound = 512;
// Tokens in the window that proposes periods (detect_steady_state).
inline constexpr std::size_t kWindow = 16;
// A recording longer than this starts over.
inline constexpr std::size_t kMaxRecordTokens = 1u << 22;
// In sync, a request may take a slot up to this many slots ahead of the cursor (skipping the ones
// between) or one skipped at most this far behind it: the same iteration with a request more or
// less, or with two streams interleaved in another order, stays planned.
inline constexpr std::size_t kLookahead = 16;
// Consecutive requests that match no slot before the rest of the iteration goes to the fallback.
inline constexpr std::uint32_t kMaxMisses = 8;
// Requests outside the plan per lane iteration that may borrow free arena space (lend_arena_space).
inline constexpr std::uint32_t kMaxMissLoans = 2;
// Iterations in a row that leave the plan before it is set aside (suspend), and how long it sits
// out: kFirstSuspension iterations, doubling up to kMaxSuspension while it keeps failing; as many
// iterations kept in a row restore the first length.
inline constexpr std::uint32_t kMaxLostInRow = 3;
// ... or that leave it this often among the last kOutcomeWindow (iterations of two shapes drawn at
// random: the plan fits one, the other leaves it every other iteration, and each loss empties the
// fallback's cache when the plan comes back; planning.md, "Iterations of several shapes").
inline constexpr int kOutcomeWindow = 8;
inline constexpr int kMaxLostInWindow = 4;
// Changes of shape among the last 16 marked iterations that make a re-plan for another shape
// alternation rather than a new phase (plan_front::shape_changes).
inline constexpr std::size_t kMinShapeChanges = 4;
// The shape noted for an iteration that left the plan part way (not recorded whole): not the
// plan's, otherwise unknown.
inline constexpr std::uint64_t kUnknownShape = 1;
// Plans a library holds: the shapes of iterations that alternate (sequence-length buckets), laid
// out together in one arena. More shapes than this are left to the caching allocator.
inline constexpr std::size_t kMaxPlans = 8;
// Requests of a marked iteration that may go to the fallback while more than one plan of the
// library starts with them (choose_plan); then the active plan, if among them, or the first.
inline constexpr std::uint32_t kMaxUndecided = 16;
// A marked iteration's first requests recorded in sync as well (try_allocate's shadow), so that
// one that leaves the plan among them is recorded whole (and the undecided ones before them).
inline constexpr std::uint32_t kShadowRequests = 16;
// Planned iterations after which a plan of the library that none of them picked leaves it
// (drop_unused_plans). A bucket drawn 1 time in 8 goes unpicked that long with odds of 1e-15.
inline constexpr std::int64_t kUnusedIterations = 256;
inline constexpr std::uint32_t kFirstSuspension = 8;
inline constexpr std::uint32_t kMaxSuspension = 1024;
// A plan that allows for every order of frees seen may need more memory than the order it was
// recorded in: at most this much more (the sum of each stream's largest live bytes, in the
// recorded order and with every free at its latest). Orders that vary more than that are not a
// training step's timing jitter: they stay with the caching allocator, or with the plan as it is.
inline constexpr double kMaxWidening = 1.10;
// The token hash: polynomial, mod the Mersenne prime 2^61 - 1 (prefix hashes of the recording).
inline constexpr std::uint64_t kMod = (std::uint64_t{1} << 61) - 1;
inline constexpr std::uint64_t kBase = 0x2545f4914f6cdd1dull % kMod;

inline std::uint64_t mulmod(std::uint64_t a, std::uint64_t b) noexcept {
  const unsigned __int128 p = static_cast<unsigned __int128>(a) * b;
  std::uint64_t r = static_cast<std::uint64_t>(p & kMod) + static_cast<std::uint64_t>(p >> 61);
  if (r >= kMod) r -= kMod;
  return r;
}

// The polynomial hash of a token sequence, extended by one token (range_hash's prefix hashes and
// streams_hash's per-stream ones).
inline std::uint64_t extend_hash(std::uint64_t h, std::uint64_t token) noexcept {
  return (mulmod(h, kBase) + (token % (kMod - 1)) + 1) % kMod;
}

// A 64-bit finaliser (splitmix's), for keys made of several fields.
inline std::uint64_t mix(std::uint64_t x) noexcept {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  return x ^ (x >> 33);
}

// The request size as tokens and slots see it.
inline std::size_t round_up(std::size_t n) noexcept { return (n + kRound - 1) / kRound * kRound; }

}  // namespace terrace::detail::plan_tuning

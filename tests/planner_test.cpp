// SPDX-License-Identifier: Apache-2.0
// The planner (offline placement) and the planned policy: plans never overlap, replay follows the
// plan on steady traces, deviations fall back without error, and live blocks never overlap
// whatever the program does.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "terrace/caching_allocator.hpp"
#include "terrace/config.hpp"
#include "terrace/error.hpp"
#include "terrace/offload_engine.hpp"
#include "terrace/planner.hpp"
#include "terrace/sim_device.hpp"
#include "fuzz_support.hpp"
#include "trace_generator.hpp"
#include "tools/replay.hpp"

namespace {

using terrace::plan_interval;

std::vector<plan_interval> random_intervals(std::uint64_t seed, std::size_t n) {
  std::mt19937_64 rng(seed);
  std::vector<plan_interval> v;
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint64_t b = rng() % 1000;
    v.push_back({(rng() % 64 + 1) * 512 * (rng() % 8 == 0 ? 64 : 1), b, b + 1 + rng() % 200});
  }
  return v;
}

// The planned policy over exact-size segments and (almost) no small pool, as the engine's settings,
// so that sizes add up; short iterations are planned.
constexpr const char* kPlannedExactConf =
    "policy:planned,plan_min_period:16,small_size:4096,min_large_alloc:1,large_round:4096";

// The blocks a test holds from a planned allocator; every allocation is checked against them for
// overlap (the safety property of the planned policy).
class held_blocks {
 public:
  explicit held_blocks(terrace::caching_allocator& a) : a_(a) {}
  void* get(std::size_t n, terrace::stream_ref s = {}, const char* tag = "") {
    void* p = a_.allocate(n, s, tag);
    const auto u = reinterpret_cast<std::uintptr_t>(p);
    auto next = live_.lower_bound(u);
    if (next != live_.end()) {
      EXPECT_LE(u + n, next->first) << "overlap";
    }
    if (next != live_.begin()) {
      EXPECT_LE(std::prev(next)->first + std::prev(next)->second, u) << "overlap";
    }
    live_[u] = n;
    return p;
  }
  void give(void* p, terrace::stream_ref s = {}) {
    live_.erase(reinterpret_cast<std::uintptr_t>(p));
    a_.deallocate(p, s);
  }
  bool empty() const noexcept { return live_.empty(); }

 private:
  terrace::caching_allocator& a_;
  std::map<std::uintptr_t, std::size_t> live_;
};

TEST(Planner, PlansNeverOverlapAndRespectTheLowerBound) {
  for (std::uint64_t seed = 1; seed <= 20; ++seed) {
    const auto items = random_intervals(seed, 300);
    const auto plan = terrace::plan_placement(items);
    EXPECT_NO_THROW(terrace::check_placement(items, plan)) << seed;
    EXPECT_GE(plan.arena_bytes, plan.lower_bound) << seed;
    EXPECT_EQ(plan.lower_bound, terrace::max_live_bytes(items)) << seed;
    EXPECT_LE(static_cast<double>(plan.arena_bytes), 1.5 * static_cast<double>(plan.lower_bound)) << seed;
  }
}

TEST(Planner, CheckPlacementCatchesAnOverlapAndBadIntervals) {
  const std::vector<plan_interval> items = {{1024, 0, 10}, {1024, 5, 15}};
  terrace::placement_plan bad;
  bad.offsets = {0, 512};
  bad.arena_bytes = 2048;
  EXPECT_THROW(terrace::check_placement(items, bad), terrace::logic_error);
  EXPECT_THROW(terrace::plan_placement({{512, 5, 5}}), terrace::logic_error);
  EXPECT_THROW(terrace::plan_placement(items, 3), terrace::logic_error);
}

// Found in review: sizes or times near 2^64 wrapped the offset, size and time arithmetic (a size
// of SIZE_MAX aligned to 0 bytes; two of 2^63 summed to a lower bound of 0). They are refused.
TEST(Planner, SizesAndTimesWhereTheArithmeticWouldOverflowAreRefused) {
  using terrace::plan_interval;
  const std::size_t huge = std::size_t{1} << 62;
  EXPECT_THROW(terrace::plan_placement({{SIZE_MAX, 0, 1}}), terrace::logic_error);
  EXPECT_THROW(terrace::plan_placement({{huge, 0, 2}, {huge, 1, 3}}), terrace::logic_error);
  EXPECT_THROW(terrace::max_live_bytes({{std::size_t{1} << 63, 0, 1}, {std::size_t{1} << 63, 0, 1}}),
               terrace::logic_error);
  EXPECT_THROW(terrace::plan_placement({{512, 0, UINT64_MAX}}), terrace::logic_error);
  EXPECT_THROW(terrace::plan_placement({{512, 0, 1}}, {huge, huge}), terrace::logic_error);
  // Up to the bound the plan is exact.
  const auto plan = terrace::plan_placement({{huge / 2, 0, 2}, {huge / 2, 1, 3}});
  EXPECT_EQ(plan.arena_bytes, huge);
  EXPECT_EQ(plan.lower_bound, huge);
  terrace::check_placement({{huge / 2, 0, 2}, {huge / 2, 1, 3}}, plan);
}

// Found in review: check_placement bounded each block by offset + size, which wraps for an offset
// near 2^64: a block placed past the arena's end, over another, passed the checker.
TEST(Planner, CheckPlacementRefusesAnOffsetWhoseEndWraps) {
  const std::vector<plan_interval> items = {{1024, 0, 2}, {1024, 0, 2}};
  terrace::placement_plan bad;
  bad.offsets = {0, SIZE_MAX - 511};
  bad.arena_bytes = 1024;
  EXPECT_THROW(terrace::check_placement(items, bad), terrace::logic_error);
}

// Found in review: a zero-size interval at the offset where another block starts was reported as
// an overlap (whether it was depended on the intervals' order), so check_placement refused plans
// plan_placement made for inputs with zero sizes. A zero-size block occupies no byte.
TEST(Planner, ZeroSizeIntervalsOverlapNothing) {
  const std::vector<plan_interval> items = {{512, 3, 8}, {0, 2, 4}};
  terrace::placement_plan plan;
  plan.offsets = {0, 0};
  plan.arena_bytes = 512;
  EXPECT_NO_THROW(terrace::check_placement(items, plan));
  for (std::uint64_t seed = 1; seed <= 2000; ++seed) {
    std::mt19937_64 rng(seed);
    std::vector<plan_interval> v;
    for (std::size_t i = 0, n = 1 + rng() % 8; i < n; ++i) {
      const std::uint64_t b = rng() % 6;
      v.push_back({(rng() % 3) * 512, b, b + 1 + rng() % 5});
    }
    EXPECT_NO_THROW(terrace::check_placement(v, terrace::plan_placement(v))) << seed;
  }
}

TEST(Planner, DisjointLifetimesShareSpace) {
  const std::vector<plan_interval> items = {{4096, 0, 2}, {4096, 2, 4}, {4096, 4, 6}};
  const auto plan = terrace::plan_placement(items);
  EXPECT_EQ(plan.arena_bytes, 4096u);
  EXPECT_EQ(plan.lower_bound, 4096u);
}

// With holes (memory already there, free at all times): blocks go into holes first, never straddle
// two holes or a hole and the open region, and still never overlap.
TEST(Planner, HolesAreFilledFirstAndNeverStraddled) {
  // Three blocks live together; two holes each hold exactly one of them.
  const std::vector<plan_interval> items = {{4096, 0, 10}, {8192, 0, 10}, {2048, 0, 10}};
  const auto fits = terrace::plan_placement(items, std::vector<std::size_t>{8192, 4096}, 512);
  ASSERT_EQ(fits.hole_base.size(), 2u);
  EXPECT_EQ(fits.hole_base[0], 0u);
  EXPECT_EQ(fits.hole_base[1], 8192u + 512u);
  EXPECT_EQ(fits.offsets[1], 0u);                // 8 KiB: the first hole
  EXPECT_EQ(fits.offsets[0], fits.hole_base[1]);  // 4 KiB: the second
  EXPECT_GE(fits.offsets[2], fits.open_base);    // 2 KiB: no room left, the open region
  EXPECT_EQ(fits.arena_bytes - fits.open_base, 2048u);
  EXPECT_THROW(terrace::plan_placement(items, std::vector<std::size_t>{1000}, 512),
               terrace::logic_error);
  for (std::uint64_t seed = 1; seed <= 20; ++seed) {
    const auto v = random_intervals(seed, 300);
    std::mt19937_64 rng(seed * 77);
    std::vector<std::size_t> holes;
    for (int h = 0; h < 12; ++h) holes.push_back((rng() % 256 + 1) * 512);
    const auto plan = terrace::plan_placement(v, holes, 512);
    EXPECT_NO_THROW(terrace::check_placement(v, plan)) << seed;
    const auto plain = terrace::plan_placement(v);
    EXPECT_LE(plan.arena_bytes - plan.open_base, plain.arena_bytes) << seed;
    for (std::size_t i = 0; i < v.size(); ++i) {
      const std::size_t lo = plan.offsets[i], hi = lo + (v[i].size + 511) / 512 * 512;
      if (lo >= plan.open_base) continue;
      const auto h = static_cast<std::size_t>(
          std::upper_bound(plan.hole_base.begin(), plan.hole_base.end(), lo) - plan.hole_base.begin() - 1);
      EXPECT_LE(hi, plan.hole_base[h] + holes[h]) << "block " << i << " straddles hole " << h;
    }
  }
}

// ---- Review of the planner core (2026-11-26): properties checked against references that share
// no code with planner.cpp (a pairwise overlap check, a per-instant sum), on many random sets.

std::size_t aligned(std::size_t n, std::size_t a) { return (n + a - 1) / a * a; }

// Families of random iterations: uniform sizes and lifetimes; sizes over 16 powers of two with
// mostly short lives; properly nested (stack) lifetimes; a forward/backward pass (activations held
// until their gradient, scratch between); many duplicates on few instants; sizes from bytes to
// 512 MiB, not multiples of the alignment.
enum class family { uniform, heavy_tail, nested, training, duplicates, wide, count };
const char* family_name(family f) {
  static const char* names[] = {"uniform", "heavy-tail", "nested", "training", "duplicates", "wide"};
  return names[static_cast<int>(f)];
}

std::vector<plan_interval> family_intervals(family f, std::mt19937_64& rng, std::size_t n) {
  std::vector<plan_interval> v;
  switch (f) {
    case family::uniform:
      for (std::size_t i = 0; i < n; ++i) {
        const std::uint64_t b = rng() % (4 * n + 1);
        v.push_back({(rng() % 64 + 1) * 512, b, b + 1 + rng() % (n + 1)});
      }
      break;
    case family::heavy_tail:
      for (std::size_t i = 0; i < n; ++i) {
        const std::uint64_t b = rng() % (4 * n + 1);
        const std::uint64_t life = rng() % 8 == 0 ? rng() % (4 * n + 1) : rng() % 20;
        v.push_back({(std::size_t{512} << (rng() % 16)) + (rng() % 3) * 100, b, b + 1 + life});
      }
      break;
    case family::nested: {
      std::vector<std::size_t> open;
      for (std::uint64_t t = 0; v.size() < n || !open.empty(); ++t) {
        if (v.size() < n && (open.empty() || rng() % 2 == 0)) {
          open.push_back(v.size());
          v.push_back({(rng() % 128 + 1) * 512, t, 0});
        } else {
          v[open.back()].end = t;
          open.pop_back();
        }
      }
      break;
    }
    case family::training: {
      std::vector<std::size_t> acts;
      std::uint64_t t = 0;
      for (std::size_t l = 0; l < std::max<std::size_t>(1, n / 4); ++l, t += 2) {
        acts.push_back(v.size());
        v.push_back({(rng() % 8 + 1) * 4096 * (1 + rng() % 4), t, 0});
        v.push_back({(rng() % 16 + 1) * 512, t + 1, t + 2 + rng() % 3});
      }
      for (std::size_t l = acts.size(); l-- > 0; t += 2) {
        v[acts[l]].end = t + 1;
        v.push_back({v[acts[l]].size, t, t + 2 + rng() % 4});
        v.push_back({(rng() % 16 + 1) * 512, t, t + 1});
      }
      break;
    }
    case family::duplicates:
      for (std::size_t i = 0; i < n; ++i) {
        const std::uint64_t b = rng() % 6;
        v.push_back({(rng() % 3 + 1) * 512, b, b + 1 + rng() % 5});
      }
      break;
    case family::wide:
      for (std::size_t i = 0; i < n; ++i) {
        const std::uint64_t b = rng() % (2 * n + 1);
        const std::size_t s = rng() % 4 == 0 ? std::size_t{1} << (20 + rng() % 10) : 1 + rng() % 100000;
        v.push_back({s, b, b + 1 + rng() % (n / 2 + 2)});
      }
      break;
    case family::count:
      break;
  }
  return v;
}

// The reference checks: every block aligned and inside the arena (and, with holes, wholly inside
// one hole or the open region), and no two blocks live at one instant share a byte. "" when valid.
std::string reference_check(const std::vector<plan_interval>& v, const terrace::placement_plan& p,
                            std::size_t a, const std::vector<std::size_t>& holes = {}) {
  if (p.offsets.size() != v.size()) return "offsets for " + std::to_string(p.offsets.size());
  if (p.hole_base.size() != holes.size()) return "hole bases for " + std::to_string(p.hole_base.size());
  for (std::size_t i = 0; i < v.size(); ++i) {
    const std::size_t lo = p.offsets[i], size = aligned(v[i].size, a);
    if (lo % a != 0) return "block " + std::to_string(i) + " misaligned";
    if (lo > p.arena_bytes || size > p.arena_bytes - lo) return "block " + std::to_string(i) + " past the arena";
    if (size > 0 && lo < p.open_base) {
      bool inside = false;
      for (std::size_t h = 0; h < holes.size(); ++h) {
        inside = inside || (lo >= p.hole_base[h] && lo + size <= p.hole_base[h] + holes[h]);
      }
      if (!inside) return "block " + std::to_string(i) + " not inside one hole";
    }
    for (std::size_t j = 0; j < i; ++j) {
      const std::size_t other = aligned(v[j].size, a);
      if (size == 0 || other == 0) continue;
      const bool in_time = v[i].begin < v[j].end && v[j].begin < v[i].end;
      const bool in_space = lo < p.offsets[j] + other && p.offsets[j] < lo + size;
      if (in_time && in_space) return "blocks " + std::to_string(j) + " and " + std::to_string(i) + " overlap";
    }
  }
  return "";
}

// The largest sum of aligned sizes live at one instant, instant by instant (the peak is at a begin).
std::size_t reference_bound(const std::vector<plan_interval>& v, std::size_t a) {
  std::size_t peak = 0;
  for (const auto& at : v) {
    std::size_t live = 0;
    for (const auto& x : v) {
      if (x.begin <= at.begin && at.begin < x.end) live += aligned(x.size, a);
    }
    peak = std::max(peak, live);
  }
  return peak;
}

// Many small random sets, every family, three alignments, with holes and without: every plan is
// valid by the reference check, its lower bound is the reference's, and check_placement agrees.
// The worst arena / lower bound seen is reported; docs/planning.md's 5% target is met on the
// generated training traces, not on arbitrary sets (measured worst here on 2026-11-26: 1.37, a
// small uniform set; the nested family is always exact, since best fit leaves no gap under a
// stack). On sets of up to 7 blocks an exhaustive search found the optimum equal to the lower
// bound every time, so such gaps are the heuristics', not the bound's.
TEST(Planner, RandomPlansAreValidByAReferenceCheck) {
  double worst = 1.0;
  std::string worst_at;
  int sets = 0;
  for (int f = 0; f < static_cast<int>(family::count); ++f) {
    for (const std::size_t a : {std::size_t{1}, std::size_t{512}, std::size_t{4096}}) {
      for (std::uint64_t seed = 1; seed <= 400; ++seed) {
        std::mt19937_64 rng(seed * 131 + static_cast<std::uint64_t>(f) * 7 + a);
        const auto v = family_intervals(static_cast<family>(f), rng, 1 + rng() % 48);
        const auto plan = terrace::plan_placement(v, a);
        const std::string where = std::string(family_name(static_cast<family>(f))) + " alignment " +
                                  std::to_string(a) + " seed " + std::to_string(seed);
        ASSERT_EQ(reference_check(v, plan, a), "") << where;
        ASSERT_EQ(plan.lower_bound, reference_bound(v, a)) << where;
        ASSERT_EQ(plan.lower_bound, terrace::max_live_bytes(v, a)) << where;
        ASSERT_GE(plan.arena_bytes, plan.lower_bound) << where;
        ASSERT_NO_THROW(terrace::check_placement(v, plan, a)) << where;
        if (static_cast<family>(f) == family::nested) {
          EXPECT_EQ(plan.arena_bytes, plan.lower_bound) << where;
        }
        if (plan.lower_bound > 0) {
          const double ratio = static_cast<double>(plan.arena_bytes) / static_cast<double>(plan.lower_bound);
          if (ratio > worst) worst = ratio, worst_at = where + " (" + plan.heuristic + ")";
        }
        std::vector<std::size_t> holes;
        for (std::size_t h = 0, n = rng() % 6; h < n; ++h) holes.push_back((rng() % 64 + 1) * a * 8);
        const auto in_holes = terrace::plan_placement(v, holes, a);
        ASSERT_EQ(reference_check(v, in_holes, a, holes), "") << where << " with holes";
        ASSERT_EQ(in_holes.lower_bound, plan.lower_bound) << where << " with holes";
        ++sets;
      }
    }
  }
  std::printf("[ planner  ] %d random sets valid; worst arena / lower bound %.4f at %s\n", sets, worst,
              worst_at.c_str());
  ::testing::Test::RecordProperty("worst_ratio", std::to_string(worst));
  EXPECT_LE(worst, 1.5);
}

// Larger random sets on both sides of the greedy-by-size cutoff (4096 blocks): valid, and their
// mean and worst arena / lower bound per family, reported and held to what was measured on
// 2026-11-26 with a margin (mean 1.00-1.10, worst 1.12: the wide family at 4097 blocks, where
// greedy by size no longer runs, against mean 1.03 and worst 1.04 at 4096).
TEST(Planner, LargeRandomSetsStayNearTheLowerBound) {
  for (int f = 0; f < static_cast<int>(family::count); ++f) {
    for (const std::size_t n : {std::size_t{300}, std::size_t{4096}, std::size_t{4097}, std::size_t{8000}}) {
      double worst = 1.0, sum = 0.0;
      int runs = 0;
      for (std::uint64_t seed = 1; seed <= 2; ++seed) {
        std::mt19937_64 rng(seed * 7919 + static_cast<std::uint64_t>(f) * 31 + n);
        const auto v = family_intervals(static_cast<family>(f), rng, n);
        const auto plan = terrace::plan_placement(v);
        ASSERT_NO_THROW(terrace::check_placement(v, plan)) << family_name(static_cast<family>(f)) << " " << n;
        ASSERT_EQ(plan.lower_bound, terrace::max_live_bytes(v));
        if (v.size() > 4096) {
          EXPECT_EQ(plan.heuristic, "greedy-by-start");
        }
        const double ratio = static_cast<double>(plan.arena_bytes) / static_cast<double>(plan.lower_bound);
        worst = std::max(worst, ratio);
        sum += ratio;
        ++runs;
      }
      std::printf("[ planner  ] %-10s %5zu blocks: arena / lower bound mean %.4f, worst %.4f\n",
                  family_name(static_cast<family>(f)), n, sum / runs, worst);
      EXPECT_LE(sum / runs, 1.15) << family_name(static_cast<family>(f)) << " " << n;
      EXPECT_LE(worst, 1.25) << family_name(static_cast<family>(f)) << " " << n;
    }
  }
}

// The lower bound at the instants that matter: intervals are half-open, so a block freed at the
// instant another is made does not count with it; frees and allocations at one instant; sizes
// aligned before they are summed; zero sizes count nothing; a lifetime that ends where it begins
// (zero length) is refused rather than counted or dropped.
TEST(Planner, TheLowerBoundIsTheLargestSumLiveAtOneInstant) {
  using terrace::max_live_bytes;
  EXPECT_EQ(max_live_bytes({}), 0u);
  EXPECT_EQ(max_live_bytes({{1000, 0, 1}}), 1024u);
  EXPECT_EQ(max_live_bytes({{1000, 0, 1}}, 1), 1000u);
  EXPECT_EQ(max_live_bytes({{1, 0, 1}, {1, 0, 1}}), 1024u);
  EXPECT_EQ(max_live_bytes({{1, 0, 1}, {1, 0, 1}}, 1), 2u);
  EXPECT_EQ(max_live_bytes({{4096, 0, 5}, {4096, 5, 9}}), 4096u);  // freed as the other is made
  EXPECT_EQ(max_live_bytes({{4096, 0, 5}, {4096, 4, 9}}), 8192u);
  // Three freed at 5 while two are made at 5, and one more made at 6.
  EXPECT_EQ(max_live_bytes({{512, 0, 5}, {512, 1, 5}, {512, 2, 5}, {512, 5, 8}, {512, 5, 8}, {512, 6, 7}}),
            1536u);
  EXPECT_EQ(max_live_bytes({{512, 0, 5}, {512, 1, 5}, {512, 2, 5}, {512, 5, 8}, {512, 5, 8}, {512, 5, 7},
                            {512, 5, 6}}),
            2048u);
  EXPECT_EQ(max_live_bytes({{0, 0, 9}, {512, 3, 4}, {0, 3, 4}}), 512u);
  // A block held to the iteration's last instant (the caller's stand-in for "not freed in it")
  // counts at every instant after its start.
  EXPECT_EQ(max_live_bytes({{8192, 1, 100}, {512, 10, 11}, {512, 50, 60}, {512, 55, 56}}), 9216u);
  for (const std::uint64_t t : {std::uint64_t{0}, std::uint64_t{7}}) {
    const std::vector<plan_interval> zero_length = {{512, 0, 9}, {512, t, t}};
    EXPECT_THROW(max_live_bytes(zero_length), terrace::logic_error) << t;
    EXPECT_THROW(terrace::plan_placement(zero_length), terrace::logic_error) << t;
    terrace::placement_plan p;
    p.offsets = {0, 512};
    p.arena_bytes = 1024;
    EXPECT_THROW(terrace::check_placement(zero_length, p), terrace::logic_error) << t;
  }
  EXPECT_THROW(max_live_bytes({{512, 5, 4}}), terrace::logic_error);
}

// An empty iteration, one block, duplicates (the same interval many times: they all live together
// and each needs its own bytes), identical sizes one after another (they share one place).
TEST(Planner, EmptySingleDuplicateAndIdenticalIterations) {
  const auto empty = terrace::plan_placement({});
  EXPECT_TRUE(empty.offsets.empty());
  EXPECT_EQ(empty.arena_bytes, 0u);
  EXPECT_EQ(empty.lower_bound, 0u);
  EXPECT_FALSE(empty.heuristic.empty());
  EXPECT_NO_THROW(terrace::check_placement({}, empty));
  const auto empty_holes = terrace::plan_placement({}, std::vector<std::size_t>{4096, 512}, 512);
  EXPECT_EQ(empty_holes.open_base, 4096u + 512u + 512u + 512u);
  EXPECT_EQ(empty_holes.arena_bytes, empty_holes.open_base);  // nothing new to reserve

  const auto one = terrace::plan_placement({{1000, 3, 4}});
  EXPECT_EQ(one.offsets, std::vector<std::size_t>{0});
  EXPECT_EQ(one.arena_bytes, 1024u);
  EXPECT_EQ(one.lower_bound, 1024u);

  for (const std::size_t n : {std::size_t{2}, std::size_t{100}, std::size_t{5000}}) {
    const std::vector<plan_interval> same(n, plan_interval{4096, 10, 20});
    const auto plan = terrace::plan_placement(same);
    EXPECT_EQ(plan.arena_bytes, n * 4096) << n;
    EXPECT_EQ(plan.lower_bound, n * 4096) << n;
    EXPECT_EQ(reference_check(same, plan, 512), "") << n;
    std::vector<plan_interval> chain;
    for (std::size_t i = 0; i < n; ++i) chain.push_back({4096, i, i + 1});
    const auto shared = terrace::plan_placement(chain);
    EXPECT_EQ(shared.arena_bytes, 4096u) << n;
    EXPECT_EQ(shared.offsets, std::vector<std::size_t>(n, 0)) << n;
  }
}

// Sizes near the limits: the largest accepted sums place without wrapping (offset + size stays
// inside the reported arena), one alignment more is refused, as are SIZE_MAX-sized blocks whose
// alignment would wrap to 0, and alignments that are no power of two or past 2^62.
TEST(Planner, SizesAtTheLimitPlaceWithoutWrapping) {
  const std::size_t limit = std::size_t{1} << 62;
  const std::vector<plan_interval> full = {{limit / 4, 0, 4}, {limit / 4, 1, 3}, {limit / 2, 2, 5}};
  const auto plan = terrace::plan_placement(full);
  EXPECT_EQ(reference_check(full, plan, 512), "");
  EXPECT_EQ(plan.lower_bound, limit);
  EXPECT_EQ(plan.arena_bytes, limit);
  std::vector<plan_interval> over = full;
  over.push_back({1, 9, 10});  // aligned to 512: the sum passes 2^62
  EXPECT_THROW(terrace::plan_placement(over), terrace::logic_error);
  EXPECT_THROW(terrace::max_live_bytes(over), terrace::logic_error);
  for (const std::size_t size : {SIZE_MAX, SIZE_MAX - 510, limit + 1}) {
    EXPECT_THROW(terrace::plan_placement({{size, 0, 1}}), terrace::logic_error) << size;
  }
  for (const std::size_t a : {std::size_t{0}, std::size_t{3}, std::size_t{768}, limit << 1}) {
    EXPECT_THROW(terrace::plan_placement({{512, 0, 1}}, a), terrace::logic_error) << a;
  }
  // The largest alignment: one block per 2^62.
  const auto coarse = terrace::plan_placement({{1, 0, 1}}, limit);
  EXPECT_EQ(coarse.arena_bytes, limit);
  EXPECT_THROW(terrace::plan_placement({{1, 0, 1}, {1, 0, 1}}, limit), terrace::logic_error);
  // Holes up to the limit: blocks go into them and offsets + sizes stay below the arena's end.
  const std::vector<std::size_t> holes = {limit / 2, limit / 4};
  const std::vector<plan_interval> big = {{limit / 4, 0, 2}, {limit / 2, 1, 3}, {limit / 4, 1, 2}};
  const auto in_holes = terrace::plan_placement(big, holes, 512);
  EXPECT_EQ(reference_check(big, in_holes, 512, holes), "");
  EXPECT_EQ(in_holes.arena_bytes - in_holes.open_base, limit / 4);  // one of them fits no hole
  EXPECT_THROW(terrace::plan_placement(big, std::vector<std::size_t>{limit, 512}, 512), terrace::logic_error);
}

// The factor on the time limits of the tests that guard against quadratic paths: their limits
// are several times what an optimised build takes; sanitized or unoptimised builds get ten times.
double complexity_slack() {
#ifdef NDEBUG
  return terrace::fuzz::kAddressSanitized || terrace::fuzz::kThreadSanitized ? 10 : 1;
#else
  return 10;
#endif
}

// Review (2026-11-26): check_placement kept its live blocks in a sorted vector, so checking a plan
// with n blocks live together cost O(n^2) moves: 0.7 s for 50,000, 2.2 s for 100,000 (it runs under
// check_invariants on every replayed event the caller asks for). A 100,000-event iteration (50,000
// allocations) is planned and checked in well under a second.
TEST(Planner, AHundredThousandEventIterationIsPlannedAndCheckedQuickly) {
  const double slack = complexity_slack();
  constexpr std::size_t kN = 50000;
  std::mt19937_64 rng(11);
  const auto v = family_intervals(family::uniform, rng, kN);
  std::vector<plan_interval> together;  // all live at once
  for (std::size_t i = 0; i < kN; ++i) together.push_back({512 * (1 + i % 7), i, 2 * kN + 1});
  for (const std::vector<plan_interval>* items : {&v, static_cast<const std::vector<plan_interval>*>(&together)}) {
    const auto t0 = std::chrono::steady_clock::now();
    const auto plan = terrace::plan_placement(*items);
    const auto t1 = std::chrono::steady_clock::now();
    terrace::check_placement(*items, plan);
    const auto t2 = std::chrono::steady_clock::now();
    EXPECT_LT(std::chrono::duration<double>(t1 - t0).count(), 0.5 * slack);
    EXPECT_LT(std::chrono::duration<double>(t2 - t1).count(), 0.25 * slack);
  }
}

TEST(PlannerConfig, PolicyKeysParseAndRefuseNonsense) {
  auto c = terrace::parse_alloc_conf("policy:planned,plan_counterfactual:1,plan_min_period:32");
  EXPECT_EQ(c.policy, terrace::alloc_policy::planned);
  EXPECT_TRUE(c.plan_counterfactual);
  EXPECT_EQ(c.plan_min_period, 32u);
  EXPECT_TRUE(terrace::parse_alloc_conf("policy:expandable").expandable_segments);
  EXPECT_THROW(terrace::parse_alloc_conf("policy:magic"), terrace::logic_error);
  EXPECT_THROW(terrace::parse_alloc_conf("plan_min_period:3"), terrace::logic_error);
}

terrace::tracegen::training_trace_options steady_model(int iterations) {
  terrace::tracegen::training_trace_options o;
  o.layers = 3;
  o.hidden = 256;
  o.seq_len = 128;
  o.vocab = 4096;
  o.iterations = iterations;
  o.shape_determined_scratch = true;
  return o;
}

TEST(PlannedPolicy, SteadyTraceIsServedFromThePlan) {
  const auto events = terrace::tracegen::generate_training_trace(steady_model(8));
  terrace::tools::replay_options o;
  o.config = terrace::parse_alloc_conf("policy:planned");
  o.check_invariants_every = 97;
  const auto r = terrace::tools::replay(events, o);
  EXPECT_EQ(r.plan.plans, 1);
  EXPECT_GE(r.plan.iterations, 4);
  EXPECT_GT(r.plan.hit_rate(), 0.95);
  // The live plan is placed into the fallback's holes first: the new reservation stays under the
  // lower bound's 5% margin, and its footprint (reservation + hole extents) near it. Holes cut the
  // space into pieces, so the planner's own quality is measured without them (counterfactual).
  EXPECT_LE(static_cast<double>(r.plan.arena_reserved_bytes),
            1.05 * static_cast<double>(r.plan.lower_bound_bytes));
  EXPECT_LE(static_cast<double>(r.plan.arena_bytes), 1.10 * static_cast<double>(r.plan.lower_bound_bytes));
  EXPECT_EQ(r.ooms, 0u);
  terrace::tools::replay_options cf;
  cf.config = terrace::parse_alloc_conf("policy:caching,plan_counterfactual:true");
  const auto q = terrace::tools::replay(events, cf);
  EXPECT_LE(static_cast<double>(q.plan.arena_bytes), 1.05 * static_cast<double>(q.plan.lower_bound_bytes));
}

TEST(PlannedPolicy, DynamicShapesDeviateFallBackAndResync) {
  auto opt = steady_model(12);
  opt.dynamic_iterations = 3;
  opt.seed = 7;
  const auto events = terrace::tracegen::generate_training_trace(opt);
  terrace::tools::replay_options o;
  o.config = terrace::parse_alloc_conf("policy:planned");
  o.check_invariants_every = 53;
  const auto r = terrace::tools::replay(events, o);
  EXPECT_GE(r.plan.plans, 1);
  EXPECT_GT(r.plan.deviations, 0);
  EXPECT_GT(r.plan.planned_hits, 0);
  EXPECT_EQ(r.ooms, 0u);
}

TEST(PlannedPolicy, CounterfactualReportsButHandsOutNothing) {
  const auto events = terrace::tracegen::generate_training_trace(steady_model(6));
  terrace::tools::replay_options plain, cf;
  plain.config = terrace::parse_alloc_conf("policy:caching");
  cf.config = terrace::parse_alloc_conf("policy:caching,plan_counterfactual:true");
  const auto a = terrace::tools::replay(events, plain);
  const auto b = terrace::tools::replay(events, cf);
  EXPECT_TRUE(b.plan.counterfactual);
  EXPECT_GT(b.plan.planned_hits, 0);
  EXPECT_GT(b.plan.arena_bytes, 0);
  EXPECT_EQ(a.peak_reserved_bytes, b.peak_reserved_bytes);  // nothing changed in what was done
  EXPECT_EQ(a.device_allocs, b.device_allocs);
}

// A program of random iterations: mostly the same sequence, sometimes another size, a swapped
// order or a late free. Whatever happens, live blocks never overlap and every invariant holds.
TEST(PlannedPolicy, RandomProgramsNeverGetOverlappingBlocks) {
  for (std::uint64_t seed = 1; seed <= 6; ++seed) {
    auto dev = terrace::make_device("null");
    terrace::caching_allocator a(*dev, terrace::parse_alloc_conf("policy:planned,plan_min_period:16"));
    std::mt19937_64 rng(seed);
    std::vector<std::size_t> base;
    for (int i = 0; i < 24; ++i) base.push_back((rng() % 32 + 1) * 4096);
    std::map<std::uintptr_t, std::size_t> live;  // addr -> size
    std::vector<void*> held_over;
    auto check_no_overlap = [&] {
      std::uintptr_t end = 0;
      for (const auto& [p, n] : live) {
        ASSERT_GE(p, end) << "overlap at seed " << seed;
        end = p + n;
      }
    };
    for (int it = 0; it < 40; ++it) {
      const bool explicit_marks = seed % 2 == 0;
      if (explicit_marks) a.begin_iteration();
      std::vector<void*> mine;
      for (std::size_t k = 0; k < base.size(); ++k) {
        std::size_t n = base[k];
        if (rng() % 50 == 0) n += 512;  // a dynamic shape
        void* p = a.allocate(n);
        ASSERT_NE(p, nullptr);
        live[reinterpret_cast<std::uintptr_t>(p)] = n;
        check_no_overlap();
        mine.push_back(p);
        // Free in a pattern, sometimes late, sometimes out of order.
        if (k % 3 == 2 && rng() % 40 != 0) {
          const std::size_t victim = mine.size() - 2;
          if (mine[victim] != nullptr) {
            live.erase(reinterpret_cast<std::uintptr_t>(mine[victim]));
            a.deallocate(mine[victim]);
            mine[victim] = nullptr;
          }
        }
      }
      for (void* p : mine) {
        if (p == nullptr) continue;
        if (rng() % 60 == 0) {
          held_over.push_back(p);  // outlives its iteration
          continue;
        }
        live.erase(reinterpret_cast<std::uintptr_t>(p));
        a.deallocate(p);
      }
      if (explicit_marks) a.end_iteration();
      if (!held_over.empty() && rng() % 3 == 0) {
        live.erase(reinterpret_cast<std::uintptr_t>(held_over.back()));
        a.deallocate(held_over.back());
        held_over.pop_back();
      }
      ASSERT_NO_THROW(a.check_invariants()) << seed;
    }
    const auto ps = a.plan_stats();
    EXPECT_GE(ps.plans, 1) << seed;
    EXPECT_GT(ps.planned_hits, 0) << seed;
    for (void* p : held_over) a.deallocate(p);
    a.check_invariants();
  }
}

// Parameters and optimizer state are placed by the caching allocator during the learning
// iterations, between activations; the plan must reuse the holes those leave, so that the planned
// policy reserves no more than caching in the steady state (issue 5's fragmentation target).
TEST(PlannedPolicy, ReusesTheLearningPhaseHolesAndBeatsCaching) {
  for (const int dynamic : {0, 3}) {
    terrace::tracegen::training_trace_options opt;
    opt.iterations = 10;
    opt.dynamic_iterations = dynamic;
    opt.shape_determined_scratch = true;
    const auto events = terrace::tracegen::generate_training_trace(opt);
    terrace::tools::replay_options planned, caching;
    planned.config = terrace::parse_alloc_conf("policy:planned");
    planned.check_invariants_every = 41;
    const auto p = terrace::tools::replay(events, planned);
    caching.config = terrace::parse_alloc_conf("policy:caching");
    caching.steady_from_event = p.steady_from_event;
    const auto c = terrace::tools::replay(events, caching);
    EXPECT_GT(p.plan.hole_bytes, 0) << dynamic;
    EXPECT_LE(p.steady_peak_reserved_bytes, c.steady_peak_reserved_bytes) << dynamic;
    if (dynamic == 0) {
      // Within 3% of peak live once the plan runs, and its footprint near the lower bound.
      EXPECT_LT(p.steady_fragmentation, 0.03);
      EXPECT_LE(static_cast<double>(p.plan.arena_bytes),
                1.05 * static_cast<double>(p.plan.lower_bound_bytes));
    }
    // The claimed holes count as the arena's: the books show only what the program holds.
    EXPECT_EQ(p.stats.allocation[0].current, static_cast<std::int64_t>(p.live_at_end)) << dynamic;
    EXPECT_EQ(p.stats.allocated_bytes[0].current, c.stats.allocated_bytes[0].current) << dynamic;
    // Claimed holes never count as live at the peak either (the fallback may round a block up).
    EXPECT_GE(p.stats.allocated_bytes[0].peak, p.peak_allocated_bytes) << dynamic;
    EXPECT_LE(p.stats.allocated_bytes[0].peak, c.stats.allocated_bytes[0].peak + (2 << 20)) << dynamic;
    EXPECT_LE(p.stats.allocated_bytes[0].peak, p.stats.reserved_bytes[0].peak) << dynamic;

    // Mid-iteration, planned blocks show inside the fallback's segments where the holes were.
    terrace::tools::replay_options stop = planned;
    stop.check_invariants_every = 0;
    stop.stop_after_event = p.steady_from_event + (events.size() - p.steady_from_event) / 2;
    const auto s = terrace::tools::replay(events, stop);
    ASSERT_TRUE(s.snapshot_at_stop.has_value());
    std::size_t in_holes = 0;
    for (std::size_t g = 0; g + 1 < s.snapshot_at_stop->segments.size(); ++g) {
      const auto& seg = s.snapshot_at_stop->segments[g];
      std::uint64_t active = 0;
      for (const auto& b : seg.blocks) {
        if (b.state == "active_allocated") active += b.size;
        if (b.tag == "planned") ++in_holes;
      }
      EXPECT_EQ(active, seg.active_size) << "segment " << g;
    }
    if (dynamic == 0) {
      EXPECT_GT(in_holes, 0u);
    }
  }
}

// Random programs whose first iterations also allocate blocks that live for ever, interleaved with
// large transient ones (the case that leaves holes). Live blocks never overlap, whatever happens.
TEST(PlannedPolicy, RandomProgramsWithLongLivedBlocksNeverOverlap) {
  int seeds_in_holes = 0;  // runs whose plan, at the end, is installed partly in claimed holes
  for (std::uint64_t seed = 1; seed <= 6; ++seed) {
    auto dev = terrace::make_device("null");
    terrace::caching_allocator a(*dev, terrace::parse_alloc_conf("policy:planned,plan_min_period:16"));
    std::mt19937_64 rng(seed);
    std::vector<std::size_t> base;
    for (int i = 0; i < 20; ++i) {
      const std::size_t unit = rng() % 2 ? (1u << 20) : 4096u;  // large and small pool
      base.push_back((rng() % 24 + 1) * unit + 512 * (rng() % 4));
    }
    SCOPED_TRACE(seed);
    held_blocks live(a);
    std::vector<void*> forever;
    auto take = [&](std::size_t n) { return live.get(n); };
    auto give = [&](void* p) { live.give(p); };
    for (int it = 0; it < 30; ++it) {
      std::vector<void*> mine;
      for (std::size_t k = 0; k < base.size(); ++k) {
        mine.push_back(take(base[k] + (rng() % 80 == 0 ? 512 : 0)));
        if (it < 3 && k % 5 == 0) forever.push_back(take((rng() % 8 + 1) << 20));
        if (k % 4 == 3) {
          give(mine[k - 1]);
          mine[k - 1] = nullptr;
        }
      }
      for (void* p : mine) {
        if (p != nullptr) give(p);
      }
      if (it % 7 == 6 && !forever.empty() && rng() % 2 == 0) {
        give(forever.back());  // even a long-lived block goes some day
        forever.pop_back();
      }
      ASSERT_NO_THROW(a.check_invariants()) << seed;
    }
    const auto ps = a.plan_stats();
    EXPECT_GE(ps.plans, 1) << seed;
    EXPECT_GT(ps.planned_hits, 0) << seed;
    if (ps.hole_bytes > 0) ++seeds_in_holes;
    for (void* p : forever) give(p);
    a.check_invariants();
    EXPECT_TRUE(live.empty());
    EXPECT_EQ(a.stats().allocated_bytes[0].current, 0) << seed;
  }
  EXPECT_GE(seeds_in_holes, 2);
}

// The same on two streams whose holes the plan shares out (a stream's slots may lie in what the
// other's left of its holes): random sizes, long-lived blocks on both streams, iterations of
// another shape now and then, requests outside the plan. Live blocks never overlap.
TEST(PlannedPolicy, RandomTwoStreamProgramsNeverOverlap) {
  int seeds_in_holes = 0;
  for (std::uint64_t seed = 1; seed <= 6; ++seed) {
    auto dev = terrace::make_device("null");
    const terrace::stream_ref streams[2] = {dev->create_stream(), dev->create_stream()};
    terrace::caching_allocator a(*dev, terrace::parse_alloc_conf("policy:planned,plan_min_period:16"));
    std::mt19937_64 rng(seed);
    std::vector<std::pair<std::size_t, int>> base;  // size, stream
    for (int i = 0; i < 24; ++i) {
      const std::size_t unit = rng() % 2 ? (1u << 20) : 4096u;
      base.emplace_back((rng() % 12 + 1) * unit + 512 * (rng() % 4), static_cast<int>(rng() % 2));
    }
    SCOPED_TRACE(seed);
    held_blocks live(a);
    std::vector<std::pair<void*, int>> forever;
    bool in_holes = false;
    auto take = [&](std::size_t n, int s) { return live.get(n, streams[s]); };
    auto give = [&](void* p, int s) { live.give(p, streams[s]); };
    for (int it = 0; it < 40; ++it) {
      const bool other_shape = it > 8 && rng() % 6 == 0;
      std::vector<std::pair<void*, int>> mine;
      for (std::size_t k = 0; k < base.size(); ++k) {
        const auto [n, s] = base[k];
        mine.emplace_back(take(other_shape ? n + 8192 : n, s), s);
        if (it < 3 && k % 6 == 0) forever.emplace_back(take((rng() % 6 + 2) << 19, s), s);
        if (rng() % 40 == 0) mine.emplace_back(take((rng() % 8 + 1) << 18, 1 - s), 1 - s);  // extra
        if (k % 4 == 3) {
          auto& [victim, vs] = mine[mine.size() - 2];
          if (victim != nullptr) give(victim, vs);
          victim = nullptr;
        }
      }
      for (auto [p, s] : mine) {
        if (p != nullptr) give(p, s);
      }
      if (it % 9 == 8 && !forever.empty() && rng() % 2 == 0) {
        give(forever.back().first, forever.back().second);
        forever.pop_back();
      }
      ASSERT_NO_THROW(a.check_invariants()) << seed;
      in_holes = in_holes || a.plan_stats().hole_bytes > 0;
    }
    const auto ps = a.plan_stats();
    EXPECT_GE(ps.plans, 1) << seed;
    EXPECT_GT(ps.planned_hits, 0) << seed;
    if (in_holes) ++seeds_in_holes;
    for (auto [p, s] : forever) give(p, s);
    a.check_invariants();
    EXPECT_TRUE(live.empty());
    EXPECT_EQ(a.stats().allocated_bytes[0].current, 0) << seed;
  }
  EXPECT_GE(seeds_in_holes, 2);
}

// Two streams, as in an offloaded training step: a copy stream fetches "params" that the compute
// stream's "activations" use. Every other iteration fetches one block more (a prefetch the eviction
// policy repeats), and in those the copy stream's fetch lands before the compute stream's last
// frees instead of after. The plan must stay in sync through both variants (requests outside the
// plan go elsewhere, the rest keep their slots), never re-plan, never hand out overlapping blocks,
// and keep its arena reserved once.
TEST(PlannedPolicy, ExtraRequestsAndStreamInterleavingStayPlanned) {
  auto dev = terrace::make_device("null");
  const terrace::stream_ref copy = dev->create_stream(), compute = dev->create_stream();
  terrace::caching_allocator a(*dev, terrace::parse_alloc_conf("policy:planned"));
  held_blocks live(a);
  auto get = [&](std::size_t n, terrace::stream_ref s, const char* tag) { return live.get(n, s, tag); };
  auto give = [&](void* p, terrace::stream_ref s) { live.give(p, s); };
  std::int64_t reservations_after_warmup = -1;
  for (int it = 0; it < 30; ++it) {
    const bool variant = it % 2 == 1 && it > 6;  // learning sees only the first variant
    std::vector<void*> params, acts;
    for (int layer = 0; layer < 6; ++layer) {
      params.push_back(get(std::size_t{2} << 20, copy, "param"));
      for (int k = 0; k < 4; ++k) acts.push_back(get(std::size_t{256} << 10, compute, "act"));
      void* scratch = get(std::size_t{1} << 20, compute, "scratch");
      give(scratch, compute);
    }
    // Backward: activations go in reverse, params after their layer.
    for (int layer = 5; layer >= 0; --layer) {
      for (int k = 3; k >= 0; --k) {
        give(acts.back(), compute);
        acts.pop_back();
      }
      if (layer == 1 && variant) {
        void* extra = get(std::size_t{2} << 20, copy, "param");  // one fetch more
        give(extra, copy);
      }
      give(params.back(), copy);
      params.pop_back();
    }
    if (it == 10) reservations_after_warmup = a.stats().num_device_alloc;
  }
  a.check_invariants();
  const auto ps = a.plan_stats();
  EXPECT_EQ(ps.plans, 1);  // no re-planning churn
  EXPECT_GT(ps.deviating_iterations, 0);  // the variant was seen, and served outside the plan
  EXPECT_GT(ps.hit_rate(), 0.9) << ps.planned_hits << " of " << ps.allocs_under_plan << ", "
                                 << ps.unplanned_allocs << " unplanned, " << ps.deviations
                                 << " deviations";
  // The arena was reserved once, not again for every iteration that differs.
  EXPECT_EQ(a.stats().num_device_alloc, reservations_after_warmup);
  EXPECT_TRUE(live.empty());
  EXPECT_EQ(a.stats().allocated_bytes[0].current, 0);
}

// Two streams as in an offloaded training step, each repeating exactly, but the copy stream runs
// ahead of the compute stream by a varying number of requests (0-9) across every boundary (a
// prefetch that, depending on timing, is issued before or after the compute stream's last frees),
// as in a 250-step `terrace train` run on a busy machine (docs/planning.md). Iterations in
// `other_shape` request 8 KiB more per param. Returns the plan's stats after 40 iterations; every
// allocation is checked for overlap.
terrace::planner_stats run_shifted_streams(const std::set<int>& other_shape) {
  auto dev = terrace::make_device("null");
  const terrace::stream_ref copy = dev->create_stream(), compute = dev->create_stream();
  terrace::caching_allocator a(*dev, terrace::parse_alloc_conf("policy:planned,plan_min_period:16"));
  held_blocks live(a);
  struct op {
    bool alloc;
    std::size_t bytes;
    int id;  // the block, unique over the run
  };
  // Each stream's program, all iterations; a copy op also names how far ahead of the compute
  // stream it may go (its iteration's lead).
  std::vector<op> copy_ops, compute_ops;
  std::vector<int> copy_lead;
  std::mt19937_64 rng(7);
  int next_id = 0;
  constexpr int kIterations = 40, kLayers = 6;
  for (int it = 0; it < kIterations; ++it) {
    const int lead = it < 8 ? 0 : static_cast<int>(rng() % 4) * 3;  // learning sees no shift
    const std::size_t param_bytes = (std::size_t{2} << 20) + (other_shape.count(it) ? 8192 : 0);
    std::vector<int> params, acts;
    for (int layer = 0; layer < kLayers; ++layer) {
      params.push_back(next_id++);
      copy_ops.push_back({true, param_bytes, params.back()});
      copy_lead.push_back(lead);
      for (int k = 0; k < 3; ++k) {
        acts.push_back(next_id++);
        compute_ops.push_back({true, static_cast<std::size_t>(256 + 64 * k) << 10, acts.back()});
      }
    }
    for (int layer = kLayers - 1; layer >= 0; --layer) {
      for (int k = 0; k < 3; ++k) {
        compute_ops.push_back({false, 0, acts.back()});
        acts.pop_back();
      }
      copy_ops.push_back({false, 0, params[static_cast<std::size_t>(layer)]});
      copy_lead.push_back(lead);
    }
    const int scratch = next_id++;
    compute_ops.push_back({true, std::size_t{1} << 20, scratch});
    compute_ops.push_back({false, 0, scratch});
  }
  // Merge: the copy stream's i-th op of an iteration goes with the compute stream's op of the same
  // progress, minus its lead; each stream's own order is kept.
  const double copy_per_compute = static_cast<double>(copy_ops.size()) / compute_ops.size();
  std::map<int, void*> ptr;
  auto run = [&](const op& o, terrace::stream_ref s) {
    if (o.alloc) {
      ptr[o.id] = live.get(o.bytes, s, "");
    } else {
      live.give(ptr.at(o.id), s);
      ptr.erase(o.id);
    }
  };
  std::size_t c = 0, k = 0;
  while (c < copy_ops.size() || k < compute_ops.size()) {
    const bool take_copy =
        c < copy_ops.size() &&
        (k == compute_ops.size() ||
         static_cast<double>(c) / copy_per_compute - copy_lead[c] <= static_cast<double>(k));
    if (take_copy) {
      run(copy_ops[c++], copy);
    } else {
      run(compute_ops[k++], compute);
    }
  }
  a.check_invariants();
  EXPECT_TRUE(live.empty());
  EXPECT_EQ(a.stats().allocated_bytes[0].current, 0);
  return a.plan_stats();
}

// Each stream keeps to the plan on its own, so no request misses its slot. With one cursor for
// both streams, 39 did here (and 14% of the requests on the busy-box trace).
TEST(PlannedPolicy, StreamsThatShiftAgainstEachOtherStayPlanned) {
  const auto ps = run_shifted_streams({});
  EXPECT_EQ(ps.plans, 1);
  EXPECT_EQ(ps.lost_iterations, 0);
  EXPECT_GT(ps.iterations, 25) << ps.allocs_under_plan << " allocations under the plan";
  EXPECT_EQ(ps.deviations, 0) << ps.planned_hits << " of " << ps.allocs_under_plan;
}

// Two iterations of another shape leave the plan (one lost iteration: the second is served while
// seeking), and it comes back at the next boundary of the lead stream, although the copy stream
// interleaves differently there: the boundary is recognised by the lead stream's own tokens.
// Measured 55 deviations (the two iterations are 50); recognised by both streams' tokens, 355
// (the plan came back 12 iterations later).
TEST(PlannedPolicy, ShiftedStreamsResynchroniseAfterAnotherShape) {
  const auto ps = run_shifted_streams({15, 16});
  EXPECT_EQ(ps.plans, 1);
  EXPECT_EQ(ps.lost_iterations, 1);
  EXPECT_LE(ps.deviations, 3 * 25) << ps.planned_hits << " of " << ps.allocs_under_plan;
}

// tests/data/train_offload_trace.jsonl: the device allocator's trace recorded live by
// `terrace train --steps 20 --save-trace ...` (default model, 28 MiB sim device; see
// docs/planning.md). Its steps come in two variants (one param fetch more in about half of them,
// and the copy stream's fetch before or after the compute stream's last frees). Before the
// planner tolerated that, every other step deviated: hit rate 49%, 47 device allocations, steady
// peak reserved 72 MiB against caching's 52.
TEST(PlannedPolicy, RecordedTrainingTraceStaysPlannedAndBeatsCaching) {
  const auto path = std::filesystem::path(__FILE__).parent_path() / "data" / "train_offload_trace.jsonl";
  const auto events = terrace::tools::load_trace(path.string());
  terrace::tools::replay_options planned, caching;
  planned.config = terrace::parse_alloc_conf("policy:planned");
  planned.check_invariants_every = 97;
  const auto p = terrace::tools::replay(events, planned);
  caching.config = terrace::parse_alloc_conf("policy:caching");
  caching.steady_from_event = p.steady_from_event;
  const auto c = terrace::tools::replay(events, caching);
  ASSERT_LT(p.steady_from_event, events.size());
  EXPECT_EQ(p.ooms, 0u);
  EXPECT_EQ(p.plan.replans, 0);
  EXPECT_GT(p.plan.hit_rate(), 0.95);  // measured 98.2%
  EXPECT_LE(p.device_allocs, c.device_allocs + 4);  // measured 9 vs 8 (was 47)
  // Measured 2026-11-24: steady 34.9 MiB against caching's 52.0 and expandable's 36.0 (before:
  // 54.9). The extra fetch outside the plan is served from a claimed hole's tail from its first
  // occurrence on, and while a plan is installed the fallback cuts large segments to the request,
  // so an occasional request no longer strands a 20 MiB segment beside the arena.
  terrace::tools::replay_options expandable = caching;
  expandable.config = terrace::parse_alloc_conf("policy:expandable");
  const auto x = terrace::tools::replay(events, expandable);
  EXPECT_LT(p.steady_peak_reserved_bytes, c.steady_peak_reserved_bytes);
  EXPECT_LE(p.steady_peak_reserved_bytes, x.steady_peak_reserved_bytes);
  EXPECT_LE(p.peak_reserved_bytes, c.peak_reserved_bytes);  // the learning steps are caching's
}

// An occasional request outside the plan (an extra block in every other iteration) borrows free
// arena space that no slot needs soon, instead of a segment of the caching allocator beside the
// arena; the plan keeps its hits and no block overlaps another.
TEST(PlannedPolicy, AnOccasionalExtraRequestBorrowsFreeArenaSpace) {
  auto dev = terrace::make_device("null");
  terrace::caching_allocator a(*dev, terrace::parse_alloc_conf(kPlannedExactConf));
  held_blocks live(a);
  constexpr std::size_t kUnit = std::size_t{1} << 20;
  auto iteration = [&](bool extra) {
    a.begin_iteration();
    // A large block first, freed at once; the short blocks after it use part of its space, and
    // the rest is free until the next iteration begins.
    void* base = live.get(kUnit);
    live.give(live.get(3 * kUnit));
    for (int k = 0; k < 24; ++k) {
      void* p = live.get(kUnit + static_cast<std::size_t>(k % 3) * 4096);
      if (extra && k == 4) live.give(live.get(kUnit / 4));  // outside the plan
      live.give(p);
    }
    live.give(base);
    a.end_iteration();
    ASSERT_NO_THROW(a.check_invariants());
  };
  for (int it = 0; it < 4; ++it) iteration(false);
  ASSERT_TRUE(a.plan_stats().active);
  const auto device_allocs = a.stats().num_device_alloc;
  for (int it = 0; it < 8; ++it) iteration(it % 2 == 1);
  EXPECT_EQ(a.plan_stats().miss_loans, 4);
  EXPECT_EQ(a.stats().num_device_alloc, device_allocs) << "the extra request reserved memory";
  EXPECT_GT(a.plan_stats().hit_rate(), 0.95);
  EXPECT_EQ(a.plan_stats().lost_iterations, 0);
  EXPECT_TRUE(live.empty());
}

// A deviating iteration (another shape) uninstalls the plan; the arena becomes a segment of the
// caching allocator, which serves that iteration from it instead of reserving beside it.
TEST(PlannedPolicy, ADeviatingIterationIsServedFromTheArenasMemory) {
  auto dev = terrace::make_device("null");
  terrace::caching_allocator a(*dev, terrace::parse_alloc_conf(kPlannedExactConf));
  constexpr std::size_t kUnit = std::size_t{1} << 20;
  auto iteration = [&](std::size_t unit) {
    a.begin_iteration();
    std::vector<void*> blocks;
    for (int k = 0; k < 24; ++k) blocks.push_back(a.allocate(unit + static_cast<std::size_t>(k) * 4096));
    for (void* p : blocks) a.deallocate(p);
    a.end_iteration();
  };
  for (int it = 0; it < 4; ++it) iteration(kUnit);
  ASSERT_TRUE(a.plan_stats().active);
  const auto steady = a.stats();
  a.reset_peak_stats();
  // Another shape, half the size. Its first requests are misses the plan tolerates (two borrow
  // arena space, the others get segments of their own); at the eighth the plan is uninstalled,
  // and the remaining 16 come out of the arena's memory.
  iteration(kUnit / 2);
  EXPECT_GE(a.plan_stats().lost_iterations, 1);
  EXPECT_LE(a.stats().num_device_alloc - steady.num_device_alloc, 6);
  EXPECT_LE(a.stats().reserved_bytes[0].peak,
            steady.reserved_bytes[0].current + static_cast<std::int64_t>(6 * (kUnit / 2 + 24 * 4096)));
  for (int it = 0; it < 3; ++it) iteration(kUnit);  // the plan comes back
  EXPECT_GT(a.plan_stats().arena_reserved_bytes, 0);
  a.check_invariants();
  EXPECT_EQ(a.stats().allocated_bytes[0].current, 0);
}

// A device error (not out-of-memory) while the plan's arena is reserved reaches the caller, and
// the fallback holes the installation had claimed go back to the caching allocator: nothing is
// lost, and the plan is installed at a later iteration.
TEST(PlannedPolicy, ADeviceErrorWhileInstallingThePlanLosesNoMemory) {
  auto dev = terrace::make_device("null");
  terrace::caching_allocator a(*dev, terrace::parse_alloc_conf(kPlannedExactConf));
  constexpr std::size_t kUnit = std::size_t{1} << 20;
  // Before the recording: a long-lived block in part of a transient one's segment, which leaves
  // a hole that the installation claims.
  a.deallocate(a.allocate(8 * kUnit));
  void* kept = a.allocate(kUnit);
  auto iteration = [&] {
    a.begin_iteration();
    std::vector<void*> blocks;
    for (int k = 0; k < 24; ++k) blocks.push_back(a.allocate(kUnit + static_cast<std::size_t>(k) * 4096));
    for (void* p : blocks) a.deallocate(p);
    a.end_iteration();
  };
  int refused = 0;
  for (int it = 0; it < 8 && !a.plan_stats().active; ++it) iteration();
  ASSERT_TRUE(a.plan_stats().active);
  ASSERT_EQ(a.plan_stats().iterations, 0) << "the plan was installed before the test could fail it";
  dev->inject_device_error(1);
  try {
    iteration();
  } catch (const terrace::device_error&) {
    ++refused;
  }
  ASSERT_EQ(refused, 1) << "the injected error did not reach the installation";
  dev->inject_device_error(0);
  ASSERT_NO_THROW(a.check_invariants());
  for (int it = 0; it < 3; ++it) iteration();
  EXPECT_GT(a.plan_stats().iterations, 0);
  a.deallocate(kept);
  a.empty_cache();
  a.check_invariants();
  EXPECT_EQ(a.stats().reserved_bytes[0].current, 0);
  EXPECT_EQ(dev->used_bytes(), 0u) << "memory the failed installation claimed was lost";
}

// The same trace on a device of the size it was recorded on (28 MiB) under the engine's settings:
// the caching allocator fits by giving cached segments back; the plan's arena must then not make
// a request fail that caching would serve. The extra param fetch outside the plan (2 MiB) finds
// the device full while the arena holds live blocks: it borrows free space of the arena. Before,
// 9 requests ran out of memory.
TEST(PlannedPolicy, ALateFreeBeforeASlotTheFallbackServesIsStillChecked) {
  // x's space is planned for c, x being freed first. b, between them, outlives the iteration, so
  // the fallback serves it; handing b out marked the due lists up to it as checked without
  // checking them, and when x was freed late c was placed over the live x. Found by a fuzzer.
  constexpr std::size_t kMiB = std::size_t{1} << 20;
  auto dev = terrace::make_device("null");
  terrace::caching_allocator a(*dev, terrace::parse_alloc_conf("policy:planned"));
  void* b_prev = nullptr;
  for (int it = 0; it < 6; ++it) {
    const bool late_free = it >= 3;
    a.begin_iteration();
    if (b_prev != nullptr) a.deallocate(b_prev);
    void* x = a.allocate(kMiB);
    if (!late_free) a.deallocate(x);
    void* b = a.allocate(3 * kMiB);
    void* c = a.allocate(kMiB);
    const auto xa = reinterpret_cast<std::uintptr_t>(x);
    const auto ca = reinterpret_cast<std::uintptr_t>(c);
    if (late_free) {
      EXPECT_FALSE(xa < ca + kMiB && ca < xa + kMiB) << "iteration " << it << ": c lies on the live x";
      a.deallocate(x);
    }
    a.deallocate(c);
    b_prev = b;
    a.end_iteration();
    a.check_invariants();
  }
  a.deallocate(b_prev);
  EXPECT_GT(a.plan_stats().planned_hits, 0);
}

TEST(PlannedPolicy, ARequestRefusedEveryIterationDoesNotKeepThePlanAway) {
  // A workspace request that fails every iteration (the caller catches the out-of-memory and
  // takes a smaller one, as cuDNN's algorithm search does) was recorded as a block that stays
  // live: the live bytes grew by it every iteration, so no steady state was ever seen (and huge
  // refused requests overflowed the recorded byte count).
  constexpr std::size_t kMiB = std::size_t{1} << 20;
  terrace::device_options o;
  o.capacity = 256 * kMiB;
  auto dev = terrace::make_device("null", o);
  terrace::caching_allocator a(*dev, terrace::parse_alloc_conf("policy:planned,plan_min_period:16"));
  for (int it = 0; it < 30; ++it) {  // no iteration marks: the plan must see the period itself
    std::vector<void*> held;
    for (std::size_t i = 1; i <= 16; ++i) held.push_back(a.allocate(i * kMiB / 2));
    EXPECT_THROW(a.allocate(std::size_t{1} << 61), terrace::out_of_memory);
    EXPECT_THROW(a.allocate(512 * kMiB), terrace::out_of_memory);
    for (std::size_t i = 0; i < 8; ++i) a.deallocate(held[i]);
    held.push_back(a.allocate(3 * kMiB));
    for (std::size_t i = 8; i < held.size(); ++i) a.deallocate(held[i]);
  }
  a.check_invariants();
  EXPECT_GT(a.plan_stats().plans, 0);
  EXPECT_GT(a.plan_stats().planned_hits, 0);
}

TEST(PlannedPolicy, DestroyingTheAllocatorWaitsForWorkStillUsingTheArena) {
  // A stream-ordered free is legal while a kernel queued before it still writes the block; the
  // arena went back to the device before that kernel ran (ASan: heap-use-after-free on the sim
  // stream's thread; with blocks this large the sim device maps the arena, so a plain build
  // faults too).
  constexpr std::size_t kBlock = std::size_t{2} << 20;
  auto dev = terrace::make_device("sim");
  const terrace::stream_ref s = dev->create_stream();
  std::atomic<bool> wrote{false};
  {
    terrace::caching_allocator a(*dev, terrace::parse_alloc_conf("policy:planned"));
    for (int it = 0; it < 4; ++it) {
      a.begin_iteration();
      void* x = a.allocate(kBlock, s);
      void* y = a.allocate(2 * kBlock, s);
      a.deallocate(x, s);
      a.deallocate(y, s);
      a.end_iteration();
    }
    a.begin_iteration();
    void* p = a.allocate(kBlock, s);
    ASSERT_GT(a.plan_stats().planned_hits, 0) << "the block must come from the arena";
    terrace::enqueue_host_function(*dev, s, [p, &wrote] {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      std::memset(p, 0xab, kBlock);
      wrote = true;
    });
    a.deallocate(p, s);
  }
  EXPECT_TRUE(wrote.load()) << "the allocator was destroyed before the queued work finished";
  dev->synchronize_device();
  dev->destroy_stream(s);
}

TEST(PlannedPolicy, TheRecordedTrainingTraceStaysPlannedOnItsDevice) {
  const auto path = std::filesystem::path(__FILE__).parent_path() / "data" / "train_offload_trace.jsonl";
  const auto events = terrace::tools::load_trace(path.string());
  terrace::tools::replay_options o;
  o.config = terrace::offload_engine_options::default_device_allocator();
  o.config.device_capacity = std::size_t{28} << 20;
  const auto c = terrace::tools::replay(events, o);
  ASSERT_EQ(c.ooms, 0u);
  o.config.policy = terrace::alloc_policy::planned;
  o.check_invariants_every = 61;
  const auto p = terrace::tools::replay(events, o);
  EXPECT_EQ(p.ooms, 0u);
  // The extra fetch (copy stream), a param fetched again after an early free, is served from its
  // own slot again (before, from the compute stream's part, lent under pressure): no deviation.
  EXPECT_EQ(p.plan.deviations, 0);
  EXPECT_GT(p.plan.hit_rate(), 0.95);  // measured 98.6%, as without the capacity
  EXPECT_LT(p.steady_peak_reserved_bytes, c.steady_peak_reserved_bytes);  // 26.44 vs 27.85 MiB

  // At 26 MiB the plan (a 25.4 MiB arena) does not fit beside what the iterations keep outside
  // it: neither whole nor mapped page by page (whose pages, once mapped, starved the caching
  // allocator: 67 failed requests before the lazy arena checked for room), and the caching
  // allocator serves the trace as without a plan.
  o.config.device_capacity = std::size_t{26} << 20;
  const auto tight = terrace::tools::replay(events, o);
  EXPECT_EQ(tight.ooms, 0u);
  EXPECT_EQ(tight.plan.lazy_arenas, 0);
  EXPECT_GT(tight.plan.arena_refusals, 0);
}

// A block of the iteration freed early and requested again before its planned free (a delayed
// update's params, published over the copies prefetched for the next forward, are fetched
// again): its slot's space is still its own, so the request is served there again. Before, it
// missed the plan every iteration, and the fallback held a segment for it beside the arena.
TEST(PlannedPolicy, ABlockFreedEarlyAndRequestedAgainGetsItsSlotAgain) {
  auto dev = terrace::make_device("null");
  terrace::caching_allocator a(*dev, terrace::parse_alloc_conf(kPlannedExactConf));
  constexpr std::size_t kUnit = std::size_t{1} << 20;
  held_blocks live(a);
  auto iteration = [&](bool refetch) {
    a.begin_iteration();
    void* first = live.get(2 * kUnit, {}, "param/first");
    void* second = live.get(kUnit, {}, "param/second");
    if (refetch) {  // dropped and fetched again, in the same order
      live.give(first);
      live.give(second);
      first = live.get(2 * kUnit, {}, "param/first");
      second = live.get(kUnit, {}, "param/second");
    }
    for (int k = 0; k < 10; ++k) live.give(live.get(kUnit + static_cast<std::size_t>(k) * 4096));
    live.give(second);
    live.give(first);
    a.end_iteration();
    ASSERT_NO_THROW(a.check_invariants());
  };
  for (int it = 0; it < 3; ++it) iteration(false);
  ASSERT_EQ(a.plan_stats().plans, 1);
  const auto before = a.plan_stats();
  const std::int64_t reserved = a.stats().reserved_bytes[0].current;
  a.reset_peak_stats();
  for (int it = 0; it < 6; ++it) iteration(it % 2 == 0);
  const auto after = a.plan_stats();
  EXPECT_EQ(after.deviations, before.deviations);
  EXPECT_EQ(after.planned_hits - before.planned_hits, after.allocs_under_plan - before.allocs_under_plan);
  EXPECT_EQ(after.lost_iterations, 0);
  EXPECT_EQ(a.stats().reserved_bytes[0].peak, reserved) << "a segment beside the arena";
  EXPECT_TRUE(live.empty());
}

// Under memory pressure a request outside the plan is served from free space of the arena while
// blocks are live in it: the device (the arena plus 1 MiB) has no room for it beside the arena,
// and the plan would need the space soon, so it is not lent by choice.
TEST(PlannedPolicy, UnderMemoryPressureThePlanLendsItsFreeSpace) {
  constexpr std::size_t kUnit = std::size_t{1} << 20;
  terrace::device_options d;
  d.capacity = 7 * kUnit;
  auto dev = terrace::make_device("null", d);
  terrace::caching_allocator a(*dev, terrace::parse_alloc_conf(kPlannedExactConf));
  held_blocks live(a);
  auto iteration = [&](bool extra) {
    a.begin_iteration();
    void* kept = live.get(kUnit);  // live all iteration: the arena is never idle
    void* big = live.get(4 * kUnit);
    live.give(big);
    if (extra) live.give(live.get(3 * kUnit));  // a new size, where `big` was
    for (int k = 0; k < 8; ++k) {
      void* p = live.get(2 * kUnit + static_cast<std::size_t>(k) * 4096);
      void* q = live.get(2 * kUnit);
      live.give(q);
      live.give(p);
    }
    live.give(kept);
    a.end_iteration();
    ASSERT_NO_THROW(a.check_invariants());
  };
  for (int it = 0; it < 3; ++it) iteration(false);
  ASSERT_EQ(a.plan_stats().plans, 1);
  ASSERT_GE(a.plan_stats().arena_bytes, static_cast<std::int64_t>(5 * kUnit));
  for (int it = 0; it < 4; ++it) ASSERT_NO_THROW(iteration(it % 2 == 0)) << it;
  const auto s = a.plan_stats();
  EXPECT_EQ(s.pressure_loans, 2);
  EXPECT_EQ(s.lost_iterations, 0);
  EXPECT_TRUE(live.empty());
  // Every request was served: none was an out-of-memory error to the caller. The fallback's own
  // failures before the loans counted as OOMs (num_ooms 2) until 2026-11-25.
  EXPECT_EQ(a.stats().num_ooms, 0);
}

// A request nothing can serve, neither the fallback nor the plan's arena, is one OOM to the
// caller: counted once, and one oom event in the trace.
TEST(PlannedPolicy, AnOomTheCallerSeesIsCountedOnce) {
  terrace::device_options d;
  d.capacity = std::size_t{4} << 20;
  auto dev = terrace::make_device("null", d);
  terrace::caching_allocator a(*dev, terrace::parse_alloc_conf(kPlannedExactConf));
  a.record_trace(true);
  EXPECT_THROW((void)a.allocate(std::size_t{8} << 20), terrace::out_of_memory);
  EXPECT_EQ(a.stats().num_ooms, 1);
  const auto trace = a.snapshot().trace;
  EXPECT_EQ(std::count_if(trace.begin(), trace.end(),
                          [](const terrace::trace_event& e) { return e.action == terrace::trace_action::oom; }),
            1);
}

// An idle arena (no block live in it) is given back at once when the caching allocator runs out
// of memory, and the request is retried; a plan whose arena the device refuses is tried less and
// less often instead of emptying the caching allocator's cache at every boundary.
TEST(PlannedPolicy, UnderMemoryPressureAnIdleArenaIsGivenBack) {
  terrace::device_options d;
  d.capacity = std::size_t{8} << 20;
  auto dev = terrace::make_device("null", d);
  terrace::caching_allocator a(*dev, terrace::parse_alloc_conf(kPlannedExactConf));
  constexpr std::size_t kUnit = std::size_t{1} << 20;
  void* carry = nullptr;  // lives across the boundary: the fallback's, beside the arena
  auto iteration = [&](std::size_t extra_at_start) {
    a.begin_iteration();
    if (extra_at_start > 0) a.deallocate(a.allocate(extra_at_start));
    if (carry != nullptr) a.deallocate(carry);
    for (int k = 0; k < 8; ++k) {
      void* p = a.allocate(kUnit + static_cast<std::size_t>(k) * 4096);
      void* q = a.allocate(5 * kUnit / 4);
      a.deallocate(q);
      a.deallocate(p);
    }
    carry = a.allocate(3 * kUnit / 2);
    a.end_iteration();
  };
  for (int it = 0; it < 4; ++it) iteration(0);
  ASSERT_TRUE(a.plan_stats().active);
  ASSERT_GT(a.plan_stats().arena_reserved_bytes, 0);  // 2.28 MiB
  // 5 MiB beside the carried 1.5 fit only without the arena.
  EXPECT_NO_THROW(iteration(5 * kUnit));
  EXPECT_EQ(a.plan_stats().pressure_releases, 1);
  for (int it = 0; it < 4; ++it) iteration(0);
  EXPECT_EQ(a.plan_stats().arena_refusals, 0);

  // 5 MiB kept from now on: the idle arena is given back for them between iterations, and the
  // device no longer holds it beside the carried block, while the caching allocator still serves
  // the iterations (it reuses the carried block's space, which the plan cannot).
  void* kept = a.allocate(5 * kUnit);
  EXPECT_EQ(a.plan_stats().pressure_releases, 2);
  const auto before = a.plan_stats();
  for (int it = 0; it < 12; ++it) EXPECT_NO_THROW(iteration(0)) << it;
  const auto after = a.plan_stats();
  EXPECT_GE(after.arena_refusals - before.arena_refusals, 3);
  EXPECT_LE(after.arena_refusals - before.arena_refusals, 4) << "tried at every boundary";
  EXPECT_GE(after.suspensions, before.suspensions + 1);
  a.deallocate(kept);
  a.deallocate(carry);
  a.check_invariants();
  EXPECT_EQ(a.stats().allocated_bytes[0].current, 0);
}

// Iterations of 16 short blocks (1 MiB and 1.25 MiB pairs: a 2.3 MiB arena) that end by allocating
// a block carried into the next iteration, which frees it first: the carried block is the
// fallback's (it outlives the iteration), beside the arena, on an 8 MiB device with virtual memory.
class carried_block_program {
 public:
  static constexpr std::size_t kUnit = std::size_t{1} << 20;

  explicit carried_block_program(std::size_t carried) : carried_(carried) {
    terrace::device_options d;
    d.capacity = 8 * kUnit;
    d.map_granularity = std::size_t{64} << 10;
    dev_ = terrace::make_device("null", d);
      a_ = std::make_unique<terrace::caching_allocator>(*dev_, terrace::parse_alloc_conf(kPlannedExactConf));
  }
  ~carried_block_program() {
    if (carry_ != nullptr) a_->deallocate(carry_);
  }

  terrace::caching_allocator& allocator() { return *a_; }
  const terrace::device_backend& device() const { return *dev_; }

  /// Three iterations, then a 4 MiB block that the fourth frees early: at the boundary the
  /// carried block (3 MiB), it and the 2.3 MiB arena are more than the device's 8, so the plan is
  /// installed with its arena mapped page by page.
  void install_lazily() {
    for (int it = 0; it < 3; ++it) iteration();
    void* transient = a_->allocate(4 * kUnit);
    iteration([&] { a_->deallocate(transient); });
  }

  /// One iteration; `before_the_slots` runs after the carried block is freed, with the first
  /// short block (a slot) live.
  void iteration(const std::function<void()>& before_the_slots = {}) {
    a_->begin_iteration();
    if (carry_ != nullptr) a_->deallocate(std::exchange(carry_, nullptr));
    for (int k = 0; k < 8; ++k) {
      void* p = a_->allocate(kUnit + static_cast<std::size_t>(k) * 4096);
      if (k == 0 && before_the_slots) before_the_slots();
      void* q = a_->allocate(5 * kUnit / 4);
      a_->deallocate(q);
      a_->deallocate(p);
    }
    carry_ = a_->allocate(carried_);
    a_->end_iteration();
    a_->check_invariants();
  }

 private:
  std::size_t carried_;
  std::unique_ptr<terrace::device_backend> dev_;
  std::unique_ptr<terrace::caching_allocator> a_;
  void* carry_ = nullptr;
};

// A block live at the boundary (freed early in the first planned iteration) leaves no room to
// reserve the arena whole; the device has virtual memory, so the arena is an address range whose
// pages are mapped as its slots reach them, and the plan serves every iteration from the first
// on, in no more memory than when reserved whole.
TEST(PlannedPolicy, AnArenaTheDeviceCannotHoldWholeAtInstallationIsMappedPageByPage) {
  constexpr std::size_t kUnit = carried_block_program::kUnit;
  carried_block_program program(3 * kUnit);
  auto& a = program.allocator();
  program.install_lazily();
  auto s = a.plan_stats();
  ASSERT_EQ(s.lazy_arenas, 1);
  EXPECT_EQ(s.iterations, 1);
  EXPECT_EQ(s.lost_iterations, 0);
  EXPECT_EQ(s.map_refusals, 0);
  for (int it = 0; it < 6; ++it) program.iteration();
  s = a.plan_stats();
  EXPECT_EQ(s.lost_iterations, 0);
  EXPECT_EQ(s.planned_hits, 7 * 16);  // every short block: only the carried one is outside
  EXPECT_EQ(s.arena_reserved_bytes, static_cast<std::int64_t>(
      (s.arena_bytes + (64 << 10) - 1) / (64 << 10) * (64 << 10)));  // all pages mapped, once
  EXPECT_LE(program.device().used_bytes(), 3 * kUnit + static_cast<std::size_t>(s.arena_reserved_bytes));
}

// Found in review: whether a lazily mapped arena fits beside what stays outside it was judged
// against the configured memory fraction, not the one set_memory_fraction set since. Under a
// lowered cap an arena that can never be mapped whole beside the carried block was installed
// again and again, each time losing its iteration.
TEST(PlannedPolicy, ALazilyMappedArenaIsJudgedAgainstTheMemoryFractionInForce) {
  constexpr std::size_t kUnit = carried_block_program::kUnit;
  carried_block_program program(3 * kUnit);
  auto& a = program.allocator();
  for (int it = 0; it < 3; ++it) program.iteration();  // the plan is installed under 8 MiB
  void* transient = a.allocate(4 * kUnit);
  a.set_memory_fraction(0.65);  // 5.2 MiB: less than the 2.3 MiB arena beside the 3 MiB block
  program.iteration([&] { a.deallocate(transient); });  // lost: no room to map the arena's pages
  ASSERT_EQ(a.plan_stats().lazy_arenas, 1);
  program.iteration();  // installed again: judged against 5.2 MiB, refused (before: mapped lazily)
  const auto s = a.plan_stats();
  EXPECT_EQ(s.lazy_arenas, 1);
  EXPECT_EQ(s.arena_refusals, 1);
}

// A request outside the plan that the device cannot hold beside the lazily mapped arena: the
// iteration leaves the plan (as at a refused installation), and the arena's pages that hold no
// live block go back for the request; the slots map them again in the iterations that follow.
TEST(PlannedPolicy, UnderMemoryPressureALazilyMappedArenaGivesBackItsIdlePages) {
  constexpr std::size_t kUnit = carried_block_program::kUnit;
  carried_block_program program(3 * kUnit);
  auto& a = program.allocator();
  program.install_lazily();
  ASSERT_EQ(a.plan_stats().lazy_arenas, 1);
  // 6 MiB beside the first slot's 1 MiB: only with the arena's other pages given back.
  program.iteration([&] { a.deallocate(a.allocate(6 * kUnit)); });
  auto s = a.plan_stats();
  EXPECT_EQ(s.pressure_unmaps, 1);
  EXPECT_EQ(s.lost_iterations, 1);
  const auto hits = s.planned_hits;
  for (int it = 0; it < 4; ++it) program.iteration();
  s = a.plan_stats();
  EXPECT_EQ(s.lost_iterations, 1);
  EXPECT_GE(s.planned_hits, hits + 3 * 16);
  EXPECT_EQ(s.map_refusals, 0);
}

// A carried block so large that the arena fits beside it only while it is freed: the arena,
// mapped page by page, must go back for every carried block. That never fails a request (the
// idle arena goes back under pressure); the plan loses those iterations and is set aside.
TEST(PlannedPolicy, ALazilyMappedArenaThatNeverFitsIsSetAsideWithoutFailingARequest) {
  constexpr std::size_t kUnit = carried_block_program::kUnit;
  carried_block_program program(59 * kUnit / 10);
  for (int it = 0; it < 12; ++it) ASSERT_NO_THROW(program.iteration()) << it;
  const auto s = program.allocator().plan_stats();
  EXPECT_GE(s.lazy_arenas, 1);
  EXPECT_EQ(s.suspensions, 1);
  EXPECT_LE(s.lost_iterations, 3);
}

// Explicitly marked iterations that come in two ways, alternating (one request more in every
// other one, as a copy stream's fetch that lands before or after the compute stream's frees): no
// two in a row are equal, but each way recurs, and that is enough to plan one of them (before,
// only an iteration equal to the one just before it was planned: never, here).
TEST(PlannedPolicy, AlternatingMarkedIterationsArePlanned) {
  auto dev = terrace::make_device("null");
  terrace::caching_allocator a(*dev, terrace::parse_alloc_conf(kPlannedExactConf));
  constexpr std::size_t kUnit = std::size_t{1} << 20;
  held_blocks live(a);
  auto iteration = [&](bool extra) {
    a.begin_iteration();
    for (int k = 0; k < 12; ++k) {
      void* p = live.get(kUnit + static_cast<std::size_t>(k) * 4096);
      if (extra && k == 5) live.give(live.get(kUnit / 4));
      live.give(p);
    }
    a.end_iteration();
    ASSERT_NO_THROW(a.check_invariants());
  };
  for (int it = 0; it < 4; ++it) iteration(it % 2 == 1);
  auto s = a.plan_stats();
  EXPECT_EQ(s.plans, 1);
  EXPECT_GE(s.iterations, 1);
  for (int it = 4; it < 12; ++it) iteration(it % 2 == 1);
  s = a.plan_stats();
  EXPECT_EQ(s.plans, 1);
  EXPECT_EQ(s.lost_iterations, 0);
  EXPECT_GE(s.planned_hits, 9 * 12);
}

namespace {

// One marked iteration of the two tests below: the copy stream's three fetches come at another
// point of the compute stream's twelve requests in each iteration (never the same within four).
void interleaved_iteration(terrace::caching_allocator& a, held_blocks& live, terrace::stream_ref copy,
                           terrace::stream_ref compute, int it) {
  const int shift = it * 5 % 12;
  a.begin_iteration();
  std::vector<void*> params;
  for (int k = 0; k < 12; ++k) {
    if (k == shift) {
      for (int j = 0; j < 3; ++j) params.push_back(live.get(std::size_t{2} << 20, copy, ""));
    }
    live.give(live.get((std::size_t{256} + 64 * static_cast<std::size_t>(k)) << 10, compute, ""), compute);
  }
  for (void* p : params) live.give(p, copy);
  a.end_iteration();
}

}  // namespace

// Marked iterations whose two streams interleave differently every time: the copy stream's three
// fetches come at another point of the compute stream's requests in each iteration (never the
// same within four), while each stream on its own does the same. Compared as one sequence, no
// iteration equalled one of the last four and nothing was planned; stream by stream they are one
// iteration, and the lanes replay it whatever the interleaving.
TEST(PlannedPolicy, MarkedIterationsAreComparedStreamByStream) {
  auto dev = terrace::make_device("null");
  const terrace::stream_ref copy = dev->create_stream(), compute = dev->create_stream();
  terrace::caching_allocator a(*dev, terrace::parse_alloc_conf(
      "policy:planned,plan_min_period:16,min_large_alloc:1,large_round:4096"));
  held_blocks live(a);
  auto iteration = [&](int it) {
    interleaved_iteration(a, live, copy, compute, it);
    ASSERT_NO_THROW(a.check_invariants());
  };
  for (int it = 0; it < 3; ++it) iteration(it);
  EXPECT_EQ(a.plan_stats().plans, 1) << "the second iteration equals the first stream by stream";
  for (int it = 3; it < 24; ++it) iteration(it);
  const auto s = a.plan_stats();
  EXPECT_EQ(s.plans, 1);
  EXPECT_EQ(s.lost_iterations, 0);
  EXPECT_EQ(s.deviations, 0);
  EXPECT_GE(s.planned_hits, 20 * 15);
}

// A trace recorded with iteration marks replays with them: the planner sees the iterations it saw
// live. Here the workload of the test above, recorded under the caching policy, then replayed
// with the planned policy: with the marks, one plan from the second iteration on and no
// deviation, as live; with the marks taken out, the planner must find the period in the one
// sequence of both streams, whose interleaving never repeats within four iterations.
TEST(PlannedPolicy, ATraceReplaysWithItsIterationMarks) {
  auto dev = terrace::make_device("null");
  const terrace::stream_ref copy = dev->create_stream(), compute = dev->create_stream();
  terrace::caching_allocator a(*dev, terrace::parse_alloc_conf("record_trace:true,trace_max_events:100000"));
  held_blocks live(a);
  for (int it = 0; it < 24; ++it) interleaved_iteration(a, live, copy, compute, it);
  const std::vector<terrace::trace_event> marked = a.snapshot().trace;
  std::vector<terrace::trace_event> unmarked;
  for (const terrace::trace_event& e : marked) {
    if (e.action != terrace::trace_action::iteration_begin &&
        e.action != terrace::trace_action::iteration_end) {
      unmarked.push_back(e);
    }
  }
  ASSERT_EQ(marked.size() - unmarked.size(), 48u);
  terrace::tools::replay_options o;
  o.config = terrace::parse_alloc_conf("policy:planned,plan_min_period:16,min_large_alloc:1,large_round:4096");
  o.check_invariants_every = 13;
  const auto with = terrace::tools::replay(marked, o);
  EXPECT_EQ(with.iteration_marks, 48u);
  EXPECT_EQ(with.plan.plans, 1);
  EXPECT_EQ(with.plan.deviations, 0);
  EXPECT_EQ(with.plan.lost_iterations, 0);
  EXPECT_GE(with.plan.planned_hits, 21 * 15) << "every request from the third iteration on";
  const auto without = terrace::tools::replay(unmarked, o);
  EXPECT_EQ(without.iteration_marks, 0u);
  EXPECT_LT(without.plan.planned_hits, with.plan.planned_hits);  // measured 0 against 330 of 360
}

// A block freed later than the plan says holds up only the slots planned over its space. Here
// Y's space goes to V, allocated right after Y's planned free, and the ten Z blocks (alive beside
// V) lie above it. In the first late iteration Y is freed only after the Zs: V, whose slot is
// still held, goes to the fallback; the Zs keep to the plan. (Before, every slot due after Y's
// free waited for it, and ten requests in a row outside the plan lost the iteration.) Then the
// plan is laid out again with Y's free at its latest, and the late iterations after it keep to
// it wholly.
TEST(PlannedPolicy, ALateFreeHoldsUpOnlyTheSlotsOverItsSpace) {
  auto dev = terrace::make_device("null");
  terrace::caching_allocator a(*dev, terrace::parse_alloc_conf(kPlannedExactConf));
  constexpr std::size_t kMiB = std::size_t{1} << 20;
  held_blocks live(a);
  auto iteration = [&](bool late) {
    a.begin_iteration();
    void* x = live.get(8 * kMiB);
    void* y = live.get(kMiB);
    if (!late) live.give(y);
    void* v = live.get(2 * kMiB);  // placed before the smaller Zs: over Y, below them
    for (int k = 0; k < 10; ++k) live.give(live.get(kMiB + 8192 + static_cast<std::size_t>(k) * 4096));
    if (late) live.give(y);
    live.give(v);
    live.give(x);
    a.end_iteration();
    ASSERT_NO_THROW(a.check_invariants());
  };
  for (int it = 0; it < 3; ++it) iteration(false);
  ASSERT_EQ(a.plan_stats().plans, 1);
  const auto before = a.plan_stats();
  for (int it = 0; it < 8; ++it) iteration(it % 2 == 0);
  const auto s = a.plan_stats();
  EXPECT_EQ(s.lost_iterations, 0);
  EXPECT_EQ(s.deviating_iterations - before.deviating_iterations, 1);
  EXPECT_EQ(s.deviations - before.deviations, 1) << "V alone, in the first late iteration";
  EXPECT_EQ(s.planned_hits - before.planned_hits, 8 * 13 - 1);
  EXPECT_EQ(s.widenings, 1);
  EXPECT_EQ(s.plans, 1);
  EXPECT_TRUE(live.empty());
}

namespace {

// 25 marked iterations of `body(live, rng)` under `conf` on a device of `capacity` bytes (0: the
// default), the peaks reset after the tenth: the plan's statistics and the steady state's
// reserved peak.
std::pair<terrace::planner_stats, std::int64_t> run_marked_iterations(
    const char* conf, std::uint64_t seed,
    const std::function<void(held_blocks&, std::mt19937_64&)>& body, std::size_t capacity = 0) {
  terrace::device_options d;
  d.capacity = capacity;
  auto dev = terrace::make_device("null", d);
  terrace::caching_allocator a(*dev, terrace::parse_alloc_conf(conf));
  held_blocks live(a);
  std::mt19937_64 rng(seed);
  for (int it = 0; it < 25; ++it) {
    if (it == 10) a.reset_peak_stats();
    a.begin_iteration();
    body(live, rng);
    a.end_iteration();
    EXPECT_NO_THROW(a.check_invariants());
  }
  EXPECT_TRUE(live.empty());
  return {a.plan_stats(), a.stats().reserved_bytes[0].peak};
}

constexpr const char* kCachingExactConf = "small_size:4096,min_large_alloc:1,large_round:4096";

}  // namespace

// Marked iterations that make the same requests and frees, each in an order of its own, as
// timing orders a stream's frees among its requests: each block is freed just before or just
// after the next one is requested, at random. No order recurs, but the requests do: the plan
// allows for every order seen (each free at its latest), is laid out again when an iteration
// frees a block later still, and then serves them all. Reserved in the steady state: below what
// the caching allocator holds. (Planning one order and replaying it in the others was tried
// first: the slots that late frees held sent their requests to the fallback, and the arena and
// the fallback together reserved 31 MiB where caching alone reserves 22; docs/planning.md.)
TEST(PlannedPolicy, IterationsReorderedByTimingArePlannedForEveryOrderSeen) {
  constexpr std::size_t kUnit = std::size_t{1} << 20;
  constexpr int kBlocks = 16;
  const auto body = [&](held_blocks& live, std::mt19937_64& rng) {
    void* last = nullptr;
    for (int k = 0; k < kBlocks; ++k) {
      const bool free_first = rng() % 2 == 0;
      if (free_first && last != nullptr) live.give(last);
      void* p = live.get(kUnit * static_cast<std::size_t>(1 + k % 7) + static_cast<std::size_t>(k) * 4096);
      if (!free_first && last != nullptr) live.give(last);
      last = p;
    }
    live.give(last);
  };
  const auto [planned, planned_reserved] = run_marked_iterations(kPlannedExactConf, 11, body);
  const auto [caching, caching_reserved] = run_marked_iterations(kCachingExactConf, 11, body);
  EXPECT_EQ(planned.plans, 1);
  EXPECT_EQ(planned.lost_iterations, 0);
  EXPECT_GE(planned.widenings, 1);
  const std::int64_t under_plan = planned.iterations * kBlocks;
  EXPECT_GE(planned.planned_hits, under_plan - 8) << "a miss per widening at most";
  EXPECT_LT(planned_reserved, caching_reserved);
  std::printf("steady reserved: planned %.2f MiB (widenings %lld, hits %lld of %lld), caching %.2f MiB\n",
              static_cast<double>(planned_reserved) / kUnit, static_cast<long long>(planned.widenings),
              static_cast<long long>(planned.planned_hits), static_cast<long long>(under_plan),
              static_cast<double>(caching_reserved) / kUnit);
}

// Orders that vary far beyond timing jitter (each iteration frees random live blocks at random
// moments): a plan that allowed for every order seen would keep nearly every block apart, more
// than 10% above what the recorded order needs, so nothing is planned and the caching allocator
// serves them, reserving what it would alone.
TEST(PlannedPolicy, IterationsReorderedAtRandomStayWithTheCachingAllocator) {
  constexpr std::size_t kUnit = std::size_t{1} << 20;
  const auto body = [&](held_blocks& live, std::mt19937_64& rng) {
    std::vector<void*> held;
    for (int k = 0; k < 40; ++k) {
      held.push_back(live.get(kUnit * static_cast<std::size_t>(1 + k % 7) + static_cast<std::size_t>(k) * 4096));
      if (held.size() > 4 && rng() % 2 == 0) {
        const std::size_t i = rng() % held.size();
        live.give(held[i]);
        held.erase(held.begin() + static_cast<std::ptrdiff_t>(i));
      }
    }
    std::shuffle(held.begin(), held.end(), rng);
    for (void* p : held) live.give(p);
  };
  const auto [planned, planned_reserved] = run_marked_iterations(kPlannedExactConf, 5, body);
  const auto [caching, caching_reserved] = run_marked_iterations(kCachingExactConf, 5, body);
  EXPECT_EQ(planned.plans, 0);
  EXPECT_EQ(planned_reserved, caching_reserved);
}

// Iterations that keep leaving the plan (here: each begins with requests of random sizes) run on
// the fallback beside the arena and reinstall the plan every time; after three in a row the plan
// is set aside for 8 iterations (then 16, ...), the caching allocator alone serving them, and it
// comes back once iterations follow it again.
TEST(PlannedPolicy, APlanThatKeepsLosingItsIterationsIsSetAside) {
  auto dev = terrace::make_device("null");
  terrace::caching_allocator a(*dev, terrace::parse_alloc_conf("policy:planned"));
  std::mt19937_64 rng(7);
  auto iteration = [&](bool noisy) {
    a.begin_iteration();
    std::vector<void*> blocks;
    if (noisy) {
      for (int k = 0; k < 12; ++k) blocks.push_back(a.allocate((rng() % 4096 + 1) * 512));
    }
    for (int k = 0; k < 40; ++k) blocks.push_back(a.allocate(std::size_t{64} << 10 << (k % 4)));
    for (auto p = blocks.rbegin(); p != blocks.rend(); ++p) a.deallocate(*p);
    a.end_iteration();
    ASSERT_NO_THROW(a.check_invariants());
  };
  for (int it = 0; it < 4; ++it) iteration(false);
  const auto planned = a.plan_stats();
  ASSERT_EQ(planned.plans, 1);
  ASSERT_GT(planned.planned_hits, 0);
  EXPECT_EQ(planned.suspensions, 0);
  for (int it = 0; it < 3; ++it) iteration(true);
  auto s = a.plan_stats();
  EXPECT_EQ(s.lost_iterations, 3);
  EXPECT_EQ(s.suspensions, 1);
  // Set aside: plain iterations run on the fallback, nothing is installed or planned.
  const auto reservations = a.stats().num_device_alloc;
  for (int it = 0; it < 8; ++it) iteration(false);
  s = a.plan_stats();
  EXPECT_EQ(s.planned_hits, planned.planned_hits + 0) << "no plan while set aside";
  EXPECT_EQ(s.arena_reserved_bytes + s.hole_bytes, 0);
  EXPECT_EQ(a.stats().num_device_alloc, reservations) << "the fallback's cache serves them";
  // Back: the plan serves the iterations that follow it.
  for (int it = 0; it < 4; ++it) iteration(false);
  s = a.plan_stats();
  EXPECT_GT(s.planned_hits, planned.planned_hits + 100);
  EXPECT_EQ(s.lost_iterations, 3);
  EXPECT_EQ(s.plans, 1);
  // Three more lost iterations: set aside again, for 16 this time.
  for (int it = 0; it < 3; ++it) iteration(true);
  EXPECT_EQ(a.plan_stats().suspensions, 2);
  const auto hits = a.plan_stats().planned_hits;
  for (int it = 0; it < 16; ++it) iteration(false);
  EXPECT_EQ(a.plan_stats().planned_hits, hits);
  iteration(false);
  iteration(false);
  EXPECT_GT(a.plan_stats().planned_hits, hits);
  EXPECT_EQ(a.stats().allocated_bytes[0].current, 0);
}

namespace {

// One marked iteration of a transformer-like step of sequence length `seq`: per layer an
// activation and an attention score block kept for backward and a temporary, then backward frees
// them in reverse. Iterations of one length are alike; of two lengths, no request is alike.
void shaped_iteration(terrace::caching_allocator& a, held_blocks& live, std::size_t seq,
                      std::size_t common_first = 0) {
  a.begin_iteration();
  void* input = common_first != 0 ? live.get(common_first) : nullptr;
  std::vector<void*> kept;
  for (int layer = 0; layer < 6; ++layer) {
    kept.push_back(live.get(seq * 4096));
    kept.push_back(live.get(seq * seq * 16));
    live.give(live.get(seq * 8192));
  }
  while (!kept.empty()) {
    void* grad = live.get(seq * 4096);
    live.give(kept.back());
    kept.pop_back();
    live.give(kept.back());
    kept.pop_back();
    live.give(grad);
  }
  if (input != nullptr) live.give(input);
  a.end_iteration();
}

}  // namespace

// A plan that loses every other iteration (the others each of a length never seen before, so
// never planned) never loses three in a row; it is set aside once half of its last eight are lost.
// Before, the plan was never set aside: each loss emptied the fallback's cache when the plan came
// back, and the next loss reserved it again, for as long as the run went.
TEST(PlannedPolicy, APlanThatLosesEveryOtherIterationIsSetAside) {
  auto dev = terrace::make_device("null");
  terrace::caching_allocator a(*dev, terrace::parse_alloc_conf("policy:planned"));
  held_blocks live(a);
  for (int it = 0; it < 3; ++it) shaped_iteration(a, live, 256);
  ASSERT_EQ(a.plan_stats().plans, 1);
  std::size_t other = 136;
  for (int pair = 0; pair < 4; ++pair) {
    shaped_iteration(a, live, 256);
    shaped_iteration(a, live, other += 8);
  }
  auto s = a.plan_stats();
  EXPECT_EQ(s.lost_iterations, 4);
  EXPECT_EQ(s.suspensions, 1);
  EXPECT_EQ(s.plans, 1);
  // Set aside for 8 iterations: the fallback serves them, none is lost.
  const auto hits = s.planned_hits;
  for (int pair = 0; pair < 4; ++pair) {
    shaped_iteration(a, live, 256);
    shaped_iteration(a, live, other += 8);
  }
  s = a.plan_stats();
  EXPECT_EQ(s.lost_iterations, 4);
  EXPECT_EQ(s.planned_hits, hits);
  ASSERT_NO_THROW(a.check_invariants());
}

// Iterations of several lengths drawn at random (sequence-length buckets). One plan at a time
// cannot serve them: each length recurs, is planned, and is lost at the next change. A re-plan
// while the length keeps changing keeps the plans of every length together, a library laid out in
// one arena, and each iteration's first request picks its length's plan. Before the library, the
// planner was set aside and the caching allocator served both lengths (reserved peak within 10% of
// its own); before that, the plan changed at nearly every change of length (129 plans and 117
// device allocations in the last 300 of 400 iterations of a probe of the same kind; planning.md).
namespace {

// The same marked iterations, of the lengths given, through a planned and a caching allocator
// side by side. From iteration `from` on, the reserved peaks are theirs and the planned one's
// device allocations are counted (`reservations` holds its count at `from`).
struct side_by_side {
  std::unique_ptr<terrace::device_backend> dev = terrace::make_device("null");
  terrace::caching_allocator planned{*dev, terrace::parse_alloc_conf("policy:planned")};
  terrace::caching_allocator caching{*dev, terrace::parse_alloc_conf("policy:caching")};
  held_blocks live_planned{planned}, live_caching{caching};
  std::int64_t reservations = 0;
  std::size_t common_first = 0;  // a first request alike in every iteration (0: none)

  void run(const std::vector<std::size_t>& lengths, std::size_t from,
           const std::function<void(std::size_t)>& before_each = {}) {
    for (std::size_t it = 0; it < lengths.size(); ++it) {
      if (it == from) {
        planned.reset_peak_stats();
        caching.reset_peak_stats();
        reservations = planned.stats().num_device_alloc;
      }
      if (before_each) before_each(it);
      shaped_iteration(planned, live_planned, lengths[it], common_first);
      shaped_iteration(caching, live_caching, lengths[it], common_first);
    }
  }
  double reserved() const { return static_cast<double>(planned.stats().reserved_bytes[0].peak); }
  double reference() const { return static_cast<double>(caching.stats().reserved_bytes[0].peak); }

  // From `from` on: at most `ratio` of the caching allocator's reserved peak, and no device
  // allocation; the planned allocator's invariants hold.
  void expect_below_caching(double ratio) const {
    EXPECT_LT(reserved(), ratio * reference())
        << reserved() << " B against the caching allocator's " << reference();
    EXPECT_EQ(planned.stats().num_device_alloc, reservations);
    ASSERT_NO_THROW(planned.check_invariants());
  }
};

// `n` lengths drawn at random from `buckets` multiples of 128.
std::vector<std::size_t> random_lengths(std::size_t buckets, std::size_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<std::size_t> lengths(n);
  for (std::size_t& seq : lengths) seq = 128 * (1 + rng() % buckets);
  return lengths;
}

}  // namespace

TEST(PlannedPolicy, IterationsOfSeveralShapesAtRandomArePlannedAsALibrary) {
  for (const std::size_t buckets : {2, 4}) {
    SCOPED_TRACE(buckets);
    side_by_side run;
    terrace::planner_stats at_150;
    run.run(random_lengths(buckets, 200, 11), 50, [&](std::size_t it) {
      if (it == 150) at_150 = run.planned.plan_stats();
    });
    const auto s = run.planned.plan_stats();
    EXPECT_EQ(s.shape_alternations, 1);
    EXPECT_EQ(s.library_plans, static_cast<std::int64_t>(buckets));
    // Each length planned once, but for a plan or two made before the alternation was found.
    EXPECT_LE(s.plans, static_cast<std::int64_t>(buckets) + 2);
    EXPECT_GT(s.plan_switches, 20);
    // The last 50 iterations: every request from the library, none lost.
    EXPECT_EQ(s.planned_hits - at_150.planned_hits, 50 * 24);
    EXPECT_EQ(s.lost_iterations, at_150.lost_iterations);
    // From iteration 50 on: no device allocation, and less reserved than the caching allocator
    // (each length's arena shares the memory of the others'; the probe of planning.md: 12% less
    // at 2 lengths, 19% at 4).
    run.expect_below_caching(0.95);
  }
}

// Shapes whose first request is alike (a batch of fixed bytes: the input ids of a token budget
// split into more or fewer sequences) are told apart at their first request that differs: until
// then the fallback serves them. Before, the first request picked the plan, always the active one:
// every other shape's iterations were lost, and the library reserved up to 31% more than the
// caching allocator (4 lengths: 71 MiB against 54).
TEST(PlannedPolicy, ShapesThatStartAlikeArePickedAtTheirFirstRequestThatDiffers) {
  for (const std::size_t buckets : {2, 4}) {
    SCOPED_TRACE(buckets);
    side_by_side run;
    run.common_first = std::size_t{1} << 20;
    terrace::planner_stats at_100;
    run.run(random_lengths(buckets, 200, 11), 50, [&](std::size_t it) {
      if (it == 100) at_100 = run.planned.plan_stats();
    });
    const auto s = run.planned.plan_stats();
    EXPECT_EQ(s.library_plans, static_cast<std::int64_t>(buckets));
    // The last 100 iterations: the first request of each from the fallback, every other one from
    // the library, none lost.
    EXPECT_EQ(s.undecided_requests - at_100.undecided_requests, 100);
    EXPECT_EQ(s.planned_hits - at_100.planned_hits, 100 * 24);
    EXPECT_EQ(s.lost_iterations, at_100.lost_iterations);
    // From iteration 50 on (measured: 17 MiB against 34 at 2 lengths, 43 against 54 at 4).
    run.expect_below_caching(0.95);
  }
}

// The shapes in use change (a curriculum moves on; an evaluation phase of long sequences ends):
// plans no iteration picked in 256 planned iterations leave the library, and the arena, laid out
// again, shrinks to the plans left. Before, it stayed the largest plan's for as long as the
// library lasted.
TEST(PlannedPolicy, PlansOfShapesNoLongerSeenLeaveTheLibrary) {
  side_by_side run;
  run.run(random_lengths(3, 100, 3), 0);
  const auto formed = run.planned.plan_stats();
  ASSERT_EQ(formed.library_plans, 3);
  const auto reserved_formed = run.planned.stats().reserved_bytes[0].current;
  run.run(std::vector<std::size_t>(100, 128), 0);
  EXPECT_EQ(run.planned.plan_stats().dropped_plans, 0) << "dropped before 256 iterations";
  run.run(std::vector<std::size_t>(200, 128), 0);
  const auto s = run.planned.plan_stats();
  EXPECT_EQ(s.dropped_plans, 2);
  EXPECT_EQ(s.library_plans, 1);
  EXPECT_LT(s.arena_bytes, formed.arena_bytes);
  const auto reserved_after = run.planned.stats().reserved_bytes[0].current;
  EXPECT_LT(reserved_after, reserved_formed);
  std::printf("[          ] arena %.1f -> %.1f MiB, reserved %.1f -> %.1f MiB\n",
              static_cast<double>(formed.arena_bytes) / 1048576,
              static_cast<double>(s.arena_bytes) / 1048576,
              static_cast<double>(reserved_formed) / 1048576,
              static_cast<double>(reserved_after) / 1048576);
  // The last iterations all from the one plan left.
  const auto hits = s.planned_hits;
  run.run(std::vector<std::size_t>(4, 128), 0);
  EXPECT_EQ(run.planned.plan_stats().planned_hits - hits, 4 * 24);
  ASSERT_NO_THROW(run.planned.check_invariants());
}

// More lengths than a library holds (8): the planner is set aside once the library is full and
// the caching allocator serves them, until 16 iterations in a row have one length, which is then
// planned again (no waiting out the 1024).
TEST(PlannedPolicy, MoreShapesThanALibraryHoldsSettleOnTheCachingAllocator) {
  side_by_side run;
  std::mt19937_64 rng(5);
  std::vector<std::size_t> lengths(400);
  for (std::size_t& seq : lengths) seq = 64 + 16 * (rng() % 12);
  run.run(lengths, 300);
  const auto s = run.planned.plan_stats();
  EXPECT_EQ(s.shape_alternations, 1);
  EXPECT_EQ(s.library_plans, 8);
  EXPECT_GE(s.suspensions, 1);
  run.expect_below_caching(1.10);
  terrace::caching_allocator& planned = run.planned;
  held_blocks& live_planned = run.live_planned;
  for (int it = 0; it < 20; ++it) shaped_iteration(planned, live_planned, 512);
  const auto settled = planned.plan_stats();
  for (int it = 0; it < 4; ++it) shaped_iteration(planned, live_planned, 512);
  EXPECT_EQ(planned.plan_stats().planned_hits - settled.planned_hits, 4 * 24);
  ASSERT_NO_THROW(planned.check_invariants());
}

// A phase of another length (an evaluation between training steps) is planned in its turn, and
// the training length again after it: two changes of shape among the last 16 iterations are a
// new phase, not alternation. Three warm-up iterations of lengths of their own come first (a
// framework's first steps often differ); by the time of the phase they are history.
TEST(PlannedPolicy, APhaseOfAnotherShapeIsPlannedInItsTurn) {
  auto dev = terrace::make_device("null");
  terrace::caching_allocator a(*dev, terrace::parse_alloc_conf("policy:planned"));
  held_blocks live(a);
  for (std::size_t warm_up : {64, 72, 80}) shaped_iteration(a, live, warm_up);
  for (int it = 0; it < 16; ++it) shaped_iteration(a, live, 256);
  for (int it = 0; it < 12; ++it) shaped_iteration(a, live, 192);
  for (int it = 0; it < 12; ++it) shaped_iteration(a, live, 256);
  const auto before = a.plan_stats();
  for (int it = 0; it < 4; ++it) shaped_iteration(a, live, 256);
  const auto s = a.plan_stats();
  EXPECT_EQ(s.shape_alternations, 0);
  // A new phase's iterations leave the plan among their first requests, which a marked iteration
  // records in sync too: each is recorded whole, and the new shape is planned after two of them
  // (192), or after one when recorded iterations of it are still among the last few (256 again).
  // Before, a lost iteration was recorded only from where it left the plan: each change of phase
  // lost three, set the plan aside, and recorded the new shape twice while it sat out.
  EXPECT_EQ(s.lost_iterations, 3);
  EXPECT_EQ(s.suspensions, 0);
  EXPECT_EQ(s.plans, 3);
  EXPECT_EQ(s.planned_hits - before.planned_hits, 4 * 24) << "each of 24 requests from the plan";
  ASSERT_NO_THROW(a.check_invariants());
}

// A request outside the plan is served from a claimed hole's tail (no new reservation) and may
// outlive the plan: when iterations of another shape follow, the plan is uninstalled anyway and
// the block becomes the fallback's own, never handed out twice, freed through the fallback.
TEST(PlannedPolicy, TailBlocksOutliveThePlanAsTheFallbacks) {
  auto dev = terrace::make_device("null");
  terrace::caching_allocator a(*dev, terrace::parse_alloc_conf("policy:planned,plan_min_period:16"));
  held_blocks live(a);
  auto get = [&](std::size_t n) { return live.get(n); };
  auto give = [&](void* p) { live.give(p); };
  std::vector<void*> forever;
  void* extra = nullptr;
  auto iteration = [&](int it, std::size_t unit) {
    std::vector<void*> acts;
    for (int k = 0; k < 10; ++k) {
      acts.push_back(get(unit + static_cast<std::size_t>(k) * 4096));
      // Long-lived blocks between transient ones leave holes in the fallback's 20 MiB segments.
      if (it < 3 && k == 2) forever.push_back(get(std::size_t{5} << 18));  // 1.25 MiB
      if (it == 12 && k == 5) {
        const auto reservations = a.stats().num_device_alloc;
        extra = get(std::size_t{512} << 10);  // outside the plan, kept
        EXPECT_EQ(a.stats().num_device_alloc, reservations) << "served from a hole's tail";
      }
    }
    for (auto p = acts.rbegin(); p != acts.rend(); ++p) give(*p);
    ASSERT_NO_THROW(a.check_invariants()) << it;
  };
  const std::size_t planned_unit = std::size_t{3} << 19;  // 1.5 MiB
  for (int it = 0; it < 14; ++it) iteration(it, planned_unit);
  ASSERT_NE(extra, nullptr);

  EXPECT_GT(a.plan_stats().hole_bytes, 0) << "the plan was laid into the fallback's holes";
  for (int it = 14; it < 18; ++it) iteration(it, std::size_t{3} << 20);  // another shape
  EXPECT_EQ(a.plan_stats().hole_bytes, 0) << "uninstalled although the extra block lives";
  for (int it = 18; it < 24; ++it) iteration(it, planned_unit);  // the plan comes back
  EXPECT_GT(a.plan_stats().hole_bytes, 0);
  give(extra);
  for (void* p : forever) give(p);
  a.check_invariants();
  EXPECT_TRUE(live.empty());
  EXPECT_EQ(a.stats().allocated_bytes[0].current, 0);
  EXPECT_EQ(a.stats().allocation[0].current, 0);
}

// record_stream on an arena block: another stream's work still queued at the free must finish
// before the plan hands the space out again, and the host must not wait for it at the free (a
// host wait there would stall every free behind the slowest stream). Checked on the data: the
// other stream reads the block while its owner's next block over the same space is written.
TEST(PlannedPolicyConcurrent, RecordStreamOrdersReuseOnTheDeviceWithoutBlockingTheHost) {
  auto dev = terrace::make_device("sim");
  terrace::caching_allocator a(*dev, terrace::parse_alloc_conf("policy:planned,plan_min_period:16"));
  const terrace::stream_ref owner = dev->create_stream();
  const terrace::stream_ref reader = dev->create_stream();
  constexpr std::size_t kBytes = 64 << 10;
  // Work after the two blocks of interest, so that an iteration is long enough to be planned.
  auto more_work = [&] {
    for (int k = 1; k <= 6; ++k) a.deallocate(a.allocate(k * kBytes, owner, "more"), owner);
  };
  // One iteration: two blocks with disjoint lifetimes, which the plan puts at one address.
  auto iteration = [&] {
    a.begin_iteration();
    void* first = a.allocate(kBytes, owner, "first");
    a.deallocate(first, owner);
    void* second = a.allocate(kBytes, owner, "second");
    a.deallocate(second, owner);
    more_work();
    a.end_iteration();
    return first == second;
  };
  for (int it = 0; it < 4; ++it) iteration();
  EXPECT_TRUE(iteration()) << "the plan puts both blocks at one address";
  ASSERT_TRUE(a.plan_stats().active);
  const auto hits = a.plan_stats().planned_hits;

  a.begin_iteration();
  auto* first = static_cast<unsigned char*>(a.allocate(kBytes, owner, "first"));
  std::memset(first, 0xAB, kBytes);
  std::atomic<bool> go{false}, intact{false}, read{false}, released{false};
  terrace::enqueue_host_function(*dev, reader, [&] {
    // The deadline only turns a host wait at the free (a hang) into a failure below.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (!go.load() && std::chrono::steady_clock::now() < deadline) std::this_thread::yield();
    released = go.load();
    bool ok = true;
    for (std::size_t i = 0; i < kBytes; ++i) ok = ok && first[i] == 0xAB;
    intact = ok;
    read = true;
  });
  a.record_stream(first, reader);
  a.deallocate(first, owner);  // returns at once: the reader has not even started
  auto* second = static_cast<unsigned char*>(a.allocate(kBytes, owner, "second"));
  ASSERT_EQ(second, first);
  EXPECT_EQ(a.plan_stats().planned_hits, hits + 2);
  EXPECT_EQ(a.plan_stats().stream_waits, 1);
  std::atomic<bool> written_after_read{false};
  terrace::enqueue_host_function(*dev, owner, [&] {
    written_after_read = read.load();
    std::memset(second, 0xCD, kBytes);
  });
  go = true;
  dev->synchronize(owner);
  dev->synchronize(reader);
  EXPECT_TRUE(released.load()) << "the free waited on the host for the reader";
  EXPECT_TRUE(intact.load()) << "the owner's next block was written before the reader was done";
  EXPECT_TRUE(written_after_read.load());
  EXPECT_EQ(second[0], 0xCD);
  a.deallocate(second, owner);
  more_work();
  a.end_iteration();
  a.check_invariants();

  // A free deferred at the uninstall (another shape) is waited for there, on the host.
  a.begin_iteration();
  first = static_cast<unsigned char*>(a.allocate(kBytes, owner, "first"));
  a.record_stream(first, reader);
  a.deallocate(first, owner);
  void* other = a.allocate(3 * kBytes, owner, "another shape");
  a.deallocate(other, owner);
  more_work();
  a.end_iteration();
  for (int it = 0; it < 4; ++it) iteration();
  EXPECT_TRUE(iteration()) << "the plan came back";
  a.check_invariants();
  EXPECT_EQ(a.stats().allocated_bytes[0].current, 0);
  dev->destroy_stream(owner);
  dev->destroy_stream(reader);
}

TEST(PlannedPolicyConcurrent, ThreadsShareOnePlannedAllocator) {
  auto dev = terrace::make_device("null");
  terrace::caching_allocator a(*dev, terrace::parse_alloc_conf("policy:planned,plan_min_period:16"));
  auto worker = [&](int id) {
    for (int it = 0; it < 200; ++it) {
      std::vector<void*> ps;
      for (int k = 0; k < 8; ++k) ps.push_back(a.allocate(static_cast<std::size_t>((k + 1 + id) * 4096)));
      for (void* p : ps) a.deallocate(p);
    }
  };
  std::thread t1(worker, 0), t2(worker, 1);
  t1.join();
  t2.join();
  a.check_invariants();
  EXPECT_EQ(a.stats().allocated_bytes[0].current, 0);
}

}  // namespace

namespace {

// The start of a step in the two tests below: a 10 MiB block that lives the whole step, then b0
// and b1, then b2, requested after both are freed (late < 0) or after one of them and before the
// other (b`late`). Returns the whole-step block and b2, both live.
std::pair<void*, void*> step_with_a_late_free(held_blocks& live, int late) {
  constexpr std::size_t kUnit = std::size_t{1} << 20;
  void* whole_step = live.get(10 * kUnit);
  void* b[2] = {live.get(kUnit / 2 + 8192), live.get(kUnit / 2 + 4096)};
  if (late != 0) live.give(b[0]);
  if (late != 1) live.give(b[1]);
  void* b2 = live.get(kUnit / 2);
  if (late >= 0) live.give(b[late]);
  return {whole_step, b2};
}

}  // namespace

// A plan allowed for every order seen may need more memory than the device has where the order
// it was recorded in fits. Here the first three iterations free b0 late, b1 late, neither (no
// order recurs, so the plan allows for all three: 11.5 MiB; the third alone needs 11), and the
// later ones alternate b0 and b1. On an 11.5 MiB device the widened arena has no room (the
// caching allocator's cache aside), so the plan is laid out again for the recorded order alone:
// every iteration keeps to it, and in every other one b2, whose slot a late free holds, goes to
// the fallback (lent the arena's free space). Before, the widened arena was refused at every
// boundary and no iteration was planned.
TEST(PlannedPolicy, AWidenedPlanWithNoRoomIsPlannedForTheRecordedOrderAlone) {
  constexpr std::size_t kUnit = std::size_t{1} << 20;
  int it = 0;
  const auto body = [&](held_blocks& live, std::mt19937_64&) {
    const auto [whole_step, b2] = step_with_a_late_free(live, it == 2 ? -1 : it % 2);
    live.give(b2);
    live.give(whole_step);
    ++it;
  };
  const auto [roomy, roomy_reserved] = run_marked_iterations(kPlannedExactConf, 1, body);
  EXPECT_EQ(roomy.plans, 1);
  EXPECT_EQ(roomy.narrowings, 0);
  EXPECT_EQ(roomy.planned_hits, roomy.iterations * 4) << "the widened plan serves every order";
  EXPECT_GT(roomy_reserved, static_cast<std::int64_t>(11 * kUnit + kUnit / 4));

  it = 0;
  const auto [narrow, narrow_reserved] =
      run_marked_iterations(kPlannedExactConf, 1, body, 11 * kUnit + kUnit / 2);
  EXPECT_EQ(narrow.plans, 1);
  EXPECT_EQ(narrow.narrowings, 1);
  EXPECT_EQ(narrow.lost_iterations, 0);
  EXPECT_EQ(narrow.arena_refusals, 0);
  EXPECT_GE(narrow.iterations, 20);
  EXPECT_GE(narrow.planned_hits, narrow.iterations * 4 - (narrow.iterations + 1) / 2)
      << "b2 misses in every other iteration, nothing else";
  EXPECT_LT(narrow_reserved, static_cast<std::int64_t>(11 * kUnit + kUnit / 4));
}

// After a narrowing, a plan still widens for the later frees of its own iterations, as long as the
// result stays below the layout the device refused: here the first three iterations (b0 late, b1
// late, neither) give a widened plan of 11.5 MiB, which an 11.5 MiB device refuses, so the plan
// is laid out for the third (11 MiB). The iterations after it free b2 only after a 64 KiB block c
// is requested: widened for that (11.06 MiB), the plan fits, and serves them all.
TEST(PlannedPolicy, ANarrowedPlanStillWidensForLaterFreesThatFit) {
  constexpr std::size_t kUnit = std::size_t{1} << 20;
  int it = 0;
  const auto body = [&](held_blocks& live, std::mt19937_64&) {
    const auto [whole_step, b2] = step_with_a_late_free(live, it < 2 ? it : -1);
    const bool c_before_b2_is_freed = it >= 3;
    if (!c_before_b2_is_freed) live.give(b2);
    void* c = live.get(kUnit / 16);
    if (c_before_b2_is_freed) live.give(b2);
    live.give(c);
    live.give(whole_step);
    ++it;
  };
  const auto [s, reserved] = run_marked_iterations(kPlannedExactConf, 1, body, 11 * kUnit + kUnit / 2);
  EXPECT_EQ(s.plans, 1);
  EXPECT_EQ(s.narrowings, 1);
  EXPECT_EQ(s.widenings, 1);
  EXPECT_EQ(s.lost_iterations, 0);
  EXPECT_GE(s.iterations, 20);
  EXPECT_GE(s.planned_hits, s.iterations * 5 - 1) << "c misses once, before the plan widens";
  EXPECT_LE(reserved, static_cast<std::int64_t>(11 * kUnit + kUnit / 8));
}

// Found in review: the arena's reservation was outside the memory fraction. The caching allocator
// compared only its own segments with the cap, so beside an installed arena it reserved up to the
// whole fraction again, and an arena (re)installed after set_memory_fraction lowered the cap was
// reserved whatever the cap. The allocator's reservations, arena included, stay under the cap.
TEST(PlannedPolicy, TheArenaCountsAgainstTheMemoryFraction) {
  constexpr std::size_t kUnit = std::size_t{1} << 20;
  terrace::device_options d;
  d.capacity = 64 * kUnit;
  auto dev = terrace::make_device("null", d);
  terrace::caching_allocator a(
      *dev, terrace::parse_alloc_conf(std::string(kPlannedExactConf) + ",memory_fraction:0.5"));
  const auto cap = static_cast<std::int64_t>(32 * kUnit);
  std::string report;
  auto iteration = [&](std::size_t extra) {
    a.begin_iteration();
    void* p = a.allocate(8 * kUnit);
    void* q = a.allocate(8 * kUnit);
    if (extra > 0) {
      // The caching allocator alone would hold 16 + extra here.
      try {
        a.deallocate(a.allocate(extra));
      } catch (const terrace::out_of_memory& e) {
        report = e.what();
      }
      EXPECT_LE(a.stats().reserved_bytes[0].current, cap);
    }
    a.deallocate(q);
    a.deallocate(p);
    a.end_iteration();
    ASSERT_NO_THROW(a.check_invariants());
  };
  for (int it = 0; it < 4; ++it) iteration(0);
  ASSERT_TRUE(a.plan_stats().active);
  ASSERT_GE(a.plan_stats().arena_reserved_bytes, static_cast<std::int64_t>(16 * kUnit));
  iteration(24 * kUnit);  // beside the arena's 16: over the cap
  EXPECT_LE(a.stats().reserved_bytes[0].peak, cap);
  // The report says where the fraction went (its reserved figure is the segments').
  EXPECT_NE(report.find("the planned policy's arena holds 16.00 MiB"), std::string::npos) << report;

  // A lower cap: the arena, once given back, is not reserved again above it.
  a.set_memory_fraction(0.125);  // 8 MiB
  iteration(20 * kUnit);
  for (int it = 0; it < 6; ++it) {
    a.begin_iteration();
    void* p = a.allocate(3 * kUnit);  // another shape, within the cap: the arena goes back
    a.deallocate(p);
    a.end_iteration();
  }
  a.reset_peak_stats();
  for (int it = 0; it < 6; ++it) {
    a.begin_iteration();
    void* p = nullptr;
    void* q = nullptr;
    try {
      p = a.allocate(8 * kUnit);
      q = a.allocate(8 * kUnit);
    } catch (const terrace::out_of_memory&) {  // 16 MiB of blocks do not fit under 8
    }
    EXPECT_LE(a.stats().reserved_bytes[0].current, static_cast<std::int64_t>(8 * kUnit)) << it;
    if (q != nullptr) a.deallocate(q);
    if (p != nullptr) a.deallocate(p);
    a.end_iteration();
  }
  ASSERT_NO_THROW(a.check_invariants());
}

// Found in review: greedy by start scanned every live block per item, O(n^2) on an iteration whose
// blocks all overlap; 20,000 of them took 0.7 s to plan, and a library of three such shapes,
// laid out together at its installation, stalled one request for 2.5 s. Planning an iteration
// of 20,000 allocations (and a library of three) takes well under a second (in an optimised
// build; sanitized or unoptimised ones get ten times as long).
TEST(PlannedPolicy, IterationsOf20000AllocationsArePlannedInUnderASecond) {
  const double slack = complexity_slack();
  constexpr std::size_t kN = 20000;
  std::vector<plan_interval> all;
  for (std::size_t i = 0; i < kN; ++i) all.push_back({512 * (1 + i % 7), i, 2 * kN + 1});
  const auto t0 = std::chrono::steady_clock::now();
  const auto plan = terrace::plan_placement(all);
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(),
            0.25 * slack);
  EXPECT_EQ(plan.arena_bytes, plan.lower_bound);

  terrace::device_options d;
  d.capacity = std::size_t{4} << 30;
  auto dev = terrace::make_device("null", d);
  terrace::caching_allocator a(*dev, terrace::parse_alloc_conf("policy:planned,plan_min_period:16"));
  std::vector<void*> v(kN);
  double slowest = 0;
  for (int it = 0; it < 30; ++it) {
    const auto shape = static_cast<std::size_t>((it / 2) % 3);
    const auto start = std::chrono::steady_clock::now();
    a.begin_iteration();
    for (std::size_t i = 0; i < kN; ++i) v[i] = a.allocate(512 * (1 + i % (5 + shape)));
    for (void* p : v) a.deallocate(p);
    a.end_iteration();
    slowest = std::max(slowest,
                       std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  EXPECT_EQ(a.plan_stats().library_plans, 3);
  EXPECT_LT(slowest, slack);
  EXPECT_LT(a.plan_stats().plan_seconds, slack);
}

// The planner's contract with the planned policy (review, 2026-11-26): blocks made before the
// steady state (parameters) and blocks an iteration makes but frees only in the next one get no
// slot, stay out of the arena and out of the lower bound, which is the largest sum of the
// iteration's own blocks live at one instant. With marks and with detected boundaries alike.
TEST(PlannedPolicy, BlocksOutlivingTheIterationAreNeitherPlannedNorInTheLowerBound) {
  for (const bool marked : {true, false}) {
    SCOPED_TRACE(marked ? "marked" : "detected");
    auto dev = terrace::make_device("null");
    terrace::caching_allocator a(*dev, terrace::parse_alloc_conf(kPlannedExactConf));
    constexpr std::size_t kUnit = std::size_t{1} << 20;
    std::vector<void*> params;
    for (int i = 0; i < 4; ++i) params.push_back(a.allocate(8 * kUnit));
    void* carry = nullptr;
    terrace::planner_stats before;
    for (int it = 0; it < 12; ++it) {
      if (marked) a.begin_iteration();
      std::vector<void*> acts;
      for (std::size_t k = 0; k < 16; ++k) acts.push_back(a.allocate(kUnit + k * 4096));
      a.deallocate(a.allocate(3 * kUnit));  // scratch
      void* next = a.allocate(2 * kUnit);   // freed in the next iteration
      for (std::size_t k = acts.size(); k-- > 0;) a.deallocate(acts[k]);
      if (carry != nullptr) a.deallocate(carry);
      carry = next;
      if (marked) a.end_iteration();
      ASSERT_NO_THROW(a.check_invariants());
      if (it == 7) before = a.plan_stats();
    }
    const auto s = a.plan_stats();
    ASSERT_TRUE(s.active);
    EXPECT_EQ(s.period_allocs, 18);
    EXPECT_EQ(s.planned_slots, 17);
    std::int64_t transient = 3 * kUnit;
    for (std::int64_t k = 0; k < 16; ++k) transient += kUnit + k * 4096;
    EXPECT_EQ(s.lower_bound_bytes, transient);
    EXPECT_EQ(s.planned_hits - before.planned_hits, 4 * 17);
    EXPECT_EQ(s.unplanned_allocs - before.unplanned_allocs, 4);
    EXPECT_EQ(s.deviations, 0);
    std::size_t in_arena = 0;
    for (const auto& seg : a.snapshot().segments) {
      for (const auto& b : seg.blocks) {
        if (b.state != "active_allocated") continue;
        const bool long_lived = std::find(params.begin(), params.end(), reinterpret_cast<void*>(b.addr)) !=
                                    params.end() ||
                                reinterpret_cast<void*>(b.addr) == carry;
        EXPECT_TRUE(long_lived) << "a block of the finished iteration is still live";
        if (b.tag == "planned") ++in_arena;
      }
    }
    EXPECT_EQ(in_arena, 0u) << "a long-lived block lies in the arena";
    for (void* p : params) a.deallocate(p);
    a.deallocate(carry);
    a.check_invariants();
    EXPECT_EQ(a.stats().allocated_bytes[0].current, 0);
  }
}

// Found in review (2026-11-26): without marks, once a plan was made every token of a repeating
// iteration reached the detector's O(period) scan for the boundary before the check that the
// period was the plan's own, so the iteration the planner spends seeking its anchor cost
// O(period^2): 12.8 s for an iteration of 50,000 allocations (100,000 events), 2.1 s for 20,000.
TEST(PlannedPolicy, DetectedIterationsOf100000EventsAreSoughtInLinearTime) {
  const double slack = complexity_slack();
  constexpr std::size_t kN = 50000;
  terrace::device_options d;
  d.capacity = std::size_t{64} << 30;
  auto dev = terrace::make_device("null", d);
  terrace::caching_allocator a(*dev, terrace::parse_alloc_conf("policy:planned,plan_min_period:16"));
  std::mt19937_64 rng(1);
  std::vector<std::size_t> size(kN), life(kN);
  for (std::size_t i = 0; i < kN; ++i) {
    size[i] = 512 * (1 + rng() % 2048);
    life[i] = rng() % 8 == 0 ? rng() % 5000 : rng() % 20;  // mostly short, some long
  }
  double slowest = 0;
  std::vector<std::vector<void*>> due(kN + 1);
  for (int it = 0; it < 5; ++it) {
    const auto start = std::chrono::steady_clock::now();
    for (std::size_t i = 0; i < kN; ++i) {
      for (void* p : due[i]) a.deallocate(p);
      due[i].clear();
      due[std::min(kN, i + 1 + life[i])].push_back(a.allocate(size[i]));
    }
    for (void* p : due[kN]) a.deallocate(p);
    due[kN].clear();
    slowest = std::max(slowest,
                       std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  const auto s = a.plan_stats();
  EXPECT_EQ(s.plans, 1);
  EXPECT_EQ(s.planned_slots, static_cast<std::int64_t>(kN));
  EXPECT_GE(s.planned_hits, static_cast<std::int64_t>(2 * kN));
  EXPECT_LT(slowest, slack);
  a.check_invariants();
  EXPECT_EQ(a.stats().allocated_bytes[0].current, 0);
}

// Found in review: empty_cache() returned the fallback's free segments but kept an idle arena
// (no block live in it, between two iterations) reserved: 16 MiB stayed on the device with
// nothing allocated. It goes back too, and the next iteration installs the plan again without
// losing an iteration (marked), or after resynchronising (detected boundaries).
TEST(PlannedPolicy, EmptyCacheBetweenIterationsGivesTheIdleArenaBack) {
  constexpr std::size_t kUnit = std::size_t{1} << 20;
  for (const bool marked : {true, false}) {
    auto dev = terrace::make_device("null");
    terrace::caching_allocator a(*dev, terrace::parse_alloc_conf(kPlannedExactConf));
    held_blocks live(a);
    auto iteration = [&] {
      if (marked) a.begin_iteration();
      for (int k = 0; k < 10; ++k) {
        void* p = live.get(8 * kUnit + static_cast<std::size_t>(k) * 4096);
        void* q = live.get(8 * kUnit);
        live.give(q);
        live.give(p);
      }
      if (marked) a.end_iteration();
    };
    for (int it = 0; it < 6; ++it) iteration();
    ASSERT_TRUE(a.plan_stats().active) << marked;
    ASSERT_GT(a.stats().reserved_bytes[0].current, 0) << marked;
    a.empty_cache();
    EXPECT_EQ(a.stats().reserved_bytes[0].current, 0) << marked;
    EXPECT_EQ(dev->used_bytes(), 0u) << marked;
    ASSERT_NO_THROW(a.check_invariants()) << marked;
    const auto before = a.plan_stats();
    for (int it = 0; it < 4; ++it) iteration();
    const auto after = a.plan_stats();
    EXPECT_EQ(after.lost_iterations, before.lost_iterations) << marked;
    EXPECT_GE(after.planned_hits - before.planned_hits, marked ? 4 * 20 : 2 * 20) << marked;
    ASSERT_NO_THROW(a.check_invariants()) << marked;
    EXPECT_TRUE(live.empty());
  }
}

// The 16th request of a marked iteration in sync is the last the shadow records; refused by the
// fallback, with an idle arena, the pressure path leaves the plan (the recording starts over
// there) and retries; refused again, the request is taken back out of a recording that no longer
// holds it. It popped the emptied recording's vectors (their sentinel too) instead.
TEST(PlannedPolicy, ARequestRefusedAfterThePressurePathRestartedTheRecordingLeavesItWhole) {
  terrace::device_options d;
  d.capacity = std::size_t{64} << 20;
  auto dev = terrace::make_device("null", d);
  terrace::caching_allocator a(*dev, terrace::parse_alloc_conf(kPlannedExactConf));
  constexpr std::size_t kUnit = std::size_t{1} << 20;
  held_blocks live(a);
  auto iteration = [&](bool too_large_last) {
    a.begin_iteration();
    for (int k = 0; k < 15; ++k) live.give(live.get(kUnit + static_cast<std::size_t>(k) * 4096));
    if (too_large_last) {
      EXPECT_THROW(a.allocate(std::size_t{128} << 20), terrace::out_of_memory);
      ASSERT_NO_THROW(a.check_invariants());
    }
    a.end_iteration();
  };
  for (int it = 0; it < 4; ++it) iteration(false);
  ASSERT_TRUE(a.plan_stats().active);
  iteration(true);
  for (int it = 0; it < 6; ++it) iteration(false);
  ASSERT_NO_THROW(a.check_invariants());
  EXPECT_TRUE(a.plan_stats().active);
  EXPECT_TRUE(live.empty());
}

// end_iteration called twice closes one iteration: the second has nothing to close. It compared
// the iteration with itself, found it repeated and planned it from one sighting (a warm-up step
// unlike the rest), whose replay the next iteration then lost.
TEST(PlannedPolicy, AnIterationEndedTwiceIsNotTakenForTwo) {
  auto dev = terrace::make_device("null");
  terrace::caching_allocator a(*dev, terrace::parse_alloc_conf(kPlannedExactConf));
  constexpr std::size_t kUnit = std::size_t{1} << 20;
  held_blocks live(a);
  for (int it = 0; it < 3; ++it) {  // every iteration of its own shape
    a.begin_iteration();
    for (int k = 0; k < 12; ++k) {
      live.give(live.get(kUnit + static_cast<std::size_t>(it * 12 + k) * 4096));
    }
    a.end_iteration();
    a.end_iteration();
    ASSERT_NO_THROW(a.check_invariants());
  }
  const auto s = a.plan_stats();
  EXPECT_EQ(s.plans, 0);
  EXPECT_EQ(s.lost_iterations, 0);
  EXPECT_TRUE(live.empty());
}

// begin_iteration called twice with no request between marks one start (a trainer's loop and a
// library under it both marking the step): the first mark's iteration is not one lost. It counted
// one lost iteration per step, and after three the plan was set aside though every step kept to it.
TEST(PlannedPolicy, AnIterationBegunTwiceIsNotLost) {
  auto dev = terrace::make_device("null");
  terrace::caching_allocator a(*dev, terrace::parse_alloc_conf(kPlannedExactConf));
  constexpr std::size_t kUnit = std::size_t{1} << 20;
  held_blocks live(a);
  for (int it = 0; it < 12; ++it) {
    a.begin_iteration();
    a.begin_iteration();
    for (int k = 0; k < 12; ++k) live.give(live.get(kUnit + static_cast<std::size_t>(k) * 4096));
    a.end_iteration();
    ASSERT_NO_THROW(a.check_invariants());
  }
  const auto s = a.plan_stats();
  EXPECT_EQ(s.plans, 1);
  EXPECT_EQ(s.lost_iterations, 0);
  EXPECT_EQ(s.suspensions, 0);
  EXPECT_GE(s.planned_hits, 9 * 12);
  EXPECT_TRUE(live.empty());
}

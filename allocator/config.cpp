// SPDX-License-Identifier: Apache-2.0
// TERRACE_ALLOC_CONF parsing: `key:value,...` applied over a base allocator_config.
//
// Errors are collected as strings by the helpers below and thrown once, at the item level, so that
// every message names the offending `key:value` item and lists the valid keys whatever went wrong.

#include "terrace/config.hpp"

#include <algorithm>
#include <array>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <optional>
#include <string>
#include <system_error>
#include <vector>

#include "terrace/error.hpp"

namespace terrace {
namespace {

constexpr std::size_t MiB = std::size_t{1} << 20;
// Sizes of device memory are handed out in 512-byte granules, as in PyTorch.
constexpr std::size_t kGranule = 512;

// ------------------------------------------------------------------------------- small helpers

std::string_view trim(std::string_view s) noexcept {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

bool iequals(std::string_view a, std::string_view b) noexcept {
  return a.size() == b.size() &&
         std::equal(a.begin(), a.end(), b.begin(), [](char x, char y) {
           return std::tolower(static_cast<unsigned char>(x)) ==
                  std::tolower(static_cast<unsigned char>(y));
         });
}

bool all_digits(std::string_view s) noexcept {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
}

// The outcome of parsing one value: the value, or why it was refused.
template <class T>
struct parsed {
  std::optional<T> value;
  std::string why;
  static parsed ok(T v) { return {std::move(v), {}}; }
  static parsed fail(std::string w) { return {std::nullopt, std::move(w)}; }
};

// Quotes what the user wrote. A long text is cut, so that the reason after it is never lost (the
// C ABI keeps 4 KiB of a message).
std::string quoted(std::string_view s) {
  constexpr std::size_t kLongest = 200;
  if (s.size() <= kLongest) return "'" + std::string(s) + "'";
  return "'" + std::string(s.substr(0, kLongest)) + "...' (" + std::to_string(s.size()) + " characters)";
}

// ------------------------------------------------------------------------------- numbers

parsed<std::uint64_t> parse_unsigned(std::string_view text) {
  // from_chars alone would accept a prefix ("12abc" -> 12); insisting on digits only also keeps
  // out signs, which from_chars for an unsigned type would otherwise refuse less clearly.
  if (!all_digits(text)) return parsed<std::uint64_t>::fail("expected an unsigned integer, got " + quoted(text));
  std::uint64_t v = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec == std::errc::result_out_of_range) {
    return parsed<std::uint64_t>::fail(quoted(text) + " is too large");
  }
  if (ec != std::errc{} || end != text.data() + text.size()) {
    return parsed<std::uint64_t>::fail("expected an unsigned integer, got " + quoted(text));
  }
  return parsed<std::uint64_t>::ok(v);
}

parsed<double> parse_real(std::string_view text) {
  double v = 0.0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (text.empty() || ec != std::errc{} || end != text.data() + text.size() || !std::isfinite(v)) {
    return parsed<double>::fail("expected a finite number, got " + quoted(text));
  }
  return parsed<double>::ok(v);
}

// Binary multipliers; "K", "KB" and "KiB" all mean 1024 (mimalloc and PyTorch users write both).
std::optional<std::uint64_t> suffix_multiplier(std::string_view suffix) noexcept {
  if (suffix.empty() || iequals(suffix, "B")) return 1;
  static constexpr struct {
    char letter;
    unsigned shift;
  } units[] = {{'K', 10}, {'M', 20}, {'G', 30}, {'T', 40}};
  const char first = static_cast<char>(std::toupper(static_cast<unsigned char>(suffix.front())));
  const std::string_view rest = suffix.substr(1);
  for (const auto& u : units) {
    if (first == u.letter && (rest.empty() || iequals(rest, "B") || iequals(rest, "iB"))) {
      return std::uint64_t{1} << u.shift;
    }
  }
  return std::nullopt;
}

constexpr std::string_view kSuffixHelp = "B, K, KB, KiB, M, MB, MiB, G, GB, GiB, T, TB, TiB";

parsed<std::size_t> parse_size_impl(std::string_view text) {
  using result = parsed<std::size_t>;
  text = trim(text);
  if (text.empty()) return result::fail("expected a size, got an empty value");

  // The shapes a user is likeliest to try, each refused in words that say what to write instead.
  const std::string malformed = "malformed size " + quoted(text);
  if (text.front() == '-') return result::fail(malformed + ": sizes cannot be negative");
  if (text.size() > 1 && text[0] == '0' && (text[1] == 'x' || text[1] == 'X')) {
    return result::fail(malformed + ": hexadecimal is not accepted (write it in decimal, or as 2MiB)");
  }

  // Split "<digits>[.<digits>] [suffix]". Only the shape is checked here; from_chars converts.
  std::size_t n = 0;
  while (n < text.size() && ((text[n] >= '0' && text[n] <= '9') || text[n] == '.')) ++n;
  const std::string_view number = text.substr(0, n);
  const std::string_view suffix = trim(text.substr(n));
  const auto dot = number.find('.');
  const bool decimal = dot != std::string_view::npos;
  if (number.empty() || (decimal && (!all_digits(number.substr(0, dot)) ||
                                     !all_digits(number.substr(dot + 1))))) {
    return result::fail(malformed + " (expected a number such as 512, 2MiB or 1.5G)");
  }
  const auto mult = suffix_multiplier(suffix);
  if (!mult && suffix.size() > 1 && (suffix[0] == 'e' || suffix[0] == 'E') &&
      (std::isdigit(static_cast<unsigned char>(suffix[1])) || suffix[1] == '-' || suffix[1] == '+')) {
    return result::fail(malformed + ": exponents are not accepted (write the digits, or 1G)");
  }
  if (!mult) {
    return result::fail("unknown size suffix " + quoted(suffix) + " in " + quoted(text) +
                        " (expected one of " + std::string(kSuffixHelp) + ")");
  }
  const std::string overflow = "size " + quoted(text) + " does not fit in 64 bits";

  if (!decimal) {
    std::uint64_t v = 0;
    const auto [end, ec] = std::from_chars(number.data(), number.data() + number.size(), v);
    if (ec == std::errc::result_out_of_range) return result::fail(overflow);
    if (ec != std::errc{} || end != number.data() + number.size()) return result::fail(malformed);
    if (v > std::numeric_limits<std::size_t>::max() / *mult) return result::fail(overflow);
    return result::ok(static_cast<std::size_t>(v * *mult));
  }
  double v = 0.0;
  const auto [end, ec] = std::from_chars(number.data(), number.data() + number.size(), v,
                                         std::chars_format::fixed);
  if (ec != std::errc{} || end != number.data() + number.size()) return result::fail(malformed);
  // Fractions of a byte are dropped: "1.5K" is exact, "0.3K" is 307 bytes.
  const long double bytes = static_cast<long double>(v) * static_cast<long double>(*mult);
  // 2^64 is exactly representable, SIZE_MAX is not: compare against the former.
  constexpr long double limit = 18446744073709551616.0L;
  if (!(bytes < limit)) return result::fail(overflow);
  // Several sizes read 0 as "the default": a fraction of a byte must not turn into that.
  if (bytes > 0 && bytes < 1) return result::fail("size " + quoted(text) + " is less than one byte");
  return result::ok(static_cast<std::size_t>(bytes));
}

parsed<bool> parse_bool(std::string_view text) {
  if (text == "1" || iequals(text, "true")) return parsed<bool>::ok(true);
  if (text == "0" || iequals(text, "false")) return parsed<bool>::ok(false);
  return parsed<bool>::fail("expected true, false, 1 or 0, got " + quoted(text));
}

// ------------------------------------------------------------------------------- the keys

// One row per key: how to apply a value to the config, or why it is refused. Rows are in the
// header's declaration order, which alloc_conf_keys() reports.
using apply_fn = std::string (*)(allocator_config&, std::string_view);

std::string size_granular(std::size_t& field, std::string_view v, std::string_view what) {
  auto s = parse_size_impl(v);
  if (!s.value) return s.why;
  if (*s.value == 0 || *s.value % kGranule != 0) {
    return std::string(what) + " must be a positive multiple of 512 bytes, got " +
           std::to_string(*s.value);
  }
  field = *s.value;
  return {};
}

struct key_rule {
  std::string_view key;
  apply_fn apply;
};

constexpr key_rule kRules[] = {
    {"device",
     [](allocator_config& c, std::string_view v) -> std::string {
       for (std::string_view d : {"auto", "sim", "null", "cuda", "cuda-vmm"}) {
         if (v == d) {
           c.device = std::string(v);
           return {};
         }
       }
       return "unknown device " + quoted(v) + " (expected auto, sim, null, cuda or cuda-vmm)";
     }},
    {"device_capacity",
     [](allocator_config& c, std::string_view v) -> std::string {
       auto s = parse_size_impl(v);
       if (!s.value) return s.why;
       c.device_capacity = *s.value;
       return {};
     }},
    {"copy_bandwidth",
     [](allocator_config& c, std::string_view v) -> std::string {
       // Bytes per second: a plain number ("1e9") or a size ("12GiB").
       double bw = 0.0;
       if (auto r = parse_real(v); r.value) {
         bw = *r.value;
       } else if (auto s = parse_size_impl(v); s.value) {
         bw = static_cast<double>(*s.value);
       } else {
         return "expected bytes per second such as 1e10 or 12GiB, got " + quoted(v);
       }
       if (bw < 0.0) return "copy_bandwidth must be >= 0 (0 = unlimited), got " + quoted(v);
       c.copy_bandwidth = bw;
       return {};
     }},
    {"small_size",
     [](allocator_config& c, std::string_view v) -> std::string {
       auto s = parse_size_impl(v);
       if (!s.value) return s.why;
       if (*s.value == 0) return "small_size must be > 0";
       c.small_size = *s.value;
       return {};
     }},
    {"small_segment_size",
     [](allocator_config& c, std::string_view v) {
       return size_granular(c.small_segment_size, v, "small_segment_size");
     }},
    {"large_segment_size",
     [](allocator_config& c, std::string_view v) {
       return size_granular(c.large_segment_size, v, "large_segment_size");
     }},
    {"min_large_alloc",
     [](allocator_config& c, std::string_view v) -> std::string {
       auto s = parse_size_impl(v);
       if (!s.value) return s.why;
       c.min_large_alloc = *s.value;
       return {};
     }},
    {"large_round",
     [](allocator_config& c, std::string_view v) {
       return size_granular(c.large_round, v, "large_round");
     }},
    {"max_split_size_mb",
     [](allocator_config& c, std::string_view v) -> std::string {
       // PyTorch's unit: whole MiB. Its lower bound (the large segment size) is checked once all
       // items are applied, since large_segment_size may come later in the same text.
       auto n = parse_unsigned(v);
       if (!n.value) return n.why;
       // Like PyTorch, a value too large to express in bytes means "never split a large block".
       c.max_split_size = *n.value > std::numeric_limits<std::size_t>::max() / MiB
                              ? std::numeric_limits<std::size_t>::max()
                              : static_cast<std::size_t>(*n.value) * MiB;
       return {};
     }},
    {"roundup_power2_divisions",
     [](allocator_config& c, std::string_view v) -> std::string {
       if (v.front() == '[') {
         return "PyTorch's per-size form " + quoted(v) +
                " is not supported: terrace takes one number of divisions for every size, 0 (off) "
                "or a power of two from 1 to 64";
       }
       auto n = parse_unsigned(v);
       if (!n.value) return n.why;
       const std::uint64_t d = *n.value;
       if (d > 64 || (d & (d - 1)) != 0) {
         return "roundup_power2_divisions must be 0 (off) or a power of two from 1 to 64, got " +
                quoted(v);
       }
       c.roundup_power2_divisions = static_cast<unsigned>(d);
       return {};
     }},
    {"garbage_collection_threshold",
     [](allocator_config& c, std::string_view v) -> std::string {
       auto r = parse_real(v);
       if (!r.value) return r.why;
       if (!(*r.value >= 0.0 && *r.value < 1.0)) {
         return "garbage_collection_threshold must be in [0, 1) (0 = off), got " + quoted(v);
       }
       c.garbage_collection_threshold = *r.value;
       return {};
     }},
    {"expandable_segments",
     [](allocator_config& c, std::string_view v) -> std::string {
       auto b = parse_bool(v);
       if (!b.value) return b.why;
       c.expandable_segments = *b.value;
       return {};
     }},
    {"memory_fraction",
     [](allocator_config& c, std::string_view v) -> std::string {
       auto r = parse_real(v);
       if (!r.value) return r.why;
       if (!(*r.value > 0.0 && *r.value <= 1.0)) {
         return "memory_fraction must be in (0, 1], got " + quoted(v);
       }
       c.memory_fraction = *r.value;
       return {};
     }},
    {"policy",
     [](allocator_config& c, std::string_view v) -> std::string {
       // What caching and expandable mean for expandable_segments is applied once every item is
       // read (parse), where an expandable_segments item in either order is checked against it.
       if (iequals(v, "caching")) {
         c.policy = alloc_policy::caching;
       } else if (iequals(v, "expandable")) {
         c.policy = alloc_policy::expandable;
       } else if (iequals(v, "planned")) {
         c.policy = alloc_policy::planned;
       } else {
         return "policy must be caching, expandable or planned, got " + quoted(v);
       }
       return {};
     }},
    {"plan_counterfactual",
     [](allocator_config& c, std::string_view v) -> std::string {
       auto b = parse_bool(v);
       if (!b.value) return b.why;
       c.plan_counterfactual = *b.value;
       return {};
     }},
    {"plan_min_period",
     [](allocator_config& c, std::string_view v) -> std::string {
       auto n = parse_unsigned(v);
       if (!n.value) return n.why;
       if (*n.value < 16 || *n.value > (1u << 30)) {
         return "plan_min_period must be in [16, 2^30], got " + quoted(v);
       }
       c.plan_min_period = static_cast<std::size_t>(*n.value);
       return {};
     }},
    {"record_trace",
     [](allocator_config& c, std::string_view v) -> std::string {
       auto b = parse_bool(v);
       if (!b.value) return b.why;
       c.record_trace = *b.value;
       return {};
     }},
    {"trace_max_events",
     [](allocator_config& c, std::string_view v) -> std::string {
       auto n = parse_unsigned(v);
       if (!n.value) return n.why;
       if (*n.value == 0) return "trace_max_events must be >= 1";
       if (*n.value > std::numeric_limits<std::size_t>::max()) return quoted(v) + " is too large";
       c.trace_max_events = static_cast<std::size_t>(*n.value);
       return {};
     }},
};

std::string valid_keys_list() {
  std::string out;
  for (const auto& r : kRules) {
    if (!out.empty()) out += ", ";
    out += r.key;
  }
  return out;
}

// Levenshtein distance, for suggesting the key a typo meant.
std::size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<std::size_t> row(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    std::size_t diagonal = row[0];
    row[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t above = row[j];
      const bool same = std::tolower(static_cast<unsigned char>(a[i - 1])) ==
                        std::tolower(static_cast<unsigned char>(b[j - 1]));
      row[j] = std::min({above + 1, row[j - 1] + 1, diagonal + (same ? 0 : 1)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

// PYTORCH_CUDA_ALLOC_CONF's keys that have no terrace equivalent. A user who copies that variable
// over is told so, rather than left to read "unknown key" as a typo of theirs.
constexpr std::string_view kPyTorchOnlyKeys[] = {
    "backend",                        "max_non_split_rounding_mb",
    "release_lock_on_cudamalloc",     "release_lock_on_hipmalloc",
    "pinned_use_cuda_host_register",  "pinned_use_hip_host_register",
    "pinned_num_register_threads",    "pinned_use_background_threads",
    "pinned_reserve_segment_size_mb", "graph_capture_record_stream_reuse"};

// "unknown key 'x'" with the nearest key when a typo explains it, then every valid key: the
// list is what a user needs when the key is the problem, and noise when the value is.
std::string unknown_key(std::string_view key) {
  std::string why = "unknown key " + quoted(key) + " (";
  if (std::find(std::begin(kPyTorchOnlyKeys), std::end(kPyTorchOnlyKeys), key) !=
      std::end(kPyTorchOnlyKeys)) {
    why += "a PYTORCH_CUDA_ALLOC_CONF key that terrace does not implement; ";
  } else {
    std::string_view nearest;
    std::size_t best = std::numeric_limits<std::size_t>::max();
    for (const auto& r : kRules) {
      const std::size_t d = edit_distance(key, r.key);
      if (d < best) best = d, nearest = r.key;
    }
    if (!key.empty() && best <= std::max<std::size_t>(2, nearest.size() / 4)) {
      why += "did you mean " + quoted(nearest) + "? ";
    }
  }
  return why + "valid keys: " + valid_keys_list() + ")";
}

[[noreturn]] void fail(std::string_view source, std::string_view item, const std::string& why) {
  throw logic_error("terrace: " + std::string(source) + ": bad item " + quoted(item) + ": " + why);
}

// Where the item that starts at `pos` ends: at the next comma outside square brackets, so that
// PyTorch's roundup_power2_divisions:[256:1,>:8] stays one item (refused whole, by its key).
std::size_t item_end(std::string_view text, std::size_t pos) noexcept {
  int depth = 0;
  for (; pos < text.size(); ++pos) {
    if (text[pos] == '[') {
      ++depth;
    } else if (text[pos] == ']' && depth > 0) {
      --depth;
    } else if (text[pos] == ',' && depth == 0) {
      break;
    }
  }
  return pos;
}

consteval std::size_t rule_index(std::string_view key) {
  for (std::size_t i = 0; i < std::size(kRules); ++i) {
    if (kRules[i].key == key) return i;
  }
  throw "not a key";  // a compile error: rule_index is consteval
}

allocator_config parse(std::string_view source, std::string_view text, allocator_config base,
                       const std::vector<alloc_conf_reserved_key>& reserved) {
  // A base made in code may split nothing on purpose (the offload engine's max_split_size of 1 B,
  // every block a whole segment); a text that only resizes its segments is not then refused over
  // a limit it did not set, quoted as "max_split_size_mb (0 MiB)".
  const bool base_limit_above_segment = base.max_split_size == std::numeric_limits<std::size_t>::max() ||
                                        base.max_split_size > base.large_segment_size;
  allocator_config c = std::move(base);
  // The item that set each key (empty if none): a key given twice is refused quoting both, and a
  // failed cross-check quotes the item it blames.
  std::array<std::string_view, std::size(kRules)> item_of{};
  std::string_view previous;  // the item before, for a stray piece after a comma

  for (std::size_t pos = 0; pos <= text.size();) {
    const std::size_t end = item_end(text, pos);
    const std::string_view item = trim(text.substr(pos, end - pos));
    pos = end + 1;
    if (item.empty()) continue;  // "", "a:1," and "a:1,,b:2" are all fine

    const std::size_t colon = item.find(':');
    if (colon == std::string_view::npos) {
      std::string why = "expected key:value";
      if (!previous.empty()) why += " after " + quoted(previous);
      why += " (";
      if (all_digits(item) && !previous.empty()) {
        why += "a comma separates items, so numbers take no thousands separators; ";
      }
      fail(source, item, why + "valid keys: " + valid_keys_list() + ")");
    }
    previous = item;
    const std::string_view key = trim(item.substr(0, colon));
    const std::string_view value = trim(item.substr(colon + 1));
    const auto rule = std::find_if(std::begin(kRules), std::end(kRules),
                                   [&](const key_rule& r) { return r.key == key; });
    if (rule == std::end(kRules)) fail(source, item, unknown_key(key));
    if (value.empty()) fail(source, item, "missing value for " + quoted(key));
    for (const alloc_conf_reserved_key& r : reserved) {
      if (r.key == key) fail(source, item, quoted(key) + " cannot be set here: " + std::string(r.reason));
    }
    std::string_view& first = item_of[static_cast<std::size_t>(rule - std::begin(kRules))];
    if (!first.empty()) {
      // PyTorch lets the last one win; one of the two is then ignored without a word.
      fail(source, item, quoted(key) + " is already set by " + quoted(first) + " (give each key once)");
    }
    if (std::string why = rule->apply(c, value); !why.empty()) fail(source, item, why);
    first = item;
  }

  // policy:expandable is caching with expandable segments, policy:caching is caching without: a
  // policy sets expandable_segments, and said both ways, the two must agree (else the run would be
  // labelled one policy and behave as the other, or one of the items be ignored).
  const std::string_view policy_item = item_of[rule_index("policy")],
                         expandable_item = item_of[rule_index("expandable_segments")];
  if (!policy_item.empty() && c.policy != alloc_policy::planned) {
    const bool expandable = c.policy == alloc_policy::expandable;
    if (expandable_item.empty()) {
      c.expandable_segments = expandable;
    } else if (c.expandable_segments != expandable) {
      fail(source, expandable_item,
           "contradicts " + quoted(policy_item) +
               " (policy:expandable means expandable segments, policy:caching means none)");
    }
  }
  // The one backend known, from its name alone, to lack the virtual memory expandable segments
  // grow in: said now, not at the first allocation (the C ABI's is long after terrace_configure).
  if (c.device == "cuda" && c.expandable_segments) {
    const std::string_view blamed = !expandable_item.empty() ? expandable_item
                                    : !policy_item.empty()   ? policy_item
                                                             : item_of[rule_index("device")];
    if (!blamed.empty()) {
      fail(source, blamed,
           "expandable segments need a backend with virtual memory, and device 'cuda' has none "
           "(use device:cuda-vmm, or device:auto, which picks cuda-vmm on a GPU)");
    }
  }

  // Cross-key rules, checked on the final values whatever order the items came in.
  const std::string_view small_size_item = item_of[rule_index("small_size")],
                         small_segment_item = item_of[rule_index("small_segment_size")];
  if (!small_size_item.empty() || !small_segment_item.empty()) {
    if (c.small_segment_size < c.small_size) {
      fail(source, small_segment_item.empty() ? small_size_item : small_segment_item,
           "small_segment_size (" + std::to_string(c.small_segment_size) +
               ") must be >= small_size (" + std::to_string(c.small_size) + ")");
    }
  }
  // PyTorch refuses max_split_size_mb below its 20 MiB large segment: a limit that low forbids
  // splitting the very segments that exist to be split. A request below 10 MiB gets a whole large
  // segment; once freed, that segment is one block of max_split_size bytes or more, which such a
  // request may not split, so every allocation reserved a new segment. Ours is configurable, and
  // the bound follows it (equal is refused too, as earlier PyTorch releases refused 20: "must be
  // > 20"; current ones take 20 itself).
  const std::string_view max_split_item = item_of[rule_index("max_split_size_mb")],
                         large_segment_item = item_of[rule_index("large_segment_size")];
  if (!max_split_item.empty() || (!large_segment_item.empty() && base_limit_above_segment)) {
    if (c.max_split_size != std::numeric_limits<std::size_t>::max() &&
        c.max_split_size <= c.large_segment_size) {
      fail(source, max_split_item.empty() ? large_segment_item : max_split_item,
           "max_split_size_mb (" + std::to_string(c.max_split_size / MiB) +
               " MiB) must be larger than large_segment_size (" +
               std::to_string(c.large_segment_size) + " bytes)");
    }
  }
  return c;
}

}  // namespace

std::string_view to_string(alloc_policy p) noexcept {
  switch (p) {
    case alloc_policy::caching: return "caching";
    case alloc_policy::expandable: return "expandable";
    case alloc_policy::planned: return "planned";
  }
  return "?";
}

const std::vector<std::string_view>& alloc_conf_keys() {
  static const std::vector<std::string_view> keys = [] {
    std::vector<std::string_view> k;
    for (const auto& r : kRules) k.push_back(r.key);
    return k;
  }();
  return keys;
}

allocator_config parse_alloc_conf(std::string_view text, allocator_config base,
                                  const std::vector<alloc_conf_reserved_key>& reserved) {
  return parse("allocator config", text, std::move(base), reserved);
}

allocator_config alloc_conf_from_env() {
  const char* text = std::getenv("TERRACE_ALLOC_CONF");
  if (text == nullptr) return {};
  return parse("TERRACE_ALLOC_CONF", text, {}, {});
}

std::size_t parse_size(std::string_view text) {
  auto s = parse_size_impl(text);
  if (!s.value) throw logic_error("terrace: " + s.why);
  return *s.value;
}

}  // namespace terrace

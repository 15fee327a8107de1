// SPDX-License-Identifier: Apache-2.0
// TERRACE_ALLOC_CONF parsing: every key, every size suffix, and every way a value is refused.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <algorithm>
#include <fstream>
#include <iterator>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "terrace/caching_allocator.hpp"
#include "terrace/config.hpp"
#include "terrace/device.hpp"
#include "terrace/error.hpp"

namespace terrace {
namespace {

constexpr std::size_t KiB = 1024;
constexpr std::size_t MiB = 1024 * KiB;
constexpr std::size_t GiB = 1024 * MiB;
constexpr std::size_t TiB = 1024 * GiB;

// The message of the logic_error that parsing `text` throws; fails the test if nothing is thrown.
std::string error_of(std::string_view text) {
  try {
    parse_alloc_conf(text);
  } catch (const logic_error& e) {
    return e.what();
  }
  ADD_FAILURE() << "parse_alloc_conf(\"" << text << "\") did not throw";
  return {};
}

std::string size_error_of(std::string_view text) {
  try {
    parse_size(text);
  } catch (const logic_error& e) {
    return e.what();
  }
  ADD_FAILURE() << "parse_size(\"" << text << "\") did not throw";
  return {};
}

// Every error names the offending item. When the key is the problem (unknown, or no key:value
// at all) it lists every valid key; when the value is, the list would only bury the reason.
void expect_item_error(std::string_view text, std::string_view item, std::string_view problem) {
  SCOPED_TRACE(std::string(text));
  const std::string msg = error_of(text);
  EXPECT_NE(msg.find("'" + std::string(item) + "'"), std::string::npos) << msg;
  EXPECT_NE(msg.find(problem), std::string::npos) << msg;
  const bool key_problem = problem.find("unknown key") != std::string_view::npos ||
                           problem.find("did you mean") != std::string_view::npos ||
                           problem.find("expected key:value") != std::string_view::npos;
  EXPECT_EQ(msg.find("valid keys: ") != std::string::npos, key_problem) << msg;
  if (!key_problem) return;
  for (std::string_view key : alloc_conf_keys()) {
    EXPECT_NE(msg.find(key), std::string::npos) << "key " << key << " missing from: " << msg;
  }
}

// ------------------------------------------------------------------------------------- keys

TEST(AllocConf, KeysAreTheHeadersInDeclarationOrder) {
  const std::vector<std::string_view> expected = {
      "device",          "device_capacity",          "copy_bandwidth",
      "small_size",      "small_segment_size",       "large_segment_size",
      "min_large_alloc", "large_round",              "max_split_size_mb",
      "roundup_power2_divisions", "garbage_collection_threshold", "expandable_segments",
      "memory_fraction", "policy", "plan_counterfactual", "plan_min_period", "record_trace",             "trace_max_events"};
  EXPECT_EQ(alloc_conf_keys(), expected);
}

TEST(AllocConf, EmptyTextAndEmptyItemsKeepTheBase) {
  allocator_config base;
  base.small_size = 4 * KiB;
  base.device = "null";
  for (std::string_view text : {"", "   ", ",", ",,", " , , "}) {
    const auto c = parse_alloc_conf(text, base);
    EXPECT_EQ(c.small_size, 4 * KiB) << text;
    EXPECT_EQ(c.device, "null") << text;
  }
  const auto c = parse_alloc_conf("record_trace:true,", base);
  EXPECT_TRUE(c.record_trace);
  EXPECT_EQ(c.small_size, 4 * KiB);
}

TEST(AllocConf, EveryKeyParses) {
  const auto c = parse_alloc_conf(
      "device:sim,device_capacity:8GiB,copy_bandwidth:12.5e9,small_size:512KiB,"
      "small_segment_size:4MiB,large_segment_size:32MiB,min_large_alloc:16MiB,large_round:4MiB,"
      "max_split_size_mb:256,roundup_power2_divisions:4,garbage_collection_threshold:0.75,"
      "expandable_segments:true,memory_fraction:0.5,record_trace:1,trace_max_events:1000");
  EXPECT_EQ(c.device, "sim");
  EXPECT_EQ(c.device_capacity, 8 * GiB);
  EXPECT_DOUBLE_EQ(c.copy_bandwidth, 12.5e9);
  EXPECT_EQ(c.small_size, 512 * KiB);
  EXPECT_EQ(c.small_segment_size, 4 * MiB);
  EXPECT_EQ(c.large_segment_size, 32 * MiB);
  EXPECT_EQ(c.min_large_alloc, 16 * MiB);
  EXPECT_EQ(c.large_round, 4 * MiB);
  EXPECT_EQ(c.max_split_size, 256 * MiB);
  EXPECT_EQ(c.roundup_power2_divisions, 4u);
  EXPECT_DOUBLE_EQ(c.garbage_collection_threshold, 0.75);
  EXPECT_TRUE(c.expandable_segments);
  EXPECT_DOUBLE_EQ(c.memory_fraction, 0.5);
  EXPECT_TRUE(c.record_trace);
  EXPECT_EQ(c.trace_max_events, 1000u);
}

TEST(AllocConf, DefaultsMatchPyTorch) {
  const allocator_config c = parse_alloc_conf("");
  EXPECT_EQ(c.device, "auto");
  EXPECT_EQ(c.small_size, 1 * MiB);
  EXPECT_EQ(c.small_segment_size, 2 * MiB);
  EXPECT_EQ(c.large_segment_size, 20 * MiB);
  EXPECT_EQ(c.min_large_alloc, 10 * MiB);
  EXPECT_EQ(c.large_round, 2 * MiB);
  EXPECT_EQ(c.max_split_size, SIZE_MAX);
  EXPECT_EQ(c.roundup_power2_divisions, 0u);
  EXPECT_FALSE(c.expandable_segments);
}

TEST(AllocConf, SpacesAroundItemsKeysAndValuesAreTrimmed) {
  const auto c = parse_alloc_conf("  device : null ,  small_size :  2 MiB , memory_fraction: 1 ");
  EXPECT_EQ(c.device, "null");
  EXPECT_EQ(c.small_size, 2 * MiB);
  EXPECT_DOUBLE_EQ(c.memory_fraction, 1.0);
}

TEST(AllocConf, UntouchedFieldsKeepTheBase) {
  allocator_config base;
  base.trace_max_events = 7;
  const auto c = parse_alloc_conf("small_size:8K", base);
  EXPECT_EQ(c.small_size, 8 * KiB);
  EXPECT_EQ(c.trace_max_events, 7u);
}

// PyTorch lets the last of two items with one key win, so that the first is ignored without a
// word; here each key is given once, and a second one is refused quoting both.
TEST(AllocConfErrors, AKeyGivenTwiceIsRefusedQuotingBothItems) {
  expect_item_error("small_size:4K,small_size:8K", "small_size:8K",
                    "'small_size' is already set by 'small_size:4K' (give each key once)");
  expect_item_error("record_trace:1, memory_fraction:0.5 ,record_trace:1", "record_trace:1",
                    "already set by 'record_trace:1'");
  expect_item_error("expandable_segments:true,policy:planned,expandable_segments:0",
                    "expandable_segments:0", "already set by 'expandable_segments:true'");
  // Keys differ from the base's fields: a text may set what the base set.
  allocator_config base;
  base.small_size = 4 * KiB;
  EXPECT_EQ(parse_alloc_conf("small_size:8K", base).small_size, 8 * KiB);
}

TEST(AllocConf, EveryDeviceName) {
  for (std::string_view d : {"auto", "sim", "null", "cuda", "cuda-vmm"}) {
    EXPECT_EQ(parse_alloc_conf("device:" + std::string(d)).device, d);
  }
}

TEST(AllocConf, BooleanSpellings) {
  for (std::string_view t : {"true", "True", "TRUE", "1"}) {
    EXPECT_TRUE(parse_alloc_conf("expandable_segments:" + std::string(t)).expandable_segments) << t;
  }
  allocator_config on;
  on.record_trace = true;
  for (std::string_view f : {"false", "False", "0"}) {
    EXPECT_FALSE(parse_alloc_conf("record_trace:" + std::string(f), on).record_trace) << f;
  }
}

TEST(AllocConf, RoundupDivisionsAcceptsZeroAndPowersOfTwoUpTo64) {
  for (unsigned d : {0u, 1u, 2u, 4u, 8u, 16u, 32u, 64u}) {
    EXPECT_EQ(parse_alloc_conf("roundup_power2_divisions:" + std::to_string(d))
                  .roundup_power2_divisions,
              d);
  }
}

TEST(AllocConf, MaxSplitSizeIsInMiBAndBoundedBelowByTheLargeSegment) {
  EXPECT_EQ(parse_alloc_conf("max_split_size_mb:21").max_split_size, 21 * MiB);
  // The bound follows the configured large segment, whichever item comes first.
  EXPECT_EQ(parse_alloc_conf("max_split_size_mb:9,large_segment_size:8MiB").max_split_size, 9 * MiB);
  EXPECT_EQ(parse_alloc_conf("large_segment_size:8MiB,max_split_size_mb:9").max_split_size, 9 * MiB);
  // Too large to express in bytes: never split, as PyTorch clamps it.
  EXPECT_EQ(parse_alloc_conf("max_split_size_mb:18446744073709551615").max_split_size, SIZE_MAX);
  // Equal to the segment is refused too, as PyTorch's "must be > 20": a whole freed segment
  // would be a block no small request may split, and each would reserve a new segment.
  for (const char* item : {"max_split_size_mb:20", "max_split_size_mb:19", "max_split_size_mb:0"}) {
    expect_item_error(item, item, "larger than large_segment_size");
  }
  expect_item_error("large_segment_size:8MiB,max_split_size_mb:8", "max_split_size_mb:8",
                    "larger than large_segment_size");
  // Raising the segment above an earlier limit is refused too, quoting the limit's item.
  expect_item_error("max_split_size_mb:32,large_segment_size:64MiB", "max_split_size_mb:32",
                    "larger than large_segment_size");
  // Without a limit anywhere, any segment size goes.
  EXPECT_EQ(parse_alloc_conf("large_segment_size:64MiB").large_segment_size, 64 * MiB);
  // A limit from the base is checked against a segment size from the text, quoting that item...
  allocator_config base;
  base.max_split_size = 32 * MiB;
  try {
    parse_alloc_conf("large_segment_size:64MiB", base);
    ADD_FAILURE() << "expected a throw";
  } catch (const logic_error& e) {
    EXPECT_NE(std::string(e.what()).find("'large_segment_size:64MiB'"), std::string::npos)
        << e.what();
  }
  // ...but a base that no item touches is left to the allocator's own checks.
  EXPECT_EQ(parse_alloc_conf("small_size:4K", base).max_split_size, 32 * MiB);
  // A base that splits nothing on purpose (the offload engine's: a limit of 1 byte, below its
  // segments) takes a new segment size: `terrace train --alloc-conf large_segment_size:40MB` was
  // refused over "max_split_size_mb (0 MiB)", a limit the user never set.
  allocator_config whole_segments;
  whole_segments.max_split_size = 1;
  whole_segments.large_segment_size = 64 * KiB;
  const allocator_config c = parse_alloc_conf("large_segment_size:40MB", whole_segments);
  EXPECT_EQ(c.large_segment_size, 40 * MiB);  // MB is MiB here, as in PyTorch's settings
  EXPECT_EQ(c.max_split_size, 1u);
  // A limit the text gives is checked as ever.
  expect_item_error("large_segment_size:40MB,max_split_size_mb:8", "max_split_size_mb:8",
                    "larger than large_segment_size");
}

TEST(AllocConf, BoundaryValuesAreAccepted) {
  EXPECT_DOUBLE_EQ(parse_alloc_conf("garbage_collection_threshold:0").garbage_collection_threshold, 0.0);
  EXPECT_DOUBLE_EQ(parse_alloc_conf("garbage_collection_threshold:0.999").garbage_collection_threshold,
                   0.999);
  EXPECT_DOUBLE_EQ(parse_alloc_conf("memory_fraction:1.0").memory_fraction, 1.0);
  EXPECT_DOUBLE_EQ(parse_alloc_conf("memory_fraction:1e-3").memory_fraction, 1e-3);
  EXPECT_DOUBLE_EQ(parse_alloc_conf("copy_bandwidth:0").copy_bandwidth, 0.0);
  EXPECT_DOUBLE_EQ(parse_alloc_conf("copy_bandwidth:2GiB").copy_bandwidth, 2.0 * GiB);
  EXPECT_EQ(parse_alloc_conf("small_segment_size:1MiB").small_segment_size, 1 * MiB);
  EXPECT_EQ(parse_alloc_conf("small_segment_size:512,small_size:512").small_segment_size, 512u);
  EXPECT_EQ(parse_alloc_conf("device_capacity:0").device_capacity, 0u);
  EXPECT_EQ(parse_alloc_conf("min_large_alloc:0").min_large_alloc, 0u);
  EXPECT_EQ(parse_alloc_conf("trace_max_events:1").trace_max_events, 1u);
}

// ------------------------------------------------------------------------------------- errors

TEST(AllocConfErrors, UnknownKey) {
  expect_item_error("small_size:1K,bogus:3", "bogus:3", "unknown key 'bogus'");
  expect_item_error(":3", ":3", "unknown key ''");
  // Keys are case-sensitive, as in PyTorch.
  expect_item_error("Small_Size:1K", "Small_Size:1K", "did you mean 'small_size'?");
  expect_item_error("garbage_conversion_threshold:0.5", "garbage_conversion_threshold:0.5",
                    "unknown key 'garbage_conversion_threshold' (did you mean "
                    "'garbage_collection_threshold'?");
  // A key near none of them gets the list without a guess.
  EXPECT_EQ(error_of("bogus:3").find("did you mean"), std::string::npos);
}

TEST(AllocConfErrors, MissingColonOrValue) {
  expect_item_error("record_trace", "record_trace", "expected key:value");
  expect_item_error("small_size:1K, expandable_segments", "expandable_segments", "expected key:value");
  expect_item_error("small_size:", "small_size:", "missing value");
}

TEST(AllocConfErrors, MalformedValues) {
  expect_item_error("device:gpu", "device:gpu", "unknown device");
  expect_item_error("device:CUDA", "device:CUDA", "unknown device");
  expect_item_error("device_capacity:lots", "device_capacity:lots", "malformed size");
  expect_item_error("small_size:-1", "small_size:-1", "malformed size");
  expect_item_error("small_size:1Q", "small_size:1Q", "unknown size suffix 'Q'");
  expect_item_error("copy_bandwidth:fast", "copy_bandwidth:fast", "bytes per second");
  expect_item_error("copy_bandwidth:inf", "copy_bandwidth:inf", "bytes per second");
  expect_item_error("max_split_size_mb:1.5", "max_split_size_mb:1.5", "unsigned integer");
  expect_item_error("max_split_size_mb:64M", "max_split_size_mb:64M", "unsigned integer");
  expect_item_error("max_split_size_mb:99999999999999999999", "max_split_size_mb:99999999999999999999",
                    "too large");
  expect_item_error("roundup_power2_divisions:x", "roundup_power2_divisions:x", "unsigned integer");
  expect_item_error("garbage_collection_threshold:half", "garbage_collection_threshold:half",
                    "finite number");
  expect_item_error("garbage_collection_threshold:nan", "garbage_collection_threshold:nan",
                    "finite number");
  expect_item_error("expandable_segments:yes", "expandable_segments:yes", "expected true, false");
  expect_item_error("record_trace:2", "record_trace:2", "expected true, false");
  expect_item_error("memory_fraction:0.5x", "memory_fraction:0.5x", "finite number");
  expect_item_error("trace_max_events:-5", "trace_max_events:-5", "unsigned integer");
  expect_item_error("trace_max_events:1e6", "trace_max_events:1e6", "unsigned integer");
}

// Shapes a user tries when writing a number, each refused naming its item, the value and what to
// write instead; the lenient spellings are accepted on purpose.
TEST(AllocConfErrors, NumbersASizeDoesNotTake) {
  expect_item_error("small_size:-1", "small_size:-1", "malformed size '-1': sizes cannot be negative");
  expect_item_error("large_segment_size:-2MiB", "large_segment_size:-2MiB", "sizes cannot be negative");
  expect_item_error("device_capacity:0x1000", "device_capacity:0x1000",
                    "malformed size '0x1000': hexadecimal is not accepted");
  expect_item_error("device_capacity:0X10", "device_capacity:0X10", "hexadecimal is not accepted");
  expect_item_error("small_size:1e6", "small_size:1e6", "malformed size '1e6': exponents are not accepted");
  expect_item_error("small_size:1E+3", "small_size:1E+3", "exponents are not accepted");
  expect_item_error("device_capacity:99999999999999GiB", "device_capacity:99999999999999GiB",
                    "size '99999999999999GiB' does not fit in 64 bits");
  expect_item_error("small_size:1XB", "small_size:1XB", "unknown size suffix 'XB' in '1XB'");
  expect_item_error("small_size:1PiB", "small_size:1PiB", "unknown size suffix 'PiB'");
  expect_item_error("small_size:1_000", "small_size:1_000", "unknown size suffix '_000'");
  // A thousands separator splits the item: the piece after the comma is named with the item before.
  expect_item_error("small_size:1,000", "000",
                    "expected key:value after 'small_size:1' (a comma separates items, so numbers "
                    "take no thousands separators");
  expect_item_error("max_split_size_mb:-5", "max_split_size_mb:-5", "expected an unsigned integer, got '-5'");
  expect_item_error("max_split_size_mb:0x80", "max_split_size_mb:0x80", "unsigned integer");
  expect_item_error("garbage_collection_threshold:0x0.8p0", "garbage_collection_threshold:0x0.8p0",
                    "finite number");
  // Accepted: units in any case, a space before the unit, decimals that are whole bytes.
  EXPECT_EQ(parse_alloc_conf("small_size:1mib,small_segment_size:4 MIB").small_segment_size, 4 * MiB);
  EXPECT_EQ(parse_alloc_conf("device_capacity:1.5GiB").device_capacity, 3 * GiB / 2);
  // A long value is quoted cut, so that the reason after it is not lost in a cut message.
  const std::string msg = error_of("small_size:" + std::string(100000, '9'));
  EXPECT_LT(msg.size(), 1000u);
  EXPECT_NE(msg.find("...' (100011 characters): size '999"), std::string::npos) << msg;
  EXPECT_NE(msg.find("...' (100000 characters) does not fit in 64 bits"), std::string::npos) << msg;
  EXPECT_EQ(parse_alloc_conf("device_capacity:  2 gb ").device_capacity, 2 * GiB);
}

// What a user copies from PYTORCH_CUDA_ALLOC_CONF behaves as PyTorch documents it, from the text to
// the allocator, or is refused saying that terrace does not have it: never parsed and ignored.
TEST(AllocConf, WhatAUserCopiesFromPyTorch) {
  const allocator_config c = parse_alloc_conf(
      "expandable_segments:True,garbage_collection_threshold:0.6,max_split_size_mb:128,"
      "roundup_power2_divisions:4");
  EXPECT_TRUE(c.expandable_segments);
  EXPECT_DOUBLE_EQ(c.garbage_collection_threshold, 0.6);
  EXPECT_EQ(c.max_split_size, 128 * MiB);
  EXPECT_EQ(c.roundup_power2_divisions, 4u);
  EXPECT_FALSE(parse_alloc_conf("expandable_segments:False").expandable_segments);
  // PyTorch's bounds: max_split_size_mb above its 20 MiB segment (PyTorch itself takes 20 since
  // it changed ">" to ">="), a threshold below 1, divisions a power of two.
  expect_item_error("max_split_size_mb:20", "max_split_size_mb:20", "must be larger than large_segment_size");
  expect_item_error("garbage_collection_threshold:1.0", "garbage_collection_threshold:1.0", "[0, 1)");
  expect_item_error("roundup_power2_divisions:6", "roundup_power2_divisions:6", "power of two");
  expect_item_error("max_split_size_mb:200MB", "max_split_size_mb:200MB",
                    "expected an unsigned integer, got '200MB'");  // PyTorch's stoi read 200
  // PyTorch's per-size divisions: one item whatever its commas, refused whole.
  expect_item_error("roundup_power2_divisions:[256:1,512:2,1024:4,>:8],max_split_size_mb:128",
                    "roundup_power2_divisions:[256:1,512:2,1024:4,>:8]",
                    "PyTorch's per-size form '[256:1,512:2,1024:4,>:8]' is not supported: terrace "
                    "takes one number of divisions for every size");
  expect_item_error("roundup_power2_divisions:[256:1,512:2", "roundup_power2_divisions:[256:1,512:2",
                    "per-size form");
  // PyTorch's other keys.
  for (std::string_view item :
       {"backend:native", "backend:cudaMallocAsync", "max_non_split_rounding_mb:40",
        "release_lock_on_cudamalloc:True", "pinned_use_cuda_host_register:True",
        "pinned_num_register_threads:8", "pinned_use_background_threads:True",
        "pinned_reserve_segment_size_mb:64", "graph_capture_record_stream_reuse:True"}) {
    const std::string key(item.substr(0, item.find(':')));
    expect_item_error("max_split_size_mb:128," + std::string(item), item,
                      "unknown key '" + key + "' (a PYTORCH_CUDA_ALLOC_CONF key that terrace does not implement");
  }

  // From the text to the allocator, on the null device, as PyTorch documents each key.
  const auto run = [](std::string_view text, std::size_t capacity, auto&& body) {
    SCOPED_TRACE(std::string(text));
    const allocator_config cfg = parse_alloc_conf(text);
    auto device = make_device("null", {.capacity = capacity});
    caching_allocator a(*device, cfg);
    body(a);
    a.check_invariants();
  };
  // max_split_size_mb: a block this large or larger is never split for a smaller request.
  run("max_split_size_mb:128", GiB, [](caching_allocator& a) {
    void* big = a.allocate(200 * MiB);
    a.deallocate(big);
    void* small = a.allocate(30 * MiB);
    EXPECT_EQ(a.stats().reserved_bytes[0].current, static_cast<std::int64_t>(230 * MiB));
    a.deallocate(small);
  });
  run("", GiB, [](caching_allocator& a) {  // without it, the cached block is split
    void* big = a.allocate(200 * MiB);
    a.deallocate(big);
    void* small = a.allocate(30 * MiB);
    EXPECT_EQ(a.stats().reserved_bytes[0].current, static_cast<std::int64_t>(200 * MiB));
    a.deallocate(small);
  });
  // roundup_power2_divisions: sizes round up to quarters between powers of two.
  run("roundup_power2_divisions:4", GiB, [](caching_allocator& a) {
    void* p = a.allocate(1200 * KiB);
    EXPECT_EQ(a.stats().allocated_bytes[0].current, static_cast<std::int64_t>(1280 * KiB));
    a.deallocate(p);
  });
  // garbage_collection_threshold: past that fraction of the device, free segments go back
  // before new memory is asked for (no out-of-memory retry).
  run("garbage_collection_threshold:0.5", 100 * MiB, [](caching_allocator& a) {
    a.deallocate(a.allocate(40 * MiB));
    void* q = a.allocate(50 * MiB);
    EXPECT_EQ(a.stats().reserved_bytes[0].current, static_cast<std::int64_t>(50 * MiB));
    EXPECT_EQ(a.stats().num_alloc_retries, 0);
    a.deallocate(q);
  });
  // expandable_segments: one growing segment per stream and pool.
  run("expandable_segments:True", GiB, [](caching_allocator& a) {
    void* p = a.allocate(30 * MiB);
    void* q = a.allocate(30 * MiB);
    EXPECT_EQ(a.stats().segment[0].current, 1);
    a.deallocate(p);
    a.deallocate(q);
  });
}

// A tool that sets a key by its own flag refuses it in the text, which would otherwise be ignored
// or overwritten (terrace train's --alloc-conf: device, device_capacity, copy_bandwidth,
// record_trace; compare and report: policy, expandable_segments).
TEST(AllocConfErrors, AKeyTheCallerReservesIsRefusedWithItsReason) {
  const std::vector<alloc_conf_reserved_key> reserved = {{"device", "use --device"},
                                                         {"record_trace", "use --save-trace"}};
  try {
    parse_alloc_conf("small_size:4K,device:null", {}, reserved);
    ADD_FAILURE() << "expected a throw";
  } catch (const logic_error& e) {
    EXPECT_NE(std::string(e.what()).find("bad item 'device:null': 'device' cannot be set here: use --device"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(parse_alloc_conf("record_trace:false", {}, reserved), logic_error);
  EXPECT_EQ(parse_alloc_conf("small_size:4K,policy:planned", {}, reserved).small_size, 4 * KiB);
}

TEST(AllocConfErrors, OutOfRangeValues) {
  for (std::string_view d : {"3", "12", "65", "128"}) {
    const std::string item = "roundup_power2_divisions:" + std::string(d);
    expect_item_error(item, item, "power of two from 1 to 64");
  }
  for (std::string_view v : {"1", "1.0", "-0.1", "2"}) {
    const std::string item = "garbage_collection_threshold:" + std::string(v);
    expect_item_error(item, item, "[0, 1)");
  }
  for (std::string_view v : {"0", "0.0", "-0.5", "1.0001"}) {
    const std::string item = "memory_fraction:" + std::string(v);
    expect_item_error(item, item, "(0, 1]");
  }
  expect_item_error("copy_bandwidth:-1", "copy_bandwidth:-1", ">= 0");
  expect_item_error("small_size:0", "small_size:0", "small_size must be > 0");
  expect_item_error("trace_max_events:0", "trace_max_events:0", ">= 1");
  expect_item_error("device_capacity:20000000T", "device_capacity:20000000T", "does not fit");
}

TEST(AllocConfErrors, SegmentSizesArePositiveMultiplesOf512) {
  for (std::string_view key : {"small_segment_size", "large_segment_size", "large_round"}) {
    for (std::string_view v : {"0", "1000", "513", "0.75K"}) {
      const std::string item = std::string(key) + ":" + std::string(v);
      expect_item_error(item, item, "positive multiple of 512");
    }
  }
  // 1.5K = 3 * 512 is a granule multiple even though it is written as a decimal.
  EXPECT_EQ(parse_alloc_conf("small_size:512,small_segment_size:1.5K").small_segment_size, 1536u);
  EXPECT_EQ(parse_alloc_conf("large_segment_size:1.5K").large_segment_size, 1536u);
  EXPECT_EQ(parse_alloc_conf("large_round:1.5K").large_round, 1536u);
}

TEST(AllocConfErrors, SmallSegmentMustHoldASmallBlock) {
  expect_item_error("small_segment_size:512K", "small_segment_size:512K",
                    "must be >= small_size");
  expect_item_error("small_size:4MiB", "small_size:4MiB", "must be >= small_size");
  expect_item_error("small_size:4MiB,small_segment_size:2MiB", "small_segment_size:2MiB",
                    "must be >= small_size");
  EXPECT_EQ(parse_alloc_conf("small_size:4MiB,small_segment_size:4MiB").small_size, 4 * MiB);
}

TEST(AllocConfErrors, APolicyAndExpandableSegmentsThatContradictEachOther) {
  expect_item_error("policy:expandable,expandable_segments:false", "expandable_segments:false",
                    "contradicts 'policy:expandable'");
  expect_item_error("policy:caching,expandable_segments:true", "expandable_segments:true",
                    "contradicts 'policy:caching'");
  // Whichever comes first: the two are checked on the final values.
  expect_item_error("expandable_segments:true,policy:caching", "expandable_segments:true",
                    "contradicts 'policy:caching'");
  EXPECT_TRUE(parse_alloc_conf("policy:expandable,expandable_segments:true").expandable_segments);
  EXPECT_TRUE(parse_alloc_conf("policy:planned,expandable_segments:true").expandable_segments);
  EXPECT_FALSE(parse_alloc_conf("policy:planned,expandable_segments:0").expandable_segments);
  // A policy alone sets expandable_segments over the base's.
  allocator_config expandable;
  expandable.expandable_segments = true;
  EXPECT_FALSE(parse_alloc_conf("policy:caching", expandable).expandable_segments);
}

// The plain cuda backend has no virtual memory to grow expandable segments in: said when the text
// is parsed (terrace_configure), not at the first allocation. cuda-vmm has it, and the C ABI
// takes `auto` as cuda-vmm on a GPU when expandable segments are on.
TEST(AllocConfErrors, ExpandableSegmentsOnThePlainCudaBackend) {
  const std::string why = "need a backend with virtual memory, and device 'cuda' has none";
  expect_item_error("device:cuda,expandable_segments:True", "expandable_segments:True", why);
  expect_item_error("expandable_segments:1,device:cuda", "expandable_segments:1", why);
  expect_item_error("device:cuda,policy:expandable", "policy:expandable", why);
  allocator_config cuda;
  cuda.device = "cuda";
  try {
    parse_alloc_conf("expandable_segments:true", cuda);
    ADD_FAILURE() << "expected a throw";
  } catch (const logic_error& e) {
    EXPECT_NE(std::string(e.what()).find("'expandable_segments:true'"), std::string::npos) << e.what();
  }
  EXPECT_EQ(parse_alloc_conf("device:cuda").device, "cuda");
  EXPECT_TRUE(parse_alloc_conf("device:cuda-vmm,expandable_segments:True").expandable_segments);
  EXPECT_TRUE(parse_alloc_conf("device:auto,expandable_segments:True").expandable_segments);
  allocator_config expandable;
  expandable.expandable_segments = true;
  try {
    parse_alloc_conf("device:cuda", expandable);
    ADD_FAILURE() << "expected a throw";
  } catch (const logic_error& e) {
    EXPECT_NE(std::string(e.what()).find("'device:cuda'"), std::string::npos) << e.what();
  }
}

TEST(AllocConfErrors, TheFirstBadItemIsReportedAndTheBaseIsUntouched) {
  allocator_config base;
  base.small_size = 4 * KiB;
  try {
    parse_alloc_conf("small_size:8K,nope:1,alsobad", base);
    FAIL() << "expected a throw";
  } catch (const logic_error& e) {
    EXPECT_NE(std::string(e.what()).find("'nope:1'"), std::string::npos) << e.what();
  }
  EXPECT_EQ(base.small_size, 4 * KiB);
}

// Damaged configurations, at random: parsing gives a configuration or a logic_error, never another
// exception; what parses builds an allocator over the null device (or is refused there with a
// logic_error), and that allocator serves or refuses a few requests cleanly. A user's typo in
// TERRACE_ALLOC_CONF must never reach the allocator as an unchecked value.
TEST(AllocConfErrors, DamagedTextParsesOrIsRefusedAndWhatParsesBuildsAWorkingAllocator) {
  const std::vector<std::string> items{
      "device_capacity:1GiB", "small_size:512KiB", "small_segment_size:4MiB", "large_segment_size:32MiB",
      "min_large_alloc:16MiB", "large_round:4MiB", "max_split_size_mb:256", "roundup_power2_divisions:4",
      "garbage_collection_threshold:0.75", "expandable_segments:true", "memory_fraction:0.5",
      "record_trace:1", "trace_max_events:1000", "policy:planned", "plan_min_period:64"};
  const std::vector<std::string> values{"0", "-1", "1.5", "1e308", "nan", "inf", "18446744073709551615",
                                        "18446744073709551616", "1K", "1EiB", "0x10", "", " ", "true"};
  std::mt19937_64 rng(1);
  auto below = [&](std::size_t n) { return std::uniform_int_distribution<std::size_t>(0, n - 1)(rng); };
  std::size_t parsed = 0, refused = 0;
  for (int round = 0; round < 3000; ++round) {
    // A few items, then one or two changes: with every key at once, nearly every change is refused.
    std::string text;
    for (std::size_t k = 0, n = 1 + below(4); k < n; ++k) text += (k ? "," : "") + items[below(items.size())];
    for (int k = 0, n = 1 + static_cast<int>(below(2)); k < n && !text.empty(); ++k) {
      const std::size_t at = below(text.size());
      switch (below(4)) {
        case 0: text.erase(at, 1 + below(6)); break;
        case 1: text.insert(at, 1, ",:.-+eEKMGiB0123456789 _"[below(24)]); break;
        case 2: {  // one value replaced by an extreme one
          const std::size_t colon = text.rfind(':', at);
          if (colon == std::string::npos) break;
          const std::size_t end = std::min(text.find(',', colon), text.size());
          text.replace(colon + 1, end - colon - 1, values[below(values.size())]);
          break;
        }
        case 3: text[at] = static_cast<char>(below(256)); break;
      }
    }
    SCOPED_TRACE(text);
    allocator_config c;
    try {
      c = parse_alloc_conf(text);
    } catch (const logic_error&) {
      ++refused;
      continue;
    } catch (const std::exception& e) {
      FAIL() << "parse threw something other than logic_error: " << e.what();
    }
    ++parsed;
    c.device_capacity = std::min<std::size_t>(c.device_capacity == 0 ? GiB : c.device_capacity, GiB);
    auto device = make_device("null", {.capacity = c.device_capacity});
    try {
      caching_allocator alloc(*device, c);
      for (std::size_t bytes : {std::size_t{1}, 700 * KiB, 5 * MiB, 40 * MiB, 2 * GiB}) {
        try {
          alloc.deallocate(alloc.allocate(bytes));
        } catch (const out_of_memory&) {
        }
      }
      alloc.check_invariants();
    } catch (const logic_error&) {
      // A combination of keys the allocator refuses (its message names them).
    } catch (const std::exception& e) {
      FAIL() << "the allocator threw something other than logic_error: " << e.what();
    }
  }
  EXPECT_GT(parsed, 100u);
  EXPECT_GT(refused, 100u);
  std::printf("[          ] %zu damaged configurations parsed, %zu refused\n", parsed, refused);
}

// ------------------------------------------------------------------------------------- sizes

TEST(ParseSize, PlainNumbersAreBytes) {
  EXPECT_EQ(parse_size("0"), 0u);
  EXPECT_EQ(parse_size("512"), 512u);
  EXPECT_EQ(parse_size("18446744073709551615"), SIZE_MAX);
  EXPECT_EQ(parse_size("  42  "), 42u);
}

TEST(ParseSize, EverySuffixIsBinaryAndCaseInsensitive) {
  struct row {
    const char* suffix;
    std::size_t mult;
  };
  const row rows[] = {{"B", 1},      {"K", KiB},    {"KB", KiB},   {"KiB", KiB},
                      {"M", MiB},    {"MB", MiB},   {"MiB", MiB},  {"G", GiB},
                      {"GB", GiB},   {"GiB", GiB},  {"T", TiB},    {"TB", TiB},
                      {"TiB", TiB},  {"b", 1},      {"k", KiB},    {"kb", KiB},
                      {"kib", KiB},  {"mib", MiB},  {"gB", GiB},   {"TIB", TiB}};
  for (const row& r : rows) {
    EXPECT_EQ(parse_size(std::string("3") + r.suffix), 3 * r.mult) << r.suffix;
    EXPECT_EQ(parse_size(std::string("3 ") + r.suffix), 3 * r.mult) << r.suffix;
  }
}

TEST(ParseSize, DecimalsAreScaledAndFractionalBytesDropped) {
  EXPECT_EQ(parse_size("1.5G"), 3 * GiB / 2);
  EXPECT_EQ(parse_size("1.5KiB"), 1536u);
  EXPECT_EQ(parse_size("0.5M"), 512 * KiB);
  EXPECT_EQ(parse_size("2.0"), 2u);
  EXPECT_EQ(parse_size("0.3K"), 307u);  // 307.2 bytes
  EXPECT_EQ(parse_size("2.25T"), 9 * TiB / 4);
  EXPECT_EQ(parse_size("0.001K"), 1u);  // 1.024 bytes
  EXPECT_EQ(parse_size("0.0"), 0u);     // zero said as a decimal is still zero
}

TEST(ParseSize, AFractionOfAByteIsRefusedNotReadAsZero) {
  // 0 is "the default" for several keys: device_capacity:0.4 became the default 8 GiB.
  EXPECT_NE(size_error_of("0.4").find("less than one byte"), std::string::npos);
  EXPECT_NE(size_error_of("0.0001K").find("less than one byte"), std::string::npos);
  expect_item_error("device_capacity:0.4", "device_capacity:0.4", "less than one byte");
}

TEST(ParseSize, OverflowIsRejected) {
  EXPECT_NE(size_error_of("18446744073709551616").find("does not fit"), std::string::npos);
  EXPECT_NE(size_error_of("16777216T").find("does not fit"), std::string::npos);  // exactly 2^64
  EXPECT_EQ(parse_size("16777215T"), 16777215 * TiB);
  EXPECT_NE(size_error_of("16777216.0T").find("does not fit"), std::string::npos);
  EXPECT_NE(size_error_of("99999999999999999999999999K").find("does not fit"), std::string::npos);
}

TEST(ParseSize, MalformedTextIsRejectedWithTheText) {
  for (std::string_view bad : {"", " ", "K", "abc", "-1", "+1", "1.", ".5", "1..5", "1.2.3",
                               "1e3", "0x10", "1 2", "1KK", "1 KiBs", "inf", "nan", "1,5M"}) {
    const std::string msg = size_error_of(bad);
    EXPECT_NE(msg.find("terrace: "), std::string::npos) << bad << ": " << msg;
    if (!std::string_view(bad).empty() && bad != " ") {
      EXPECT_NE(msg.find(std::string(bad)), std::string::npos) << bad << ": " << msg;
    }
  }
  EXPECT_NE(size_error_of("5 PiB").find("B, K, KB, KiB"), std::string::npos);
}

// ------------------------------------------------------------------------------------- docs

#ifdef TERRACE_SOURCE_DIR
std::string read_source(const char* relative) {
  std::ifstream in(std::string(TERRACE_SOURCE_DIR) + "/" + relative);
  EXPECT_TRUE(in) << "cannot read " << relative;
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// The README's table of keys and the header's `key ...` comments name exactly the keys that the
// parser takes, in its order.
TEST(AllocConfDocs, TheReadmeTableAndTheHeaderListEveryKeyAndNoOther) {
  const std::vector<std::string_view>& keys = alloc_conf_keys();
  const std::string readme = read_source("README.md");
  const std::size_t section = readme.find("## Configuration: TERRACE_ALLOC_CONF");
  ASSERT_NE(section, std::string::npos);
  std::vector<std::string> table;
  std::istringstream lines(readme.substr(section));
  std::string line;
  std::getline(lines, line);  // the heading
  while (std::getline(lines, line) && line.rfind("## ", 0) != 0) {
    if (line.rfind("| `", 0) == 0) table.push_back(line.substr(3, line.find('`', 3) - 3));
  }
  EXPECT_EQ(table, std::vector<std::string>(keys.begin(), keys.end()));

  const std::string header = read_source("include/terrace/config.hpp");
  std::vector<std::string> documented;
  for (std::size_t at = header.find("key `"); at != std::string::npos; at = header.find("key `", at + 1)) {
    documented.push_back(header.substr(at + 5, header.find('`', at + 5) - at - 5));
  }
  EXPECT_EQ(documented, std::vector<std::string>(keys.begin(), keys.end()));
}
#endif

// ------------------------------------------------------------------------------------- env

class AllocConfEnv : public ::testing::Test {
 protected:
  void SetUp() override {
    if (const char* old = std::getenv("TERRACE_ALLOC_CONF")) saved_ = old;
    unsetenv("TERRACE_ALLOC_CONF");
  }
  void TearDown() override {
    if (saved_) {
      setenv("TERRACE_ALLOC_CONF", saved_->c_str(), 1);
    } else {
      unsetenv("TERRACE_ALLOC_CONF");
    }
  }
  std::optional<std::string> saved_;
};

TEST_F(AllocConfEnv, UnsetGivesDefaults) {
  const auto c = alloc_conf_from_env();
  EXPECT_EQ(c.device, "auto");
  EXPECT_EQ(c.small_size, 1 * MiB);
  EXPECT_FALSE(c.record_trace);
}

TEST_F(AllocConfEnv, ReadsTheVariable) {
  ASSERT_EQ(setenv("TERRACE_ALLOC_CONF", "device:null,max_split_size_mb:64,record_trace:true", 1), 0);
  const auto c = alloc_conf_from_env();
  EXPECT_EQ(c.device, "null");
  EXPECT_EQ(c.max_split_size, 64 * MiB);
  EXPECT_TRUE(c.record_trace);
  ASSERT_EQ(setenv("TERRACE_ALLOC_CONF", "", 1), 0);
  EXPECT_EQ(alloc_conf_from_env().device, "auto");
}

// The message alloc_conf_from_env throws with TERRACE_ALLOC_CONF set to `text`.
std::string env_error_of(const char* text) {
  EXPECT_EQ(setenv("TERRACE_ALLOC_CONF", text, 1), 0);
  try {
    alloc_conf_from_env();
  } catch (const logic_error& e) {
    return e.what();
  }
  ADD_FAILURE() << "TERRACE_ALLOC_CONF=" << text << " did not throw";
  return {};
}

TEST_F(AllocConfEnv, ErrorsNameTheVariableTheItemAndTheKeys) {
  std::string msg = env_error_of("device:sim,memory_fraction:2");
  EXPECT_EQ(msg.rfind("terrace: TERRACE_ALLOC_CONF: ", 0), 0u) << msg;
  EXPECT_NE(msg.find("'memory_fraction:2'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("(0, 1]"), std::string::npos) << msg;
  msg = env_error_of("device:sim,memory_fration:0.5");
  EXPECT_EQ(msg.rfind("terrace: TERRACE_ALLOC_CONF: ", 0), 0u) << msg;
  EXPECT_NE(msg.find("did you mean 'memory_fraction'?"), std::string::npos) << msg;
  for (std::string_view key : alloc_conf_keys()) {
    EXPECT_NE(msg.find(key), std::string::npos) << key;
  }
  // parse_alloc_conf itself does not claim the variable.
  EXPECT_EQ(error_of("memory_fraction:2").find("TERRACE_ALLOC_CONF"), std::string::npos);
}

}  // namespace
}  // namespace terrace

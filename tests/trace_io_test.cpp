// SPDX-License-Identifier: Apache-2.0
// Trace JSON lines and snapshot JSON: round trips, every read error, PyTorch's field names.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "terrace/error.hpp"
#include "terrace/trace.hpp"

namespace terrace {
namespace {

using json = nlohmann::json;

const std::vector<trace_action> kAllActions = {
    trace_action::alloc,         trace_action::free_requested, trace_action::free_completed,
    trace_action::segment_alloc, trace_action::segment_free,   trace_action::segment_map,
    trace_action::segment_unmap, trace_action::oom,            trace_action::snapshot,
    trace_action::iteration_begin, trace_action::iteration_end};

std::string read_error_of(const std::string& text) {
  std::istringstream in(text);
  try {
    read_trace_jsonl(in);
  } catch (const logic_error& e) {
    return e.what();
  }
  ADD_FAILURE() << "read_trace_jsonl did not throw on:\n" << text;
  return {};
}

void expect_read_error(const std::string& text, int line, std::string_view problem) {
  SCOPED_TRACE(text);
  const std::string msg = read_error_of(text);
  EXPECT_NE(msg.find("line " + std::to_string(line) + ":"), std::string::npos) << msg;
  EXPECT_NE(msg.find(problem), std::string::npos) << msg;
}

const std::string kGood =
    R"({"action":"alloc","time_ns":1,"stream":0,"addr":4096,"size":512,"requested":100,"tag":"x"})";

// ------------------------------------------------------------------------------------ actions

// PyTorch's names, and two of terrace's own: the caller's iteration marks.
TEST(TraceAction, NamesArePyTorchsAndRoundTrip) {
  const std::vector<std::string_view> names = {
      "alloc",       "free_requested", "free_completed", "segment_alloc",   "segment_free",
      "segment_map", "segment_unmap",  "oom",            "snapshot",        "iteration_begin",
      "iteration_end"};
  ASSERT_EQ(names.size(), kAllActions.size());
  for (std::size_t i = 0; i < names.size(); ++i) {
    EXPECT_EQ(to_string(kAllActions[i]), names[i]);
    EXPECT_EQ(parse_trace_action(names[i]), kAllActions[i]);
  }
}

TEST(TraceAction, UnknownNamesAndValues) {
  EXPECT_EQ(parse_trace_action(""), std::nullopt);
  EXPECT_EQ(parse_trace_action("Alloc"), std::nullopt);
  EXPECT_EQ(parse_trace_action("free"), std::nullopt);
  EXPECT_EQ(parse_trace_action("alloc "), std::nullopt);
  EXPECT_EQ(to_string(static_cast<trace_action>(200)), "unknown");
}

// ------------------------------------------------------------------------------------ JSONL

TEST(TraceJsonl, EveryActionRoundTripsWithAwkwardTags) {
  std::vector<trace_event> events;
  const std::vector<std::string> tags = {
      "", "plain", "with \"quotes\"", "two\nlines\r\n", "tab\tand\\backslash", "{\"json\":1}",
      std::string("nul\0byte", 8), "unicode \xc3\xa9\xe2\x82\xac", "last"};
  std::uint64_t t = 0;
  for (std::size_t i = 0; i < kAllActions.size(); ++i) {
    trace_event e;
    e.action = kAllActions[i];
    e.time_ns = t += 1234567;
    e.stream = static_cast<std::uintptr_t>(i * 7);
    e.addr = UINTPTR_MAX - i;  // full 64-bit values must survive JSON
    e.size = UINT64_MAX - 2 * i;
    e.requested = i * 100;
    e.tag = tags[i % tags.size()];
    events.push_back(e);
  }
  std::ostringstream out;
  write_trace_jsonl(out, events);
  const std::string text = out.str();

  // One line per event, even though tags hold newlines.
  EXPECT_EQ(static_cast<std::size_t>(std::count(text.begin(), text.end(), '\n')), events.size());

  std::istringstream in(text);
  const auto back = read_trace_jsonl(in);
  ASSERT_EQ(back.size(), events.size());
  for (std::size_t i = 0; i < events.size(); ++i) {
    SCOPED_TRACE(i);
    EXPECT_EQ(back[i].action, events[i].action);
    EXPECT_EQ(back[i].time_ns, events[i].time_ns);
    EXPECT_EQ(back[i].stream, events[i].stream);
    EXPECT_EQ(back[i].addr, events[i].addr);
    EXPECT_EQ(back[i].size, events[i].size);
    EXPECT_EQ(back[i].requested, events[i].requested);
    EXPECT_EQ(back[i].tag, events[i].tag);
  }
}

TEST(TraceJsonl, WritesTheDocumentedFields) {
  trace_event e;
  e.action = trace_action::segment_map;
  e.time_ns = 42;
  e.stream = 3;
  e.addr = 0x7f0000000000;
  e.size = 2 << 20;
  e.requested = 0;
  e.tag = "t";
  std::ostringstream out;
  write_trace_jsonl(out, {e});
  const json j = json::parse(out.str());
  EXPECT_EQ(j.size(), 7u);
  EXPECT_EQ(j.at("action"), "segment_map");
  EXPECT_EQ(j.at("time_ns"), 42u);
  EXPECT_EQ(j.at("stream"), 3u);
  EXPECT_EQ(j.at("addr"), 0x7f0000000000u);
  EXPECT_EQ(j.at("size"), 2u << 20);
  EXPECT_EQ(j.at("requested"), 0u);
  EXPECT_EQ(j.at("tag"), "t");
}

TEST(TraceJsonl, EmptyInputAndBlankLines) {
  std::istringstream empty("");
  EXPECT_TRUE(read_trace_jsonl(empty).empty());
  std::istringstream in("\n   \n" + kGood + "\n\t\r\n" + kGood + "\r\n\n");
  const auto events = read_trace_jsonl(in);
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[1].addr, 4096u);
  EXPECT_EQ(events[1].tag, "x");
}

TEST(TraceJsonl, TagAndRequestedAreOptionalAndExtraFieldsIgnored) {
  std::istringstream in(
      R"({"action":"oom","time_ns":9,"stream":1,"addr":0,"size":1073741824,"frames":[]})");
  const auto events = read_trace_jsonl(in);
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].action, trace_action::oom);
  EXPECT_EQ(events[0].size, 1u << 30);
  EXPECT_EQ(events[0].requested, 0u);
  EXPECT_EQ(events[0].tag, "");
}

TEST(TraceJsonl, InvalidUtf8InATagIsReplacedNotFatal) {
  trace_event e;
  e.tag = "bad \xff\xfe tag";
  std::ostringstream out;
  ASSERT_NO_THROW(write_trace_jsonl(out, {e}));
  std::istringstream in(out.str());
  const auto back = read_trace_jsonl(in);
  ASSERT_EQ(back.size(), 1u);
  EXPECT_EQ(back[0].tag.rfind("bad ", 0), 0u);
  EXPECT_NE(back[0].tag.find("\xef\xbf\xbd"), std::string::npos);  // U+FFFD
}

// ------------------------------------------------------------------------------------ read errors

TEST(TraceJsonlErrors, MalformedJsonNamesTheLine) {
  expect_read_error(kGood + "\n" + kGood + "\n{\"action\":\n", 3, "malformed JSON");
  expect_read_error("not json\n", 1, "malformed JSON");
  expect_read_error(kGood + "\n\n" + kGood + " trailing\n", 3, "malformed JSON");
}

TEST(TraceJsonlErrors, NotAnObject) {
  expect_read_error(kGood + "\n[1,2]\n", 2, "expected a JSON object");
  expect_read_error("42\n", 1, "expected a JSON object");
}

// Found in review: the parser takes a line nested 300 000 levels deep without recursing, but
// the error message dumped it, and the serializer recursed once per level: a stack overflow.
TEST(TraceJsonlErrors, ADeeplyNestedLineIsRefusedWithoutQuotingItWhole) {
  constexpr std::size_t kDepth = 300'000;  // the serializer overflowed 8 MiB of stack near 50 000
  for (const bool as_action : {false, true}) {
    const std::string nested = std::string(kDepth, '[') + std::string(kDepth, ']');
    std::istringstream in(as_action ? R"({"action": )" + nested + "}\n" : nested + "\n");
    try {
      read_trace_jsonl(in);
      FAIL() << "a nested line was accepted";
    } catch (const logic_error& e) {
      EXPECT_NE(std::string(e.what()).find("an array of 1 elements"), std::string::npos)
          << std::string(e.what()).substr(0, 200);
    }
  }
}

TEST(TraceJsonlErrors, UnknownOrMistypedAction) {
  expect_read_error(kGood + "\n" +
                        R"({"action":"malloc","time_ns":1,"stream":0,"addr":1,"size":1})",
                    2, "unknown action \"malloc\"");
  expect_read_error(R"({"action":3,"time_ns":1,"stream":0,"addr":1,"size":1})", 1,
                    "field \"action\" must be a string");
}

TEST(TraceJsonlErrors, EveryMissingRequiredField) {
  const json full = json::parse(kGood);
  for (const char* key : {"action", "time_ns", "stream", "addr", "size"}) {
    json j = full;
    j.erase(key);
    expect_read_error(kGood + "\n" + j.dump() + "\n", 2,
                      std::string("missing field \"") + key + "\"");
  }
}

TEST(TraceJsonlErrors, EveryWronglyTypedField) {
  const json full = json::parse(kGood);
  for (const char* key : {"time_ns", "stream", "addr", "size", "requested"}) {
    for (const json& bad : {json("12"), json(-1), json(1.5), json(nullptr), json::array()}) {
      json j = full;
      j[key] = bad;
      expect_read_error(j.dump(), 1, std::string("field \"") + key + "\" must be an unsigned integer");
    }
  }
  for (const json& bad : {json(5), json(nullptr), json::object()}) {
    json j = full;
    j["tag"] = bad;
    expect_read_error(j.dump(), 1, "field \"tag\" must be a string");
  }
}

// ------------------------------------------------------------------------------------ snapshot

memory_snapshot sample_snapshot() {
  memory_snapshot s;
  s.device = 1;
  snapshot_segment small;
  small.addr = 0x10000;
  small.total_size = 2 << 20;
  small.allocated_size = 1024;
  small.active_size = 1536;
  small.requested_size = 1000;
  small.stream = 0;
  small.is_small_pool = true;
  small.blocks = {{0x10000, 1024, 1000, "active_allocated", "w\"1\""},
                  {0x10400, 512, 0, "active_pending_free", ""},
                  {0x10600, (2 << 20) - 1536, 0, "inactive", ""}};
  snapshot_segment large;
  large.addr = 0x7f0000000000;
  large.total_size = 64 << 20;
  large.stream = 0xdeadbeef;
  large.is_expandable = true;
  large.blocks = {{0x7f0000000000, 64 << 20, 0, "unmapped", "line\nbreak"}};
  s.segments = {small, large};
  trace_event a;
  a.action = trace_action::segment_alloc;
  a.time_ns = 1999;
  a.addr = 0x10000;
  a.size = 2 << 20;
  trace_event b;
  b.action = trace_action::alloc;
  b.time_ns = 2'500'000;
  b.addr = 0x10000;
  b.size = 1024;
  b.requested = 1000;
  b.tag = "w\"1\"";
  s.trace = {a, b};
  return s;
}

TEST(SnapshotJson, HasPyTorchsStructureAndFieldNames) {
  std::ostringstream out;
  write_snapshot_json(out, sample_snapshot());
  const json j = json::parse(out.str());
  ASSERT_TRUE(j.is_object());
  EXPECT_EQ(j.size(), 3u);
  EXPECT_EQ(j.at("device"), 1);

  const json& segs = j.at("segments");
  ASSERT_TRUE(segs.is_array());
  ASSERT_EQ(segs.size(), 2u);
  const json& s0 = segs[0];
  for (const char* key : {"address", "total_size", "allocated_size", "active_size",
                          "requested_size", "stream", "segment_type", "is_expandable", "blocks"}) {
    EXPECT_TRUE(s0.contains(key)) << key;
  }
  EXPECT_EQ(s0.size(), 9u);
  EXPECT_EQ(s0.at("address"), 0x10000u);
  EXPECT_EQ(s0.at("total_size"), 2u << 20);
  EXPECT_EQ(s0.at("allocated_size"), 1024u);
  EXPECT_EQ(s0.at("active_size"), 1536u);
  EXPECT_EQ(s0.at("requested_size"), 1000u);
  EXPECT_EQ(s0.at("segment_type"), "small");
  EXPECT_EQ(s0.at("is_expandable"), false);
  ASSERT_EQ(s0.at("blocks").size(), 3u);
  const json& b0 = s0.at("blocks")[0];
  EXPECT_EQ(b0.size(), 5u);
  EXPECT_EQ(b0.at("address"), 0x10000u);
  EXPECT_EQ(b0.at("size"), 1024u);
  EXPECT_EQ(b0.at("requested_size"), 1000u);
  EXPECT_EQ(b0.at("state"), "active_allocated");
  EXPECT_EQ(b0.at("tag"), "w\"1\"");
  EXPECT_EQ(s0.at("blocks")[1].at("state"), "active_pending_free");
  EXPECT_EQ(s0.at("blocks")[2].at("state"), "inactive");

  const json& s1 = segs[1];
  EXPECT_EQ(s1.at("segment_type"), "large");
  EXPECT_EQ(s1.at("is_expandable"), true);
  EXPECT_EQ(s1.at("stream"), 0xdeadbeefu);
  EXPECT_EQ(s1.at("address"), 0x7f0000000000u);
  EXPECT_EQ(s1.at("blocks")[0].at("state"), "unmapped");
  EXPECT_EQ(s1.at("blocks")[0].at("tag"), "line\nbreak");

  const json& traces = j.at("device_traces");
  ASSERT_TRUE(traces.is_array());
  ASSERT_EQ(traces.size(), 1u);  // one device per snapshot
  const json& t = traces[0];
  ASSERT_EQ(t.size(), 2u);
  for (const char* key : {"action", "addr", "size", "requested", "stream", "time_us", "tag"}) {
    EXPECT_TRUE(t[0].contains(key)) << key;
  }
  EXPECT_EQ(t[0].size(), 7u);
  EXPECT_EQ(t[0].at("action"), "segment_alloc");
  EXPECT_EQ(t[0].at("time_us"), 1u);  // 1999 ns: whole microseconds
  EXPECT_EQ(t[1].at("action"), "alloc");
  EXPECT_EQ(t[1].at("time_us"), 2500u);
  EXPECT_TRUE(t[1].at("time_us").is_number());
  EXPECT_EQ(t[1].at("size"), 1024u);
  EXPECT_EQ(t[1].at("requested"), 1000u);
  EXPECT_EQ(t[1].at("tag"), "w\"1\"");
}

TEST(SnapshotJson, EmptySnapshotStillHasEveryList) {
  std::ostringstream out;
  write_snapshot_json(out, memory_snapshot{});
  const json j = json::parse(out.str());
  EXPECT_EQ(j.at("device"), 0);
  EXPECT_TRUE(j.at("segments").is_array());
  EXPECT_TRUE(j.at("segments").empty());
  ASSERT_EQ(j.at("device_traces").size(), 1u);
  EXPECT_TRUE(j.at("device_traces")[0].is_array());
  EXPECT_TRUE(j.at("device_traces")[0].empty());
}

}  // namespace
}  // namespace terrace

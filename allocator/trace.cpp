// SPDX-License-Identifier: Apache-2.0
// Trace events as JSON lines, and snapshots as one JSON document with PyTorch's field names.
//
// Tags come from callers and may hold any bytes. JSON needs UTF-8, so invalid sequences are
// written as U+FFFD rather than failing the whole dump: a trace is a diagnostic and must not be
// lost to one odd tag.

#include "terrace/trace.hpp"

#include <array>
#include <istream>
#include <ostream>
#include <string>

#include <nlohmann/json.hpp>

#include "terrace/error.hpp"

namespace terrace {
namespace {

using json = nlohmann::json;

constexpr std::array<std::string_view, 11> kActionNames = {
    "alloc",        "free_requested", "free_completed", "segment_alloc",   "segment_free",
    "segment_map",  "segment_unmap",  "oom",            "snapshot",        "iteration_begin",
    "iteration_end",
};
static_assert(static_cast<std::size_t>(trace_action::iteration_end) + 1 == kActionNames.size(),
              "kActionNames must follow trace_action");

std::string dump(const json& j) {
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

// A value quoted in an error: scalars as written, an array or object by its size only. The
// serializer recurses once per level, so a line nested a million levels deep (which the parser
// takes without recursion) overflowed the stack while its error was being written.
std::string quote(const json& j) {
  if (j.is_array()) return "an array of " + std::to_string(j.size()) + " elements";
  if (j.is_object()) return "an object of " + std::to_string(j.size()) + " members";
  return dump(j);
}

json event_to_json(const trace_event& e) {
  return json{{"action", to_string(e.action)},
              {"time_ns", e.time_ns},
              {"stream", static_cast<std::uint64_t>(e.stream)},
              {"addr", static_cast<std::uint64_t>(e.addr)},
              {"size", e.size},
              {"requested", e.requested},
              {"tag", e.tag}};
}

[[noreturn]] void bad_line(std::size_t line, const std::string& why) {
  throw logic_error("terrace: trace line " + std::to_string(line) + ": " + why);
}

// A required or optional unsigned field. JSON integers that are >= 0 parse as number_unsigned;
// anything else (negative, fractional, a string) is the wrong type.
std::uint64_t get_u64(const json& j, const char* key, bool required, std::size_t line) {
  const auto it = j.find(key);
  if (it == j.end()) {
    if (required) bad_line(line, std::string("missing field \"") + key + "\"");
    return 0;
  }
  if (!it->is_number_unsigned()) {
    bad_line(line, std::string("field \"") + key + "\" must be an unsigned integer, got " +
                       quote(*it));
  }
  return it->get<std::uint64_t>();
}

}  // namespace

std::string_view to_string(trace_action a) noexcept {
  const auto i = static_cast<std::size_t>(a);
  return i < kActionNames.size() ? kActionNames[i] : std::string_view{"unknown"};
}

std::optional<trace_action> parse_trace_action(std::string_view name) noexcept {
  for (std::size_t i = 0; i < kActionNames.size(); ++i) {
    if (kActionNames[i] == name) return static_cast<trace_action>(i);
  }
  return std::nullopt;
}

void write_trace_jsonl(std::ostream& out, const std::vector<trace_event>& events) {
  for (const trace_event& e : events) out << dump(event_to_json(e)) << '\n';
}

std::vector<trace_event> read_trace_jsonl(std::istream& in) {
  std::vector<trace_event> events;
  std::string text;
  std::size_t line = 0;
  while (std::getline(in, text)) {
    ++line;
    if (text.find_first_not_of(" \t\r\n") == std::string::npos) continue;

    json j;
    try {
      j = json::parse(text);
    } catch (const json::exception& e) {  // parse_error, and out_of_range for a number too large
      bad_line(line, std::string("malformed JSON: ") + e.what());
    }
    if (!j.is_object()) bad_line(line, "expected a JSON object, got " + quote(j));

    trace_event e;
    const auto action = j.find("action");
    if (action == j.end()) bad_line(line, "missing field \"action\"");
    if (!action->is_string()) bad_line(line, "field \"action\" must be a string, got " + quote(*action));
    const auto parsed = parse_trace_action(action->get_ref<const std::string&>());
    if (!parsed) bad_line(line, "unknown action " + quote(*action));
    e.action = *parsed;
    e.time_ns = get_u64(j, "time_ns", true, line);
    e.stream = static_cast<std::uintptr_t>(get_u64(j, "stream", true, line));
    e.addr = static_cast<std::uintptr_t>(get_u64(j, "addr", true, line));
    e.size = get_u64(j, "size", true, line);
    e.requested = get_u64(j, "requested", false, line);
    if (const auto tag = j.find("tag"); tag != j.end()) {
      if (!tag->is_string()) bad_line(line, "field \"tag\" must be a string, got " + quote(*tag));
      e.tag = tag->get<std::string>();
    }
    events.push_back(std::move(e));
  }
  if (in.bad()) throw logic_error("terrace: trace: read error after line " + std::to_string(line));
  return events;
}

void write_snapshot_json(std::ostream& out, const memory_snapshot& s) {
  json segments = json::array();
  for (const snapshot_segment& seg : s.segments) {
    json blocks = json::array();
    for (const snapshot_block& b : seg.blocks) {
      blocks.push_back({{"address", static_cast<std::uint64_t>(b.addr)},
                        {"size", b.size},
                        {"requested_size", b.requested},
                        {"state", b.state},
                        {"tag", b.tag}});
    }
    segments.push_back({{"address", static_cast<std::uint64_t>(seg.addr)},
                        {"total_size", seg.total_size},
                        {"allocated_size", seg.allocated_size},
                        {"active_size", seg.active_size},
                        {"requested_size", seg.requested_size},
                        {"stream", static_cast<std::uint64_t>(seg.stream)},
                        {"segment_type", seg.is_small_pool ? "small" : "large"},
                        {"is_expandable", seg.is_expandable},
                        {"blocks", std::move(blocks)}});
  }
  json trace = json::array();
  for (const trace_event& e : s.trace) {
    // PyTorch records whole microseconds.
    trace.push_back({{"action", to_string(e.action)},
                     {"addr", static_cast<std::uint64_t>(e.addr)},
                     {"size", e.size},
                     {"requested", e.requested},
                     {"stream", static_cast<std::uint64_t>(e.stream)},
                     {"time_us", e.time_ns / 1000},
                     {"tag", e.tag}});
  }
  json doc = {{"device", s.device},
              {"segments", std::move(segments)},
              {"device_traces", json::array({std::move(trace)})}};
  // Not PyTorch fields; written only when the trace has gaps or lacks its start, which a reader
  // should know of.
  if (s.trace_events_lost > 0) doc["trace_events_lost"] = s.trace_events_lost;
  if (s.trace_events_dropped > 0) doc["trace_events_dropped"] = s.trace_events_dropped;
  out << dump(doc) << '\n';
}

}  // namespace terrace

// SPDX-License-Identifier: Apache-2.0
// A snapshot held whole is many times its file: a pickle shares each distinct stack frame (5
// bytes per use) that a document spells out at every use, and JSON's own tree is several times
// the text. Read as events stream by, a snapshot costs its trace_events and, for a pickle, the
// pickle machine's compact values.
#include "tools/snapshot_import.hpp"

#include <algorithm>
#include <utility>

#include "terrace/error.hpp"
#include "tools/import_values.hpp"
#include "tools/pickle_reader.hpp"
#include "tools/trace_input.hpp"

namespace terrace::tools {

namespace {

using json = nlohmann::json;

// Frames only label blocks: a frame field of the wrong type is left out like a missing one, as a
// frame that is not a dict is.
std::string frame_field(const json& frame, const char* key, const char* missing) {
  const auto it = frame.find(key);
  if (it == frame.end()) return missing;
  if (it->is_string()) return it->get<std::string>();
  if (it->is_number_integer()) return std::to_string(it->get<std::int64_t>());
  return missing;
}

std::string frames_text(const json& frames) {
  if (!frames.is_array()) return {};
  // The innermost frames that are not PyTorch's own are the useful ones; keep the first two.
  std::string out;
  int kept = 0;
  for (const auto& f : frames) {
    if (!f.is_object()) continue;
    const std::string file = frame_field(f, "filename", "");
    // tools/terrace_to_torch_snapshot.py writes a terrace tag as this one frame: the tag again.
    if (file == "<terrace tag>" && kept == 0) return frame_field(f, "name", "");
    if (file.find("torch/") != std::string::npos && kept == 0 && frames.size() > 1) continue;
    if (!out.empty()) out += " < ";
    out += frame_field(f, "name", "?") + " " + file + ":" + frame_field(f, "line", "0");
    if (++kept == 2) break;
  }
  return out;
}

// Every event carries its stack as a list of frame dicts; only the frames' text is used, so each
// list becomes it as soon as it is complete.
const value_digest& frames_digest() {
  static const value_digest digest{"frames", [](const json& f) { return f.is_string() ? f : json(frames_text(f)); }};
  return digest;
}

trace_event snapshot_event(const json& e, const std::string& where) {
  if (!e.is_object() || !e.contains("action")) throw logic_error(where + ": no action");
  const json& a = e.at("action");
  const auto action = a.is_string() ? parse_trace_action(a.get<std::string>()) : std::nullopt;
  if (!action) throw logic_error(where + ": unknown action " + quote(a));
  trace_event ev;
  ev.action = *action;
  ev.addr = e.contains("addr") ? as_u64(e.at("addr"), where + " addr") : 0;
  ev.size = e.contains("size") ? as_u64(e.at("size"), where + " size", kMaxTraceSize) : 0;
  ev.requested = ev.size;
  ev.stream = e.contains("stream") ? as_u64(e.at("stream"), where + " stream") : 0;
  if (e.contains("time_us")) {
    ev.time_ns = as_u64(e.at("time_us"), where + " time_us", UINT64_MAX / 1000) * 1000;
  }
  if (e.contains("tag") && e.at("tag").is_string()) ev.tag = e.at("tag").get<std::string>();
  if (ev.tag.empty() && e.contains("frames")) {
    const json& f = e.at("frames");  // digested to its text as it was read
    ev.tag = f.is_string() ? f.get<std::string>() : frames_text(f);
  }
  return ev;
}

}  // namespace

snapshot_reader::snapshot_reader(std::string source)
    : source_(std::move(source)), capture_(&frames_digest()) {}

bool snapshot_reader::is_one_trace_event() const {
  return root_is_object_ && root_has_action_ && !has_traces_ && !has_segments_;
}

// ---- the SAX events: a captured value's go to its builder; the rest place themselves.

bool snapshot_reader::value(json v) {
  return captures(shape::scalar) ? forwarded(capture_.scalar(std::move(v))) : true;
}
bool snapshot_reader::start_object(std::size_t n) {
  return captures(shape::object) ? forwarded(capture_.start_object(n)) : true;
}
bool snapshot_reader::start_array(std::size_t n) {
  return captures(shape::array) ? forwarded(capture_.start_array(n)) : true;
}
bool snapshot_reader::end_object() { return capturing_ ? forwarded(capture_.end_object()) : close(); }
bool snapshot_reader::end_array() { return capturing_ ? forwarded(capture_.end_array()) : close(); }
bool snapshot_reader::key(string_t& k) {
  if (capturing_) return capture_.key(k);
  if (!open_.empty() && open_.back() == role::root && k == "action") root_has_action_ = true;
  key_ = std::move(k);
  return true;
}

bool snapshot_reader::close() {
  open_.pop_back();
  return true;
}

// Where a value starting outside a capture sits decides what becomes of it: captured whole (a
// trace event, a segment's size or device), kept track of (a container on the way to those), or
// skipped. A key given twice counts as its last value, as when the document is read whole:
// device_traces and segments start over.
bool snapshot_reader::captures(shape s) {
  if (capturing_) return true;
  const bool list = s == shape::array;
  const bool object = s == shape::object;
  role r = role::skipped;
  const role parent = open_.empty() ? role::skipped : open_.back();
  if (open_.empty()) {
    root_is_object_ = object;
    if (object) r = role::root;
  } else if (parent == role::root && (key_ == "device_traces" || key_ == "segments")) {
    if (key_ == "device_traces") {
      has_traces_ = true;
      traces_is_list_ = list;
      devices_.clear();
      if (list) r = role::traces;
    } else {
      has_segments_ = true;
      segments_is_list_ = list;
      segments_.clear();
      if (list) r = role::segments;
    }
  } else if (parent == role::traces) {
    devices_.emplace_back().is_list = list;
    if (list) r = role::device_trace;
  } else if (parent == role::segments) {
    segments_.push_back(object ? json::object() : json());
    if (object) r = role::segment;
  } else if (parent == role::device_trace ||
             (parent == role::segment && (key_ == "total_size" || key_ == "device"))) {
    capturing_ = true;
    capture_is_event_ = parent == role::device_trace;
    capture_key_ = key_;
    return true;
  }
  if (s != shape::scalar) open_.push_back(r);
  return false;
}

bool snapshot_reader::forwarded(bool go_on) {
  if (capture_.depth() == 0) {
    capturing_ = false;
    captured(capture_.take());
  }
  return go_on;
}

void snapshot_reader::captured(json v) {
  if (capture_is_event_) return add_event(v);
  segments_.back()[capture_key_] = std::move(v);
}

// Each device's events are converted as they come, up to the first that fails: which device is
// replayed (and so whether that failure matters) is known only at the end.
void snapshot_reader::add_event(const json& e) {
  device_trace& d = devices_.back();
  const std::size_t i = d.count++;
  if (d.error) return;
  const std::string where = source_ + ": device_traces[" + std::to_string(devices_.size() - 1) +
                            "][" + std::to_string(i) + "]";
  try {
    d.events.push_back(per_event(where, [&] { return snapshot_event(e, where); }));
  } catch (const logic_error& x) {
    d.error = x.what();
  }
}

imported_trace snapshot_reader::finish(std::string format) && {
  imported_trace t;
  t.format = std::move(format);
  if (!root_is_object_) throw logic_error(source_ + ": a snapshot is a dict/object");
  // Any other object would read as an empty trace, and a wrong file as a trace with nothing in it.
  if (!has_traces_ && !has_segments_) {
    throw logic_error(source_ + ": not a snapshot (it has neither device_traces nor segments)");
  }
  // The device whose trace is longest: snapshots list one (possibly empty) trace per device.
  device_trace* trace = nullptr;
  int device = 0;
  if (has_traces_) {
    if (!traces_is_list_) throw logic_error(source_ + ": device_traces is not a list");
    std::string counts;  // of the devices with events
    std::size_t busy = 0;
    for (std::size_t d = 0; d < devices_.size(); ++d) {
      const device_trace& tr = devices_[d];
      if (!tr.is_list) throw logic_error(source_ + ": device_traces[" + std::to_string(d) + "] is not a list");
      if (trace == nullptr || tr.count > trace->count) {
        trace = &devices_[d];
        device = static_cast<int>(d);
      }
      if (tr.count > 0) {
        ++busy;
        counts += (counts.empty() ? "" : ", ") + std::to_string(tr.count) + " on device " +
                  std::to_string(d);
      }
    }
    if (busy > 1) {
      t.notes.push_back(source_ + ": trace events on " + std::to_string(busy) + " devices (" +
                        counts + "); replaying device " + std::to_string(device) +
                        ", the one with the most events");
    }
  }
  std::int64_t seg_delta = 0, seg_running = 0, seg_peak_rel = 0;
  if (trace != nullptr) {
    for (std::size_t i = 0; i < trace->events.size(); ++i) {
      const trace_event& ev = trace->events[i];
      const auto size = static_cast<std::int64_t>(ev.size);
      // Each size is at most kMaxTraceSize, but a run of them must not overflow the totals either.
      const bool grows =
          ev.action == trace_action::segment_alloc || ev.action == trace_action::segment_map;
      const bool shrinks =
          ev.action == trace_action::segment_free || ev.action == trace_action::segment_unmap;
      if ((grows && __builtin_add_overflow(seg_running, size, &seg_running)) ||
          (shrinks && __builtin_sub_overflow(seg_running, size, &seg_running))) {
        throw logic_error(source_ + ": device_traces[" + std::to_string(device) + "][" +
                          std::to_string(i) + "]: the segment events' sizes add up past 2^63 bytes");
      }
      seg_peak_rel = std::max(seg_peak_rel, seg_running);
    }
    if (trace->error) throw logic_error(*trace->error);
    seg_delta = seg_running;
    t.events = std::move(trace->events);
  }
  if (has_segments_) {
    if (!segments_is_list_) throw logic_error(source_ + ": segments is not a list");
    std::int64_t now = 0;
    for (std::size_t i = 0; i < segments_.size(); ++i) {
      const json& s = segments_[i];
      if (!s.is_object() || !s.contains("total_size")) {
        throw logic_error(source_ + ": segments[" + std::to_string(i) + "] has no total_size");
      }
      // PyTorch's segments name their device: only the replayed device's count.
      if (const auto d = s.find("device"); has_traces_ && d != s.end() &&
                                           d->is_number_integer() && *d != device) {
        continue;
      }
      const std::uint64_t size = as_u64(s.at("total_size"), source_ + ": segments[" +
                                        std::to_string(i) + "] total_size", kMaxTraceSize);
      if (size > kMaxTraceSize - static_cast<std::uint64_t>(now)) {
        throw logic_error(source_ + ": segments add up to more than " +
                          std::to_string(kMaxTraceSize) + " bytes");
      }
      now += static_cast<std::int64_t>(size);
    }
    t.torch_reserved_now = now;
    // Reserved at the window's start was `now` minus what the trace's segment events added.
    std::int64_t before = 0, peak = 0;
    if (__builtin_sub_overflow(now, seg_delta, &before) ||
        __builtin_add_overflow(before, seg_peak_rel, &peak)) {
      throw logic_error(source_ + ": the segments and the segment events disagree past 2^63 bytes");
    }
    t.torch_reserved_peak = std::max(now, peak);
  }
  return t;
}

imported_trace torch_snapshot_json(std::istream& text, const std::string& source) {
  snapshot_reader reader(source);
  // parse_error, and out_of_range for a number too large, come to parse_error().
  if (!json::sax_parse(text, &reader)) throw logic_error(source + ": malformed JSON: " + reader.error);
  return std::move(reader).finish("torch-snapshot-json");
}

imported_trace parse_torch_snapshot_json(std::string_view text, const std::string& source) {
  view_istream in(text);
  return torch_snapshot_json(in, source);
}

imported_trace parse_torch_snapshot_pickle(std::string_view bytes, const std::string& source) {
  snapshot_reader reader(source);
  read_pickle(bytes, source, reader);
  return std::move(reader).finish("torch-snapshot-pickle");
}

}  // namespace terrace::tools

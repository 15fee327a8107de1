// SPDX-License-Identifier: Apache-2.0
// The HTML report. Charts are inline SVG written here (line charts and a segment strip): no script
// runs, so the page has nothing to fail at load and renders the same offline and in any browser.
#include "tools/html_report.hpp"

#include <algorithm>
#include <fmt/format.h>
#include <string_view>
#include <unordered_map>
#include <unordered_set>

#include "terrace/config.hpp"
#include "tools/replay_format.hpp"

namespace terrace::tools {

namespace {

const char* const kColors[] = {"#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e"};

std::string esc(const std::string& s) {
  std::string o;
  for (char c : s) {
    switch (c) {
      case '<': o += "&lt;"; break;
      case '>': o += "&gt;"; break;
      case '&': o += "&amp;"; break;
      case '"': o += "&quot;"; break;
      // Control characters (a NUL from a trace's "\u0000", an escape sequence) are not allowed in
      // HTML, not even as character references: shown as U+FFFD, as a browser would.
      case '\t': case '\n': case '\r': o += c; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20 || c == '\x7f') {
          o += "\uFFFD";
        } else {
          o += c;
        }
    }
  }
  return o;
}

// A tag or stack as the page shows it: at most 200 bytes (cut at a UTF-8 character boundary),
// escaped. Frames from a trace can be any length, and each appears twice on the page.
std::string shown_tag(const std::string& tag) {
  constexpr std::size_t kMax = 200;
  if (tag.size() <= kMax) return esc(tag);
  std::size_t cut = kMax;
  while (cut > 0 && (static_cast<unsigned char>(tag[cut]) & 0xC0) == 0x80) --cut;
  return esc(tag.substr(0, cut)) + "\u2026";
}

struct series {
  std::string name, color;
  bool dashed = false;
  std::vector<std::pair<double, double>> pts;  // (event, value)
};

// A line chart with axes, ticks and a legend; y in GiB or a fraction.
std::string line_chart(const std::string& title, const std::vector<series>& all, bool fraction) {
  const double w = 900, h = 300, l = 70, r = 20, t = 30, b = 40;
  double xmax = 1, ymax = fraction ? 1.0 : 1.0;
  if (!fraction) ymax = 0;
  for (const auto& s : all) {
    for (const auto& [x, y] : s.pts) {
      xmax = std::max(xmax, x);
      if (!fraction) ymax = std::max(ymax, y);
    }
  }
  if (ymax <= 0) ymax = 1;
  auto X = [&](double x) { return l + (w - l - r) * x / xmax; };
  auto Y = [&](double y) { return h - b - (h - t - b) * y / ymax; };
  std::string o = fmt::format(
      "<svg class=\"chart\" viewBox=\"0 0 {} {}\" width=\"{}\" height=\"{}\" role=\"img\" "
      "aria-label=\"{}\"><text x=\"{}\" y=\"18\" class=\"title\">{}</text>",
      w, h, w, h, esc(title), l, esc(title));
  for (int k = 0; k <= 4; ++k) {
    const double v = ymax * k / 4;
    const std::string label = fraction ? fmt::format("{:.0f}%", v * 100)
                                       : format_bytes(static_cast<std::int64_t>(v));
    o += fmt::format(
        "<line x1=\"{}\" y1=\"{:.1f}\" x2=\"{}\" y2=\"{:.1f}\" class=\"grid\"/>"
        "<text x=\"{}\" y=\"{:.1f}\" class=\"tick\" text-anchor=\"end\">{}</text>",
        l, Y(v), w - r, Y(v), l - 6, Y(v) + 4, esc(label));
  }
  o += fmt::format("<text x=\"{}\" y=\"{}\" class=\"tick\" text-anchor=\"middle\">trace event</text>",
                   (l + w - r) / 2, h - 8);
  o += fmt::format("<text x=\"{}\" y=\"{}\" class=\"tick\">0</text><text x=\"{}\" y=\"{}\" "
                   "class=\"tick\" text-anchor=\"end\">{:.0f}</text>",
                   l, h - b + 16, w - r, h - b + 16, xmax);
  double ly = t + 8;
  for (const auto& s : all) {
    std::string path;
    for (const auto& [x, y] : s.pts) path += fmt::format("{:.1f},{:.1f} ", X(x), Y(std::min(y, ymax)));
    o += fmt::format("<polyline fill=\"none\" stroke=\"{}\" stroke-width=\"1.6\"{} points=\"{}\"/>",
                     s.color, s.dashed ? " stroke-dasharray=\"5,3\"" : "", path);
    o += fmt::format("<rect x=\"{}\" y=\"{:.0f}\" width=\"14\" height=\"3\" fill=\"{}\"/>"
                     "<text x=\"{}\" y=\"{:.0f}\" class=\"tick\">{}</text>",
                     w - r - 250, ly, s.color, w - r - 230, ly + 4, esc(s.name));
    ly += 14;
  }
  return o + "</svg>";
}

// The segments at the peak as horizontal strips, blocks coloured by state.
std::string segment_map(const memory_snapshot& snap) {
  if (snap.segments.empty()) return "<p>No segments.</p>";
  std::vector<const snapshot_segment*> segs;
  for (const auto& s : snap.segments) segs.push_back(&s);
  std::sort(segs.begin(), segs.end(),
            [](auto* a, auto* b) { return a->total_size > b->total_size; });
  const std::size_t shown = std::min<std::size_t>(segs.size(), 60);
  const double w = 900, row = 16, label = 150;
  std::uint64_t largest = segs.front()->total_size;
  if (largest == 0) return "<p>No segments.</p>";
  std::string o = fmt::format(
      "<svg class=\"chart\" viewBox=\"0 0 {} {}\" width=\"{}\" height=\"{}\" role=\"img\" "
      "aria-label=\"segment map\">",
      w, row * static_cast<double>(shown) + 10, w, row * static_cast<double>(shown) + 10);
  for (std::size_t i = 0; i < shown; ++i) {
    const snapshot_segment& s = *segs[i];
    const double y = 4 + row * static_cast<double>(i);
    const double scale = (w - label - 10) / static_cast<double>(largest);
    o += fmt::format("<text x=\"0\" y=\"{:.0f}\" class=\"tick\">{}{}</text>", y + 11,
                     esc(format_bytes(static_cast<std::int64_t>(s.total_size))),
                     s.blocks.size() == 1 || s.allocated_size == 0 ? "" : "");
    // Neighbouring blocks narrower than a pixel are drawn as one rectangle up to a pixel wide,
    // "mixed" when their states differ: a segment of a million small blocks would otherwise be a
    // million sub-pixel rectangles (many megabytes of page), and blocks alternately live and
    // free would never join if only blocks of one state did.
    struct run {
      const snapshot_block* first = nullptr;
      const char* cls = nullptr;
      double x = 0, end = 0;
      std::size_t blocks = 0;
      std::uint64_t bytes = 0, live_bytes = 0;
    } r;
    const auto flush = [&] {
      if (r.blocks == 0) return;
      const std::string title =
          r.blocks == 1 ? esc(format_bytes(static_cast<std::int64_t>(r.bytes))) + " " + esc(r.first->state) +
                              (r.first->tag.empty() ? "" : " " + shown_tag(r.first->tag))
          : std::string_view(r.cls) == "mixed"
              ? fmt::format("{} blocks, {}, {} of it live", r.blocks,
                            esc(format_bytes(static_cast<std::int64_t>(r.bytes))),
                            esc(format_bytes(static_cast<std::int64_t>(r.live_bytes))))
              : fmt::format("{} blocks, {} {}", r.blocks,
                            esc(format_bytes(static_cast<std::int64_t>(r.bytes))), esc(r.first->state));
      o += fmt::format("<rect x=\"{:.1f}\" y=\"{:.0f}\" width=\"{:.1f}\" height=\"12\" class=\"{}\">"
                       "<title>{}</title></rect>",
                       r.x, y, std::max(0.5, r.end - r.x), r.cls, title);
      r = run{};
    };
    for (const auto& b : s.blocks) {
      if (b.addr < s.addr) continue;
      const double x = label + scale * static_cast<double>(b.addr - s.addr);
      const double bw = scale * static_cast<double>(b.size);
      const char* cls = b.state == "active_allocated" ? "live"
                        : b.state == "inactive"        ? "free"
                        : b.state == "unmapped"        ? "unmapped"
                                                       : "pending";
      const bool joins = r.blocks > 0 && bw < 1.0 && r.end - r.x < 1.0;
      if (!joins) {
        flush();
        r.first = &b;
        r.cls = cls;
        r.x = x;
      } else if (r.cls != cls) {
        r.cls = "mixed";
      }
      r.end = x + bw;
      ++r.blocks;
      r.bytes += b.size;
      if (std::string_view(cls) == "live") r.live_bytes += b.size;
    }
    flush();
  }
  o += "</svg>";
  if (shown < segs.size()) o += fmt::format("<p>{} smaller segments not shown.</p>", segs.size() - shown);
  return o;
}

}  // namespace

report_input make_report_input(const std::vector<trace_event>& events, const replay_options& base,
                               std::string trace_path, std::string format,
                               std::optional<std::int64_t> torch_reserved_peak) {
  report_input in;
  in.trace_path = std::move(trace_path);
  in.format = std::move(format);
  in.torch_reserved_peak = torch_reserved_peak;
  replay_options timelines = base;
  timelines.timeline_points = 400;
  in.runs = replay_policies(events, timelines);
  const replay_result& caching = in.runs.front().second;
  // The segment map: the caching policy replayed up to its peak of live bytes. That may come
  // before the first event (the pre-existing blocks alone), so the stop is a count of events.
  replay_options at_peak = base;
  at_peak.config = parse_alloc_conf("policy:caching", base.config);
  at_peak.timeline_points = 0;
  at_peak.stop_after_event = caching.peak_live_after_events;
  replay_result stopped = replay(events, at_peak);
  if (stopped.snapshot_at_stop) in.segments_at_peak = std::move(*stopped.snapshot_at_stop);
  in.holders = largest_holders(events, caching.peak_live_after_events, 20, caching.unplaced_events);
  return in;
}

std::vector<holder> largest_holders(const std::vector<trace_event>& events, std::size_t events_done,
                                    std::size_t n, const std::vector<std::size_t>& unplaced) {
  // A free of an address the window has not seen yet is a block from before the window: it was
  // live from the start until that free (the replay allocates it up front, with its free's size),
  // so it is a holder once `events_done` events have happened when its free comes later. The
  // whole trace is read for those.
  std::unordered_map<std::uintptr_t, holder> live;
  std::unordered_set<std::uintptr_t> seen;  // addresses allocated or freed so far
  // A block the replay could not place (out of memory) was never live: it is in no peak.
  const std::unordered_set<std::size_t> never_held(unplaced.begin(), unplaced.end());
  for (std::size_t i = 0; i < events.size(); ++i) {
    const trace_event& e = events[i];
    const std::uint64_t bytes = e.requested != 0 ? e.requested : e.size;
    if (e.action == trace_action::alloc) {
      seen.insert(e.addr);
      if (i < events_done && never_held.count(i) == 0) live[e.addr] = {e.addr, bytes, e.tag};
    } else if (e.action == trace_action::free_requested) {
      if (seen.insert(e.addr).second) {
        if (i >= events_done && bytes != 0 && never_held.count(i) == 0) {
          live[e.addr] = {e.addr, bytes, "pre-existing"};
        }
      } else if (i < events_done) {
        live.erase(e.addr);
      }
    }
  }
  std::vector<holder> out;
  for (auto& [a, h] : live) out.push_back(h);
  std::sort(out.begin(), out.end(), [](const holder& a, const holder& b) {
    return a.bytes != b.bytes ? a.bytes > b.bytes : a.addr < b.addr;
  });
  if (out.size() > n) out.resize(n);
  return out;
}

std::string report_summary(const report_input& in) {
  std::string o = fmt::format("trace {} ({})\n", in.trace_path, in.format);
  for (const auto& [name, r] : in.runs) {
    o += fmt::format(
        "{:<11} peak live {:>11}  peak reserved {:>11}  fragmentation {:5.1f}%  steady-state "
        "reserved {:>11} ({:4.1f}% unused, {:4.1f}% not requested)  device allocs {:>6}",
        name, format_bytes(r.peak_allocated_bytes), format_bytes(r.peak_reserved_bytes),
        100 * r.fragmentation, format_bytes(r.steady_peak_reserved_bytes),
        100 * r.steady_fragmentation,
        100 * unused_fraction(r.steady_peak_requested_bytes, r.steady_peak_reserved_bytes),
        r.device_allocs);
    if (r.plan.enabled) {
      o += fmt::format("  planned hit rate {:.1f}%  arena {} (lower bound {})",
                       100 * r.plan.hit_rate(), format_bytes(r.plan.arena_bytes),
                       format_bytes(r.plan.lower_bound_bytes));
    }
    // The peaks count only what was allocated: without this a trace too large for the device
    // would read as a smaller one.
    if (r.ooms > 0) {
      o += fmt::format("  {} OOM{} (a failed allocation{}, not in the peaks)", r.ooms,
                       r.ooms == 1 ? "" : "s", r.ooms == 1 ? "" : "s");
    }
    if (r.preexisting_unplaced > 0) {
      o += fmt::format("  {} pre-existing block{} the device could not hold (not in the peaks)",
                       r.preexisting_unplaced, r.preexisting_unplaced == 1 ? "" : "s");
    }
    o += "\n";
  }
  // A snapshot whose segment list is empty says nothing of what PyTorch reserved (as in compare).
  if (in.torch_reserved_peak && *in.torch_reserved_peak > 0) {
    o += fmt::format("PyTorch itself reserved {} at its peak\n", format_bytes(*in.torch_reserved_peak));
  }
  return o;
}

std::string render_html_report(const report_input& in) {
  std::vector<series> timeline, frag;
  std::size_t c = 0;
  for (const auto& [name, r] : in.runs) {
    const std::string color = kColors[c++ % 5];
    series live{name + " live", color, false, {}}, res{name + " reserved", color, true, {}};
    series f{name, color, false, {}};
    std::int64_t peak_live = 0, peak_res = 0;
    for (const auto& p : r.timeline) {
      live.pts.emplace_back(static_cast<double>(p.after_events), static_cast<double>(p.live_bytes));
      res.pts.emplace_back(static_cast<double>(p.after_events), static_cast<double>(p.reserved_bytes));
      // Fragmentation so far: 1 - peak live / peak reserved up to this event (GMLake's figure).
      peak_live = std::max(peak_live, p.live_bytes);
      peak_res = std::max(peak_res, p.reserved_bytes);
      f.pts.emplace_back(static_cast<double>(p.after_events), unused_fraction(peak_live, peak_res));
    }
    if (c == 1) timeline.push_back(live);
    timeline.push_back(res);
    frag.push_back(f);
  }
  std::string o =
      "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>terrace memory "
      "report</title><style>body{font:14px sans-serif;margin:24px;max-width:960px}"
      "pre{background:#f6f6f6;padding:8px;overflow-x:auto}table{border-collapse:collapse}"
      "td,th{border:1px solid #ccc;padding:2px 6px;text-align:right}td.t{text-align:left}"
      ".grid{stroke:#e5e5e5}.tick{font-size:11px;fill:#444}.title{font-size:13px;font-weight:bold}"
      ".live{fill:#d62728}.free{fill:#bde0bd}.pending{fill:#ffbf00}.unmapped{fill:#eee}"
      ".mixed{fill:#e99a9a}"
      "</style></head><body>\n<h1>terrace memory report</h1>\n<h2>Summary</h2>\n<pre id=\"summary\">";
  o += esc(report_summary(in)) + "</pre>\n";
  o += "<h2>Live vs reserved bytes</h2>\n" +
       line_chart("live (solid) and reserved (dashed) per policy", timeline, false) + "\n";
  o += "<h2>Fragmentation over time</h2>\n" +
       line_chart("1 - peak live / peak reserved so far", frag, true) + "\n";
  o += "<h2>Segment map at peak requested (caching policy)</h2>\n<p>When the callers' live bytes "
       "peaked (the same moment under every policy). Red: live blocks; green: free cached; amber: "
       "waiting on other streams; pink: blocks of several states too small to draw apart. Largest "
       "segments first.</p>\n" +
       segment_map(in.segments_at_peak) + "\n";
  o += "<h2>Largest holders at peak requested</h2>\n<table><tr><th>size</th><th>address</th><th>tag or "
       "frames</th></tr>";
  for (const auto& h : in.holders) {
    o += fmt::format("<tr><td>{}</td><td>0x{:x}</td><td class=\"t\">{}</td></tr>",
                     esc(format_bytes(static_cast<std::int64_t>(h.bytes))), h.addr, shown_tag(h.tag));
  }
  o += "</table>\n</body></html>\n";
  return o;
}

}  // namespace terrace::tools

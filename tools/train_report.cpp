// SPDX-License-Identifier: Apache-2.0
// The memory report of `terrace train`: the device allocator's trace, recorded live during
// training, drawn by the profiler's HTML report (the page `terrace report` writes for a trace
// file). The trace is replayed under the three policies over the null backend, exactly as
// `terrace report` does, so the page compares what the run reserved with what expandable segments
// and the planned policy would have.
#include <fstream>
#include <stdexcept>

#include "tools/html_report.hpp"
#include "tools/replay.hpp"
#include "tools/train.hpp"

namespace terrace::tools {

std::string write_memory_report(const memory_snapshot& recorded, const allocator_config& config,
                                const std::filesystem::path& path, const std::string& title) {
  const std::vector<trace_event>& events = recorded.trace;
  // Every policy replays the run's own settings (the engine's exact-size segments), so that the
  // page compares policies, not settings: caching is then what the run reserved.
  const auto options_for = [&](alloc_policy policy) {
    replay_options o;
    o.device = "null";
    o.config = config;
    o.config.record_trace = false;
    o.config.policy = policy;
    o.config.expandable_segments = policy == alloc_policy::expandable;
    o.timeline_points = 400;
    return o;
  };
  report_input in;
  in.trace_path = title;
  in.format = "terrace trace (recorded live by terrace train)";
  // Planned first: its first planned iteration marks the steady state, over which the other
  // policies are then measured too (the same window; see `terrace compare`).
  replay_result planned = replay(events, options_for(alloc_policy::planned));
  const std::size_t steady = planned.steady_from_event < events.size() ? planned.steady_from_event : 0;
  for (alloc_policy p : {alloc_policy::caching, alloc_policy::expandable}) {
    auto o = options_for(p);
    o.steady_from_event = steady;
    in.runs.emplace_back(std::string(to_string(p)), replay(events, o));
  }
  in.runs.emplace_back("planned", std::move(planned));
  const replay_result& caching = in.runs.front().second;
  // The segment map: the caching policy replayed up to just after its peak-live event.
  auto at_peak_options = options_for(alloc_policy::caching);
  at_peak_options.timeline_points = 0;
  at_peak_options.stop_after_event = caching.peak_live_event + 1;
  auto at_peak = replay(events, at_peak_options);
  if (at_peak.snapshot_at_stop) in.segments_at_peak = std::move(*at_peak.snapshot_at_stop);
  in.holders = largest_holders(events, caching.peak_live_event, 20);

  std::ofstream out(path, std::ios::binary);
  if (!out) throw std::runtime_error("cannot write the memory report '" + path.string() + "'");
  out << render_html_report(in);
  out.close();
  if (!out) throw std::runtime_error("cannot write the memory report '" + path.string() + "'");
  return report_summary(in);
}

}  // namespace terrace::tools

// SPDX-License-Identifier: Apache-2.0
#include "tools/replay_format.hpp"

#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "terrace/stats.hpp"

namespace terrace::tools {

std::string format_bytes(std::int64_t bytes) {
  constexpr const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while ((v >= 1024.0 || v <= -1024.0) && u < 4) {
    v /= 1024.0;
    ++u;
  }
  return u == 0 ? fmt::format("{} B", bytes) : fmt::format("{:.2f} {}", v, units[u]);
}

std::string format_replay_text(const replay_result& r, const replay_context& c) {
  std::string out;
  auto line = [&out](std::string_view label, const std::string& value) {
    fmt::format_to(std::back_inserter(out), "  {:<22}{}\n", label, value);
  };
  fmt::format_to(std::back_inserter(out), "replay of {} on the {} device{}{}\n", c.trace_path,
                 r.device, c.expandable ? ", expandable segments" : "",
                 c.conf.empty() ? std::string() : ", conf " + c.conf);
  line("events", fmt::format("{} in the trace, {} replayed ({} allocs, {} frees), {}{}{} other actions "
                             "skipped",
                             r.events_total, r.events_replayed, r.allocs,
                             // Every replayed event that is not an alloc is a free: those of
                             // failed allocs and of blocks from before the window included.
                             r.events_replayed - r.allocs,
                             r.iteration_marks > 0
                                 ? fmt::format("{} iteration marks passed on, ", r.iteration_marks)
                                 : std::string(),
                             // Else in no count: the figures would not add up to the trace's.
                             r.preexisting_skipped == 1
                                 ? std::string("1 free of a block from before the window skipped "
                                               "(no size, or not accounted), ")
                             : r.preexisting_skipped > 1
                                 ? fmt::format("{} frees of blocks from before the window skipped "
                                               "(no size, or not accounted), ",
                                               r.preexisting_skipped)
                                 : std::string(),
                             r.skipped_events));
  line("pre-existing frees", fmt::format("{} (freed addresses allocated before the window)",
                                         r.preexisting_frees));
  // Said apart from the OOMs below, which are the trace's own requests: a block the job held
  // before the window and the device cannot hold is missing from every peak.
  line("pre-existing blocks",
       r.preexisting_unplaced == 0
           ? fmt::format("{} allocated up front", r.preexisting_allocs)
           : fmt::format("{} allocated up front, {} could not be placed (out of memory; not in the "
                         "peaks)",
                         r.preexisting_allocs, r.preexisting_unplaced));
  line("streams", fmt::format("{}", r.streams));
  line("peak live requested", fmt::format("{} ({} B)", format_bytes(r.peak_requested_bytes),
                                          r.peak_requested_bytes));
  line("peak live allocated", fmt::format("{} ({} B)", format_bytes(r.peak_allocated_bytes),
                                          r.peak_allocated_bytes));
  line("peak reserved", fmt::format("{} ({} B)", format_bytes(r.peak_reserved_bytes),
                                    r.peak_reserved_bytes));
  line("fragmentation", fmt::format("{:.2f} % (1 - peak allocated / peak reserved)",
                                    100.0 * r.fragmentation));
  line("device allocations", fmt::format("{}", r.device_allocs));
  line("OOMs", fmt::format("{}", r.ooms));
  line("live at end", fmt::format("{} blocks", r.live_at_end));
  line("policy", r.policy);
  if (r.plan.enabled) {
    line("planned hit rate",
         fmt::format("{:.2f} % ({} of {} allocations under a plan; {} plans, arena {} for a lower "
                     "bound of {})",
                     100.0 * r.plan.hit_rate(), r.plan.planned_hits, r.plan.allocs_under_plan,
                     r.plan.plans, format_bytes(r.plan.arena_bytes),
                     format_bytes(r.plan.lower_bound_bytes)));
    line("planned iterations",
         fmt::format("{} ({} left the plan for the fallback; set aside {} times; laid out again "
                     "for later frees {} times, for want of room {} times)",
                     r.plan.iterations, r.plan.lost_iterations, r.plan.suspensions,
                     r.plan.widenings, r.plan.narrowings));
    if (r.plan.shape_alternations > 0) {
      line("shape library",
           fmt::format("{} plans in one arena for iterations of shapes that alternate (found {} "
                       "times); {} iterations' first requests switched plans, {} requests served "
                       "before the choice; {} plans dropped unused",
                       r.plan.library_plans, r.plan.shape_alternations, r.plan.plan_switches,
                       r.plan.undecided_requests, r.plan.dropped_plans));
    }
  }
  line("steady state",
       fmt::format("{}: peak requested {}, peak live {}, peak reserved {}, {:.2f} % unused "
                   "({:.2f} % not requested)",
                   r.steady_from_event < r.events_total
                       ? fmt::format("from event {}", r.steady_from_event)
                       : std::string("none reached (no plan formed): the whole trace's"),
                   format_bytes(r.steady_peak_requested_bytes), format_bytes(r.steady_peak_live_bytes),
                   format_bytes(r.steady_peak_reserved_bytes), 100.0 * r.steady_fragmentation,
                   100.0 * unused_fraction(r.steady_peak_requested_bytes, r.steady_peak_reserved_bytes)));
  line("replay time", fmt::format("{:.4f} s, {:.0f} events/s", r.seconds, r.events_per_second));
  out += '\n';
  out += to_text(r.stats);
  return out;
}

std::string format_replay_json(const replay_result& r, const replay_context& c) {
  nlohmann::ordered_json j;
  j["trace"] = c.trace_path;
  j["device"] = r.device;
  j["expandable_segments"] = c.expandable;
  j["conf"] = c.conf;
  j["events_total"] = r.events_total;
  j["events_replayed"] = r.events_replayed;
  j["allocs"] = r.allocs;
  j["frees"] = r.frees;
  j["preexisting_frees"] = r.preexisting_frees;
  j["failed_alloc_frees"] = r.failed_alloc_frees;
  j["iteration_marks"] = r.iteration_marks;
  j["skipped_events"] = r.skipped_events;
  j["preexisting_skipped"] = r.preexisting_skipped;
  j["streams"] = r.streams;
  j["live_at_end"] = r.live_at_end;
  j["peak_requested_bytes"] = r.peak_requested_bytes;
  j["peak_allocated_bytes"] = r.peak_allocated_bytes;
  j["peak_reserved_bytes"] = r.peak_reserved_bytes;
  j["fragmentation"] = r.fragmentation;
  j["device_allocs"] = r.device_allocs;
  j["ooms"] = r.ooms;
  j["seconds"] = r.seconds;
  j["events_per_second"] = r.events_per_second;
  j["policy"] = r.policy;
  j["preexisting_allocs"] = r.preexisting_allocs;
  j["preexisting_unplaced"] = r.preexisting_unplaced;
  j["planned_hit_rate"] = r.plan.hit_rate();
  j["steady_from_event"] = r.steady_from_event;
  j["steady_peak_requested_bytes"] = r.steady_peak_requested_bytes;
  j["steady_peak_live_bytes"] = r.steady_peak_live_bytes;
  j["steady_peak_reserved_bytes"] = r.steady_peak_reserved_bytes;
  j["steady_fragmentation"] = r.steady_fragmentation;
  j["stats"] = nlohmann::ordered_json::parse(to_json(r.stats));
  j["plan"] = nlohmann::ordered_json::parse(to_json(r.plan));
  // The trace's path is any bytes the file system allows: invalid UTF-8 becomes U+FFFD rather than
  // failing the dump after the whole replay.
  return j.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace);
}

}  // namespace terrace::tools

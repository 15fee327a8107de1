// SPDX-License-Identifier: Apache-2.0
/// @file html_report.hpp
/// @brief The fragmentation report: one self-contained HTML page (inline SVG and CSS, no scripts,
/// no external assets) that opens offline.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "terrace/trace.hpp"
#include "tools/replay.hpp"

namespace terrace::tools {

/// @brief A block live at the peak, for the "largest holders" table.
struct holder {
  std::uintptr_t addr = 0;
  std::uint64_t bytes = 0;
  std::string tag;  ///< the trace's tag or stack frames
};

struct report_input {
  std::string trace_path;
  std::string format;
  std::vector<std::pair<std::string, replay_result>> runs;  ///< per policy, with timelines
  std::optional<std::int64_t> torch_reserved_peak;          ///< PyTorch's own figure, if known
  memory_snapshot segments_at_peak;                         ///< the caching policy at peak live
  std::vector<holder> holders;                              ///< largest live blocks at the peak
};

/// @brief The blocks live once the first `events_done` events have happened (0: before the first
/// event, when only blocks from before the window are live), largest first, at most `n`.
/// Blocks from before the trace's window (freed in it without an alloc before) are live from
/// the start to their free, as the replay accounts them, and tagged "pre-existing". Blocks of
/// `unplaced` events (replay_result::unplaced_events: the replay never held them) are left out.
std::vector<holder> largest_holders(const std::vector<trace_event>& events, std::size_t events_done,
                                    std::size_t n, const std::vector<std::size_t>& unplaced = {});

/// @brief Everything the page shows for `events`: replay_policies over `base` with 400-point
/// timelines, the caching policy's segments just after its peak of live bytes, and the 20
/// largest blocks live then. `trace_path`, `format` and `torch_reserved_peak` label the page.
/// @throws as replay().
report_input make_report_input(const std::vector<trace_event>& events, const replay_options& base,
                               std::string trace_path, std::string format,
                               std::optional<std::int64_t> torch_reserved_peak = std::nullopt);

/// @brief The whole page.
std::string render_html_report(const report_input& in);

/// @brief The plain-text summary that heads the page (also printed by `terrace report`).
std::string report_summary(const report_input& in);

}  // namespace terrace::tools

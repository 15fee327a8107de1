// SPDX-License-Identifier: Apache-2.0
// The memory report of `terrace train`: the device allocator's trace, recorded live during
// training, drawn by the profiler's HTML report (the page `terrace report` writes for a trace
// file). The trace is replayed under the three policies over the null backend, exactly as
// `terrace report` does, so the page compares what the run reserved with what expandable segments
// and the planned policy would have.
#include <filesystem>
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
  replay_options base;
  base.device = "null";
  base.config = config;
  base.config.record_trace = false;
  const report_input in = make_report_input(events, base, title, "terrace trace (recorded live by terrace train)");
  // Written beside, then renamed over: a failed write leaves the last report whole, never half.
  const std::filesystem::path tmp = path.string() + ".tmp";
  std::ofstream out(tmp, std::ios::binary);
  if (out) out << render_html_report(in);
  out.close();
  std::error_code ec;
  if (!out) {
    std::filesystem::remove(tmp, ec);
    throw std::runtime_error("cannot write the memory report '" + path.string() + "'");
  }
  std::filesystem::rename(tmp, path, ec);
  if (ec) {
    std::filesystem::remove(tmp, ec);
    throw std::runtime_error("cannot write the memory report '" + path.string() + "'");
  }
  return report_summary(in);
}

}  // namespace terrace::tools

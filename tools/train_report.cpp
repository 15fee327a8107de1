// SPDX-License-Identifier: Apache-2.0
// The memory report of `terrace train`: the device allocator's trace, recorded live during
// training, drawn by the profiler's HTML report (the page `terrace report` writes for a trace
// file). The trace is replayed under the three policies over the null backend, exactly as
// `terrace report` does, so the page compares what the run reserved with what expandable segments
// and the planned policy would have.
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>

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
  if (const std::string why = replace_file(path, render_html_report(in)); !why.empty()) {
    throw std::runtime_error("cannot write the memory report '" + path.string() + "': " + why);
  }
  return report_summary(in);
}

std::string replace_file(const std::filesystem::path& path, std::string_view contents) {
  const std::filesystem::path tmp = path.string() + ".tmp";
  errno = 0;  // the streams set it where the system refused (ENOSPC, EACCES, EISDIR, ...)
  std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
  if (out) out.write(contents.data(), static_cast<std::streamsize>(contents.size()));
  out.close();
  std::string why;
  std::error_code ec;
  if (!out) {
    why = errno != 0 ? std::strerror(errno) : "the write failed";
  } else {
    std::filesystem::rename(tmp, path, ec);
    if (ec) why = ec.message();
  }
  if (!why.empty()) std::filesystem::remove(tmp, ec);
  return why;
}

}  // namespace terrace::tools

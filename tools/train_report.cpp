// SPDX-License-Identifier: Apache-2.0
// The memory report of `terrace train`: the device allocator's trace, recorded live during
// training, drawn by the profiler's HTML report (the page `terrace report` writes for a trace
// file). The trace is replayed under the three policies over the null backend, exactly as
// `terrace report` does, so the page compares what the run reserved with what expandable segments
// and the planned policy would have.
#include <fcntl.h>
#include <unistd.h>

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
  // The temporary is a new file (O_EXCL) under a name no other writer uses: a fixed "<path>.tmp"
  // would truncate a file of the user's that has that name. Mode 0666 less the umask, as any
  // file the user creates.
  std::filesystem::path tmp;
  int fd = -1;
  for (unsigned attempt = 0; fd < 0; ++attempt) {
    tmp = path.string() + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(attempt);
    fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0666);
    if (fd < 0 && (errno != EEXIST || attempt == 99)) return std::strerror(errno);
  }
  std::string why;
  for (std::size_t done = 0; done < contents.size() && why.empty();) {
    const ssize_t n = ::write(fd, contents.data() + done, contents.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) why = std::strerror(errno);
    else done += static_cast<std::size_t>(n);
  }
  if (::close(fd) != 0 && why.empty()) why = std::strerror(errno);  // NFS reports ENOSPC here
  std::error_code ec;
  if (why.empty()) {
    std::filesystem::rename(tmp, path, ec);
    if (ec) why = ec.message();
  }
  if (!why.empty()) std::filesystem::remove(tmp, ec);
  return why;
}

}  // namespace terrace::tools

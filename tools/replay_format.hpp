// SPDX-License-Identifier: Apache-2.0
/// @file replay_format.hpp
/// @brief Renders a replay_result for people (a summary plus the stats table) or for programs
/// (one JSON object).
#pragma once

#include <string>

#include "tools/replay.hpp"

namespace terrace::tools {

/// @brief What was replayed, for the report header.
struct replay_context {
  std::string trace_path;
  bool expandable = false;
  std::string conf;  ///< the --conf text as given
};

/// @brief A human-readable summary followed by terrace::to_text(result.stats).
std::string format_replay_text(const replay_result& result, const replay_context& context);

/// @brief One JSON object (no trailing newline): the summary fields plus "stats", keyed as
/// torch.cuda.memory_stats().
std::string format_replay_json(const replay_result& result, const replay_context& context);

/// @brief "1.50 GiB", "512 B": binary units, for reports.
std::string format_bytes(std::int64_t bytes);

}  // namespace terrace::tools

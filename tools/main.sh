#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The main job: set up, build (Release), then replay the sample training trace through the
# caching allocator on the simulated device (unless --device says otherwise) and print what it
# reserved, used and wasted.
#
#   tools/main.sh [extra `terrace replay` options]
#
# Environment: TERRACE_BUILD_DIR (default build).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
build_dir="${TERRACE_BUILD_DIR:-build}"

tools/build.sh "$build_dir" Release
# The embedded default is the simulated device; an explicit --device (null, cuda, ...) replaces it.
device_args=(--device sim)
for arg in "$@"; do
  [[ "$arg" == --device || "$arg" == --device=* ]] && device_args=()
done
echo
echo "main: $build_dir/tools/terrace replay tests/data/sample_trace.jsonl ${device_args[*]} $*"
exec "$build_dir/tools/terrace" replay tests/data/sample_trace.jsonl "${device_args[@]}" "$@"

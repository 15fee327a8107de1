#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The main job: set up, build (Release), then train the demo model through the offload engine
# (`terrace train`): a char-level MLP whose state is ten times the simulated device's memory, its
# params streamed to the device layer by layer, its optimizer state in host memory and on NVMe.
#
#   tools/main.sh [extra `terrace train` options]     e.g. --steps 50, --device cuda, --resume
#   tools/main.sh replay [extra `terrace replay` options]
#                                                     the sample trace through the caching allocator
#
# Environment: TERRACE_BUILD_DIR (default build).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
build_dir="${TERRACE_BUILD_DIR:-build}"

tools/build.sh "$build_dir" Release
echo
if [[ "${1:-}" == replay ]]; then
  shift
  # The embedded default is the simulated device; an explicit --device (null, cuda, ...) replaces it.
  device_args=(--device sim)
  for arg in "$@"; do
    [[ "$arg" == --device || "$arg" == --device=* ]] && device_args=()
  done
  echo "main: $build_dir/tools/terrace replay tests/data/sample_trace.jsonl ${device_args[*]} $*"
  exec "$build_dir/tools/terrace" replay tests/data/sample_trace.jsonl "${device_args[@]}" "$@"
fi
echo "main: $build_dir/tools/terrace train $*"
exec "$build_dir/tools/terrace" train "$@"

#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Setup, configure and build one build folder. Safe to run again: packages are checked, not
# reinstalled; CMake reconfigures only what changed; Ninja rebuilds only what is stale.
#
#   tools/build.sh [BUILD_DIR] [CONFIG] [-DOPTION=VALUE]... [--target TARGET]...
#
#   BUILD_DIR   default: build (relative paths are taken from the repository root)
#   CONFIG      CMAKE_BUILD_TYPE, default: Release
#   -D...       passed to CMake, e.g. -DTERRACE_SANITIZE=address,undefined
#   --target    build only these targets (default: all)
# Environment: TERRACE_JOBS (parallel jobs, default: the number of cores).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
# shellcheck source=tools/setup.sh
source tools/setup.sh

build_dir="" config="" cmake_args=() targets=()
while (($#)); do
  case "$1" in
    -D*) cmake_args+=("$1"); shift ;;
    --target) [[ $# -ge 2 ]] || { echo "build.sh: --target needs a name" >&2; exit 2; }
              targets+=("$2"); shift 2 ;;
    -h|--help) sed -n '3,12p' "$0"; exit 0 ;;
    -*) echo "build.sh: unknown option '$1' (see tools/build.sh --help)" >&2; exit 2 ;;
    *) if [[ -z "$build_dir" ]]; then build_dir="$1"
       elif [[ -z "$config" ]]; then config="$1"
       else echo "build.sh: unexpected argument '$1' (see tools/build.sh --help)" >&2; exit 2
       fi
       shift ;;
  esac
done
build_dir="${build_dir:-build}"
config="${config:-Release}"

# Without a toolkit the CUDA option must be off explicitly: a cache made on a machine with CUDA
# would otherwise keep asking for nvcc.
if ((!TERRACE_HAVE_CUDA)) && [[ " ${cmake_args[*]-} " != *" -DTERRACE_ENABLE_CUDA="* ]]; then
  cmake_args+=(-DTERRACE_ENABLE_CUDA=OFF)
fi
# A folder already configured keeps its generator; a new one gets Ninja.
generator=()
[[ -f "$build_dir/CMakeCache.txt" ]] || generator=(-G Ninja)

echo "build: configuring $build_dir ($config${cmake_args[*]+ ${cmake_args[*]}})"
mkdir -p "$build_dir"
log="$build_dir/configure.log"
if ! cmake -S "$root" -B "$build_dir" "${generator[@]}" -DCMAKE_BUILD_TYPE="$config" \
       "${cmake_args[@]}" >"$log" 2>&1; then
  cat "$log" >&2
  echo "build: FAILED to configure $build_dir (log: $log)" >&2
  exit 1
fi
# The full log stays in the build folder; warnings are worth seeing every time.
grep -A4 "CMake Warning" "$log" || true

jobs="${TERRACE_JOBS:-$(nproc)}"
echo "build: building $build_dir${targets[*]+ (targets: ${targets[*]})} with $jobs jobs"
cmake --build "$build_dir" --parallel "$jobs" ${targets[@]+--target "${targets[@]}"}
echo "build: $build_dir is up to date"

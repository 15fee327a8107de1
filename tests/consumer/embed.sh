#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The embed_subdirectory test: configures tests/consumer/embed/ (terrace through add_subdirectory)
# in a temporary folder, as on a machine with only the library's dependencies: the test, benchmark
# and tool packages are hidden from find_package and find_library.
#   embed.sh CMAKE
set -euo pipefail
cmake_bin="${1:-cmake}"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
work="$(mktemp -d "${TMPDIR:-/tmp}/terrace-embed.XXXXXX")"
trap 'rm -rf "$work"' EXIT
arch="$(gcc -print-multiarch 2>/dev/null || true)"
if ! "$cmake_bin" -S "$here/embed" -B "$work" -DTERRACE_SOURCE_DIR="$here/../.." \
       -DTERRACE_ENABLE_CUDA=OFF \
       -DCMAKE_DISABLE_FIND_PACKAGE_GTest=ON -DCMAKE_DISABLE_FIND_PACKAGE_benchmark=ON \
       -DCMAKE_DISABLE_FIND_PACKAGE_CLI11=ON -DCMAKE_DISABLE_FIND_PACKAGE_fmt=ON \
       "-DCMAKE_IGNORE_PATH=/usr/include/$arch/openblas-pthread;/usr/lib/$arch/openblas-pthread;/usr/include/$arch;/usr/lib/$arch/libopenblas.a" \
       -DTERRACE_OPENBLAS_INCLUDE_DIR=TERRACE_OPENBLAS_INCLUDE_DIR-NOTFOUND \
       >"$work.log" 2>&1; then
  cat "$work.log" >&2; rm -f "$work.log"
  echo "embed_subdirectory: FAILED: add_subdirectory(terrace) with default options needs the" \
       "test/benchmark/tool dependencies (log above)" >&2
  exit 1
fi
rm -f "$work.log"
echo "embed_subdirectory: ok"

#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# bench_smoke.sh PATTERN COMMAND...: runs a benchmark at a toy size; it passes when the command
# exits 0 and prints a line matching PATTERN (its table got as far as that line). ctest's own
# PASS_REGULAR_EXPRESSION would ignore the exit status, so a crash after the header would pass.
set -uo pipefail
pattern="$1"
shift
out="$("$@" 2>&1)"
rc=$?
printf '%s\n' "$out"
if [[ $rc -ne 0 ]]; then
  echo "bench_smoke: '$1' exited with status $rc"
  exit 1
fi
if ! grep -Eq -- "$pattern" <<<"$out"; then
  echo "bench_smoke: no line of '$1' matches '$pattern'"
  exit 1
fi

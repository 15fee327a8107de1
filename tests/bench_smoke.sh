#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# bench_smoke.sh [--rejects] PATTERN COMMAND...: runs a benchmark at a toy size; it passes when the
# command exits 0 and prints a line matching PATTERN (its table got as far as that line). ctest's
# own PASS_REGULAR_EXPRESSION would ignore the exit status, so a crash after the header would pass.
# With --rejects the benchmark is given bad input: it passes when the command exits non-zero and
# prints a line matching PATTERN (the error says what was wrong), instead of running on a number
# it made up.
set -uo pipefail
rejects=0
if [[ "$1" == "--rejects" ]]; then
  rejects=1
  shift
fi
pattern="$1"
shift
out="$("$@" 2>&1)"
rc=$?
printf '%s\n' "$out"
if [[ $rejects -eq 0 && $rc -ne 0 ]]; then
  echo "bench_smoke: '$1' exited with status $rc"
  exit 1
fi
if [[ $rejects -eq 1 && $rc -eq 0 ]]; then
  echo "bench_smoke: '$1' accepted its input (exit status 0)"
  exit 1
fi
if ! grep -Eq -- "$pattern" <<<"$out"; then
  echo "bench_smoke: no line of '$1' matches '$pattern'"
  exit 1
fi

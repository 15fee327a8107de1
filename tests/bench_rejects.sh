#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# bench_rejects.sh PATTERN COMMAND...: a benchmark given bad input; it passes when the command
# exits non-zero and prints a line matching PATTERN (the error says what was wrong), instead of
# running on a number it made up.
set -uo pipefail
pattern="$1"
shift
out="$("$@" 2>&1)"
rc=$?
printf '%s\n' "$out"
if [[ $rc -eq 0 ]]; then
  echo "bench_rejects: '$1' accepted its input (exit status 0)"
  exit 1
fi
if ! grep -Eq -- "$pattern" <<<"$out"; then
  echo "bench_rejects: no line of '$1' matches '$pattern'"
  exit 1
fi

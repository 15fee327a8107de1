#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Renders `terrace report` output in headless Chromium: no console errors, and a screenshot that is
# not blank. Skips (exit 77) when Chromium is not installed.
set -euo pipefail
cli="$1" gen="$2"
browser="$(command -v chromium || command -v chromium-browser || true)"
[[ -n "$browser" ]] || { echo "SKIP: chromium is not installed (tools/setup.sh installs it)"; exit 77; }
dir="$(mktemp -d)"
trap 'rm -rf "$dir"' EXIT
"$gen" --iterations 6 --steady --dynamic 1 -o "$dir/t.jsonl" >/dev/null
"$cli" report "$dir/t.jsonl" -o "$dir/r.html" >/dev/null
# HOME: chromium writes a profile; keep it in the temporary folder.
HOME="$dir" timeout 120 "$browser" --headless --no-sandbox --disable-gpu --enable-logging=stderr \
  --v=0 --window-size=1000,1600 --screenshot="$dir/r.png" "file://$dir/r.html" 2>"$dir/log" || {
  cat "$dir/log"; echo "FAIL: chromium did not render the page"; exit 1; }
if grep -E 'CONSOLE|Uncaught' "$dir/log"; then echo "FAIL: console messages above"; exit 1; fi
size=$(stat -c %s "$dir/r.png")
# A blank 1000x1600 PNG is a few kB; the charts and the segment map make it far larger.
(( size > 40000 )) || { echo "FAIL: screenshot is only $size bytes (blank page?)"; exit 1; }
echo "ok: rendered without console messages, screenshot $size bytes"

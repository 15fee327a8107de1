#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# tools/setup.sh must make a fresh Debian 12 able to configure and build terrace. It installs with
# --no-install-recommends, so a program the build runs is there only if the package list, or what
# it depends on, brings it. For each program the configure and build run, the package that owns it
# here must lie in the dependency closure of setup.sh's list. Skips (exit 77) off Debian or when a
# program is not installed here (its owner is then unknown).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
command -v apt-cache >/dev/null && command -v dpkg >/dev/null ||
  { echo "SKIP: not a Debian system (no apt-cache / dpkg)"; exit 77; }

# The list alone, without running the script (which would install).
eval "$(sed -n '/^terrace_setup_packages=(/,/^)/p' "$root/tools/setup.sh")"

# cmake, ninja, the C and C++ compilers (project() enables both), pkg-config
# (tiers/CMakeLists.txt finds liburing with it) and python3 (the python tests).
programs=(cmake ninja cc c++ pkg-config python3)
closure="$(apt-cache depends --recurse --no-recommends --no-suggests --no-conflicts --no-breaks \
             --no-replaces --no-enhances "${terrace_setup_packages[@]}" 2>/dev/null |
           sed -n 's/^\([^ <][^ :]*\).*/\1/p' | sort -u)"
failed=0
for program in "${programs[@]}"; do
  # /usr/bin: where Debian's packages put them (PATH may start with pyenv's shims or the like).
  path="/usr/bin/$program"
  [[ -x "$path" ]] || { echo "SKIP: $path is not installed here"; exit 77; }
  owner="$(dpkg -S "$(readlink -f "$path")" 2>/dev/null | sed -n '1s/:.*//p' || true)"
  [[ -n "$owner" ]] || { echo "SKIP: no package owns $(readlink -f "$path")"; exit 77; }
  if ! grep -qxF "$owner" <<<"$closure"; then
    echo "FAIL: $program ($owner) is not installed by tools/setup.sh's packages"
    failed=1
  fi
done
((failed == 0)) && echo "ok: setup.sh's packages bring ${programs[*]}"
exit "$failed"

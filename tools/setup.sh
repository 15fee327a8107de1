#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Makes a fresh Debian 12 ready to build terrace, and finds the CUDA toolkit.
#
#   tools/setup.sh            install what is missing, then report what was found
#   source tools/setup.sh     the same, and keep PATH (nvcc) and TERRACE_HAVE_CUDA in this shell
#
# Packages already installed are not touched: dpkg-query decides, and apt-get (update included)
# runs only when something is missing, so a repeated run costs a fraction of a second.
# CUDA is optional: with /usr/local/cuda present, its bin/ goes first on PATH so that CMake finds
# nvcc and builds the CUDA backends; without it, terrace builds with the simulated device only.

terrace_setup_packages=(
  cmake ninja-build g++ liburing-dev libmimalloc-dev libgtest-dev googletest libbenchmark-dev
  nlohmann-json3-dev libfmt-dev libcli11-dev python3
  pkg-config  # tiers/CMakeLists.txt finds liburing with it; nothing above depends on it
  fio  # tools/bench_nvme compares the tensor store with fio on the same file system
  chromium  # tests/report_render_test.sh renders `terrace report` headless
  python3-torch  # tests/test_adam_torch.py compares the CPU Adam with torch.optim.Adam/AdamW
  libopenblas-dev  # kernels/char_model_cpu.cpp: sgemm for the cpu char model (terrace train)
)
# Optional, bench only, not installed here (terrace never links it): libaio-dev, which DeepSpeed's
# async_io op needs, for tools/bench_nvme's comparison with DeepSpeed's aio handle (docs/nvme.md).
TERRACE_CUDA_HOME="${TERRACE_CUDA_HOME:-/usr/local/cuda}"

terrace_setup_install() {
  local missing=() pkg status
  for pkg in "${terrace_setup_packages[@]}"; do
    status="$(dpkg-query -W -f='${db:Status-Abbrev}' "$pkg" 2>/dev/null || true)"
    [[ "$status" == "ii"* ]] || missing+=("$pkg")
  done
  if ((${#missing[@]} == 0)); then
    return 0
  fi
  echo "setup: installing ${missing[*]}"
  local sudo=()
  if ((EUID != 0)); then
    if ! command -v sudo >/dev/null; then
      echo "setup: missing packages (${missing[*]}) and not root, with no sudo to install them" >&2
      return 1
    fi
    sudo=(sudo)
  fi
  "${sudo[@]}" apt-get update -qq || return 1
  DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq --no-install-recommends \
    "${missing[@]}" || return 1
  for pkg in "${missing[@]}"; do
    status="$(dpkg-query -W -f='${db:Status-Abbrev}' "$pkg" 2>/dev/null || true)"
    if [[ "$status" != "ii"* ]]; then
      echo "setup: apt-get finished but $pkg is still not installed (dpkg status '${status:-none}')" >&2
      return 1
    fi
  done
}

terrace_setup_cuda() {
  TERRACE_HAVE_CUDA=0
  if [[ -x "$TERRACE_CUDA_HOME/bin/nvcc" ]]; then
    case ":$PATH:" in
      *":$TERRACE_CUDA_HOME/bin:"*) ;;
      *) PATH="$TERRACE_CUDA_HOME/bin:$PATH" ;;
    esac
    export PATH
    TERRACE_HAVE_CUDA=1
  fi
  export TERRACE_HAVE_CUDA TERRACE_CUDA_HOME
}

terrace_setup_main() {
  terrace_setup_install || { echo "setup: FAILED to install packages" >&2; return 1; }
  terrace_setup_cuda
  if ((TERRACE_HAVE_CUDA)); then
    echo "setup: packages present; CUDA toolkit at $TERRACE_CUDA_HOME ($("$TERRACE_CUDA_HOME/bin/nvcc" --version | sed -n 's/.*release \([0-9.]*\).*/\1/p'))"
  else
    echo "setup: packages present; no CUDA toolkit at $TERRACE_CUDA_HOME: building without CUDA"
  fi
}

# Sourced, the caller's shell options are left alone; run, the script is strict.
[[ "${BASH_SOURCE[0]}" != "$0" ]] || set -euo pipefail
terrace_setup_main

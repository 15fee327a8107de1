#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The install_consumer test: installs a terrace build tree into a temporary prefix, moves the
# prefix (the package must be relocatable), builds tests/consumer against it with find_package,
# and runs the result; then tests/consumer/c_only (COMPONENTS c) with the CUDA toolkit hidden, and
# the installed CLI. Everything lives in one temporary folder, removed on exit.
#
#   run.sh --build-dir=DIR [--config=CFG] [--cmake=PATH] [--generator=NAME] [--cxx=PATH]
#          [--sanitize=LIST] [--cuda-root=DIR]
# (key=value, so that an empty value survives ctest's argument handling)
#
# --sanitize must match the build's TERRACE_SANITIZE: a sanitized libterrace.a only links into a
# program built with the same runtime.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
build_dir="" config="Release" cmake_bin="cmake" generator="" cxx="" sanitize="" cuda_root=""
for arg in "$@"; do
  case "$arg" in
    --build-dir=*) build_dir="${arg#*=}" ;;
    --config=*) config="${arg#*=}" ;;
    --cmake=*) cmake_bin="${arg#*=}" ;;
    --generator=*) generator="${arg#*=}" ;;
    --cxx=*) cxx="${arg#*=}" ;;
    --sanitize=*) sanitize="${arg#*=}" ;;
    --cuda-root=*) cuda_root="${arg#*=}" ;;
    *) echo "run.sh: unknown argument '$arg' (see the header of $0)" >&2; exit 2 ;;
  esac
done
if [[ -z "$build_dir" || ! -f "$build_dir/CMakeCache.txt" ]]; then
  echo "run.sh: --build-dir must name a configured terrace build tree (got '${build_dir}')" >&2
  exit 2
fi
build_dir="$(cd "$build_dir" && pwd)"

work="$(mktemp -d "${TMPDIR:-/tmp}/terrace-consumer.XXXXXX")"
trap 'rm -rf "$work"' EXIT
log="$work/log"

# Runs a step quietly; on failure shows its output, so that ctest's log says what broke.
step() {
  local name="$1"; shift
  if ! "$@" >"$log" 2>&1; then
    echo "install_consumer: FAILED at '$name': $*" >&2
    cat "$log" >&2
    exit 1
  fi
}

step "cmake --install" "$cmake_bin" --install "$build_dir" --config "$config" --prefix "$work/staged"
mv "$work/staged" "$work/prefix"
prefix="$work/prefix"

# Absolute paths into the build or source tree would make the package work only on this machine.
source_dir="$(sed -n 's/^CMAKE_HOME_DIRECTORY:INTERNAL=//p' "$build_dir/CMakeCache.txt")"
if grep -rlF -e "$build_dir" -e "${source_dir:-$build_dir}" "$prefix" --include='*.cmake' >"$log"; then
  echo "install_consumer: FAILED: installed CMake files name the build or source tree:" >&2
  cat "$log" >&2
  exit 1
fi

args=(-S "$here" -B "$work/build" -DCMAKE_BUILD_TYPE="$config" -DCMAKE_PREFIX_PATH="$prefix"
      -DCMAKE_FIND_PACKAGE_NO_PACKAGE_REGISTRY=ON)
[[ -n "$generator" ]] && args+=(-G "$generator")
[[ -n "$cxx" ]] && args+=(-DCMAKE_CXX_COMPILER="$cxx")
[[ -n "$cuda_root" ]] && args+=(-DCUDAToolkit_ROOT="$cuda_root")
if [[ -n "$sanitize" ]]; then
  args+=(-DCMAKE_CXX_FLAGS="-fsanitize=$sanitize -fno-omit-frame-pointer"
         -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=$sanitize")
fi
step "configure the consumer" "$cmake_bin" "${args[@]}"

found="$(sed -n 's/^terrace_DIR:PATH=//p' "$work/build/CMakeCache.txt")"
if [[ "$found" != "$prefix"/* ]]; then
  echo "install_consumer: FAILED: find_package found terrace at '$found', not under '$prefix'" >&2
  exit 1
fi

step "build the consumer" "$cmake_bin" --build "$work/build" --config "$config"
"$work/build/terrace_consumer"

# The C ABI alone, on a machine without the CUDA toolkit: COMPONENTS c must not need it, even
# from a build with CUDA (whose terrace::terrace links CUDA::cudart_static).
no_cuda=(-DCMAKE_BUILD_TYPE="$config" -DCMAKE_PREFIX_PATH="$prefix"
         -DCMAKE_FIND_PACKAGE_NO_PACKAGE_REGISTRY=ON -DCMAKE_DISABLE_FIND_PACKAGE_CUDAToolkit=ON)
[[ -n "$generator" ]] && no_cuda+=(-G "$generator")
c_args=(-S "$here/c_only" -B "$work/build-c" "${no_cuda[@]}")
if [[ -n "$sanitize" ]]; then
  c_args+=(-DCMAKE_C_FLAGS="-fsanitize=$sanitize -fno-omit-frame-pointer"
           -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=$sanitize")
fi
step "configure the C-only consumer without CUDA" "$cmake_bin" "${c_args[@]}"
step "build the C-only consumer" "$cmake_bin" --build "$work/build-c" --config "$config"
"$work/build-c/terrace_c_consumer"

# There, asking for everything fails and says how to get the C ABI alone.
if grep -q '^TERRACE_ENABLE_CUDA:BOOL=ON' "$build_dir/CMakeCache.txt"; then
  if "$cmake_bin" -S "$here" -B "$work/build-refused" "${no_cuda[@]}" >"$log" 2>&1; then
    echo "install_consumer: FAILED: find_package(terrace) of a CUDA build worked without the" \
         "CUDA toolkit; terrace::terrace cannot link there" >&2
    exit 1
  fi
  if ! grep -q 'COMPONENTS c' "$log"; then
    echo "install_consumer: FAILED: without the CUDA toolkit, find_package(terrace) did not say" \
         "that COMPONENTS c works:" >&2
    cat "$log" >&2
    exit 1
  fi
fi

# The installed CLI needs nothing beyond the C and C++ runtimes (fmt is header-only in it).
if [[ -x "$prefix/bin/terrace" ]]; then
  if ldd "$prefix/bin/terrace" | grep -q libfmt; then
    echo "install_consumer: FAILED: the installed terrace needs libfmt:" >&2
    ldd "$prefix/bin/terrace" >&2
    exit 1
  fi
  step "run the installed terrace" "$prefix/bin/terrace" --version
fi
echo "install_consumer: ok"

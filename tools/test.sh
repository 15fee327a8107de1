#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The test command: everything terrace checks, in three builds.
#
#   1. build/       Release, everything (CUDA when the toolkit is present): every ctest test,
#                   the `gpu` label included (those tests GTEST_SKIP without a GPU).
#   2. build-asan/  AddressSanitizer + UBSan: every test labelled `cpu`.
#   3. build-tsan/  ThreadSanitizer: the tests labelled `concurrent`, plus any test whose name
#                   says stress or conformance (until every such test carries the label).
#
# The sanitizer builds leave out CUDA and the benchmarks: neither adds a test, the sanitizers
# cannot see into the CUDA runtime anyway, and skipping them keeps the whole run well inside its
# 25-minute budget on two cores (10 minutes from clean, builds included, on two idle cores on
# 2026-11-24; more when other builds share them). Every stage runs even after a failure, so that
# one run reports everything (hence no `set -e`); the exit status is non-zero if any stage failed.
#
# Environment: TERRACE_BUILD_DIR (default build; the sanitizer folders take its name plus -asan
# and -tsan), TERRACE_JOBS (parallel jobs, default: the number of cores).
set -uo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root" || exit 1
start=$SECONDS
base="${TERRACE_BUILD_DIR:-build}"
jobs="${TERRACE_JOBS:-$(nproc)}"
# A test that hangs must fail, not stall the run.
ctest_common=(--output-on-failure --no-tests=error --timeout 900 -j "$jobs")
# Sanitizer reports fail the test that triggered them; UBSan already aborts
# (-fno-sanitize-recover=all), these make the reports readable.
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:strict_string_checks=1:check_initialization_order=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
export TSAN_OPTIONS="${TSAN_OPTIONS:-halt_on_error=1:second_deadlock_stack=1}"

summary=()
failed=0

# record NAME STATUS SECONDS DETAIL
record() {
  summary+=("$(printf '%-28s %-5s %5ss  %s' "$1" "$2" "$3" "$4")")
  [[ "$2" == "ok" ]] || failed=1
}

# build_stage NAME BUILD_DIR ARGS... : runs tools/build.sh; returns its status.
build_stage() {
  local name="$1"; shift
  local t0=$SECONDS
  echo
  echo "==== $name"
  if tools/build.sh "$@"; then
    record "$name" ok $((SECONDS - t0)) "$1"
    return 0
  fi
  record "$name" FAIL $((SECONDS - t0)) "$1: see the build output above"
  return 1
}

# test_stage NAME BUILD_DIR CTEST_ARGS... : runs ctest; the detail line counts passed, failed and
# skipped tests from ctest's own report.
test_stage() {
  local name="$1" dir="$2"; shift 2
  local t0=$SECONDS log="$dir/ctest-$name.log" rc
  echo
  echo "==== $name"
  ctest --test-dir "$dir" "${ctest_common[@]}" "$@" 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  local line skipped
  line="$(grep -E '[0-9]+% tests passed' "$log" | tail -1)"
  skipped="$(grep -cE '\((Skipped|Disabled)\)$' "$log" || true)"
  if ((rc == 0)); then
    record "$name" ok $((SECONDS - t0)) "${line:-no ctest summary}; $skipped skipped"
  else
    record "$name" FAIL $((SECONDS - t0)) "${line:-ctest exited $rc}; $skipped skipped (log: $log)"
    # The failed tests by name (without gtest's "# GetParam() = ..." suffix), so that the summary
    # alone says what to look at.
    local failed_name
    while IFS= read -r failed_name; do
      summary+=("      failed: $failed_name")
    done < <(sed -n '/^The following tests FAILED:/,/^[^[:space:]]/s/^[[:space:]]*[0-9]* - \(.*\) ([^()]*)$/\1/p' "$log" |
             sed 's/  # GetParam().*//' | head -20)
  fi
}

# ------------------------------------------------------------------ 1. the release build, all tests
if build_stage "build (Release)" "$base" Release; then
  test_stage "all-tests" "$base"
else
  record "all-tests" FAIL 0 "not run: the build failed"
fi

# Every test carries cpu or gpu besides any other label (tests/CMakeLists.txt escapes its label
# lists for that); a concurrent test that lost its cpu label would silently miss the ASan run.
if [[ -d "$base" ]]; then
  unlabelled="$(ctest --test-dir "$base" -N -L '^concurrent$' -LE '^(cpu|gpu)$' |
                sed -n 's/^ *Total Tests: //p')"
  if [[ "${unlabelled:-0}" != 0 ]]; then
    record "labels" FAIL 0 "$unlabelled concurrent tests carry neither cpu nor gpu"
  fi
fi

# ------------------------------------------------------------------ 2. ASan + UBSan, the cpu suite
# -O1 -g1 halves the compile time of the json-heavy sources against RelWithDebInfo's -O2 -g and
# still gives sanitizer reports with file:line; NDEBUG stays as in the Release build, so the
# sanitizers check the code that ships.
san_flags="-O1 -g1 -DNDEBUG"
san_args=(-DTERRACE_ENABLE_CUDA=OFF -DTERRACE_BUILD_BENCHMARKS=OFF -DTERRACE_BUILD_TESTS=ON
          -DTERRACE_BUILD_TOOLS=ON "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=$san_flags"
          "-DCMAKE_C_FLAGS_RELWITHDEBINFO=$san_flags")
if build_stage "build (ASan+UBSan)" "$base-asan" RelWithDebInfo \
     -DTERRACE_SANITIZE=address,undefined "${san_args[@]}"; then
  test_stage "asan-ubsan-cpu" "$base-asan" -L '^cpu$'
else
  record "asan-ubsan-cpu" FAIL 0 "not run: the build failed"
fi

# ------------------------------------------------------------------ 3. TSan, the concurrent tests
if build_stage "build (TSan)" "$base-tsan" RelWithDebInfo -DTERRACE_SANITIZE=thread "${san_args[@]}"; then
  # One ctest run: the label, or a name that says the test exercises threads.
  concurrent_regex='stress|conformance'
  mapfile -t tsan_tests < <(
    { ctest --test-dir "$base-tsan" -N -L '^concurrent$'; ctest --test-dir "$base-tsan" -N -R "$concurrent_regex"; } |
      sed -n 's/^ *Test *#[0-9]*: //p' | sort -u)
  if ((${#tsan_tests[@]} == 0)); then
    record "tsan-concurrent" FAIL 0 "no test is labelled concurrent or named $concurrent_regex"
  else
    # ctest -R takes one regex: the exact names, escaped, joined with |.
    names_regex="$(printf '%s\n' "${tsan_tests[@]}" | sed 's/[][().*+?^$|\\{}]/\\&/g; s/^/^/; s/$/$/' | paste -sd'|')"
    test_stage "tsan-concurrent" "$base-tsan" -R "$names_regex"
  fi
else
  record "tsan-concurrent" FAIL 0 "not run: the build failed"
fi

# ------------------------------------------------------------------ summary
echo
echo "==== terrace test summary ($(( (SECONDS - start) / 60 ))m $(( (SECONDS - start) % 60 ))s)"
printf '%s\n' "${summary[@]}"
if ((failed)); then
  echo "RESULT: FAILED"
  exit 1
fi
echo "RESULT: all passed"

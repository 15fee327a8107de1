#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The issues' GPU steps on a lent GPU machine, where nothing can be installed, with a build made
# here. Two halves, because of what a call to that machine allows (/work/.library/device/README.md):
# at most 64 MiB of working tree travel (the build folder is over 1 GiB), at most 8 files of 16 MiB
# come back, and one command runs 10 minutes at most.
#
#   tools/gpu_session.sh pack [BUILD_DIR]
#       Here, after `tools/build.sh build Release` (with CUDA): packs the GPU tests, the CLI, the
#       GPU benchmarks, libterrace.so and every shared library they need besides the C and C++
#       runtimes (libbenchmark, ...) into gpu-pack/terrace-gpu.tar.gz (git-ignored; ~20 MiB).
#
#   OUT=DIR tools/gpu_session.sh run GROUP... [--quick]
#       There, with `gpu-pack` carried (from any folder: it goes to the repository root). GROUP:
#       tests (the gpu-labelled test binaries), bench (bench_allocator, bench_adam_gpu), train
#       (`terrace train --device cuda` offloaded, resident, recomputed, planned), torch (GPT-2 and
#       ResNet-18 in PyTorch under its allocator, terrace's caching and planned policies, and the
#       example), or all. Each group should fit one call (tests+bench in one, train+torch in
#       another, with --quick if time is short). Step logs and files go to a scratch folder; DIR
#       receives summary.txt (the GPU seen, each step's status, time and GoogleTest counts),
#       results.tar.gz (logs, JSON, losses) and snapshots-MODEL.tar.gz (the snapshots and traces:
#       test data), at most 5 files. The summary is printed last, so that it is in the call's
#       output too.
#
#       Time: a call's command is killed at its limit (10 minutes at most), and what is under DIR
#       then still comes back. So each step runs under `timeout` (GPU_SESSION_STEP_TIMEOUT
#       seconds, default 300), no step starts or runs past the run's own deadline
#       (GPU_SESSION_BUDGET seconds from the start, default 540: give the call timeout_s 600, or
#       lower this with it), and DIR is refreshed after every step: a hung step costs its own
#       limit, not the results of the others. A step stopped by its limit shows as TIMED OUT.
#       Size: an archive over 15 MiB (one file comes back only under 16 MiB) is remade without its
#       largest files, which the summary names.
#
# A call sends the checkout its session was started in, never a helper's worktree: pack in that
# checkout (or copy gpu-pack/ into it), and know that the script and tools/*.py that run there are
# that checkout's.
#
# Why the test binaries run directly rather than through `ctest -L gpu`: CTest's files name the
# build folder by its absolute path here, which does not exist there. The binaries are exactly the
# ones that carry the `gpu` label.
set -u

# The repository root: the run half reads gpu-pack/ and tools/*.py from it, wherever it is called.
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

pack() {
  local build="${1:-build}"
  [[ -d "$build" ]] || { echo "gpu_session pack: $build is not a build folder" >&2; return 1; }
  build="$(cd "$build" && pwd)"
  cd "$repo" || return 1
  local stage
  stage="$(mktemp -d)"
  mkdir -p "$stage/tests" "$stage/tools" "$stage/lib" gpu-pack
  local missing=0
  for f in "$build"/tests/*_gpu_test "$build"/tools/terrace "$build"/tools/bench_allocator \
           "$build"/tools/bench_adam_gpu "$build"/allocator/libterrace.so; do
    if [[ ! -f "$f" ]]; then
      echo "gpu_session pack: $f is missing (build with CUDA and benchmarks first)" >&2
      missing=1
      continue
    fi
    case "$f" in
      */tests/*) cp "$f" "$stage/tests/" ;;
      *.so) cp "$f" "$stage/lib/" ;;
      *) cp "$f" "$stage/tools/" ;;
    esac
  done
  [[ $missing -eq 0 ]] || { rm -rf "$stage"; return 1; }
  # Every shared library these binaries need except the C and C++ runtimes, which any machine
  # that runs PyTorch has (libbenchmark today; liburing, libfmt, ... if a build links them).
  # A library ldd cannot find here would be missing there too.
  local needs
  needs="$(ldd "$stage"/tools/* "$stage"/tests/* "$stage"/lib/* 2>/dev/null)"
  if grep -q 'not found' <<<"$needs"; then
    echo "gpu_session pack: a library is not found here:" >&2
    grep 'not found' <<<"$needs" | sort -u >&2
    rm -rf "$stage"
    return 1
  fi
  awk '/=> \// {print $1, $3}' <<<"$needs" | sort -u |
    grep -vE '^(libc|libm|libstdc\+\+|libgcc_s|libpthread|libdl|librt|ld-linux-x86-64|libterrace)\.so' |
    while read -r _ lib; do cp -L "$lib" "$stage/lib/"; done
  strip --strip-debug "$stage"/tests/* "$stage"/tools/* 2>/dev/null
  tar czf gpu-pack/terrace-gpu.tar.gz -C "$stage" .
  rm -rf "$stage"
  du -h gpu-pack/terrace-gpu.tar.gz
  echo "carry gpu-pack; there: OUT=\$OUT tools/gpu_session.sh run tests bench"
}

run() {
  local quick=0
  local groups=()
  for arg in "$@"; do
    case "$arg" in
      --quick) quick=1 ;;
      tests | bench | train | torch) groups+=("$arg") ;;
      all) groups+=(tests bench train torch) ;;
      *) echo "gpu_session run: unknown group '$arg' (tests, bench, train, torch, all)" >&2; return 2 ;;
    esac
  done
  [[ ${#groups[@]} -gt 0 ]] || { echo "gpu_session run: name a group" >&2; return 2; }
  local budget="${GPU_SESSION_BUDGET:-540}" step_limit="${GPU_SESSION_STEP_TIMEOUT:-300}"
  [[ "$budget" =~ ^[0-9]+$ && "$step_limit" =~ ^[1-9][0-9]*$ ]] || {
    echo "gpu_session run: GPU_SESSION_BUDGET and GPU_SESSION_STEP_TIMEOUT are whole seconds" >&2
    return 2
  }
  # Each step must have ended, and DIR been refreshed, by the deadline (30 s left for the last
  # refresh and the printing).
  local deadline=$((SECONDS + budget - 30))
  local out="${OUT:-gpu-out}"
  mkdir -p "$out" && out="$(cd "$out" && pwd)" || return 2
  cd "$repo" || return 2
  [[ -f gpu-pack/terrace-gpu.tar.gz ]] || {
    echo "gpu_session run: gpu-pack/terrace-gpu.tar.gz is missing: pack it here, carry gpu-pack" >&2
    return 2
  }
  # A folder of its own (under $TMPDIR), so that two runs on one machine do not meet.
  local scratch
  scratch="$(mktemp -d "${TMPDIR:-/tmp}/terrace-gpu.XXXXXX")" || return 2
  local root="$scratch/pack" work="$scratch/work"
  mkdir -p "$root" "$work/torch" "$work/torch-planned"
  tar xzf gpu-pack/terrace-gpu.tar.gz -C "$root" || return 2
  export LD_LIBRARY_PATH="$root/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export TERRACE_SOURCE_DIR="$repo"  # where bench_adam_gpu finds tools/bench_adam_torch.py
  export PYTHONUNBUFFERED=1
  # PyTorch's C++ stacks in _dump_snapshot: addr2line (the default of older releases) can take
  # minutes on its large libraries, or be missing; dladdr names the functions at once.
  export TORCH_SYMBOLIZE_MODE="${TORCH_SYMBOLIZE_MODE:-dladdr}"
  # cuBLAS for the cuda char model: PyTorch's pip wheels keep it in site-packages/nvidia/...
  if [[ -z "${TERRACE_CUBLAS_LIBRARY:-}" ]] && ! ldconfig -p 2>/dev/null | grep -q 'libcublas\.so\.13'; then
    local found
    found="$(timeout 60 python3 -c 'import glob, os, nvidia
paths = [p for base in nvidia.__path__
         for p in glob.glob(os.path.join(base, "**", "libcublas.so.13"), recursive=True)]
print(sorted(paths)[0] if paths else "")' 2>/dev/null)"
    if [[ -n "$found" ]]; then
      export TERRACE_CUBLAS_LIBRARY="$found"
      # libcublas.so.13 loads libcublasLt.so.13 beside it; its own run path may not say so.
      LD_LIBRARY_PATH="$(dirname "$found"):$LD_LIBRARY_PATH"
    fi
  fi
  local summary="$work/summary.txt"
  local gpus
  gpus="$(timeout 60 nvidia-smi -L 2>/dev/null | grep '^GPU ')"
  {
    echo "gpu_session $(date -u +%FT%TZ) groups: ${groups[*]}$([[ $quick -eq 1 ]] && echo ' --quick')" \
      "(step limit ${step_limit}s, budget ${budget}s)"
    if [[ -n "$gpus" ]]; then
      echo "GPU: $gpus"
    else
      echo "GPU: NONE (nvidia-smi is missing or lists no GPU): the gpu tests skip and nothing is measured"
    fi
    echo "cuBLAS: ${TERRACE_CUBLAS_LIBRARY:-found by the loader}"
  } > "$summary"

  # deliver: what comes back, refreshed after every step, so that a call killed at its limit
  # still returns what ran. Each archive is made beside DIR and then moved in.
  deliver() {
    local max=$((15 * 1024 * 1024))  # one file comes back only under 16 MiB
    (cd "$work" && tar czf "$scratch/results.tar.gz" --exclude='./store-*' --exclude='*snapshot*' \
      --exclude='*.pickle' --exclude='*_trace.jsonl' .)
    mv -f "$scratch/results.tar.gz" "$out/results.tar.gz"
    # One archive per model, so that one too large does not hold the others back; remade only
    # when a step has written its files since (gzip of large snapshots takes seconds).
    local model files note
    for model in gpt2 resnet18 pytorch_example; do
      files="$(cd "$work" && find . \( -name '*snapshot*' -o -name '*.pickle' -o -name '*_trace.jsonl' \) \
        -name "*$model*" -type f -printf '%s %p\n' | sort -n)"
      [[ -n "$files" ]] || continue
      note="$scratch/notes-$model.txt"
      [[ -f "$note" && -z "$(cd "$work" && find . -type f -newer "$note" -name "*$model*" -print -quit)" ]] &&
        continue
      : > "$note"
      while :; do
        (cd "$work" && cut -d' ' -f2- <<<"$files" | tar czf "$scratch/snapshots-$model.tar.gz" -T -)
        [[ $(stat -c %s "$scratch/snapshots-$model.tar.gz") -gt $max ]] || break
        # Too large to come back: leave the largest file out, and say so.
        echo "snapshots-$model.tar.gz: left out $(tail -n 1 <<<"$files" |
          awk '{printf "%s (%d MiB)", $2, $1 / 1048576}'), too large to come back" >> "$note"
        files="$(sed '$d' <<<"$files")"
        [[ -n "$files" ]] || { rm -f "$scratch/snapshots-$model.tar.gz"; break; }
      done
      [[ -f "$scratch/snapshots-$model.tar.gz" ]] &&
        mv -f "$scratch/snapshots-$model.tar.gz" "$out/snapshots-$model.tar.gz"
    done
    cat "$summary" "$scratch"/notes-*.txt > "$out/summary.txt" 2> /dev/null
  }
  trap 'echo "gpu_session: stopped by a signal" >> "$summary"; deliver; exit 143' TERM INT

  # verdict RC LOG: what the summary says of a step besides its exit status.
  verdict() {
    local rc="$1" log="$2" v
    case "$rc" in
      0) v="ok" ;;
      124) v="TIMED OUT" ;;
      137) v="KILLED (out of time, or of memory)" ;;
      127) v="NOT FOUND" ;;
      *) v="FAILED" ;;
    esac
    if grep -q '^\[==========\] .* ran\.' "$log"; then  # GoogleTest's counts
      local passed skipped failed
      passed="$(sed -n 's/^\[  PASSED  \] \([0-9]*\) tests*\..*/\1/p' "$log" | tail -n 1)"
      skipped="$(sed -n 's/^\[  SKIPPED \] \([0-9]*\) tests*, .*/\1/p' "$log" | tail -n 1)"
      failed="$(sed -n 's/^\[  FAILED  \] \([0-9]*\) tests*, .*/\1/p' "$log" | tail -n 1)"
      v+=": ${passed:-0} passed, ${skipped:-0} skipped, ${failed:-0} failed"
      [[ ${passed:-0} -eq 0 && ${skipped:-0} -gt 0 ]] && v+=" (ALL SKIPPED)"
    fi
    grep -q 'no CUDA device' "$log" && v+=" (no CUDA device)"
    # A failure's last word, often its reason (the log has the rest).
    [[ $rc -ne 0 && $rc -ne 124 && $rc -ne 137 ]] &&
      v+=": $(grep -v '^[[:space:]]*$' "$log" | tail -n 1 | cut -c 1-120)"
    echo "$v"
  }

  step() {  # step NAME COMMAND...: its output in NAME.log, its status and time in the summary
    local name="$1"
    shift
    local left=$((deadline - SECONDS))
    if [[ $left -lt 10 ]]; then
      printf '%-28s NOT RUN: the budget of %ds is spent\n' "$name" "$budget" | tee -a "$summary"
      return
    fi
    local limit=$((step_limit < left ? step_limit : left))
    local t0=$SECONDS
    echo "== $name (limit ${limit}s): $*" > "$work/$name.log"
    # timeout runs the step in a process group of its own, and ends all of it (a death test's
    # child, a Python subprocess); KILL 10 s after TERM.
    timeout -k 10 "$limit" "$@" >> "$work/$name.log" 2>&1 < /dev/null
    local rc=$?
    printf '%-28s rc=%-3d %5ds  %s\n' "$name" "$rc" $((SECONDS - t0)) \
      "$(verdict "$rc" "$work/$name.log")" | tee -a "$summary"
    tail -n 4 "$work/$name.log"
    deliver
  }

  local steps=$((quick ? 20 : 100))
  local reps=$((quick ? 3 : 5))
  local lib="$root/lib/libterrace.so"
  for group in "${groups[@]}"; do
    case "$group" in
      tests)
        step nvidia-smi nvidia-smi
        # One at a time: the VMM out-of-memory case maps most of the device.
        for t in "$root"/tests/*_gpu_test; do step "$(basename "$t")" "$t"; done
        ;;
      bench)
        step bench-allocator "$root/tools/bench_allocator" --benchmark_repetitions="$reps" \
          --benchmark_min_time=0.1 --benchmark_format=json --benchmark_out="$work/bench_allocator.json"
        step bench-adam-gpu "$root/tools/bench_adam_gpu" --reps $((reps * 4))
        ;;
      train)
        # The main job on the GPU: offloaded (a 32 MiB budget: the 297 MiB state is 9x it), its
        # resident peer, and the variants (activation recompute, the planned policy live).
        local train=("$root/tools/terrace" train --device cuda --fresh --steps "$steps" --no-report --quiet)
        step train-offloaded "${train[@]}" --device-budget 32MiB --dir "$work/store-offloaded" \
          --log "$work/train-offloaded.losses"
        step train-resident "${train[@]}" --resident --dir "$work/store-resident" \
          --log "$work/train-resident.losses"
        step train-recompute "${train[@]}" --device-budget 32MiB --recompute \
          --dir "$work/store-recompute" --log "$work/train-recompute.losses"
        step train-planned "${train[@]}" --device-budget 256MiB --alloc-conf policy:planned \
          --dir "$work/store-planned" --log "$work/train-planned.losses"
        ;;
      torch)
        for model in gpt2 resnet18; do
          step "torch-$model-pytorch" python3 tools/torch_train_check.py --allocator pytorch \
            --model "$model" --out "$work/torch"
          step "torch-$model-terrace" python3 tools/torch_train_check.py --allocator terrace \
            --model "$model" --lib "$lib" --out "$work/torch"
          step "torch-$model-planned" python3 tools/torch_train_check.py --allocator terrace \
            --model "$model" --lib "$lib" --conf policy:planned --out "$work/torch-planned"
        done
        step pytorch-example env TERRACE_ALLOC_CONF=record_trace:true python3 tools/pytorch_example.py \
          --lib "$lib" --steps 12 --snapshot "$work/pytorch_example_snapshot.json"
        ;;
    esac
  done
  trap - TERM INT

  deliver
  rm -rf "$root"  # the binaries; the work folder stays, with the stores, for a look there
  ls -l "$out"
  echo "work folder: $work"
  echo
  cat "$out/summary.txt"
}

case "${1:-}" in
  pack) shift; pack "$@" ;;
  run) shift; run "$@" ;;
  *)
    echo "usage: tools/gpu_session.sh pack [BUILD_DIR]   (here)" >&2
    echo "       OUT=DIR tools/gpu_session.sh run GROUP... [--quick]   (there; GROUP: tests bench train torch all)" >&2
    exit 2
    ;;
esac

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
#       There, from the repository root, with `gpu-pack` carried. GROUP: tests (nvidia-smi and the
#       gpu-labelled test binaries), bench (bench_allocator, bench_adam_gpu), train (`terrace train
#       --device cuda` offloaded, resident, recomputed, planned), torch (GPT-2 and ResNet-18 in
#       PyTorch under its allocator, terrace's caching and planned policies, and the example), or
#       all. Each group fits one call (tests+bench in one, train+torch in another, with --quick if
#       time is short). Step logs and files go to a scratch folder; DIR receives summary.txt and
#       results.tar.gz (logs, JSON, losses) and snapshots-MODEL.tar.gz (the snapshots and traces:
#       test data).
#       The summary is printed last, so that it is in the call's output too.
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
  [[ -f gpu-pack/terrace-gpu.tar.gz ]] || {
    echo "gpu_session run: gpu-pack/terrace-gpu.tar.gz is missing: pack it here, carry gpu-pack" >&2
    return 2
  }
  local out="${OUT:-gpu-out}"
  local root=/tmp/terrace-gpu
  local work=/tmp/terrace-gpu-work
  rm -rf "$root" "$work"
  mkdir -p "$root" "$work/torch" "$work/torch-planned" "$out"
  tar xzf gpu-pack/terrace-gpu.tar.gz -C "$root"
  export LD_LIBRARY_PATH="$root/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export TERRACE_SOURCE_DIR="$PWD"  # where bench_adam_gpu finds tools/bench_adam_torch.py
  export PYTHONUNBUFFERED=1
  # cuBLAS for the cuda char model: PyTorch's pip wheels keep it in site-packages/nvidia/...
  if [[ -z "${TERRACE_CUBLAS_LIBRARY:-}" ]] && ! ldconfig -p | grep -q 'libcublas\.so\.13'; then
    local found
    found="$(python3 -c 'import glob, os, nvidia
paths = [p for base in nvidia.__path__
         for p in glob.glob(os.path.join(base, "**", "libcublas.so.13"), recursive=True)]
print(sorted(paths)[0] if paths else "")' 2>/dev/null)"
    if [[ -n "$found" ]]; then
      export TERRACE_CUBLAS_LIBRARY="$found"
      # libcublas.so.13 loads libcublasLt.so.13 beside it; its own run path may not say so.
      export LD_LIBRARY_PATH="$(dirname "$found"):$LD_LIBRARY_PATH"
    fi
  fi
  local summary="$work/summary.txt"
  {
    echo "gpu_session $(date -u +%FT%TZ) groups: ${groups[*]}$([[ $quick -eq 1 ]] && echo ' --quick')"
    echo "cuBLAS: ${TERRACE_CUBLAS_LIBRARY:-found by the loader}"
  } > "$summary"

  step() {  # step NAME COMMAND...: its output in NAME.log, its status and time in the summary
    local name="$1"
    shift
    local t0=$SECONDS
    echo "== $name: $*" > "$work/$name.log"
    "$@" >> "$work/$name.log" 2>&1
    local rc=$?
    printf '%-28s rc=%-3d %5ds\n' "$name" "$rc" $((SECONDS - t0)) | tee -a "$summary"
    tail -n 4 "$work/$name.log"
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

  # What comes back: the summary, the small results, and the snapshots apart (they may be large).
  cp "$summary" "$out/summary.txt"
  (cd "$work" && tar czf "$out/results.tar.gz" --exclude='store-*' --exclude='*snapshot*' \
    --exclude='*.pickle' --exclude='*_trace.jsonl' .)
  # One archive per model, so that one too large to come back (16 MiB) does not hold the others.
  for model in gpt2 resnet18 pytorch_example; do
    (cd "$work" && find . \( -name '*snapshot*' -o -name '*.pickle' -o -name '*_trace.jsonl' \) \
      -name "*$model*" | tar czf "$out/snapshots-$model.tar.gz" -T -)
  done
  ls -l "$out"
  echo
  cat "$summary"
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

#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Everything the issues' GPU steps need, in one call on a lent GPU machine, where nothing can be
# installed: run it from the repository root with the build folder carried (built here with CUDA:
# `tools/build.sh build Release`). Each step's output goes to $OUT/<step>.log (and its files next
# to it); a failing step is recorded and the next one runs. The summary at the end lists each
# step's exit status. Results are then written up in docs/gpu-<date>-<device>.md by hand.
#
#   OUT=/path/to/out tools/gpu_session.sh [BUILD_DIR] [--quick]
#
# --quick: fewer steps and repetitions (a first look when the device time left is short).
set -u

build="build"
quick=0
for arg in "$@"; do
  case "$arg" in
    --quick) quick=1 ;;
    *) build="$arg" ;;
  esac
done
out="${OUT:-gpu-out}"
mkdir -p "$out"
summary="$out/summary.txt"
: > "$summary"

step() {  # step NAME COMMAND...: runs it, its output in $OUT/NAME.log, its status in the summary
  local name="$1"
  shift
  local t0=$SECONDS
  echo "== $name: $*" | tee -a "$out/$name.log"
  "$@" >> "$out/$name.log" 2>&1
  local rc=$?
  printf '%-32s rc=%-3d %5ds\n' "$name" "$rc" $((SECONDS - t0)) | tee -a "$summary"
  tail -n 5 "$out/$name.log"
}

steps=$((quick ? 20 : 100))
reps=$((quick ? 3 : 5))

step nvidia-smi nvidia-smi
step ctest-gpu ctest --test-dir "$build" -L gpu --output-on-failure
step bench-allocator "$build/tools/bench_allocator" --benchmark_repetitions="$reps" \
  --benchmark_format=json --benchmark_out="$out/bench_allocator.json"
step bench-adam-gpu "$build/tools/bench_adam_gpu" --reps $((reps * 4))

# The main job on the GPU: offloaded (a 32 MiB budget: the 297 MiB state is 9x it), its resident
# peer, and the variants (activation recompute, the planned policy live); same losses expected.
train=("$build/tools/terrace" train --device cuda --fresh --steps "$steps" --no-report --quiet)
step train-offloaded "${train[@]}" --device-budget 32MiB --dir "$out/train-offloaded" \
  --log "$out/train-offloaded.losses"
step train-resident "${train[@]}" --resident --dir "$out/train-resident" \
  --log "$out/train-resident.losses"
step train-recompute "${train[@]}" --device-budget 32MiB --recompute --dir "$out/train-recompute" \
  --log "$out/train-recompute.losses"
step train-planned "${train[@]}" --device-budget 256MiB --alloc-conf policy:planned \
  --dir "$out/train-planned" --log "$out/train-planned.losses"

# terrace inside PyTorch (CUDAPluggableAllocator): each model under PyTorch's allocator (its
# snapshot is test data), under terrace's caching policy and under the planned policy.
lib="$build/allocator/libterrace.so"
for model in gpt2 resnet18; do
  step "torch-$model-pytorch" python3 tools/torch_train_check.py --allocator pytorch \
    --model "$model" --out "$out/torch"
  step "torch-$model-terrace" python3 tools/torch_train_check.py --allocator terrace \
    --model "$model" --lib "$lib" --out "$out/torch"
  step "torch-$model-planned" python3 tools/torch_train_check.py --allocator terrace \
    --model "$model" --lib "$lib" --conf policy:planned --out "$out/torch-planned"
done
step pytorch-example env TERRACE_ALLOC_CONF=record_trace:true python3 tools/pytorch_example.py --lib "$lib" \
  --steps 12 --snapshot "$out/pytorch_example_snapshot.json"

echo
cat "$summary"

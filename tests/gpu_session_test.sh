#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# tools/gpu_session.sh's dry run, here, as far as a machine without a GPU allows: the pack holds
# every binary the run half uses and every shared library they need besides the C and C++
# runtimes, within the 64 MiB a call may carry; the run half says when there is no GPU, counts the
# GoogleTest cases that skipped, stops a step at its own limit with the results of the others
# kept, leaves out of an archive what is too large to come back, and puts in $OUT no more than a
# call brings back (8 files of under 16 MiB, 64 MiB together, plain names, 2 folders down).
#   tests/gpu_session_test.sh BUILD_DIR   (a build with CUDA and the benchmarks; else exit 77)
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="$(cd "${1:?usage: gpu_session_test.sh BUILD_DIR}" && pwd)"
for f in tools/terrace tools/bench_allocator tools/bench_adam_gpu allocator/libterrace.so; do
  [[ -f "$build/$f" ]] || { echo "SKIP: $build/$f is not built (CUDA and benchmarks)"; exit 77; }
done
compgen -G "$build/tests/*_gpu_test" > /dev/null || { echo "SKIP: no gpu tests in $build"; exit 77; }

scratch="$(mktemp -d "${TMPDIR:-/tmp}/gpu_session_test.XXXXXX")"
trap 'rm -rf "$scratch"' EXIT
failed=0
fail() { echo "FAIL: $*"; failed=1; }

# A repository root of its own, so that the checkout's gpu-pack/ is left alone.
mkdir -p "$scratch/repo/tools" "$scratch/tmp" "$scratch/stub"
cp "$root/tools/gpu_session.sh" "$scratch/repo/tools/"
(cd "$scratch" && repo/tools/gpu_session.sh pack "$build") || { echo "FAIL: pack"; exit 1; }
pack="$scratch/repo/gpu-pack/terrace-gpu.tar.gz"
size=$(stat -c %s "$pack")
echo "pack: $size bytes"
[[ $size -lt $((48 * 1024 * 1024)) ]] || fail "the pack is $size bytes: with the tree, over what a call carries"

# Each binary finds every library in the pack, except the runtimes any Linux has.
mkdir -p "$scratch/unpacked"
tar xzf "$pack" -C "$scratch/unpacked"
for bin in tools/terrace tools/bench_allocator tools/bench_adam_gpu lib/libterrace.so; do
  [[ -f "$scratch/unpacked/$bin" ]] || fail "the pack lacks $bin"
done
for bin in "$scratch"/unpacked/tests/* "$scratch"/unpacked/tools/* "$scratch"/unpacked/lib/*; do
  libs="$(LD_LIBRARY_PATH="$scratch/unpacked/lib" ldd "$bin")"
  if grep -q 'not found' <<<"$libs"; then fail "$(basename "$bin"): $(grep 'not found' <<<"$libs")"; fi
  while read -r name path; do
    [[ "$path" == "$scratch/unpacked/lib/"* ]] ||
      [[ "$name" =~ ^(libc|libm|libstdc\+\+|libgcc_s|libpthread|libdl|librt)\.so ]] ||
      fail "$(basename "$bin") takes $name from $path, outside the pack"
  done < <(awk '/=> \// {print $1, $3}' <<<"$libs")
done

# A python3 that stands in for PyTorch's: each torch step writes its files, the GPT-2 one with
# PyTorch's allocator a snapshot too large to come back (random bytes do not compress).
cat > "$scratch/stub/python3" <<'EOF'
#!/usr/bin/env bash
[[ "${1:-}" == -c ]] && exit 0  # the look for cuBLAS in PyTorch's wheels: none
out=. model=x allocator=x snapshot=
while [[ $# -gt 0 ]]; do
  case "$1" in
    --out) out="$2"; shift ;;
    --model) model="$2"; shift ;;
    --allocator) allocator="$2"; shift ;;
    --snapshot) snapshot="$2"; shift ;;
  esac
  shift
done
if [[ -n "$snapshot" ]]; then echo '{}' > "$snapshot"; exit 0; fi
mkdir -p "$out"
echo '{}' > "$out/${model}_${allocator}_summary.json"
if [[ "$model/$allocator" == gpt2/pytorch ]]; then
  head -c $((20 * 1024 * 1024)) /dev/urandom > "$out/${model}_${allocator}_snapshot.pickle"
else
  echo '{}' > "$out/${model}_${allocator}_snapshot.json"
fi
EOF
chmod +x "$scratch/stub/python3"

# A step limit of 3 s: bench_allocator takes longer, here and there.
out="$scratch/out"
(cd "$scratch/repo" && OUT="$out" TMPDIR="$scratch/tmp" GPU_SESSION_STEP_TIMEOUT=3 \
  PATH="$scratch/stub:$PATH" tools/gpu_session.sh run tests bench torch --quick) > "$scratch/run.log" 2>&1 ||
  fail "run exited $?"
summary="$out/summary.txt"
[[ -f "$summary" ]] || { cat "$scratch/run.log"; echo "FAIL: no summary.txt"; exit 1; }
cat "$summary"
if ! nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
  grep -q '^GPU: NONE' "$summary" || fail "the summary does not say that there is no GPU"
  for t in "$scratch"/unpacked/tests/*_gpu_test; do
    grep -qE "^$(basename "$t") +rc=0 .*: 0 passed, [1-9][0-9]* skipped, 0 failed \(ALL SKIPPED\)" "$summary" ||
      fail "the summary does not count $(basename "$t")'s skipped cases"
  done
fi
grep -qE '^bench-allocator +rc=124 .*TIMED OUT' "$summary" || fail "bench-allocator was not stopped at its limit"
grep -qE '^torch-resnet18-planned +rc=0 ' "$summary" || fail "the steps after the stopped one did not run"
# (Each listing is read whole: grep -q would end tar early, which pipefail reports.)
listing() { tar tzf "$1" 2>&1; }
grep -qx './bench-allocator.log' <<<"$(listing "$out/results.tar.gz")" || fail "the stopped step's log is not kept"
grep -q 'snapshots-gpt2.tar.gz: left out ./torch/gpt2_pytorch_snapshot.pickle (20 MiB)' "$summary" ||
  fail "the summary does not name the snapshot left out"
grep -qx './torch/gpt2_terrace_snapshot.json' <<<"$(listing "$out/snapshots-gpt2.tar.gz")" ||
  fail "snapshots-gpt2.tar.gz lacks what fits"
tar tzf "$out/snapshots-resnet18.tar.gz" > /dev/null || fail "no snapshots-resnet18.tar.gz"
# The unpacked binaries are removed; the work folder stays (a look there, on that machine).
for d in "$scratch"/tmp/*/; do
  [[ ! -e "$d/pack" ]] || fail "the run left its unpacked binaries in $d"
done

# What a call brings back.
count=0 total=0
while IFS= read -r -d '' f; do
  count=$((count + 1))
  s=$(stat -c %s "$f")
  total=$((total + s))
  [[ $s -lt $((16 * 1024 * 1024)) ]] || fail "$f is $s bytes: over 16 MiB, it would not come back"
  rel="${f#"$out"/}"
  [[ "$rel" =~ ^[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+){0,2}$ ]] || fail "$rel: a name or depth that does not come back"
done < <(find "$out" -type f -print0)
[[ $count -le 8 ]] || fail "$count files in OUT: at most 8 come back"
[[ $total -lt $((64 * 1024 * 1024)) ]] || fail "$total bytes in OUT: over the 64 MiB that come back"
[[ $failed -eq 0 ]] && echo "OK: $count files, $total bytes in OUT"
exit $failed

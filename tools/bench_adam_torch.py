#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The comparison half of tools/bench_adam: times torch.optim.AdamW or DeepSpeedCPUAdam on one
flat tensor of N parameters and prints one line that bench_adam parses:

    RESULT <impl> <median seconds per step>      or      UNAVAILABLE <impl> <reason>

impl: torch (torch.optim.AdamW, fp32), deepspeed (DeepSpeedCPUAdam, fp32), deepspeed-mixed
(DeepSpeed's sequence of separate passes for a mixed-precision step: bf16 grads to fp32,
overflow check, unscale, DeepSpeedCPUAdam, bf16 copy of the params), torch-cuda
(torch.optim.AdamW(fused=True) on the GPU, fp32; for tools/bench_adam_gpu).

With --terrace-library PATH (libterrace.so), the CPU impls also time terrace's step of the same
configuration (fp32 AdamW; for deepspeed-mixed the fused mixed step: bf16 grads, unscale and check,
bf16 copy) through the C ABI, interleaved with theirs step by step, and print

    PAIRED <impl> <median of their time / terrace's per pair> <lowest> <highest>

The host's memory bandwidth drifts by tens of percent within a minute on a shared machine (two
runs of minutes apart once gave DeepSpeed 0.58x and 1.08x of terrace): a ratio of adjacent
steps cancels the drift, where a ratio of medians taken minutes apart does not."""
import argparse
import statistics
import sys
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", required=True, choices=["torch", "deepspeed", "deepspeed-mixed", "torch-cuda"])
    ap.add_argument("--params", type=int, default=100_000_000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--terrace-library", default="")
    a = ap.parse_args()
    try:
        import torch
    except ImportError as e:
        print(f"UNAVAILABLE {a.impl} torch not importable by {sys.executable}: {e}")
        return
    if a.impl == "torch-cuda":
        cuda_step(torch, a)
        return
    torch.set_num_threads(a.threads)
    n = a.params
    p = torch.nn.Parameter(torch.randn(n) * 0.1)
    p.grad = torch.randn(n) * 0.01
    if a.impl == "torch":
        opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.01)
        run = opt.step
    else:
        try:
            from deepspeed.ops.adam import DeepSpeedCPUAdam
        except Exception as e:  # ImportError, or its op failing to build
            print(f"UNAVAILABLE {a.impl} deepspeed not importable: {type(e).__name__}: {e}".replace("\n", " "))
            return
        opt = DeepSpeedCPUAdam([p], lr=1e-3, weight_decay=0.01, adamw_mode=True)
        if a.impl == "deepspeed":
            run = opt.step
        else:
            grad16 = (torch.randn(n) * 1024).to(torch.bfloat16)
            param16 = torch.empty(n, dtype=torch.bfloat16)
            inv_scale = 1.0 / 1024

            def run():
                p.grad.copy_(grad16)                    # bf16 grads in, fp32 for the optimizer
                if not torch.isfinite(p.grad).all():    # overflow check
                    return
                p.grad.mul_(inv_scale)                  # unscale
                opt.step()
                param16.copy_(p.detach())               # bf16 params back for the GPU
    ours = terrace_step(torch, a) if a.terrace_library else None
    with torch.no_grad():
        run()  # warm-up: state allocation, JIT
        if ours:
            ours()
        times, ratios = [], []
        for _ in range(a.reps):
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
            if ours:
                t0 = time.perf_counter()
                ours()
                ratios.append(times[-1] / (time.perf_counter() - t0))
    print(f"RESULT {a.impl} {statistics.median(times):.6f}")
    if ratios:
        print(f"PAIRED {a.impl} {statistics.median(ratios):.4f} {min(ratios):.4f} {max(ratios):.4f}")


def terrace_step(torch, a):
    """terrace's step of the configuration a.impl stands beside, on buffers of its own, through
    the C ABI of terrace/optimizer.h (ctypes)."""
    import ctypes
    lib = ctypes.CDLL(a.terrace_library)
    P = ctypes.c_void_p
    lib.terrace_adam_create.argtypes = [ctypes.c_int] + [ctypes.c_double] * 5 + [
        ctypes.c_int, ctypes.c_int, ctypes.POINTER(P)]
    lib.terrace_adam_step.argtypes = [P, ctypes.c_size_t] + [ctypes.POINTER(P)] * 5 + [
        ctypes.POINTER(ctypes.c_size_t), ctypes.c_int, ctypes.c_int, ctypes.c_float,
        ctypes.c_float, ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
    lib.terrace_last_error.restype = ctypes.c_char_p
    f32, bf16, adamw = 0, 1, 1
    handle = P()
    if lib.terrace_adam_create(adamw, 1e-3, 0.9, 0.999, 1e-8, 0.01, f32, a.threads,
                               ctypes.byref(handle)) != 0:
        raise RuntimeError(lib.terrace_last_error().decode())
    n = a.params
    mixed = a.impl == "deepspeed-mixed"
    param = torch.randn(n) * 0.1
    m, v = torch.zeros(n), torch.zeros(n)
    grad = ((torch.randn(n) * 1024).to(torch.bfloat16) if mixed else torch.randn(n) * 0.01)
    copy = torch.empty(n, dtype=torch.bfloat16) if mixed else None
    one = lambda t: (P * 1)(t.data_ptr())
    sizes = (ctypes.c_size_t * 1)(n)
    buffers = (param, m, v, grad, copy, handle, lib)  # kept alive by the closure

    def step():
        stepped = ctypes.c_int(-1)
        rc = lib.terrace_adam_step(handle, 1, one(param), one(m), one(v), one(grad),
                                   one(copy) if mixed else None, sizes, bf16 if mixed else f32,
                                   bf16, 1024.0 if mixed else 1.0, 1.0, int(mixed),
                                   ctypes.byref(stepped))
        if rc != 0 or stepped.value != 1:
            raise RuntimeError(f"terrace_adam_step: {lib.terrace_last_error().decode()}")
        assert buffers
    return step


def cuda_step(torch, a):
    if not torch.cuda.is_available():
        print(f"UNAVAILABLE {a.impl} torch {torch.__version__} sees no CUDA device")
        return
    n = a.params
    p = torch.nn.Parameter(torch.zeros(n, device="cuda"))
    p.grad = torch.zeros(n, device="cuda")
    opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.01, fused=True)
    with torch.no_grad():
        for _ in range(2):
            opt.step()  # warm-up: state allocation
        times = []
        for _ in range(a.reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            opt.step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    print(f"RESULT {a.impl} {statistics.median(times):.6f}")


if __name__ == "__main__":
    main()

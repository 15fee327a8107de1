#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The comparison half of tools/bench_adam: times torch.optim.AdamW or DeepSpeedCPUAdam on one
flat tensor of N parameters and prints one line that bench_adam parses:

    RESULT <impl> <median seconds per step>      or      UNAVAILABLE <impl> <reason>

impl: torch (torch.optim.AdamW, fp32), deepspeed (DeepSpeedCPUAdam, fp32), deepspeed-mixed
(DeepSpeed's sequence of separate passes for a mixed-precision step: bf16 grads to fp32,
overflow check, unscale, DeepSpeedCPUAdam, bf16 copy of the params), torch-cuda
(torch.optim.AdamW(fused=True) on the GPU, fp32; for tools/bench_adam_gpu)."""
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
    with torch.no_grad():
        run()  # warm-up: state allocation, JIT
        times = []
        for _ in range(a.reps):
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
    print(f"RESULT {a.impl} {statistics.median(times):.6f}")


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

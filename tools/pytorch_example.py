#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""terrace as PyTorch's CUDA allocator: the lines a user writes, a tiny training loop, and the
stats that PyTorch's own memory_stats() cannot give for a pluggable allocator.

    python3 tools/pytorch_example.py [--lib build/allocator/libterrace.so] [--steps 20]

Needs PyTorch 2.x with CUDA and a GPU; exits with a message otherwise. terrace reads its config
from TERRACE_ALLOC_CONF (e.g. TERRACE_ALLOC_CONF=max_split_size_mb:256,record_trace:true).
"""
import argparse
import ctypes
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lib", default=os.environ.get("TERRACE_LIBRARY",
                                                    os.path.join(HERE, "..", "build", "allocator",
                                                                 "libterrace.so")))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--snapshot", help="also write terrace's snapshot JSON here")
    args = ap.parse_args()
    lib_path = os.path.abspath(args.lib)

    try:
        import torch
    except ImportError:
        sys.exit("pytorch_example: PyTorch is not installed (pip install torch); nothing to do")
    if not hasattr(torch.cuda.memory, "CUDAPluggableAllocator"):
        sys.exit(f"pytorch_example: PyTorch {torch.__version__} has no CUDAPluggableAllocator "
                 "(it needs PyTorch 2.0 or later)")
    if not torch.cuda.is_available():
        sys.exit("pytorch_example: no CUDA device is available; this example needs a GPU "
                 "(terrace itself runs without one: see tests/c_api_test.cpp)")
    if not os.path.exists(lib_path):
        sys.exit(f"pytorch_example: {lib_path} does not exist: build it with "
                 "`ninja -C build terrace_c` or pass --lib")

    # ---- the lines a user writes: load libterrace.so as PyTorch's allocator, before any tensor
    #      is created on the GPU. The optional hooks route torch.cuda.empty_cache(),
    #      set_per_process_memory_fraction() and Tensor.record_stream() to terrace, and refuse
    #      CUDA graph capture (terrace_torch.install() does all of this).
    terrace = ctypes.CDLL(lib_path)
    # terrace_torch_malloc raises an error PyTorch turns into RuntimeError where terrace_malloc
    # would return NULL, which PyTorch does not check.
    alloc = torch.cuda.memory.CUDAPluggableAllocator(lib_path, "terrace_torch_malloc",
                                                     "terrace_torch_free")
    hooks = alloc.allocator()
    fn = lambda name: ctypes.cast(getattr(terrace, name), ctypes.c_void_p).value  # noqa: E731
    hooks.set_init_fn(fn("terrace_init"))                       # void(int device_count)
    hooks.set_reset_fn(fn("terrace_empty_cache"))               # void()
    hooks.set_memory_fraction_fn(fn("terrace_set_memory_fraction"))  # void(double, int)
    hooks.set_record_stream_fn(fn("terrace_record_stream"))     # void(void*, cudaStream_t)
    # CUDA graphs need a private pool, which terrace lacks: this hook refuses a capture before it
    # begins. Without it PyTorch would let the capture run and terrace would hand the graph's
    # blocks to other tensors while replays still write them.
    if hasattr(hooks, "set_begin_allocate_to_pool"):
        hooks.set_begin_allocate_to_pool(fn("terrace_torch_begin_allocate_to_pool"))
    torch.cuda.memory.change_current_allocator(alloc)
    # ---- that is all: every CUDA tensor below comes from terrace.

    sys.path.insert(0, HERE)
    import terrace_torch  # ctypes wrappers over the same loaded library, errors as exceptions

    tt = terrace_torch.load(lib_path)

    torch.manual_seed(0)
    # One device throughout: the marks, the stats and the snapshot are per device.
    device = torch.device("cuda", torch.cuda.current_device())
    index = device.index
    model = torch.nn.Sequential(
        torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024),
        torch.nn.GELU(), torch.nn.Linear(1024, 10)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(args.steps):
        # Step marks for the planned policy (TERRACE_ALLOC_CONF=policy:planned); no-ops otherwise.
        tt.begin_iteration(index)
        batch = 64 + 32 * (step % 4)  # varying shapes exercise the cache as real data does
        x = torch.randn(batch, 1024, device=device)
        y = torch.randint(0, 10, (batch,), device=device)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        tt.end_iteration(index)
        if step % 5 == 0 or step == args.steps - 1:
            print(f"step {step:3d} loss {loss.item():.4f}")
    torch.cuda.synchronize()

    stats = tt.stats(index)
    MiB = 1 << 20
    print(json.dumps({
        "allocated_bytes.all.peak (MiB)": round(stats["allocated_bytes.all.peak"] / MiB, 1),
        "reserved_bytes.all.peak (MiB)": round(stats["reserved_bytes.all.peak"] / MiB, 1),
        "num_device_alloc": stats["num_device_alloc"],
        "num_alloc_retries": stats["num_alloc_retries"],
        "num_ooms": stats["num_ooms"],
        "num_bad_frees": stats["num_bad_frees"],
        "peak_fragmentation": round(stats["peak_fragmentation"], 4),
    }, indent=1))
    torch.cuda.empty_cache()  # the reset hook: terrace releases its cached segments
    print(f"after empty_cache: reserved "
          f"{tt.stats(index)['reserved_bytes.all.current'] / MiB:.1f} MiB")
    if args.snapshot:
        tt.dump_snapshot(args.snapshot, index)
        print(f"snapshot written to {args.snapshot}; convert it with "
              f"tools/terrace_to_torch_snapshot.py for pytorch.org/memory_viz")


if __name__ == "__main__":
    main()

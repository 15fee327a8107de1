#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The DeepSpeed half of tools/bench_nvme: DeepSpeed's async_io handle (libaio, O_DIRECT) writes
then reads the same bytes, in the same layout, on the same file as terrace's tensor store.

Layout: total // tensor tensors of `tensor` bytes each, tensor i at file offset i * tensor (where
the store's allocator puts them), sliced from one page-locked buffer. Write: every tensor is
submitted with async_pwrite, then one wait() (all in flight at once, as bench_nvme's puts); read:
the same with async_pread into a second locked buffer, then the bytes are compared (untimed).
The data are bench_nvme's: 8-byte words, word at byte offset i holding i * 0x9E3779B97F4A7C15.
The handle is aio_handle(block, qd, single_submit=False, overlap_events=True, threads=1),
DeepSpeed's own aio defaults (ds_config "aio") but for the block size and queue depth.

Prints one line that bench_nvme parses, MB = 10^6 bytes:

    RESULT {"write_mbps": <median>, "read_mbps": <median>, "write_runs": [...], ...}
    or      UNAVAILABLE <reason>

    bench_nvme_deepspeed.py --file F --total-bytes N --tensor-bytes S --block-bytes B --qd Q [--reps R]
    bench_nvme_deepspeed.py --check      (import deepspeed and load the aio op; RESULT {} or UNAVAILABLE)

Run it with a python whose path holds deepspeed (bench_nvme passes TERRACE_DEEPSPEED_PYTHONPATH
as PYTHONPATH). The first use compiles DeepSpeed's async_io op (minutes; cached afterwards in
TORCH_EXTENSIONS_DIR, by default ~/.cache/torch_extensions)."""
import argparse
import json
import os
import resource
import statistics
import sys
import time

GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)  # as a signed int64: torch multiplies with wrap-around


def unavailable(reason):
    print("UNAVAILABLE " + " ".join(str(reason).split()), flush=True)
    sys.exit(0)


def load_op():
    try:
        import torch  # noqa: F401
    except Exception as e:
        unavailable(f"torch not importable by {sys.executable}: {type(e).__name__}: {e}")
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder
    except Exception as e:
        unavailable(f"deepspeed not importable by {sys.executable}: {type(e).__name__}: {e}")
    builder = AsyncIOBuilder()
    if not builder.is_compatible(verbose=False):
        unavailable("DeepSpeed's async_io op is not compatible here (libaio-dev missing? apt-get install libaio-dev)")
    try:
        return builder.load(verbose=False)
    except Exception as e:  # the JIT build failing: no compiler, no ninja, ...
        unavailable(f"DeepSpeed's async_io op failed to build or load: {type(e).__name__}: {e}")


def can_lock(nbytes):
    """DeepSpeed's locked tensors are mlock()ed; a failed mlock aborts inside the op, so check first."""
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY or soft >= nbytes:
        return True
    if hard == resource.RLIM_INFINITY or hard >= nbytes:
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (hard, hard))
        return True
    with open("/proc/self/status") as f:  # CAP_IPC_LOCK (bit 14) ignores the limit
        for line in f:
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) & (1 << 14))
    return False


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="only load the op")
    ap.add_argument("--file")
    ap.add_argument("--total-bytes", type=int)
    ap.add_argument("--tensor-bytes", type=int)
    ap.add_argument("--block-bytes", type=int, default=1 << 20)
    ap.add_argument("--qd", type=int, default=16)
    ap.add_argument("--reps", type=int, default=1)
    a = ap.parse_args()

    op = load_op()
    if a.check:
        print("RESULT {}", flush=True)
        return
    if not a.file or not a.total_bytes or not a.tensor_bytes:
        ap.error("--file, --total-bytes and --tensor-bytes are required")
    import torch

    size = a.tensor_bytes
    n = a.total_bytes // size
    nbytes = n * size
    if n == 0 or size % 4096 or a.block_bytes % 4096:
        unavailable(f"tensor ({size}) and block ({a.block_bytes}) must be 4 KiB multiples, tensor <= total")
    if os.path.getsize(a.file) < nbytes:
        unavailable(f"{a.file} holds {os.path.getsize(a.file)} bytes, fewer than {nbytes}")
    if not can_lock(2 * nbytes):
        unavailable(f"cannot mlock {2 * nbytes} bytes (RLIMIT_MEMLOCK {resource.getrlimit(resource.RLIMIT_MEMLOCK)})")

    handle = op.aio_handle(a.block_bytes, a.qd, False, True, 1)
    example = torch.empty(0, dtype=torch.uint8)
    src = handle.new_cpu_locked_tensor(nbytes, example)
    dst = handle.new_cpu_locked_tensor(nbytes, example)
    words = torch.arange(0, nbytes, 8, dtype=torch.int64).mul_(GOLDEN)
    src.view(torch.int64).copy_(words)
    del words
    src_parts = [src[i * size:(i + 1) * size] for i in range(n)]
    dst_parts = [dst[i * size:(i + 1) * size] for i in range(n)]
    if not all(handle.is_pinned(p) for p in src_parts + dst_parts):
        unavailable("DeepSpeed does not see its own locked buffers as pinned (it would bounce every transfer)")

    def transfer(submit, parts):
        t0 = time.perf_counter()
        for i, p in enumerate(parts):
            if submit(p, a.file, i * size) != 0:
                if i:
                    handle.wait()  # the handle must not be destroyed with requests in flight
                unavailable(f"DeepSpeed aio submit failed on {a.file} at offset {i * size}")
        done = handle.wait()
        t = time.perf_counter() - t0
        if done != n:
            unavailable(f"DeepSpeed aio wait() completed {done} of {n} requests")
        return nbytes / 1e6 / t

    write, read = [], []
    for _ in range(a.reps):
        dst.zero_()
        write.append(transfer(handle.async_pwrite, src_parts))
        read.append(transfer(handle.async_pread, dst_parts))
        if not torch.equal(src, dst):
            unavailable(f"data mismatch after DeepSpeed's read of {a.file}")
    handle.free_cpu_locked_tensor(src)
    handle.free_cpu_locked_tensor(dst)
    print("RESULT " + json.dumps({
        "write_mbps": statistics.median(write),
        "read_mbps": statistics.median(read),
        "write_runs": [round(x, 1) for x in write],
        "read_runs": [round(x, 1) for x in read],
        "tensors": n,
        "tensor_bytes": size,
        "block_bytes": handle.get_block_size(),
        "queue_depth": handle.get_queue_depth(),
        "single_submit": handle.get_single_submit(),
        "overlap_events": handle.get_overlap_events(),
        "intra_op_parallelism": handle.get_intra_op_parallelism(),
    }), flush=True)


if __name__ == "__main__":
    main()

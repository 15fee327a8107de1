#!/usr/bin/env python3
"""Trains a few steps of a real model on a GPU with PyTorch's own allocator or with terrace's
libterrace.so (CUDAPluggableAllocator), and writes what each allocator did.

One allocator per process: PyTorch fixes its allocator at the first CUDA allocation.

    python3 tools/torch_train_check.py --allocator terrace --model gpt2 --lib build/allocator/libterrace.so --out out/
    python3 tools/torch_train_check.py --allocator pytorch --model gpt2 --out out/

Writes into --out: <model>_<allocator>_summary.json (losses, step times, peak figures), and
  - terrace: the stats JSON, the snapshot JSON, the trace (JSON lines) and the memory_viz pickle;
  - pytorch: torch.cuda.memory._dump_snapshot's pickle (a real allocation history for test data).
With terrace it then checks the hooks inside PyTorch (init, out of memory, record_stream, memory
fraction, graph-capture refusal; summary "hooks") and exits 1 if one fails.
"""
import argparse
import json
import os
import sys
import time


def import_or_exit(module, model):
    """The model's package, or a one-line reason to stop (nothing can be installed on a lent GPU)."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        sys.exit(f"the {model} check needs the Python package {module!r}, which does not import: {e}")


def build_model(name, torch):
    if name == "resnet18":
        torchvision = import_or_exit("torchvision", name)

        model = torchvision.models.resnet18(num_classes=100)

        def batch(step, device):
            g = torch.Generator(device="cpu").manual_seed(step)
            x = torch.randn(64, 3, 128, 128, generator=g).to(device)
            y = torch.randint(0, 100, (64,), generator=g).to(device)
            return x, y

        def loss_fn(model, x, y):
            return torch.nn.functional.cross_entropy(model(x), y)

        return model, batch, loss_fn
    if name == "gpt2":
        transformers = import_or_exit("transformers", name)

        cfg = transformers.GPT2Config(n_layer=6, n_embd=768, n_head=12, n_positions=512,
                                      vocab_size=50257)
        model = transformers.GPT2LMHeadModel(cfg)

        def batch(step, device):
            g = torch.Generator(device="cpu").manual_seed(step)
            # Varying sequence lengths make the trace non-trivial, as real fine-tuning data is.
            seq = [512, 384, 512, 448][step % 4]
            ids = torch.randint(0, cfg.vocab_size, (8, seq), generator=g).to(device)
            return ids, ids

        def loss_fn(model, x, y):
            return model(input_ids=x, labels=y).loss

        return model, batch, loss_fn
    raise SystemExit(f"unknown model {name!r}: use resnet18 or gpt2")


def check_terrace_hooks(torch, tt, device, summary, tag, planned):
    """What terrace's hooks do inside real PyTorch, none of which a machine without a GPU can run:
    each check's outcome goes into summary["hooks"]; returns the names of those that failed."""
    results = {}

    def check(name, ok, detail):
        results[name] = ("ok: " if ok else "FAILED: ") + detail
        print(f"[{tag}] hook {name}: {results[name]}", flush=True)

    def first_line(e):
        return str(e).splitlines()[0][:300] if str(e) else type(e).__name__

    # init: PyTorch passes the device count at CUDA's lazy init; terrace then refuses the next index.
    count = torch.cuda.device_count()
    try:
        tt.stats(count)
        check("init", False, f"terrace accepted device {count}: terrace_init was not called")
    except tt.TerraceError as e:
        check("init", "terrace_init was told" in e.message, first_line(e.message))

    # malloc: out of memory must raise RuntimeError with terrace's report (a NULL returned to
    # PyTorch would have become a tensor at address 0), and allocation must go on afterwards.
    try:
        torch.empty(1 << 50, dtype=torch.uint8, device=device)
        check("oom", False, "a 1 PiB tensor was allocated")
    except RuntimeError as e:
        after = torch.ones(1 << 20, device=device).sum().item()
        check("oom", str(e).startswith("CUDA out of memory. ") and "terrace_torch_malloc" in str(e)
              and after == float(1 << 20), first_line(e))

    # record_stream: Tensor.record_stream reaches terrace_record_stream, which knows the block,
    # and the free then waits for an event on that stream: until the next allocation polls it,
    # the block is active but not allocated (PyTorch's active_pending_free). The planned
    # policy's arena blocks keep books of their own, so the gap is not required there.
    side = torch.cuda.Stream()
    x = torch.ones(1 << 20, device=device)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        y = x * 2
    x.record_stream(side)
    error = tt.last_error()  # the hook ran on this thread
    del x, y
    stats = tt.stats()
    gap = stats["active_bytes.all.current"] - stats["allocated_bytes.all.current"]
    torch.cuda.synchronize()
    check("record_stream", error == "" and (gap >= 4 << 20 or planned),
          (error or "no terrace error") + f", {gap} bytes awaiting the side stream after the free")

    # memory fraction: 0 allows no new memory; 1 gives the device back.
    request = torch.cuda.get_device_properties(device).total_memory // 4
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(0.0)
    try:
        torch.empty(request, dtype=torch.uint8, device=device)
        refused = None
    except RuntimeError as e:
        refused = e
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    try:
        torch.empty(request, dtype=torch.uint8, device=device)
        check("memory_fraction", refused is not None,
              f"{request} bytes " + ("refused at 0, given at 1" if refused else "given at 0"))
    except RuntimeError as e:
        check("memory_fraction", False, f"{request} bytes refused at fraction 1: {first_line(e)}")

    # graph capture: refused before it begins, as a RuntimeError carrying terrace's reason. Eager
    # work goes on (on the capture's side stream: torch.cuda.graph entered it before capture_begin
    # raised, and its __exit__ does not run).
    static = torch.zeros(1024, device=device)
    try:
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            static.add_(1)
        check("graph_capture", False, "captured: NOT REFUSED")
    except RuntimeError as e:
        check("graph_capture", "CUDA graph capture on device" in str(e), first_line(e))
    static.add_(1)
    torch.cuda.synchronize()
    eager = float(static.sum())
    check("eager_after_graph_refusal", eager == 1024.0, f"sum {eager} (expected 1024)")

    summary["hooks"] = results
    return [name for name, outcome in results.items() if not outcome.startswith("ok")]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--allocator", choices=["terrace", "pytorch"], required=True)
    ap.add_argument("--model", choices=["resnet18", "gpt2"], default="gpt2")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--lib", default=None,
                    help="libterrace.so (default: $TERRACE_LIBRARY, else build/allocator/ of this checkout)")
    ap.add_argument("--conf", default="", help="TERRACE_ALLOC_CONF for the terrace run")
    ap.add_argument("--out", default="out")
    args = ap.parse_args()

    try:
        import torch
    except ImportError:
        sys.exit("torch is not installed: this check needs PyTorch with CUDA")
    if not torch.cuda.is_available():
        sys.exit("no CUDA device: this check needs a GPU")

    os.makedirs(args.out, exist_ok=True)
    tag = f"{args.model}_{args.allocator}"
    tt = None
    if args.allocator == "terrace":
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import terrace_torch as tt

        if args.conf:
            os.environ["TERRACE_ALLOC_CONF"] = args.conf
        tt.install(args.lib)
        tt.record_trace(True)
    else:
        torch.cuda.memory._record_memory_history(max_entries=200000)

    torch.manual_seed(0)
    device = torch.device("cuda")
    model, batch, loss_fn = build_model(args.model, torch)
    model = model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    losses, times = [], []
    for step in range(args.steps):
        x, y = batch(step, device)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_fn(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
        print(f"[{tag}] step {step:3d} loss {losses[-1]:.4f} time {times[-1]*1e3:7.1f} ms", flush=True)

    summary = {"model": args.model, "allocator": args.allocator, "steps": args.steps,
               "losses": losses, "step_seconds": times,
               "device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    if tt is not None:
        stats = tt.stats()
        summary.update({k: stats[k] for k in ("allocated_bytes.all.peak", "reserved_bytes.all.peak",
                                              "num_device_alloc", "num_alloc_retries", "num_ooms",
                                              "peak_fragmentation")})
        with open(os.path.join(args.out, f"{tag}_stats.json"), "w") as f:
            json.dump(stats, f, indent=1, sort_keys=True)
        snap_json = os.path.join(args.out, f"{tag}_snapshot.json")
        tt.dump_snapshot(snap_json)
        tt.dump_trace(os.path.join(args.out, f"{tag}_trace.jsonl"))
        import subprocess

        subprocess.run([sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                     "terrace_to_torch_snapshot.py"),
                        snap_json, os.path.join(args.out, f"{tag}_memory_viz.pickle")], check=True)
    else:
        s = torch.cuda.memory_stats()
        summary.update({"allocated_bytes.all.peak": s["allocated_bytes.all.peak"],
                        "reserved_bytes.all.peak": s["reserved_bytes.all.peak"],
                        "num_device_alloc": s.get("num_device_alloc"),
                        "num_alloc_retries": s["num_alloc_retries"], "num_ooms": s["num_ooms"]})
        summary["peak_fragmentation"] = 1 - s["active_bytes.all.peak"] / max(1, s["reserved_bytes.all.peak"])
        torch.cuda.memory._dump_snapshot(os.path.join(args.out, f"{tag}_snapshot.pickle"))
        torch.cuda.memory._record_memory_history(enabled=None)
    failed = (check_terrace_hooks(torch, tt, device, summary, tag, "policy:planned" in args.conf)
              if tt is not None else [])
    med = sorted(times[2:])[len(times[2:]) // 2] if len(times) > 2 else times[-1]
    summary["median_step_seconds_after_warmup"] = med
    with open(os.path.join(args.out, f"{tag}_summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(f"[{tag}] peak allocated {summary['allocated_bytes.all.peak']/2**20:.1f} MiB, "
          f"peak reserved {summary['reserved_bytes.all.peak']/2**20:.1f} MiB, "
          f"peak fragmentation {summary['peak_fragmentation']:.3f}, median step {med*1e3:.1f} ms")
    if failed:
        sys.exit(f"[{tag}] terrace's PyTorch hooks failed: {', '.join(failed)} (see the summary)")


if __name__ == "__main__":
    main()

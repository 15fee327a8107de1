#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Converts terrace's snapshot JSON into the pickle that https://pytorch.org/memory_viz opens.

    python3 tools/terrace_to_torch_snapshot.py snapshot.json out.pickle [--trace trace.jsonl]

The input is what terrace_dump_snapshot (write_snapshot_json) writes:
    {"device": 0, "segments": [{address, total_size, ..., blocks: [...]}], "device_traces": [[...]]}
The output is the dict torch.cuda.memory._snapshot() returns, pickled:
    {"segments": [...], "device_traces": [[...], ...]}
with PyTorch's field names. `--trace` (terrace_dump_trace's JSON lines) replaces the snapshot's own
trace, e.g. when the snapshot was taken with recording off. Block tags become a one-frame stack
so that memory_viz shows them where it shows Python stacks. A block's events (alloc,
free_requested, free_completed) give the bytes requested as their size, as PyTorch's do, not the
rounded block terrace records. An `oom` event carries `device_free` in place of `addr`, as
PyTorch writes it; terrace does not record the device's free memory at an out-of-memory, so it
is 0. Every number must be a non-negative integer, every tag a string, and a segment's blocks
must tile it (memory_viz places each block at its segment's address plus the sizes before it).
Only the standard library is used.
"""
import argparse
import json
import pickle
import sys

# Block states memory_viz knows; terrace's "unmapped" (expandable address space with no memory
# behind it) is not memory at all, and PyTorch reports only the mapped runs of such segments.
_BLOCK_STATES = ("active_allocated", "active_pending_free", "inactive")
_TRACE_ACTIONS = ("alloc", "free_requested", "free_completed", "segment_alloc", "segment_free",
                  "segment_map", "segment_unmap", "oom", "snapshot")
# Events about one block, whose size PyTorch gives as the bytes requested.
_BLOCK_ACTIONS = ("alloc", "free_requested", "free_completed")
# terrace's own: the caller's begin_iteration / end_iteration. memory_viz does not know them.
_ITERATION_MARKS = ("iteration_begin", "iteration_end")
# PyTorch lists one trace per device ordinal, so a wild ordinal would make millions of empty lists.
_MAX_DEVICE = 1023


class SnapshotFormatError(ValueError):
    """The input is not a terrace snapshot or trace; the message says where and why."""


def _field(obj, names, where, default=None):
    """The first of `names` present in `obj`, which must be a non-negative integer (addresses,
    sizes, streams and times all are; terrace's own reader refuses a negative one too); `default`
    if none is (a missing field is an error when `default` is None)."""
    for name in names:
        if name in obj:
            value = obj[name]
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise SnapshotFormatError(
                    f"{where}: field '{name}' must be a non-negative integer, got {value!r}")
            return value
    if default is None:
        raise SnapshotFormatError(f"{where}: missing field '{names[0]}'")
    return default


def _frames(obj, where):
    """The object's tag as a one-frame stack. memory_viz reads a frame's name as a string."""
    tag = obj.get("tag", "")
    if not isinstance(tag, str):
        raise SnapshotFormatError(f"{where}: field 'tag' must be a string, got {tag!r}")
    return [{"filename": "<terrace tag>", "line": 0, "name": tag}] if tag else []


def _torch_block(block, where):
    state = block.get("state")
    if state not in _BLOCK_STATES:
        raise SnapshotFormatError(f"{where}: unknown block state {state!r}")
    return {
        "address": _field(block, ("address", "addr"), where),
        "size": _field(block, ("size",), where),
        "requested_size": _field(block, ("requested_size", "requested"), where, 0),
        "state": state,
        "frames": _frames(block, where),
    }


def _torch_segment(device, seg, address, total, blocks):
    return {
        "device": device,
        "address": address,
        "total_size": total,
        "allocated_size": sum(b["size"] for b in blocks if b["state"] == "active_allocated"),
        "active_size": sum(b["size"] for b in blocks if b["state"] != "inactive"),
        "requested_size": sum(b["requested_size"] for b in blocks if b["state"] != "inactive"),
        "stream": seg.get("stream", 0),
        "segment_type": seg["segment_type"],
        "segment_pool_id": (0, 0),
        "is_expandable": bool(seg.get("is_expandable", False)),
        "frames": [],
        "blocks": blocks,
    }


def _torch_segments(device, seg, where):
    """One terrace segment as PyTorch segments: itself, or the mapped runs of an expandable one."""
    if not isinstance(seg, dict):
        raise SnapshotFormatError(f"{where}: expected an object, got {seg!r}")
    address = _field(seg, ("address", "addr"), where)
    total = _field(seg, ("total_size",), where)
    _field(seg, ("stream",), where, 0)
    if seg.get("segment_type") not in ("small", "large"):
        if "is_small_pool" in seg:
            seg = dict(seg, segment_type="small" if seg["is_small_pool"] else "large")
        else:
            raise SnapshotFormatError(f"{where}: segment_type must be 'small' or 'large', "
                                      f"got {seg.get('segment_type')!r}")
    blocks = seg.get("blocks", [])
    if not isinstance(blocks, list):
        raise SnapshotFormatError(f"{where}: 'blocks' must be a list")
    # The blocks tile the segment's address range, and the mapped ones add up to its total_size
    # (an expandable segment's mapped bytes, write_snapshot_json's).
    converted, end, mapped = [], address, 0
    for i, block in enumerate(blocks):
        bwhere = f"{where}.blocks[{i}]"
        if not isinstance(block, dict):
            raise SnapshotFormatError(f"{bwhere}: expected an object, got {block!r}")
        at, size = _field(block, ("address", "addr"), bwhere), _field(block, ("size",), bwhere)
        if at != end:
            raise SnapshotFormatError(f"{bwhere}: starts at {at:#x}, not where the blocks before it "
                                      f"end ({end:#x}): a segment's blocks must tile it")
        end += size
        converted.append(None if block.get("state") == "unmapped" else _torch_block(block, bwhere))
        mapped += 0 if converted[-1] is None else size
    expandable = seg.get("is_expandable", False)
    if not expandable and None in converted:
        raise SnapshotFormatError(f"{where}: an unmapped block in a segment that is not expandable")
    if mapped != total:
        raise SnapshotFormatError(f"{where}: its mapped blocks add up to {mapped} bytes, not its "
                                  f"total_size {total}")
    if not expandable:
        return [_torch_segment(device, seg, address, total, converted)]
    # Split at unmapped blocks: each mapped run is a segment of its own, as PyTorch reports them.
    out, run = [], []
    for block in converted + [None]:
        if block is not None:
            run.append(block)
        elif run:
            out.append(_torch_segment(device, seg, run[0]["address"], sum(b["size"] for b in run), run))
            run = []
    return out


def _torch_event(event, where):
    if not isinstance(event, dict):
        raise SnapshotFormatError(f"{where}: expected an object, got {event!r}")
    action = event.get("action")
    if action not in _TRACE_ACTIONS:
        raise SnapshotFormatError(f"{where}: unknown action {action!r}")
    if "time_us" in event:
        time_us = _field(event, ("time_us",), where)
    else:
        time_us = _field(event, ("time_ns",), where) // 1000
    converted = {"action": action}
    if action == "oom":
        # PyTorch's oom entry has no address: the key holds the memory CUDA reported free
        # (torch/csrc/cuda/memory_snapshot.cpp), and _memory_viz.trace() reads it.
        converted["device_free"] = 0
    else:
        converted["addr"] = _field(event, ("addr", "address"), where)
    converted.update({
        "size": _field(event, ("size",), where),
        "stream": _field(event, ("stream",), where, 0),
        "time_us": time_us,
        "frames": _frames(event, where),
    })
    return converted


def read_trace_jsonl(lines, name="trace", lines_out=None):
    """terrace_dump_trace's JSON lines (str or bytes) as a list of dicts (blank lines skipped).
    `lines_out`, a list, receives each event's line number."""
    events = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            events.append(json.loads(line))
        except UnicodeDecodeError as e:
            raise SnapshotFormatError(f"{name}:{n}: not UTF-8 text: {e.reason}") from None
        except (json.JSONDecodeError, RecursionError) as e:
            raise SnapshotFormatError(f"{name}:{n}: malformed JSON: {e}") from None
        if lines_out is not None:
            lines_out.append(n)
    return events


def convert(snapshot, trace=None, source="snapshot", trace_where=None):
    """terrace's snapshot (a parsed dict) as PyTorch's snapshot dict.

    `trace`, a list of terrace trace events, replaces the snapshot's own trace when given;
    `trace_where` names where each of its events was read (e.g. "trace.jsonl:3"), for errors.
    Raises SnapshotFormatError naming `source` (or the trace event's place) and the offending
    element.
    """
    if not isinstance(snapshot, dict) or "segments" not in snapshot:
        raise SnapshotFormatError(f"{source}: not a terrace snapshot: expected an object with 'segments'")
    device = snapshot.get("device", 0)
    if isinstance(device, bool) or not isinstance(device, int) or not 0 <= device <= _MAX_DEVICE:
        raise SnapshotFormatError(f"{source}: 'device' must be an integer in [0, {_MAX_DEVICE}], "
                                  f"got {device!r}")
    if not isinstance(snapshot["segments"], list):
        raise SnapshotFormatError(f"{source}: 'segments' must be a list")
    segments = []
    for i, seg in enumerate(snapshot["segments"]):
        segments.extend(_torch_segments(device, seg, f"{source}: segments[{i}]"))
    segments.sort(key=lambda s: s["address"])

    if trace is None:
        traces = snapshot.get("device_traces", [])
        if not isinstance(traces, list) or not all(isinstance(t, list) for t in traces):
            raise SnapshotFormatError(f"{source}: 'device_traces' must be a list of lists")
        # terrace writes one device per snapshot, its trace first.
        trace = [e for t in traces for e in t]
        trace_where = [f"{source}: device_traces[0][{i}]" for i in range(len(trace))]
    elif trace_where is None:
        trace_where = [f"trace[{i}]" for i in range(len(trace))]
    events, asked = [], {}  # asked: the bytes requested for each block the trace saw allocated
    for e, where in zip(trace, trace_where):
        if isinstance(e, dict) and e.get("action") in _ITERATION_MARKS:
            continue
        event = _torch_event(e, where)
        if event["action"] in _BLOCK_ACTIONS:
            # PyTorch's size for these is what was asked for (the requested size in its
            # allocator's record_trace calls), terrace's the rounded block; terrace's
            # free_completed carries no request, so it takes the block's from its alloc.
            requested = _field(e, ("requested",), where, 0)
            if event["action"] == "free_completed":
                requested = asked.pop(event["addr"], 0)
            else:
                asked[event["addr"]] = requested = requested or asked.get(event["addr"], 0)
            if requested:
                event["size"] = requested
        events.append(event)
    # PyTorch indexes device_traces by device ordinal.
    device_traces = [[] for _ in range(device)] + [events]
    return {"segments": segments, "device_traces": device_traces}


def parse_snapshot_json(data, name="snapshot"):
    """The bytes of terrace's snapshot JSON, parsed; SnapshotFormatError if they are not JSON."""
    if data[:1] == b"\x80":
        raise SnapshotFormatError(f"{name}: a pickle, not terrace's snapshot JSON (converted already?)")
    try:
        return json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise SnapshotFormatError(f"{name}: not UTF-8 text: byte {e.start} is "
                                  f"{data[e.start]:#04x}") from None
    except json.JSONDecodeError as e:
        raise SnapshotFormatError(f"{name}: malformed JSON: {e}") from None
    except RecursionError:
        raise SnapshotFormatError(f"{name}: malformed JSON: nested too deeply") from None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("snapshot", help="terrace snapshot JSON (terrace_dump_snapshot)")
    ap.add_argument("output", help="pickle to write, for pytorch.org/memory_viz")
    ap.add_argument("--trace", help="terrace trace JSON lines (terrace_dump_trace) to use instead "
                                    "of the snapshot's own trace")
    args = ap.parse_args(argv)
    try:
        with open(args.snapshot, "rb") as f:
            snapshot = parse_snapshot_json(f.read(), args.snapshot)
        trace = trace_where = None
        if args.trace:
            with open(args.trace, "rb") as f:
                lines = []
                trace = read_trace_jsonl(f, args.trace, lines)
                trace_where = [f"{args.trace}:{n}" for n in lines]
        result = convert(snapshot, trace, args.snapshot, trace_where)
        with open(args.output, "wb") as f:
            pickle.dump(result, f)
    except (OSError, SnapshotFormatError) as e:
        print(f"terrace_to_torch_snapshot: {e}", file=sys.stderr)
        return 1
    # Not PyTorch fields, so the pickle cannot carry them: said here, or nobody would know.
    if trace is None:
        for key, what in (("trace_events_dropped", "the trace ring dropped the oldest {} events: "
                           "blocks allocated before them show as allocated before the trace"),
                          ("trace_events_lost", "{} events went unrecorded (no host memory): "
                           "the trace has gaps")):
            if snapshot.get(key):
                print(f"terrace_to_torch_snapshot: note: {what.format(snapshot[key])}",
                      file=sys.stderr)
    n_blocks = sum(len(s["blocks"]) for s in result["segments"])
    n_events = sum(len(t) for t in result["device_traces"])
    print(f"wrote {args.output}: {len(result['segments'])} segments, {n_blocks} blocks, "
          f"{n_events} trace events; open it at https://pytorch.org/memory_viz")
    return 0


if __name__ == "__main__":
    sys.exit(main())

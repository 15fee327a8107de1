# SPDX-License-Identifier: Apache-2.0
"""tools/terrace_to_torch_snapshot.py (terrace snapshot JSON -> memory_viz pickle) and, when
TERRACE_LIBRARY names a built libterrace.so, the whole path through tools/terrace_torch.py:
allocate on the simulated device, dump, convert, unpickle.

    python3 -m unittest -v test_snapshot_convert        (from tests/)
"""
import contextlib
import io
import json
import os
import pickle
import subprocess
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))

import terrace_to_torch_snapshot as conv  # noqa: E402

SEGMENT_KEYS = {"device", "address", "total_size", "allocated_size", "active_size",
                "requested_size", "stream", "segment_type", "segment_pool_id", "is_expandable",
                "frames", "blocks"}
BLOCK_KEYS = {"address", "size", "requested_size", "state", "frames"}
EVENT_KEYS = {"action", "addr", "size", "stream", "time_us", "frames"}

MiB = 1 << 20


def hand_made_snapshot():
    """Two segments of device 1, as write_snapshot_json writes them: a small one with a live, a
    pending and a free block, and an expandable large one with an unmapped hole."""
    small = 0x7F0000000000
    large = 0x7F0010000000
    return {
        "device": 1,
        "segments": [
            # total_size: the mapped bytes, as write_snapshot_json gives an expandable segment's.
            {"address": large, "total_size": 4 * MiB, "allocated_size": 2 * MiB,
             "active_size": 2 * MiB, "requested_size": 2 * MiB - 100, "stream": 0,
             "segment_type": "large", "is_expandable": True,
             "blocks": [
                 {"address": large, "size": 2 * MiB, "requested_size": 2 * MiB - 100,
                  "state": "active_allocated", "tag": ""},
                 {"address": large + 2 * MiB, "size": 2 * MiB, "requested_size": 0,
                  "state": "unmapped", "tag": ""},
                 {"address": large + 4 * MiB, "size": 2 * MiB, "requested_size": 0,
                  "state": "inactive", "tag": ""},
             ]},
            {"address": small, "total_size": 2 * MiB, "allocated_size": 1024,
             "active_size": 1536, "requested_size": 1400, "stream": 4096,
             "segment_type": "small", "is_expandable": False,
             "blocks": [
                 {"address": small, "size": 1024, "requested_size": 1000,
                  "state": "active_allocated", "tag": "attn.qkv"},
                 {"address": small + 1024, "size": 512, "requested_size": 400,
                  "state": "active_pending_free", "tag": ""},
                 {"address": small + 1536, "size": 2 * MiB - 1536, "requested_size": 0,
                  "state": "inactive", "tag": ""},
             ]},
        ],
        "device_traces": [[
            {"action": "segment_alloc", "addr": small, "size": 2 * MiB, "requested": 0,
             "stream": 4096, "time_us": 10, "tag": ""},
            {"action": "alloc", "addr": small, "size": 1024, "requested": 1000, "stream": 4096,
             "time_us": 11, "tag": "attn.qkv"},
            {"action": "free_requested", "addr": small + 1024, "size": 512, "requested": 400,
             "stream": 4096, "time_us": 12, "tag": ""},
        ]],
    }


def run_cli(*args):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = conv.main(list(args))
    return code, out.getvalue(), err.getvalue()


class ConvertHandMadeSnapshot(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()
        self.addCleanup(self.dir.cleanup)

    def path(self, name):
        return os.path.join(self.dir.name, name)

    def write_json(self, name, obj):
        with open(self.path(name), "w") as f:
            json.dump(obj, f)
        return self.path(name)

    def convert_file(self, snapshot, *extra):
        src = self.write_json("snap.json", snapshot)
        code, out, err = run_cli(src, self.path("out.pickle"), *extra)
        self.assertEqual(code, 0, err)
        self.assertIn("memory_viz", out)
        with open(self.path("out.pickle"), "rb") as f:
            return pickle.load(f)

    def test_structure_and_field_names_match_torch(self):
        result = self.convert_file(hand_made_snapshot())
        self.assertEqual(set(result), {"segments", "device_traces"})
        segs = result["segments"]
        # The expandable segment's two mapped runs are reported as two segments, as PyTorch does.
        self.assertEqual(len(segs), 3)
        self.assertEqual([s["address"] for s in segs], sorted(s["address"] for s in segs))
        for s in segs:
            self.assertEqual(set(s), SEGMENT_KEYS)
            self.assertEqual(s["device"], 1)
            self.assertEqual(s["segment_pool_id"], (0, 0))
            self.assertEqual(s["frames"], [])
            self.assertEqual(s["total_size"], sum(b["size"] for b in s["blocks"]))
            for b in s["blocks"]:
                self.assertEqual(set(b), BLOCK_KEYS)
                self.assertIn(b["state"], ("active_allocated", "active_pending_free", "inactive"))

    def test_small_segment_sizes_and_tag_frames(self):
        small = self.convert_file(hand_made_snapshot())["segments"][0]
        self.assertEqual(small["segment_type"], "small")
        self.assertFalse(small["is_expandable"])
        self.assertEqual(small["stream"], 4096)
        self.assertEqual(small["total_size"], 2 * MiB)
        self.assertEqual(small["allocated_size"], 1024)
        self.assertEqual(small["active_size"], 1536)  # allocated + pending free
        self.assertEqual(small["requested_size"], 1400)
        tagged, pending, free = small["blocks"]
        self.assertEqual(tagged["frames"], [{"filename": "<terrace tag>", "line": 0,
                                             "name": "attn.qkv"}])
        self.assertEqual(pending["frames"], [])
        self.assertEqual(pending["state"], "active_pending_free")
        self.assertEqual(free["requested_size"], 0)

    def test_expandable_segment_splits_at_unmapped_pages(self):
        segs = self.convert_file(hand_made_snapshot())["segments"]
        first, second = segs[1], segs[2]
        self.assertTrue(first["is_expandable"] and second["is_expandable"])
        self.assertEqual(first["address"], 0x7F0010000000)
        self.assertEqual((first["total_size"], first["allocated_size"]), (2 * MiB, 2 * MiB))
        self.assertEqual(second["address"], 0x7F0010000000 + 4 * MiB)
        self.assertEqual((second["total_size"], second["allocated_size"]), (2 * MiB, 0))

    def test_device_traces_are_indexed_by_device(self):
        traces = self.convert_file(hand_made_snapshot())["device_traces"]
        self.assertEqual(len(traces), 2)
        self.assertEqual(traces[0], [])
        self.assertEqual([e["action"] for e in traces[1]],
                         ["segment_alloc", "alloc", "free_requested"])
        for e in traces[1]:
            self.assertEqual(set(e), EVENT_KEYS)
        self.assertEqual(traces[1][1]["time_us"], 11)
        self.assertEqual(traces[1][1]["frames"][0]["name"], "attn.qkv")

    def test_trace_file_replaces_the_snapshot_trace(self):
        trace = self.path("trace.jsonl")
        with open(trace, "w") as f:
            f.write(json.dumps({"action": "alloc", "time_ns": 5_000_123, "stream": 0, "addr": 512,
                                "size": 512, "requested": 3, "tag": ""}) + "\n\n")
            f.write(json.dumps({"action": "oom", "time_ns": 7_000_000, "stream": 0, "addr": 0,
                                "size": 1 << 40, "requested": 0, "tag": ""}) + "\n")
        traces = self.convert_file(hand_made_snapshot(), "--trace", trace)["device_traces"]
        self.assertEqual([(e["action"], e["time_us"]) for e in traces[1]],
                         [("alloc", 5000), ("oom", 7000)])

    def test_block_events_give_the_requested_size_as_pytorch_does(self):
        # Found in review: PyTorch's alloc, free_requested and free_completed entries give the
        # bytes requested as their size (CUDACachingAllocator.cpp's record_trace calls), which
        # memory_viz draws; the converter gave terrace's rounded block size, so terrace's
        # timeline read larger than PyTorch's for the same requests.
        trace = self.path("sizes.jsonl")
        with open(trace, "w") as f:
            for action, size, requested in (("segment_alloc", 2 * MiB, 0), ("alloc", 1024, 1000),
                                            ("free_requested", 1024, 1000),
                                            ("free_completed", 1024, 0),
                                            ("free_completed", 512, 0)):
                addr = 0x2000 if action == "free_completed" and size == 512 else 0x1000
                f.write(json.dumps({"action": action, "time_ns": 0, "stream": 0, "addr": addr,
                                    "size": size, "requested": requested, "tag": ""}) + "\n")
        traces = self.convert_file(hand_made_snapshot(), "--trace", trace)["device_traces"]
        # A block allocated before the trace began keeps terrace's size: nothing says more.
        self.assertEqual([e["size"] for e in traces[1]], [2 * MiB, 1000, 1000, 1000, 512])

    def test_oom_events_carry_device_free_in_place_of_addr(self):
        # Found in review: PyTorch writes an oom entry's device_free where other entries have
        # addr (torch/csrc/cuda/memory_snapshot.cpp), and torch.cuda._memory_viz.trace() reads
        # e['device_free'] for it: the converted oom had addr only, a KeyError there.
        trace = self.path("oom.jsonl")
        with open(trace, "w") as f:
            f.write(json.dumps({"action": "oom", "time_ns": 7_000_000, "stream": 0, "addr": 0,
                                "size": 1 << 40, "requested": 0, "tag": ""}) + "\n")
        oom, = self.convert_file(hand_made_snapshot(), "--trace", trace)["device_traces"][1]
        self.assertEqual(set(oom), EVENT_KEYS - {"addr"} | {"device_free"})
        self.assertEqual((oom["size"], oom["device_free"]), (1 << 40, 0))

    def test_iteration_marks_are_left_out(self):
        # terrace's begin/end_iteration marks have no place in PyTorch's trace vocabulary.
        trace = self.path("marked.jsonl")
        with open(trace, "w") as f:
            for action, t in (("iteration_begin", 1000), ("alloc", 2000), ("iteration_end", 3000)):
                f.write(json.dumps({"action": action, "time_ns": t, "stream": 0,
                                    "addr": 512 if action == "alloc" else 0,
                                    "size": 512 if action == "alloc" else 0, "requested": 0,
                                    "tag": ""}) + "\n")
        traces = self.convert_file(hand_made_snapshot(), "--trace", trace)["device_traces"]
        self.assertEqual([e["action"] for e in traces[1]], ["alloc"])

    def test_a_trace_without_its_start_is_said(self):
        # Found in review: write_snapshot_json's trace_events_dropped / trace_events_lost were
        # left out silently, and memory_viz then showed a trace that lacked its start as whole.
        snapshot = dict(hand_made_snapshot(), trace_events_dropped=7, trace_events_lost=2)
        src = self.write_json("snap.json", snapshot)
        code, _, err = run_cli(src, self.path("out.pickle"))
        self.assertEqual(code, 0, err)
        self.assertIn("note: the trace ring dropped the oldest 7 events", err)
        self.assertIn("note: 2 events went unrecorded", err)

    def test_empty_snapshot(self):
        result = self.convert_file({"device": 0, "segments": [], "device_traces": [[]]})
        self.assertEqual(result, {"segments": [], "device_traces": [[]]})

    def test_malformed_inputs_fail_with_a_message(self):
        bad_cases = [
            ({"device": 0}, "expected an object with 'segments'"),
            ({"device": -1, "segments": []}, "'device' must be an integer in [0, 1023]"),
            # PyTorch lists a trace per device ordinal: this would be 10^8 empty lists.
            ({"device": 10**8, "segments": []}, "'device' must be an integer in [0, 1023]"),
            ({"segments": [{"address": 0, "total_size": 512, "segment_type": "medium"}]},
             "segment_type must be 'small' or 'large'"),
            ({"segments": [{"total_size": 512, "segment_type": "small"}]},
             "segments[0]: missing field 'address'"),
            ({"segments": [{"address": 0, "total_size": 512, "segment_type": "small",
                            "blocks": [{"address": 0, "size": 512, "state": "lost"}]}]},
             "segments[0].blocks[0]: unknown block state 'lost'"),
            ({"segments": [{"address": 0, "total_size": 512, "segment_type": "small",
                            "blocks": [{"address": 0, "size": "512", "state": "inactive"}]}]},
             "field 'size' must be a non-negative integer"),
            # Found in review: negative numbers went into the pickle, which terrace's own
            # importer then refused.
            ({"segments": [], "device_traces": [[{"action": "alloc", "addr": -4096, "size": 512,
                                                  "time_us": 0}]]},
             "device_traces[0][0]: field 'addr' must be a non-negative integer, got -4096"),
            # Found in review: a tag that is not a string became a frame name memory_viz cannot
            # filter (it calls name.includes()).
            ({"segments": [], "device_traces": [[{"action": "alloc", "addr": 0, "size": 512,
                                                  "time_us": 0, "tag": 5}]]},
             "field 'tag' must be a string, got 5"),
            ({"segments": [{"address": 0, "total_size": 512, "segment_type": "small",
                            "stream": "s0", "blocks": []}]},
             "segments[0]: field 'stream' must be a non-negative integer"),
            # Found in review: memory_viz places each block at its segment's address plus the
            # sizes before it, and its stats assert that the blocks add up to the segment.
            ({"segments": [{"address": 0, "total_size": 1024, "segment_type": "small",
                            "blocks": [{"address": 0, "size": 256, "state": "inactive"},
                                       {"address": 512, "size": 512, "state": "inactive"}]}]},
             "segments[0].blocks[1]: starts at 0x200, not where the blocks before it end (0x100)"),
            ({"segments": [{"address": 0, "total_size": 1024, "segment_type": "small",
                            "blocks": [{"address": 0, "size": 512, "state": "inactive"}]}]},
             "segments[0]: its mapped blocks add up to 512 bytes, not its total_size 1024"),
            ({"segments": [{"address": 0, "total_size": 512, "segment_type": "small",
                            "blocks": [{"address": 0, "size": 512, "state": "unmapped"}]}]},
             "unmapped block in a segment that is not expandable"),
            ({"segments": [], "device_traces": [[{"action": "teleport", "addr": 0, "size": 0,
                                                  "time_us": 0}]]},
             "device_traces[0][0]: unknown action 'teleport'"),
            ({"segments": [], "device_traces": [[{"action": "alloc", "addr": 0, "size": 0}]]},
             "missing field 'time_ns'"),
            ({"segments": [], "device_traces": {}}, "'device_traces' must be a list of lists"),
        ]
        for snapshot, message in bad_cases:
            with self.subTest(message=message):
                src = self.write_json("bad.json", snapshot)
                code, _, err = run_cli(src, self.path("bad.pickle"))
                self.assertEqual(code, 1)
                self.assertIn(f"{src}: ", err)
                self.assertIn(message, err)

    def test_unreadable_inputs_fail_with_a_message(self):
        code, _, err = run_cli(self.path("missing.json"), self.path("x.pickle"))
        self.assertEqual(code, 1)
        self.assertIn("No such file or directory", err)
        with open(self.path("broken.json"), "w") as f:
            f.write("{\"segments\": [")
        code, _, err = run_cli(self.path("broken.json"), self.path("x.pickle"))
        self.assertEqual(code, 1)
        self.assertIn("malformed JSON", err)
        src = self.write_json("ok.json", {"segments": []})
        with open(self.path("bad_trace.jsonl"), "w") as f:
            f.write("{\"action\": \"alloc\"}\nnot json\n")
        code, _, err = run_cli(src, self.path("x.pickle"), "--trace", self.path("bad_trace.jsonl"))
        self.assertEqual(code, 1)
        self.assertIn("bad_trace.jsonl:2: malformed JSON", err)
        # Found in review: these raised UnicodeDecodeError and RecursionError with a traceback.
        # A pickle is what the converter writes, so the likeliest wrong input.
        self.write_pickle_of_hand_made("already.pickle")
        code, _, err = run_cli(self.path("already.pickle"), self.path("x.pickle"))
        self.assertEqual(code, 1)
        self.assertIn("already.pickle: a pickle, not terrace's snapshot JSON", err)
        with open(self.path("latin1.json"), "wb") as f:
            f.write(b'{"segments": [], "tag": "caf\xe9"}')
        code, _, err = run_cli(self.path("latin1.json"), self.path("x.pickle"))
        self.assertEqual(code, 1)
        self.assertIn("latin1.json: not UTF-8 text: byte 28 is 0xe9", err)
        with open(self.path("deep.json"), "w") as f:
            f.write("[" * 100000 + "]" * 100000)
        code, _, err = run_cli(self.path("deep.json"), self.path("x.pickle"))
        self.assertEqual(code, 1)
        self.assertIn("deep.json: malformed JSON: nested too deeply", err)
        with open(self.path("latin1.jsonl"), "wb") as f:
            f.write(b'\n{"action": "alloc", "tag": "caf\xe9"}\n')
        code, _, err = run_cli(src, self.path("x.pickle"), "--trace", self.path("latin1.jsonl"))
        self.assertEqual(code, 1)
        self.assertIn("latin1.jsonl:2: not UTF-8 text", err)

    def test_trace_errors_name_the_trace_file_and_line(self):
        # Found in review: an error in the --trace file was reported under the snapshot's name,
        # at an index that skipped blank lines ("snap.json: trace[0]: unknown action").
        src = self.write_json("ok.json", {"segments": []})
        with open(self.path("t.jsonl"), "w") as f:
            f.write("\n" + json.dumps({"action": "teleport", "addr": 0, "size": 0, "time_ns": 0}))
        code, _, err = run_cli(src, self.path("x.pickle"), "--trace", self.path("t.jsonl"))
        self.assertEqual(code, 1)
        self.assertIn(f"terrace_to_torch_snapshot: {self.path('t.jsonl')}:2: unknown action 'teleport'",
                      err)
        self.assertNotIn("ok.json", err)

    def write_pickle_of_hand_made(self, name):
        with open(self.path(name), "wb") as f:
            pickle.dump(conv.convert(hand_made_snapshot()), f)


# torch.cuda._memory_viz's helpers need no GPU. Debian's python3-torch is installed for
# /usr/bin/python3 only (not the python3 first on PATH); its 1.13 takes the segment list, torch 2
# the whole snapshot (and adds segsum and trace, which read every block and event).
MEMORY_VIZ_CHECK = """
import pickle, sys
try:
    import torch
    from torch.cuda import _memory_viz as viz
except ImportError as e:
    print(f"no torch: {e}")
    sys.exit(77)
for path in sys.argv[1:]:
    with open(path, "rb") as f:
        snap = pickle.load(f)
    text = lambda lines: lines
    if hasattr(viz, "segsum"):
        viz.segsum(snap)
        viz.trace(snap)
        viz.segments(snap, format_flamegraph=text)
        viz.memory(snap, format_flamegraph=text)
    else:
        viz.stats(snap["segments"])
        viz.segments(snap["segments"], format_flamegraph=text)
        viz.memory(snap["segments"], format_flamegraph=text)
print("torch", torch.__version__)
"""


class LoadsInTorchMemoryViz(unittest.TestCase):
    def test_torch_memory_viz_reads_the_converted_pickles(self):
        if not os.path.exists("/usr/bin/python3"):
            self.skipTest("no /usr/bin/python3")
        with tempfile.TemporaryDirectory() as d:
            trace = os.path.join(d, "oom.jsonl")
            with open(trace, "w") as f:
                for action, addr, size, requested in (("alloc", 0x7F0000000000, 1024, 1000),
                                                      ("oom", 0, 1 << 40, 1 << 40),
                                                      ("free_requested", 0x7F0000000000, 1024, 1000)):
                    f.write(json.dumps({"action": action, "time_ns": 0, "stream": 0, "addr": addr,
                                        "size": size, "requested": requested, "tag": "t"}) + "\n")
            src = os.path.join(d, "hand.json")
            with open(src, "w") as f:
                json.dump(hand_made_snapshot(), f)
            outs = []
            for args in ((REAL_SNAPSHOT,), (src,), (src, "--trace", trace)):
                outs.append(os.path.join(d, f"{len(outs)}.pickle"))
                code, _, err = run_cli(args[0], outs[-1], *args[1:])
                self.assertEqual(code, 0, err)
            done = subprocess.run(["/usr/bin/python3", "-c", MEMORY_VIZ_CHECK, *outs],
                                  capture_output=True, text=True, timeout=300)
        if done.returncode == 77:
            self.skipTest(f"/usr/bin/python3: {done.stdout.strip()}")
        self.assertEqual(done.returncode, 0, done.stdout + done.stderr)


LIBRARY = os.environ.get("TERRACE_LIBRARY", "")


@unittest.skipUnless(LIBRARY and os.path.exists(LIBRARY),
                     "TERRACE_LIBRARY does not name a built libterrace.so (ctest sets it, except "
                     "in sanitizer builds, whose library python3 cannot load)")
class EndToEndThroughLibterrace(unittest.TestCase):
    """One process-wide terrace state: configured once here, before any allocation."""

    @classmethod
    def setUpClass(cls):
        import terrace_torch

        cls.tt = terrace_torch
        cls.lib = terrace_torch.load(LIBRARY)
        cls.lib.configure("device:sim,device_capacity:64MiB")
        cls.dir = tempfile.TemporaryDirectory()

    @classmethod
    def tearDownClass(cls):
        cls.dir.cleanup()

    def test_dump_convert_and_unpickle(self):
        lib = self.lib
        self.tt.record_trace(True)
        a = lib.malloc(1000)
        b = lib.malloc(3 * MiB)
        lib.free(a, 1000)
        snap = os.path.join(self.dir.name, "snap.json")
        trace = os.path.join(self.dir.name, "trace.jsonl")
        self.tt.dump_snapshot(snap)
        self.tt.dump_trace(trace)
        self.tt.record_trace(False)

        out = os.path.join(self.dir.name, "viz.pickle")
        code, _, err = run_cli(snap, out)
        self.assertEqual(code, 0, err)
        with open(out, "rb") as f:
            result = pickle.load(f)
        blocks = {blk["address"]: blk for s in result["segments"] for blk in s["blocks"]}
        self.assertEqual(blocks[b]["state"], "active_allocated")
        self.assertEqual(blocks[b]["requested_size"], 3 * MiB)
        actions = [(e["action"], e["addr"]) for e in result["device_traces"][0]]
        self.assertIn(("alloc", a), actions)
        self.assertIn(("free_requested", a), actions)
        self.assertIn(("alloc", b), actions)
        with open(trace) as f:
            self.assertEqual(len(conv.read_trace_jsonl(f)), len(actions))

        stats = self.tt.stats()
        self.assertEqual(stats["allocation.all.current"], 1)
        self.assertEqual(stats["num_bad_frees"], 0)
        lib.free(b, 3 * MiB)
        self.assertEqual(self.tt.stats()["allocated_bytes.all.current"], 0)
        self.tt.empty_cache()
        self.assertEqual(self.tt.stats()["reserved_bytes.all.current"], 0)
        self.assertGreater(self.tt.stats()["allocation.all.freed"], 0)
        self.tt.reset_accumulated_stats()
        self.assertEqual(self.tt.stats()["allocation.all.freed"], 0)
        self.assertEqual(self.tt.stats()["num_device_free"], 0)

    def test_marked_steps_are_planned_through_the_wrappers(self):
        # The policy is fixed at the first allocation, once per process: a process of its own.
        tools = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools")
        script = (
            "import json, sys\n"
            f"sys.path.insert(0, {tools!r})\n"
            "import terrace_torch as tt\n"
            f"lib = tt.load({LIBRARY!r})\n"
            "lib.configure('device:sim,device_capacity:64MiB,policy:planned,plan_min_period:16')\n"
            "for step in range(6):\n"
            "    tt.begin_iteration()\n"
            "    ptrs = [lib.malloc((k + 1) << 20) for k in range(8)]\n"
            "    for p in reversed(ptrs):\n"
            "        lib.free(p)\n"
            "    tt.end_iteration()\n"
            "print(json.dumps(tt.stats()))\n")
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                              timeout=120)
        self.assertEqual(done.returncode, 0, done.stderr)
        stats = json.loads(done.stdout)
        self.assertEqual(stats["plan.plans"], 1)
        self.assertGreaterEqual(stats["plan.hits"], 4 * 8)  # steps 3-6
        with self.assertRaises(self.tt.TerraceError) as cm:
            self.tt.begin_iteration(device=99)
        self.assertIn("out of range", cm.exception.message)

    def test_errors_become_exceptions_with_the_last_error(self):
        TerraceError = self.tt.TerraceError
        with self.assertRaises(TerraceError) as cm:
            self.lib.configure("bogus_key:1")
        self.assertEqual(cm.exception.code, -1)
        self.assertIn("bogus_key", str(cm.exception))
        with self.assertRaises(TerraceError) as cm:
            self.tt.stats(device=99)
        self.assertIn("out of range", cm.exception.message)
        with self.assertRaises(TerraceError) as cm:
            self.tt.dump_snapshot(os.path.join(self.dir.name, "no", "such", "dir.json"))
        self.assertEqual(cm.exception.code, -4)
        self.assertIn("No such file or directory", cm.exception.message)
        with self.assertRaises(TerraceError) as cm:
            self.lib.malloc(1 << 30)  # the sim device holds 64 MiB
        self.assertIn("out of memory", cm.exception.message)
        with self.assertRaises(TerraceError) as cm:
            self.lib.free(0x1000, 512)
        self.assertIn("foreign pointer", cm.exception.message)


REAL_SNAPSHOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data",
                             "h100_mlp_training_snapshot.json")


class RealSnapshotFromPyTorchTraining(unittest.TestCase):
    """tests/data/h100_mlp_training_snapshot.json: terrace's snapshot after 12 steps of
    tools/pytorch_example.py on an H100, with terrace as PyTorch's allocator (see
    docs/gpu-2026-11-22-h100.md). Real data: what the converter and the tools must read."""

    @classmethod
    def setUpClass(cls):
        with open(REAL_SNAPSHOT) as f:
            cls.snap = json.load(f)

    def test_blocks_tile_every_segment_and_sizes_add_up(self):
        for seg in self.snap["segments"]:
            blocks = seg["blocks"]
            self.assertEqual(sum(b["size"] for b in blocks), seg["total_size"])
            addr = seg["address"]
            for b in blocks:
                self.assertEqual(b["address"], addr)
                addr += b["size"]
            live = [b for b in blocks if b["state"] == "active_allocated"]
            self.assertEqual(sum(b["size"] for b in live), seg["allocated_size"])

    def test_the_trace_replays_to_exactly_the_live_blocks(self):
        live, current, peak = {}, 0, 0
        for e in self.snap["device_traces"][0]:
            if e["action"] == "alloc":
                self.assertNotIn(e["addr"], live)
                live[e["addr"]] = e["size"]
                current += e["size"]
                peak = max(peak, current)
            elif e["action"] == "free_requested":
                current -= live.pop(e["addr"])  # a KeyError would be a free of an unknown block
        in_segments = {b["address"]: b["size"] for s in self.snap["segments"]
                       for b in s["blocks"] if b["state"] == "active_allocated"}
        self.assertEqual(live, in_segments)
        self.assertEqual(peak, 236896768)  # 225.9 MiB, allocated_bytes.all.peak of the run

    def test_converts_to_a_memory_viz_pickle(self):
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "viz.pickle")
            code, _, err = run_cli(REAL_SNAPSHOT, out)
            self.assertEqual(code, 0, err)
            with open(out, "rb") as f:
                result = pickle.load(f)
        self.assertEqual(len(result["segments"]), len(self.snap["segments"]))
        self.assertEqual(len(result["device_traces"][0]), len(self.snap["device_traces"][0]))


if __name__ == "__main__":
    unittest.main()

# SPDX-License-Identifier: Apache-2.0
"""tools/terrace_torch.py's install() against a stand-in for torch.cuda.memory: every hook it sets
must name a function libterrace.so exports, and a CUDA graph capture must meet terrace's refusal.
Real PyTorch with CUDA runs the same wiring on a GPU machine (tools/torch_train_check.py); this
catches a misspelled symbol or a forgotten hook without one.

    TERRACE_LIBRARY=build/allocator/libterrace.so python3 -m unittest -v test_terrace_torch_install
"""
import ctypes
import os
import sys
import types
import unittest
import warnings
from unittest import mock

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))

LIBRARY = os.environ.get("TERRACE_LIBRARY", "")


class FakeNative:
    """The object CUDAPluggableAllocator.allocator() returns: records each hook's address."""

    def __init__(self, with_graph_hook):
        self.hooks = {}
        setters = ["set_init_fn", "set_reset_fn", "set_memory_fraction_fn",
                   "set_record_stream_fn"]
        if with_graph_hook:
            setters.append("set_begin_allocate_to_pool")
        for name in setters:
            setattr(self, name, lambda address, name=name: self.hooks.__setitem__(name, address))


class StopAfterWiring(Exception):
    """Raised by the stand-in's manual_seed: tools/pytorch_example.py's first call after wiring."""


def fake_torch(with_graph_hook=True, initialized=False):
    torch = types.ModuleType("torch")
    torch.__version__ = "stand-in"
    torch.cuda = types.SimpleNamespace()
    torch.cuda.is_initialized = lambda: initialized
    torch.cuda.is_available = lambda: True

    def manual_seed(_seed):
        raise StopAfterWiring()

    torch.manual_seed = manual_seed
    state = types.SimpleNamespace(current=None, loaded=None)

    class CUDAPluggableAllocator:
        def __init__(self, path, alloc_fn_name, free_fn_name):
            lib = ctypes.CDLL(path)  # as PyTorch does: the names must resolve
            state.loaded = {name: ctypes.cast(getattr(lib, name), ctypes.c_void_p).value
                            for name in (alloc_fn_name, free_fn_name)}
            self.native = FakeNative(with_graph_hook)

        def allocator(self):
            return self.native

    def change_current_allocator(allocator):
        # As PyTorch's changeCurrentAllocator: createCustomAllocator marks a pluggable allocator
        # initialized when it is made, so once one is current no other may replace it.
        if state.current is not None:
            raise RuntimeError("Can't swap an already initialized allocator")
        state.current = allocator

    def get_device_index(device, optional=False):
        # As torch.cuda._utils._get_device_index for what these tests pass: an int, or None for
        # the current device (0 here).
        return 0 if device is None else int(device)

    torch.cuda.memory = types.SimpleNamespace(
        CUDAPluggableAllocator=CUDAPluggableAllocator,
        change_current_allocator=change_current_allocator,
        _get_device_index=get_device_index)
    return torch, state


@unittest.skipUnless(LIBRARY and os.path.exists(LIBRARY),
                     "TERRACE_LIBRARY does not name a built libterrace.so (ctest sets it, except "
                     "in sanitizer builds, whose library python3 cannot load)")
class Install(unittest.TestCase):
    def setUp(self):
        import terrace_torch
        self.tt = terrace_torch
        self.lib = terrace_torch.load(LIBRARY)
        self.saved = sys.modules.get("torch")
        self.addCleanup(setattr, terrace_torch, "_allocator", None)

    def tearDown(self):
        if self.saved is None:
            sys.modules.pop("torch", None)
        else:
            sys.modules["torch"] = self.saved

    def install(self, **fake):
        torch, state = fake_torch(**fake)
        sys.modules["torch"] = torch
        self.tt.install(LIBRARY)
        return state

    def test_every_hook_is_an_exported_function(self):
        state = self.install()
        self.assertIsNotNone(state.current)
        self.assertEqual(state.loaded, {
            "terrace_torch_malloc": self.lib.address("terrace_torch_malloc"),
            "terrace_torch_free": self.lib.address("terrace_torch_free")})
        self.assertEqual(state.current.native.hooks, {
            "set_init_fn": self.lib.address("terrace_init"),
            "set_reset_fn": self.lib.address("terrace_empty_cache"),
            "set_memory_fraction_fn": self.lib.address("terrace_set_memory_fraction"),
            "set_record_stream_fn": self.lib.address("terrace_record_stream"),
            "set_begin_allocate_to_pool":
                self.lib.address("terrace_torch_begin_allocate_to_pool")})

    def test_a_torch_without_the_graph_hook_is_warned_about(self):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            state = self.install(with_graph_hook=False)
        self.assertIsNotNone(state.current)
        self.assertTrue(any("CUDA graph" in str(w.message) for w in caught), caught)

    def test_pytorch_alloc_conf_is_warned_about_not_dropped_unseen(self):
        # PyTorch's settings configure the allocator terrace replaces.
        for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
            with self.subTest(name=name):
                self.tt._allocator = None
                with mock.patch.dict(os.environ, {name: "expandable_segments:True"}):
                    with warnings.catch_warnings(record=True) as caught:
                        warnings.simplefilter("always")
                        self.install()
                messages = [str(w.message) for w in caught]
                self.assertTrue(any(m.startswith(f"{name}=expandable_segments:True does not "
                                                 "configure terrace") and "TERRACE_ALLOC_CONF" in m
                                    for m in messages), messages)
        self.tt._allocator = None
        environ = {k: v for k, v in os.environ.items()
                   if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}
        with mock.patch.dict(os.environ, environ, clear=True):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                self.install()
        self.assertFalse(any("does not configure terrace" in str(w.message) for w in caught), caught)

    def test_the_example_wires_every_hook_install_wires(self):
        # Found in review: tools/pytorch_example.py, "the lines a user writes", left out the graph
        # hook, so a capture there would run and share the graph's blocks with other tensors.
        import pytorch_example

        torch, example = fake_torch()
        sys.modules["torch"] = torch
        with mock.patch.object(sys, "argv", ["pytorch_example.py", "--lib", LIBRARY]):
            with self.assertRaises(StopAfterWiring):
                pytorch_example.main()
        installed = self.install()
        self.assertEqual(example.loaded, installed.loaded)
        self.assertEqual(example.current.native.hooks, installed.current.native.hooks)

    def test_torchs_memory_statistics_read_terraces(self):
        # PyTorch's own raise under a pluggable allocator; install() routes the three functions
        # every torch.cuda statistic goes through (tests/test_terrace_torch_stats.py runs them
        # inside a real torch.cuda.memory).
        torch, _ = fake_torch()
        sys.modules["torch"] = torch
        self.tt.install(LIBRARY)
        for module in (torch.cuda.memory, torch.cuda):
            nested = module.memory_stats_as_nested_dict(None)
            self.assertEqual(nested["allocated_bytes"]["all"]["current"],
                             self.lib.stats(0)["allocated_bytes.all.current"])
            self.assertIn("current", nested["oversize_allocations"])
            module.reset_peak_memory_stats(0)
            module.reset_accumulated_memory_stats(0)

    def test_a_second_install_swaps_nothing(self):
        # Found in review: install() made and swapped in a second allocator, which PyTorch
        # refuses ("Can't swap an already initialized allocator") though CUDA is not initialized.
        torch, state = fake_torch()
        sys.modules["torch"] = torch
        self.tt.install(LIBRARY)
        first = state.current
        self.assertIs(self.tt.install(LIBRARY), self.lib)
        self.assertIs(state.current, first)

    def test_an_initialized_cuda_is_refused(self):
        torch, state = fake_torch(initialized=True)
        sys.modules["torch"] = torch
        with self.assertRaisesRegex(RuntimeError, "before CUDA is initialized"):
            self.tt.install(LIBRARY)
        self.assertIsNone(state.current)


if __name__ == "__main__":
    unittest.main()

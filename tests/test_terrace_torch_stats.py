# SPDX-License-Identifier: Apache-2.0
"""torch.cuda's memory statistics read terrace's once install() has routed them
(terrace_torch.route_torch_memory_stats), checked inside a real torch.cuda.memory module: PyTorch's
memory_allocated(), max_memory_allocated(), memory_reserved(), memory_stats(), memory_summary()
and reset_peak_memory_stats() must give terrace's figures for blocks malloc'd through the C ABI
(on the simulated device here).

Run with Debian's /usr/bin/python3 (python3-torch, CPU-only: CUDA is never initialized, the
device is always named). TERRACE_LIBRARY is libterrace.so. Exits 77 (ctest: skipped), saying why,
when torch or the library is missing."""
import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_test_support import torch_and_library  # noqa: E402

torch, LIB_PATH = torch_and_library()
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
import terrace_torch as tt  # noqa: E402

MiB = 1 << 20
ROUTED = ("memory_stats_as_nested_dict", "reset_peak_memory_stats",
          "reset_accumulated_memory_stats")


class RoutedStats(unittest.TestCase):
    def setUp(self):
        self.lib = tt.load(LIB_PATH)
        saved = {(m, n): getattr(m, n) for m in (torch.cuda.memory, torch.cuda) for n in ROUTED}
        self.addCleanup(lambda: [setattr(m, n, f) for (m, n), f in saved.items()])
        tt.route_torch_memory_stats(torch, self.lib)
        self.blocks = []
        self.addCleanup(lambda: [self.lib.free(p) for p in self.blocks])

    def malloc(self, size):
        self.blocks.append(self.lib.malloc(size, 0))
        return self.blocks[-1]

    def test_the_figures_are_terraces(self):
        self.malloc(3 * MiB)
        self.malloc(5 * MiB + 1)
        ours = self.lib.stats(0)
        self.assertGreaterEqual(ours["allocated_bytes.all.current"], 8 * MiB)
        self.assertEqual(torch.cuda.memory_allocated(0), ours["allocated_bytes.all.current"])
        self.assertEqual(torch.cuda.max_memory_allocated(0), ours["allocated_bytes.all.peak"])
        self.assertEqual(torch.cuda.memory_reserved(0), ours["reserved_bytes.all.current"])
        self.assertEqual(torch.cuda.max_memory_reserved(0), ours["reserved_bytes.all.peak"])
        flat = torch.cuda.memory_stats(0)
        for key in ("num_ooms", "num_alloc_retries", "allocation.large_pool.current",
                    "requested_bytes.all.current", "oversize_segments.peak"):
            self.assertEqual(flat[key], ours[key], key)

    def test_the_summary_renders_terraces_numbers(self):
        self.malloc(7 * MiB)
        summary = torch.cuda.memory_summary(0)
        self.assertIn("PyTorch CUDA memory summary, device ID 0", summary)
        self.assertIn("Oversize allocations", summary)
        # PyTorch's formatting of the 7 MiB allocated: "7168 KB" (1.13), "7168 KiB" (2.x).
        self.assertRegex(summary, r"Allocated memory +\| +7168 KiB|Allocated memory +\| +7168 KB")

    def test_the_resets_reach_terrace(self):
        p = self.malloc(9 * MiB)
        self.lib.free(p)
        self.blocks.remove(p)
        self.assertGreaterEqual(torch.cuda.max_memory_allocated(0), 9 * MiB)
        torch.cuda.reset_peak_memory_stats(0)
        self.assertEqual(torch.cuda.max_memory_allocated(0), torch.cuda.memory_allocated(0))
        self.assertEqual(self.lib.stats(0)["allocated_bytes.all.peak"],
                         self.lib.stats(0)["allocated_bytes.all.current"])
        torch.cuda.memory.reset_accumulated_memory_stats(0)
        self.assertEqual(torch.cuda.memory_stats(0)["allocation.all.allocated"], 0)


if __name__ == "__main__":
    unittest.main()

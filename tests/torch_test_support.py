# SPDX-License-Identifier: Apache-2.0
"""What the tests run with Debian's real torch share: torch, and the path of a loadable
libterrace.so, or exit 77 (ctest: skipped), saying why, when either is missing. Not a pass: a
test that cannot run says so."""
import os
import sys

SKIP = 77


def torch_and_library():
    """(the torch module, TERRACE_LIBRARY's path); exits 77 when either is missing."""
    try:
        import torch
    except ImportError as e:
        print(f"SKIP: torch is not importable by {sys.executable}: {e}")
        sys.exit(SKIP)
    path = os.environ.get("TERRACE_LIBRARY", "")
    if not path or not os.path.exists(path):
        print(f"SKIP: TERRACE_LIBRARY ('{path}') does not name libterrace.so "
              "(ctest sets it, except in sanitizer builds, whose library python3 cannot load)")
        sys.exit(SKIP)
    return torch, path

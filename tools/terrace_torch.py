# SPDX-License-Identifier: Apache-2.0
"""terrace from Python: load libterrace.so, make it PyTorch's CUDA allocator, read its stats.

    import terrace_torch as tt
    tt.install("build/allocator/libterrace.so")   # before the first CUDA tensor
    ...train...
    print(tt.stats()["allocated_bytes.all.peak"])
    tt.dump_snapshot("snap.json")                 # tools/terrace_to_torch_snapshot.py -> memory_viz

Everything but install() works without PyTorch, through ctypes alone (on the simulated device
when no GPU is present). Failures raise TerraceError carrying terrace_last_error().
"""
import ctypes
import json
import os
import warnings

__all__ = [
    "TerraceError", "Library", "load", "install", "stats", "reset_peak_stats",
    "reset_accumulated_stats", "record_trace",
    "dump_snapshot", "dump_trace", "empty_cache", "configure", "last_error",
]

# terrace_status, as in include/terrace/terrace.h.
STATUS_NAMES = {
    0: "TERRACE_OK",
    -1: "TERRACE_EINVAL",
    -2: "TERRACE_ENOMEM",
    -3: "TERRACE_EDEVICE",
    -4: "TERRACE_EIO",
    -5: "TERRACE_ERANGE",
    -6: "TERRACE_EINTERNAL",
}
ERANGE = -5


class TerraceError(RuntimeError):
    """A terrace call failed. `code` is the terrace_status (None for the calls that return void or
    a pointer, whose failure shows only in the message), `message` is terrace_last_error()."""

    def __init__(self, code, message):
        self.code = code
        self.message = message
        super().__init__(message if code is None else f"{STATUS_NAMES.get(code, code)}: {message}")


def default_library_path():
    """$TERRACE_LIBRARY, else build/allocator/libterrace.so next to this checkout's tools/."""
    env = os.environ.get("TERRACE_LIBRARY")
    if env:
        return env
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return os.path.join(root, "build", "allocator", "libterrace.so")


class Library:
    """libterrace.so through ctypes, with every C function's signature declared."""

    def __init__(self, path=None):
        self.path = os.path.abspath(path or default_library_path())
        if not os.path.exists(self.path):
            raise FileNotFoundError(
                f"libterrace.so not found at {self.path}: build it (ninja -C build terrace_c) or "
                "pass its path / set TERRACE_LIBRARY")
        # Loading the same path again (as CUDAPluggableAllocator does) returns the same handle,
        # so PyTorch and these wrappers share one terrace state.
        self.lib = ctypes.CDLL(self.path)
        c = ctypes
        sigs = {
            "terrace_malloc": (c.c_void_p, [c.c_size_t, c.c_int, c.c_void_p]),
            "terrace_free": (None, [c.c_void_p, c.c_size_t, c.c_int, c.c_void_p]),
            "terrace_init": (None, [c.c_int]),
            "terrace_empty_cache": (None, []),
            "terrace_set_memory_fraction": (None, [c.c_double, c.c_int]),
            "terrace_record_stream": (None, [c.c_void_p, c.c_void_p]),
            "terrace_configure": (c.c_int, [c.c_char_p]),
            "terrace_stats_json": (c.c_int, [c.c_int, c.c_char_p, c.c_size_t,
                                             c.POINTER(c.c_size_t)]),
            "terrace_reset_peak_stats": (c.c_int, [c.c_int]),
            "terrace_reset_accumulated_stats": (c.c_int, [c.c_int]),
            "terrace_begin_iteration": (c.c_int, [c.c_int]),
            "terrace_end_iteration": (c.c_int, [c.c_int]),
            "terrace_record_trace": (c.c_int, [c.c_int]),
            "terrace_dump_snapshot": (c.c_int, [c.c_int, c.c_char_p]),
            "terrace_dump_trace": (c.c_int, [c.c_int, c.c_char_p]),
            "terrace_last_error": (c.c_char_p, []),
        }
        for name, (restype, argtypes) in sigs.items():
            fn = getattr(self.lib, name)
            fn.restype = restype
            fn.argtypes = argtypes

    def address(self, name):
        """The C function's address as an int, as CUDAPluggableAllocator's setters take it."""
        return ctypes.cast(getattr(self.lib, name), ctypes.c_void_p).value

    def last_error(self):
        return (self.lib.terrace_last_error() or b"").decode("utf-8", "replace")

    def check(self, code):
        if code != 0:
            raise TerraceError(code, self.last_error())

    # Calls whose C function returns void: the failure is only visible in terrace_last_error().
    def check_void(self):
        message = self.last_error()
        if message:
            raise TerraceError(None, message)

    def configure(self, conf):
        self.check(self.lib.terrace_configure(conf.encode()))

    def stats(self, device=0):
        needed = ctypes.c_size_t(0)
        code = self.lib.terrace_stats_json(device, None, 0, ctypes.byref(needed))
        while code == ERANGE:
            # The stats may grow between the two calls (a counter gains a digit): retry.
            buf = ctypes.create_string_buffer(needed.value + 64)
            code = self.lib.terrace_stats_json(device, buf, len(buf), ctypes.byref(needed))
        self.check(code)
        return json.loads(buf.value.decode())

    def reset_peak_stats(self, device=0):
        self.check(self.lib.terrace_reset_peak_stats(device))

    def reset_accumulated_stats(self, device=0):
        self.check(self.lib.terrace_reset_accumulated_stats(device))

    def record_trace(self, on=True):
        self.check(self.lib.terrace_record_trace(1 if on else 0))

    def begin_iteration(self, device=0):
        """Marks the start of a training step for the planned policy (a no-op under the others)."""
        self.check(self.lib.terrace_begin_iteration(device))

    def end_iteration(self, device=0):
        """Marks its end: a step equal to one of the last four is planned."""
        self.check(self.lib.terrace_end_iteration(device))

    def dump_snapshot(self, path, device=0):
        self.check(self.lib.terrace_dump_snapshot(device, os.fsencode(path)))

    def dump_trace(self, path, device=0):
        self.check(self.lib.terrace_dump_trace(device, os.fsencode(path)))

    def empty_cache(self):
        self.lib.terrace_empty_cache()
        self.check_void()

    def malloc(self, size, device=0, stream=None):
        p = self.lib.terrace_malloc(size, device, stream)
        if not p and size:
            raise TerraceError(None, self.last_error())
        return p

    def free(self, ptr, size=0, device=0, stream=None):
        self.lib.terrace_free(ptr, size, device, stream)
        self.check_void()


_library = None
_allocator = None  # keeps PyTorch's allocator object alive


def load(path=None):
    """Loads libterrace.so once (later calls return the same Library)."""
    global _library
    if _library is None:
        _library = Library(path)
    elif path is not None and os.path.abspath(path) != _library.path:
        raise RuntimeError(f"terrace is already loaded from {_library.path}, not {path}")
    return _library


def install(path=None, conf=None):
    """Makes terrace PyTorch's CUDA allocator. Call before CUDA is initialized in this process.

    PyTorch initializes CUDA lazily, at the first CUDA tensor but also at calls such as
    torch.cuda.current_device() or get_device_properties(); its allocator can be swapped only
    before that. `conf` ("key:value,...", as TERRACE_ALLOC_CONF) configures terrace first. Raises
    TerraceError for a bad config, RuntimeError when CUDA is already initialized. Warns when
    PYTORCH_CUDA_ALLOC_CONF (or PYTORCH_ALLOC_CONF) is set: it configures PyTorch's own allocator,
    not terrace. A second call
    in the same process returns the library and swaps nothing.

    Out of device memory then raises RuntimeError opening with "CUDA out of memory.", as PyTorch's
    own message does, then terrace's report (PyTorch's own allocator raises
    torch.OutOfMemoryError, a RuntimeError subclass that a pluggable allocator cannot raise).
    CUDA graph capture (torch.cuda.graph, torch.compile(mode="reduce-overhead")) is not
    supported, as terrace has no private pools: it raises RuntimeError before the capture begins.
    torch.cuda.memory_allocated(), memory_stats() and the other statistics then read terrace's
    (route_torch_memory_stats), where PyTorch's own would raise under a pluggable allocator.
    """
    global _allocator
    import torch  # only install() needs PyTorch

    if _allocator is not None:
        # PyTorch marks a pluggable allocator initialized when it is made, so a second swap would
        # fail with "Can't swap an already initialized allocator" though CUDA is not initialized
        # (a re-run notebook cell). terrace is already the allocator: a second call changes
        # nothing, except that a `conf` is applied if no allocator of terrace exists yet.
        lib = load(path)
        if conf:
            lib.configure(conf)
        return lib
    if torch.cuda.is_initialized():
        raise RuntimeError(
            "terrace_torch.install() must run before CUDA is initialized in this process (before "
            "the first CUDA tensor, torch.cuda.current_device(), get_device_properties(), ...): "
            "PyTorch cannot swap an allocator it has initialized")
    lib = load(path)
    if conf:
        lib.configure(conf)
    # PyTorch's settings configure the allocator terrace replaces: said, so that a user's
    # max_split_size_mb or expandable_segments:True there is not dropped unseen.
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        if os.environ.get(name):
            warnings.warn(f"{name}={os.environ[name]} does not configure terrace, which replaces "
                          "PyTorch's allocator: set TERRACE_ALLOC_CONF (or install(conf=...)), "
                          "which takes max_split_size_mb, expandable_segments, "
                          "garbage_collection_threshold and roundup_power2_divisions as PyTorch does")
    # The torch_ pair: PyTorch uses a NULL from malloc as the tensor's address and never retries
    # a free (see include/terrace/terrace.h).
    alloc = torch.cuda.memory.CUDAPluggableAllocator(lib.path, "terrace_torch_malloc",
                                                     "terrace_torch_free")
    native = alloc.allocator()
    native.set_init_fn(lib.address("terrace_init"))
    native.set_reset_fn(lib.address("terrace_empty_cache"))
    native.set_memory_fraction_fn(lib.address("terrace_set_memory_fraction"))
    native.set_record_stream_fn(lib.address("terrace_record_stream"))
    # A CUDA graph needs a private pool, which terrace lacks: the hook refuses the capture with
    # a RuntimeError before it begins. Older PyTorch has no such hook, and capture would go on
    # and corrupt memory.
    if hasattr(native, "set_begin_allocate_to_pool"):
        native.set_begin_allocate_to_pool(lib.address("terrace_torch_begin_allocate_to_pool"))
    else:
        warnings.warn("this PyTorch has no set_begin_allocate_to_pool hook: terrace cannot refuse "
                      "CUDA graph capture, which it does not support; do not capture graphs")
    torch.cuda.memory.change_current_allocator(alloc)
    _allocator = alloc
    route_torch_memory_stats(torch, lib)
    return lib


def _nested(flat):
    """{"a.b.c": 1} -> {"a": {"b": {"c": 1}}}: memory_stats_as_nested_dict()'s shape, which
    torch.cuda.memory_stats() flattens again with the same dots."""
    nested = {}
    for key, value in flat.items():
        node = nested
        *path, leaf = key.split(".")
        for part in path:
            node = node.setdefault(part, {})
        node[leaf] = value
    return nested


def route_torch_memory_stats(torch, lib=None):
    """Makes torch.cuda's memory statistics terrace's. Under any pluggable allocator PyTorch's
    own raise ("CUDAPluggableAllocator does not yet support getDeviceStats"), and training code
    calls them: torch.cuda.memory_allocated(), max_memory_allocated(), memory_reserved(),
    memory_stats(), memory_summary(), reset_peak_memory_stats() (Trainer and Lightning logging,
    torch.compile's autotuning). All of them go through three functions of torch.cuda.memory,
    which this replaces, there and under torch.cuda: memory_stats_as_nested_dict and the two
    resets. install() calls it; code that took a reference to one of the three before keeps
    PyTorch's. C++ callers of the allocator's getDeviceStats still meet PyTorch's error."""
    lib = lib or load()
    memory = torch.cuda.memory
    device_index = memory._get_device_index  # None: the current device, as PyTorch resolves it

    def memory_stats_as_nested_dict(device=None):
        return _nested(lib.stats(device_index(device, optional=True)))

    def reset_peak_memory_stats(device=None):
        lib.reset_peak_stats(device_index(device, optional=True))

    def reset_accumulated_memory_stats(device=None):
        lib.reset_accumulated_stats(device_index(device, optional=True))

    for module in (memory, torch.cuda):
        module.memory_stats_as_nested_dict = memory_stats_as_nested_dict
        module.reset_peak_memory_stats = reset_peak_memory_stats
        module.reset_accumulated_memory_stats = reset_accumulated_memory_stats


def configure(conf):
    load().configure(conf)


def stats(device=0):
    """terrace's stats for `device` as a dict keyed like torch.cuda.memory_stats()."""
    return load().stats(device)


def reset_peak_stats(device=0):
    load().reset_peak_stats(device)


def reset_accumulated_stats(device=0):
    """As torch.cuda.reset_accumulated_memory_stats: the allocated/freed totals and event counts
    start again from zero."""
    load().reset_accumulated_stats(device)


def record_trace(on=True):
    load().record_trace(on)


def begin_iteration(device=0):
    load().begin_iteration(device)


def end_iteration(device=0):
    load().end_iteration(device)


def dump_snapshot(path, device=0):
    load().dump_snapshot(path, device)


def dump_trace(path, device=0):
    load().dump_trace(path, device)


def empty_cache():
    load().empty_cache()


def last_error():
    return load().last_error()

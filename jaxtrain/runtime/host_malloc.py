"""glibc malloc settings for XLA:CPU: keep freed memory in the process instead of returning it to the kernel.

    from jaxtrain.runtime.host_malloc import retain_freed_memory
    retain_freed_memory()       # `jaxtrain train`/`inspect`/`preflight` do this by themselves on the CPU

XLA:CPU allocates a program's temporaries as one buffer at every execution (buffer assignment's
`preallocated-temp`) and frees it after. glibc serves a request above its mmap threshold with a
fresh mmap, and that threshold adapts only up to 32 MiB: a step whose temporaries are larger gets
them mapped and unmapped at every step, and touches every page of them for the first time, one
page fault each, at every step. moe-tiny's dropless step has 30.7 MiB of temporaries with XLA's
concurrency-optimised schedule off, a little more with it on, or with the layers scanned, or with
32-row expert tiles: each of those crossed 32 MiB and cost ~8,750 faults (35 MB of first touches)
per step. Measured in fresh processes, 4 alternated rounds, 2-core EPYC, jax 0.10.2, 2026-12-04:

| program                          | glibc defaults          | these settings      |
|----------------------------------|-------------------------|---------------------|
| dropless MoE, layers unrolled    | 8,750 faults, 0.033 s   | 183, 0.021 s        |
| dropless MoE, layers scanned     | 10,039 faults, 0.035 s  | 42, 0.023 s         |
| dense twin, unrolled (23 MiB)    | 49 faults, 0.015 s      | 49, 0.013 s         |

A profile of such a step shows every op slower, attention included: the cost is in first
touches, not in any one op. The settings (`mallopt`):
- M_MMAP_MAX = 0: no request is served by its own mmap; large ones come from the heap (glibc
  still maps memory for the heaps themselves, and falls back to it when the heap cannot grow);
- M_TRIM_THRESHOLD = 1 GiB: up to 1 GiB free at the top of the heap is kept, not returned;
- M_TOP_PAD = 64 MiB: a heap grows by 64 MiB more than asked, and a thread arena's heap (64 MiB
  at most on 64-bit) is never unmapped when it empties.
The cost is resident memory: a process keeps what it used at its peak, as a caching allocator does.
Each of glibc's thread arenas (up to 8 per core) keeps its own: a step that runs on a thread whose
arena has not held the buffer yet pays its first touches once (under load: once or twice in 300
steps, by step 25), then no more.

Left alone: another libc or OS, another allocator preloaded (jemalloc, tcmalloc, mimalloc),
glibc malloc settings of the user's own (MALLOC_*_ variables, glibc.malloc tunables), or
JAXTRAIN_HOST_MALLOC=default. Another program (a peer in a benchmark) gets the same settings from
`env_equivalent()`, read by glibc when that program starts.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys

from jaxtrain.runtime import env

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_MAX = -1, -2, -4  # glibc malloc.h
SETTINGS = {"mmap_max": (M_MMAP_MAX, 0), "trim_threshold": (M_TRIM_THRESHOLD, 1 << 30),
            "top_pad": (M_TOP_PAD, 64 << 20)}
ENV_NAMES = {"mmap_max": "MALLOC_MMAP_MAX_", "trim_threshold": "MALLOC_TRIM_THRESHOLD_", "top_pad": "MALLOC_TOP_PAD_"}
USER_VARIABLES = ("MALLOC_TOP_PAD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_MMAP_MAX_",
                  "MALLOC_ARENA_MAX")
OTHER_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")

_applied: dict | None = None


def reason_to_leave_alone() -> str | None:
    """Why this process's malloc is not ours to tune (None: it is glibc's, with its defaults)."""
    if os.environ.get(env.HOST_MALLOC) == "default":
        return f"{env.HOST_MALLOC}=default"
    if sys.platform != "linux" or platform.libc_ver()[0] != "glibc":
        return "not glibc"
    preload = os.environ.get("LD_PRELOAD", "")
    if any(name in preload for name in OTHER_ALLOCATORS):
        return "another allocator is preloaded"
    if any(v in os.environ for v in USER_VARIABLES) or "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return "the user's own malloc settings"
    return None


def retain_freed_memory() -> dict:
    """Apply the settings of the module doc once per process. Returns what was done:
    {"mmap_max": 0, "trim_threshold": bytes, "top_pad": bytes}, or {"left_alone": reason}."""
    global _applied
    if _applied is None:
        reason = reason_to_leave_alone()
        if reason is not None:
            _applied = {"left_alone": reason}
        else:
            mallopt = ctypes.CDLL("libc.so.6").mallopt
            mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
            refused = [name for name, (code, value) in SETTINGS.items() if mallopt(code, value) != 1]  # 1: done
            _applied = ({"left_alone": f"mallopt refused {refused}"} if refused
                        else {name: value for name, (_, value) in SETTINGS.items()})
    return dict(_applied)


def applied() -> dict | None:
    """What `retain_freed_memory` did in this process (None: it was not called)."""
    return None if _applied is None else dict(_applied)


def env_equivalent() -> dict[str, str]:
    """The same settings as environment variables, for another process (glibc reads them at its start)."""
    return {ENV_NAMES[name]: str(value) for name, (_, value) in SETTINGS.items()}

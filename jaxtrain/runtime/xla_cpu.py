"""XLA flags that make the CPU backend faster; `jaxtrain train` sets them on the CPU by itself.

    from jaxtrain.runtime.xla_cpu import cpu_xla_flags, with_flags     # before JAX is imported
    os.environ["XLA_FLAGS"] = with_flags(os.environ.get("XLA_FLAGS", ""), cpu_xla_flags())

- `--xla_cpu_experimental_ynn_fusion_type=dot,eltwise,reduce`: XLA's CPU backend hands dots,
  elementwise ops and reductions to YNNPACK (by default only dots). Elementwise passes that
  XLA otherwise fuses with a layout transpose (the MLP's backward: silu' fused with a transposed
  write, ~30 ms per layer on cpu-tiny) run as YNNPACK kernels instead.
- `--xla_cpu_prefer_vector_width=512`: let LLVM use 512-bit vectors for XLA's own loops (only on
  CPUs with AVX-512; LLVM's default preference is 256).

XLA's concurrency-optimised schedule (on by default) stays on for every model. The MoE step once
looked 35-50% slower with it (0.034 against 0.025 s on moe-tiny), and a flag turned it off for a
mixture of experts. The cause was page faults, not the schedule: with it, the step's temporaries
grew past 32 MiB, above which glibc maps memory afresh at every step. With jaxtrain/runtime/host_malloc.py's
settings, which `jaxtrain train` applies on the CPU, the MoE step runs as fast with the schedule
as without, and the dense one keeps its ~15% gain from it.

Measured on cpu-tiny (2 cores, AMD EPYC with AVX-512; docs/bench_cpu_tiny.md): 10-15% less step
time on jax 0.10.2 and 0.12.0.1, and MaxText's step gains about as much from the same flags.
The numerics are the same to fp32 rounding (the loss of the first step agrees to 1e-6).
"""

from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path

YNN_FUSIONS = "--xla_cpu_experimental_ynn_fusion_type=dot,eltwise,reduce"
VECTOR_512 = "--xla_cpu_prefer_vector_width=512"


def has_accelerator_hint() -> bool:
    """Whether this machine looks like it has a GPU or TPU (read without importing JAX)."""
    return (any(k in os.environ for k in ("CUDA_VISIBLE_DEVICES", "TPU_NAME", "TPU_WORKER_ID"))
            or os.path.exists("/dev/nvidia0"))


def has_avx512() -> bool:
    """Whether this CPU advertises AVX-512F (Linux /proc/cpuinfo; False where it cannot be read)."""
    try:
        return " avx512f" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


# XLA aborts on a flag it does not know, so only versions where these were checked get them
# (the YNN fusion flag is experimental and may be renamed).
CHECKED_JAXLIB = ((0, 10), (0, 12))


def _jaxlib_checked() -> bool:
    try:
        major, minor = (int(x) for x in importlib.metadata.version("jaxlib").split(".")[:2])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return False
    return CHECKED_JAXLIB[0] <= (major, minor) <= CHECKED_JAXLIB[1]


# YNNPACK's elementwise fusions reject operands in a non-default layout ("Instruction with unsupported
# layout in YNN fusion", at run time). XLA:CPU lays out an all-gather (and its operand) with the gathered
# dimension outermost, and sequence parallelism all-gathers the residual stream (and, in the backward
# pass, its cotangent) along length before each block's projections: the fusion that produces it, e.g.
# RMSNorm's backward, then gets that layout (2026-12, jaxlib 0.10.2, Intel Xeon AVX-512; tensor 2 x data 4
# and context 2 x tensor 2 x data 2). No sharding constraint in the model avoids those gathers (they are
# what sequence parallelism is), so such configs keep YNNPACK for dots and reductions only. Context
# parallelism alone hits the same rejection on jaxlib 0.12 (context 4 x data 2: a gather of the loss's
# dx over `context`, 2026-12-06, Python 3.12 / jaxlib 0.12.0.1; 0.10.2 ran it), so every config that
# splits activations' length runs without them.
YNN_FUSIONS_NO_ELTWISE = "--xla_cpu_experimental_ynn_fusion_type=dot,reduce"


def splits_length(cfg) -> bool:
    """Whether `cfg` (a jaxtrain Config) splits activations' length: over `context`
    (`mesh.context` > 1), or over a `tensor` axis (sequence parallelism, `mesh.rules: {act_length:
    [context, tensor]}`). Read before JAX starts."""
    if cfg is None:
        return False
    if cfg.mesh.context != 1:  # (-1: resolved from the device count; it may be > 1)
        return True
    if cfg.mesh.tensor == 1:
        return False
    targets = [cfg.mesh.rules.get(name) for name in ("act_length", "length")]
    return any("tensor" in (t if isinstance(t, list) else [t]) for t in targets)


def gathers_in_muon(cfg) -> bool:
    """Whether `cfg` runs Muon on matrices split over `fsdp` or `tensor`: each Newton-Schulz step
    all-gathers them, and YNNPACK's elementwise fusions reject the gathered layout as for
    sequence parallelism (jaxtrain train, fsdp 2 x tensor 2, 2026-12-06, jaxlib 0.12.0.1)."""
    return cfg is not None and cfg.optim.name == "muon" and (cfg.mesh.fsdp != 1 or cfg.mesh.tensor != 1)


def cpu_xla_flags(cfg=None) -> list[str]:
    """The recommended XLA flags for this CPU (to be set before JAX starts); none for a jaxlib
    these flags were not checked with. With `cfg`, flags that config can run with (see
    YNN_FUSIONS_NO_ELTWISE)."""
    if not _jaxlib_checked():
        return []
    ynn = YNN_FUSIONS_NO_ELTWISE if splits_length(cfg) or gathers_in_muon(cfg) else YNN_FUSIONS
    return [ynn] + ([VECTOR_512] if has_avx512() else [])


# YNNPACK's elementwise and reduce fusions cost memory: the buffers of its fusions are not shared the
# way XLA's own are. Measured on llama3-70b.yaml at 1 layer, V 32,000, MLP 1,024, one device (7.83 GiB
# of state): the initialisation's temporaries 3.9 -> 27.7 GiB (a 29.7 GB allocation that a 24 GiB
# machine refuses at start-up), the step's 6.2 -> 10.6 GiB. Programs that run once compile without them.
DOTS_ONLY = {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_DOT"}


def lean_compile_options(platform: str) -> dict[str, str]:
    """Per-program XLA options for a program that runs once (the state's initialisation): YNNPACK
    for dots only, where this process's XLA_FLAGS turned its other fusions on for the CPU."""
    flags = os.environ.get("XLA_FLAGS", "")
    if platform != "cpu" or "xla_cpu_experimental_ynn_fusion_type" not in flags or not _jaxlib_checked():
        return {}
    return dict(DOTS_ONLY)


def with_flags(existing: str, flags: list[str]) -> str:
    """`existing` XLA_FLAGS plus `flags`, without repeating a flag already given (first one wins)."""
    names = {f.split("=")[0] for f in existing.split()}
    return " ".join(existing.split() + [f for f in flags if f.split("=")[0] not in names])

"""XLA flags that make the CPU backend faster; `jaxtrain train` sets them on the CPU by itself.

    from jaxtrain.xla_cpu import cpu_xla_flags, with_flags     # before JAX is imported
    os.environ["XLA_FLAGS"] = with_flags(os.environ.get("XLA_FLAGS", ""), cpu_xla_flags())

- `--xla_cpu_experimental_ynn_fusion_type=dot,eltwise,reduce`: XLA's CPU backend hands dots,
  elementwise ops and reductions to YNNPACK (by default only dots). Elementwise passes that
  XLA otherwise fuses with a layout transpose (the MLP's backward: silu' fused with a transposed
  write, ~30 ms per layer on cpu-tiny) run as YNNPACK kernels instead.
- `--xla_cpu_prefer_vector_width=512`: let LLVM use 512-bit vectors for XLA's own loops (only on
  CPUs with AVX-512; LLVM's default preference is 256).
- `--xla_cpu_enable_concurrency_optimized_scheduler=false`, for a mixture of experts only
  (`cpu_xla_flags(moe=True)`): XLA's CPU schedule orders the program so that independent ops run
  at once on the intra-op thread pool. That helps the dense model (off, its step is ~15% slower)
  and hurts the MoE step: moe-tiny's dropless step 0.034 -> 0.025 s with it off on jax 0.10.2,
  0.033-0.035 -> 0.021-0.023 s on 0.12.0.1; capacity inside the layer scan 0.039 -> 0.025 s
  (2 cores; docs/moe.md). The cliff follows the experts' matmul shapes (at equal rows, tiles of <= 128 rows
  slow, >= 160 not), not the cost of any one op. Only the process flag changes the schedule: the
  same option given per program (`compiler_options`) leaves the compiled HLO as it was.

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
NO_CONCURRENCY_SCHEDULE = "--xla_cpu_enable_concurrency_optimized_scheduler=false"


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


def cpu_xla_flags(moe: bool = False) -> list[str]:
    """The recommended XLA flags for this CPU (to be set before JAX starts); none for a jaxlib
    these flags were not checked with. `moe`: the model is a mixture of experts (module doc)."""
    if not _jaxlib_checked():
        return []
    return [YNN_FUSIONS] + ([VECTOR_512] if has_avx512() else []) + ([NO_CONCURRENCY_SCHEDULE] if moe else [])


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

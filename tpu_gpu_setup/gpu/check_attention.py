#!/usr/bin/env python3
"""Checks and times the attention implementations on one NVIDIA GPU.

1. Correctness: triton, pallas (if it compiles on this GPU; else reported "unsupported") and cudnn
   against the xla reference, outputs and dq/dk/dv, relative error max|a-b| / max|b|.
2. Speed: forward and forward+backward TFLOP/s for seq 2k/4k/8k/16k, head_dim 64/128, causal,
   bf16, with batch * seq = 16k tokens and heads * head_dim = 2048 (d_model 2048), so every row
   does the same matmul work per token. FLOPs from jaxtrain.kernels.attention_flops (causal = half) and
   jaxtrain.kernels.attention_training_flops (backward = 2.5x forward, the FlashAttention convention).

Prints a table; with $OUT set (or --out DIR) also writes attention_check.json and
attention_check.md there, rewritten after every row so a run cut short still leaves its results.

Usage (from the repository root, see README.md beside this file for installing jax-triton):
    python3 tpu_gpu_setup/gpu/check_attention.py [--quick] [--budget-s 420]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: jaxtrain (and its kernels)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jaxtrain.kernels as kernels  # noqa: E402
from jaxtrain.kernels import attention_flops, attention_training_flops, mha_reference  # noqa: E402
from jaxtrain.kernels.cudnn_attention import cudnn_flash_attention  # noqa: E402
from jaxtrain.kernels.pallas_attention import pallas_flash_attention  # noqa: E402
from jaxtrain.kernels.testing import TOLERANCE, random_inputs, relative_error, time_call  # noqa: E402

IMPLEMENTATIONS = ("triton", "pallas", "cudnn", "xla")

# (B, L, N, K, H, causal, segments, dtype): GQA, a length that is not a multiple of the tiles,
# packed documents, fp32 (cuDNN has no fp32 path: reported n/a).
CORRECTNESS_CASES = [
    (2, 1024, 8, 2, 128, True, True, "bfloat16"),
    (2, 1000, 8, 8, 64, False, False, "bfloat16"),
    (1, 512, 4, 1, 64, True, False, "float32"),
]


def _first_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return text.splitlines()[0][:200]


def make_implementations() -> dict:
    """name -> attention(q, k, v, causal=, segment_ids=) or a string saying why it cannot run."""
    impls: dict = {
        "xla": mha_reference,
        "cudnn": cudnn_flash_attention,
        # Compiled (interpret=False) through Pallas' GPU backend; the kernels are TPU-first.
        "pallas": functools.partial(pallas_flash_attention, interpret=False),
    }
    try:
        import jax_triton  # noqa: F401  (fails early and clearly if missing or incompatible)

        from jaxtrain.kernels.triton_attention import triton_flash_attention

        impls["triton"] = triton_flash_attention
    except Exception as exc:  # noqa: BLE001 - report, do not crash
        impls["triton"] = f"unavailable ({_first_line(exc)})"
    return impls


def check_correctness(impls: dict, log) -> list[dict]:
    rows = []
    for B, L, N, K, H, causal, segments, dtype_name in CORRECTNESS_CASES:
        dtype = jnp.dtype(dtype_name)
        q, k, v, do, seg = random_inputs(0, B, L, N, K, H, dtype, segments)
        kw = dict(causal=causal, segment_ids=seg)

        def out_and_grads(fn):
            @jax.jit
            def run(q, k, v, do):
                out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, **kw), q, k, v)
                return (out, *vjp(do))

            return run(q, k, v, do)

        # The reference in full fp32 matmul precision (XLA may otherwise use TF32 for fp32 dots).
        with jax.default_matmul_precision("highest"):
            reference = out_and_grads(mha_reference)
        case = f"B{B} L{L} N{N} K{K} H{H} {'causal' if causal else 'full'} {'seg' if segments else 'noseg'} {dtype_name}"
        for name in IMPLEMENTATIONS:
            if name == "xla":
                continue
            row = {"case": case, "implementation": name}
            fn = impls[name]
            if isinstance(fn, str):
                row["status"] = fn
            elif name == "cudnn" and dtype_name == "float32":
                row["status"] = "n/a (cuDNN attention needs fp16/bf16)"
            else:
                try:
                    with jax.default_matmul_precision("highest"):
                        got = out_and_grads(fn)
                    errors = {n: relative_error(g, r) for n, g, r in zip(("out", "dq", "dk", "dv"), got, reference)}
                    finite = all(bool(jnp.all(jnp.isfinite(g.astype(jnp.float32)))) for g in got)
                    ok = finite and max(errors.values()) <= TOLERANCE[dtype_name]
                    row.update({f"err_{n}": e for n, e in errors.items()})
                    row["status"] = "ok" if ok else ("FAIL (non-finite)" if not finite else "FAIL (error)")
                except Exception as exc:  # noqa: BLE001
                    row["status"] = f"unsupported ({_first_line(exc)})"
                    log(traceback.format_exc(limit=3))
            errs = " ".join(f"{n}={row[f'err_{n}']:.2e}" for n in ("out", "dq", "dk", "dv") if f"err_{n}" in row)
            log(f"[check] {case:45s} {name:7s} {row['status']:30.30s} {errs}")
            rows.append(row)
    return rows


def benchmark(impls: dict, usable: list[str], sizes, head_dims, deadline: float, log, write,
              tokens: int = 16 * 1024, d_model: int = 2048) -> list[dict]:
    """Times each usable implementation with batch = tokens // seq and heads = d_model // head_dim."""
    rows = []
    for H in head_dims:
        for L in sizes:
            B, N = max(1, tokens // L), d_model // H
            key_q, key_k, key_v, key_o = jax.random.split(jax.random.key(L + H), 4)
            q = jax.random.normal(key_q, (B, L, N, H), jnp.bfloat16)
            k = jax.random.normal(key_k, (B, L, N, H), jnp.bfloat16)
            v = jax.random.normal(key_v, (B, L, N, H), jnp.bfloat16)
            do = jax.random.normal(key_o, (B, L, N, H), jnp.bfloat16)
            fwd_flops = attention_flops(B, L, N, H, causal=True)
            train_flops = attention_training_flops(B, L, N, H, causal=True)
            for name in usable:
                row = {"implementation": name, "batch": B, "seq": L, "heads": N, "head_dim": H}
                # The reference materialises [B, N, L, L] fp32 scores (twice for the backward).
                if name == "xla" and B * N * L * L * 4 > 8 * 2**30:
                    row["status"] = "skipped (xla scores > 8 GiB)"
                elif time.monotonic() > deadline:
                    row["status"] = "skipped (time budget)"
                else:
                    fn = functools.partial(impls[name], causal=True)
                    fwd = jax.jit(lambda q, k, v, fn=fn: fn(q, k, v))

                    @jax.jit
                    def fwd_bwd(q, k, v, do, fn=fn):
                        out, vjp = jax.vjp(fn, q, k, v)
                        return vjp(do)

                    try:
                        t_fwd = time_call(fwd, q, k, v)
                        t_all = time_call(fwd_bwd, q, k, v, do)
                        row.update(
                            status="ok", fwd_ms=1e3 * t_fwd, fwd_tflops=fwd_flops / t_fwd / 1e12,
                            fwd_bwd_ms=1e3 * t_all, fwd_bwd_tflops=train_flops / t_all / 1e12,
                        )
                    except Exception as exc:  # noqa: BLE001
                        row["status"] = f"error ({_first_line(exc)})"
                rows.append(row)
                if row["status"] == "ok":
                    log(f"[time] H{H} L{L:6d} B{B:2d} N{N:2d} {name:7s} fwd {row['fwd_ms']:8.3f} ms "
                        f"{row['fwd_tflops']:6.1f} TFLOP/s | fwd+bwd {row['fwd_bwd_ms']:8.3f} ms "
                        f"{row['fwd_bwd_tflops']:6.1f} TFLOP/s")
                else:
                    log(f"[time] H{H} L{L:6d} {name:7s} {row['status']}")
                write(rows)
    return rows


def to_markdown(meta: dict, checks: list[dict], timings: list[dict]) -> str:
    lines = [f"# Attention check on {meta['device']}", "",
             f"jax {meta['jax']}, triton {meta['triton']}, jax-triton {meta['jax_triton']}; {meta['when']}", "",
             "## Correctness (relative error max|a-b|/max|b| against xla)", "",
             "| case | implementation | status | out | dq | dk | dv |", "|---|---|---|---|---|---|---|"]
    for r in checks:
        errs = [f"{r[f'err_{n}']:.2e}" if f"err_{n}" in r else "" for n in ("out", "dq", "dk", "dv")]
        lines.append(f"| {r['case']} | {r['implementation']} | {r['status']} | " + " | ".join(errs) + " |")
    lines += ["", "## Speed (causal, bf16; TFLOP/s with causal = half, backward = 2.5x forward)", "",
              "| head_dim | seq | batch | heads | implementation | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in timings:
        if r["status"] == "ok":
            cells = f"{r['fwd_ms']:.3f} | {r['fwd_tflops']:.1f} | {r['fwd_bwd_ms']:.3f} | {r['fwd_bwd_tflops']:.1f}"
        else:
            cells = f"{r['status']} | | |"
        lines.append(f"| {r['head_dim']} | {r['seq']} | {r['batch']} | {r['heads']} | {r['implementation']} | {cells} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="seq 2k and 8k, head_dim 128 only")
    parser.add_argument("--budget-s", type=float, default=420.0, help="stop starting new timings after this")
    parser.add_argument("--out", default=os.environ.get("OUT"), help="directory for JSON/markdown (default $OUT)")
    args = parser.parse_args(argv)
    start = time.monotonic()

    def log(message: str) -> None:
        print(message, flush=True)

    devices = jax.devices()
    if devices[0].platform != "gpu":
        log(f"no GPU: jax sees {devices}; this script is for one NVIDIA GPU")
        return 2
    impls = make_implementations()
    meta = {
        "device": devices[0].device_kind, "jax": jax.__version__, "python": platform.python_version(),
        "triton": _version("triton"), "jax_triton": _version("jax_triton"),
        "auto_gpu_implementation": kernels.AUTO_GPU_IMPLEMENTATION, "when": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    log(json.dumps(meta))
    out_dir = Path(args.out) if args.out else None
    checks: list[dict] = []

    def write(timings: list[dict]) -> None:
        if out_dir is None:
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "attention_check.json").write_text(
            json.dumps({"meta": meta, "correctness": checks, "timings": timings}, indent=1))
        (out_dir / "attention_check.md").write_text(to_markdown(meta, checks, timings))

    checks.extend(check_correctness(impls, log))
    write([])
    # Time what runs and is correct; xla as the baseline.
    ok_impls = {r["implementation"] for r in checks if r["status"] == "ok"}
    bad_impls = {r["implementation"] for r in checks if r["status"] != "ok"}
    usable = [n for n in ("triton", "pallas", "cudnn") if n in ok_impls and n not in bad_impls] + ["xla"]
    sizes = (2048, 8192) if args.quick else (2048, 4096, 8192, 16384)
    head_dims = (128,) if args.quick else (64, 128)
    timings = benchmark(impls, usable, sizes, head_dims, start + args.budget_s, log, write)
    write(timings)
    print(to_markdown(meta, checks, timings))
    _suggest_auto(timings, log)
    # Exit 1 when triton or cudnn could not run or were wrong (pallas on GPU may be unsupported).
    failed = [r for r in checks if r["implementation"] in ("triton", "cudnn")
              and r["status"] != "ok" and not r["status"].startswith("n/a")]
    return 1 if failed else 0


def _suggest_auto(timings: list[dict], log) -> None:
    """Which of triton / cudnn is faster for fwd+bwd at each size: evidence for AUTO_GPU_IMPLEMENTATION."""
    wins: dict[str, int] = {}
    for H in {r["head_dim"] for r in timings}:
        for L in {r["seq"] for r in timings}:
            best = [r for r in timings if r["head_dim"] == H and r["seq"] == L and r["status"] == "ok"
                    and r["implementation"] in ("triton", "cudnn")]
            if best:
                winner = max(best, key=lambda r: r["fwd_bwd_tflops"])["implementation"]
                wins[winner] = wins.get(winner, 0) + 1
    if wins:
        log(f"fwd+bwd wins (triton vs cudnn): {wins}; kernels.AUTO_GPU_IMPLEMENTATION is "
            f"{kernels.AUTO_GPU_IMPLEMENTATION!r}")


def _version(module: str) -> str:
    try:
        return str(__import__(module).__version__)
    except Exception as exc:  # noqa: BLE001
        return f"missing ({_first_line(exc)})"


if __name__ == "__main__":
    sys.exit(main())

"""Attention kernels: correctness against the XLA reference and speed.

  python bench/bench_attention.py [--seq 256] [--heads 4] [--kv-heads 2] [--head-dim 64]
  python bench/bench_attention.py --window 512 [--window-seq 4096]   # sliding window vs full causal

On an NVIDIA GPU this runs tpu_gpu_setup/gpu/check_attention.py (triton / pallas / cudnn against
xla, and the forward and forward+backward TFLOP/s table; extra arguments are passed through).
On CPU it compares xla with the Pallas kernels in interpret mode on one small causal shape:
relative errors of out/dq/dk/dv and the time of each, as a sanity check only, since interpret
mode runs the kernel as a loop of XLA ops and is not meant to be fast.

`--window W` (any platform, CPU-sized by default) compares sliding-window attention with full causal
attention on one `--window-seq`-token sequence: the tiles each kernel visits and their FLOPs (Pallas
128x128 tiles; Triton forward 128x64 and backward 64x64: the loop bounds the kernels compute, which
the tests pin them to), the xla path's compiled FLOPs (XLA's cost analysis of the dense reference vs
the banded `mha_local`), and the time of the xla path and of the Pallas kernels (interpret mode on
CPU: the loop trip count is what falls, so the ratio means something, the absolute times do not).
"""

from __future__ import annotations

import argparse
import functools
import runpy
import sys
from pathlib import Path

import jax

from jaxtrain.kernels import attention_flops, attention_training_flops, flash_attention, mha_reference, visited_tiles
from jaxtrain.kernels.pallas_attention import pallas_flash_attention
from jaxtrain.kernels.testing import random_inputs, relative_error, time_call

CHECK_SCRIPT = Path(__file__).resolve().parents[1] / "tpu_gpu_setup" / "gpu" / "check_attention.py"


def cpu_sanity(batch: int, seq: int, heads: int, kv_heads: int, head_dim: int) -> None:
    q, k, v, do, _ = random_inputs(0, batch, seq, heads, kv_heads, head_dim)
    impls = {"xla": mha_reference, "pallas (interpret)": pallas_flash_attention}
    results = {}
    for name, fn in impls.items():
        fwd = jax.jit(functools.partial(fn, causal=True))

        @jax.jit
        def fwd_bwd(q, k, v, do, fn=fn):
            out, vjp = jax.vjp(functools.partial(fn, causal=True), q, k, v)
            return (out, *vjp(do))

        results[name] = fwd_bwd(q, k, v, do)
        results[name + " times"] = (time_call(fwd, q, k, v, iters=5), time_call(fwd_bwd, q, k, v, do, iters=5))
    fwd_flops = attention_flops(batch, seq, heads, head_dim, causal=True)
    train_flops = attention_training_flops(batch, seq, heads, head_dim, causal=True)
    print(f"B={batch} L={seq} N={heads} K={kv_heads} H={head_dim} causal fp32 on {jax.devices()[0].platform}")
    print("| implementation | fwd ms | fwd GFLOP/s | fwd+bwd ms | fwd+bwd GFLOP/s | rel err out / dq / dk / dv |")
    print("|---|---|---|---|---|---|")
    for name in impls:
        t_fwd, t_all = results[name + " times"]
        errs = " / ".join(f"{relative_error(a, b):.1e}" for a, b in zip(results[name], results["xla"]))
        print(f"| {name} | {1e3 * t_fwd:.2f} | {fwd_flops / t_fwd / 1e9:.2f} | {1e3 * t_all:.2f} | "
              f"{train_flops / t_all / 1e9:.2f} | {errs} |")


def window_comparison(batch: int, seq: int, heads: int, kv_heads: int, head_dim: int, window: int) -> None:
    """Sliding window `window` against full causal attention: visited tiles, FLOPs and times."""
    q, k, v, do, _ = random_inputs(0, batch, seq, heads, kv_heads, head_dim)
    per_pair = 4.0 * batch * heads * head_dim  # forward FLOPs of one (query, key) pair
    print(f"B={batch} L={seq} N={heads} K={kv_heads} H={head_dim} causal fp32 on {jax.devices()[0].platform}: "
          f"window {window} vs full causal")
    print("| what | full causal | window | window / full |")
    print("|---|---|---|---|")

    def row(what, full, windowed, fmt="{:.3g}"):
        print(f"| {what} | {fmt.format(full)} | {fmt.format(windowed)} | {windowed / full:.3f} |")

    row("model FLOPs, forward (band L*W - W^2/2)", attention_flops(batch, seq, heads, head_dim),
        attention_flops(batch, seq, heads, head_dim, window=window))
    for name, bq, bk in (("pallas fwd/dq/dkv 128x128", 128, 128), ("triton fwd 128x64", 128, 64),
                         ("triton dq/dkv 64x64", 64, 64)):
        full, windowed = visited_tiles(seq, bq, bk), visited_tiles(seq, bq, bk, window=window)
        row(f"{name}: tiles visited per head", full, windowed, "{:d}")
        row(f"{name}: FLOPs of QK^T and PV over those tiles", full * per_pair * bq * bk, windowed * per_pair * bq * bk)

    def xla(window):
        return functools.partial(flash_attention, implementation="xla", window=window)

    def pallas(window):
        return functools.partial(pallas_flash_attention, window=window)

    def fwd_bwd(fn):
        def run(q, k, v, do):
            out, vjp = jax.vjp(fn, q, k, v)
            return (out, *vjp(do))
        return jax.jit(run)

    flops = [jax.jit(xla(w)).lower(q, k, v).compile().cost_analysis()["flops"] for w in (None, window)]
    row("xla path: compiled FLOPs, forward (XLA cost analysis)", *flops)
    flops = [fwd_bwd(xla(w)).lower(q, k, v, do).compile().cost_analysis()["flops"] for w in (None, window)]
    row("xla path: compiled FLOPs, forward + backward", *flops)
    kind = "interpret" if jax.default_backend() == "cpu" else "compiled"
    for name, make in (("xla path", xla), (f"pallas ({kind})", pallas)):
        fwd = [time_call(jax.jit(make(w)), q, k, v, warmup=1, iters=3) for w in (None, window)]
        row(f"{name}: forward ms", *(1e3 * t for t in fwd), "{:.1f}")
        both = [time_call(fwd_bwd(make(w)), q, k, v, do, warmup=1, iters=3) for w in (None, window)]
        row(f"{name}: forward + backward ms", *(1e3 * t for t in both), "{:.1f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--window", type=int, default=None, help="compare this sliding window with full causal")
    parser.add_argument("--window-seq", type=int, default=4096, help="sequence length of the --window comparison")
    args, passthrough = parser.parse_known_args()
    if args.window is not None:
        window_comparison(args.batch, args.window_seq, args.heads, args.kv_heads, args.head_dim, args.window)
        return 0
    if jax.default_backend() == "gpu":
        sys.argv = [str(CHECK_SCRIPT), *passthrough]
        runpy.run_path(str(CHECK_SCRIPT), run_name="__main__")  # exits with the check's status
        return 0
    cpu_sanity(args.batch, args.seq, args.heads, args.kv_heads, args.head_dim)
    return 0


if __name__ == "__main__":
    sys.exit(main())

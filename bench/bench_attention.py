"""Attention kernels: correctness against the XLA reference and speed.

  python bench/bench_attention.py [--seq 256] [--heads 4] [--kv-heads 2] [--head-dim 64]

On an NVIDIA GPU this runs tpu_gpu_setup/gpu/check_attention.py (triton / pallas / cudnn against
xla, and the forward and forward+backward TFLOP/s table; extra arguments are passed through).
On CPU it compares xla with the Pallas kernels in interpret mode on one small causal shape:
relative errors of out/dq/dk/dv and the time of each, as a sanity check only, since interpret
mode runs the kernel as a loop of XLA ops and is not meant to be fast.
"""

from __future__ import annotations

import argparse
import functools
import runpy
import sys
from pathlib import Path

import jax

from jaxtrain.kernels import attention_flops, attention_training_flops, mha_reference
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    args, passthrough = parser.parse_known_args()
    if jax.default_backend() == "gpu":
        sys.argv = [str(CHECK_SCRIPT), *passthrough]
        runpy.run_path(str(CHECK_SCRIPT), run_name="__main__")  # exits with the check's status
        return 0
    cpu_sanity(args.batch, args.seq, args.heads, args.kv_heads, args.head_dim)
    return 0


if __name__ == "__main__":
    sys.exit(main())

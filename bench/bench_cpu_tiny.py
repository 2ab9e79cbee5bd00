"""cpu-tiny benchmark (DESIGN §7): tokens/s and MFU of the train step on one CPU device.

    python bench/bench_cpu_tiny.py [--steps 20] [--repeats 3] [--no-flags] [--bounds] [overrides ...]

Measures, in one process and interleaved so machine noise hits both alike:
  - the matmul peak: a plain jitted fp32 1024x1024 matmul (best of 5), the honest CPU "peak";
  - the cpu-tiny train step (configs/bench/cpu-tiny.yaml): median step time over `--steps` steps
    after compilation, tokens/s, model TFLOP/s and MFU = model FLOP/s / matmul peak;
  - the load average at the start and the end (speed claims need a quiet machine: load ~1).
Unless --no-flags, XLA gets the CPU flags of jaxtrain/runtime/xla_cpu.py (printed in the output).

--bounds adds what bounds the step: every matmul of the step (layers, attention, the chunked
head; forward and backward) timed alone at its own shape, so "matmul floor" is the step time if
the matmuls ran at their standalone speed and everything else took no time; the best MFU such a
step could reach is model FLOPs / floor / peak. The profiler splits the real step (matmul,
attention, elementwise, idle) beside it.

Prints one JSON line with everything (last line); docs/bench_cpu_tiny.md explains the method.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from jaxtrain.runtime.xla_cpu import cpu_xla_flags, with_flags  # noqa: E402  (no JAX import)


def configure_xla(use_flags: bool) -> list[str]:
    """XLA_FLAGS for one CPU device (+ the recommended CPU flags); must run before JAX starts."""
    flags = (cpu_xla_flags() if use_flags else []) + ["--xla_force_host_platform_device_count=1"]
    os.environ["XLA_FLAGS"] = with_flags(os.environ.get("XLA_FLAGS", ""), flags)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    return flags[:-1]


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def matmul_shapes(cfg) -> list[tuple[str, int, int, int, int, int]]:
    """(what, count per step, batch, M, K, N) of every matmul in one train step of `cfg`.

    out[batch, M, N] = a[batch, M, K] @ b[batch, K, N]. Per layer weight [I, O] over T tokens:
    forward (T, I, O), input gradient (T, O, I), weight gradient (I, T, O). XLA attention computes
    the whole L x L score matrix (causal masking is a select): QK^T, PV and their four gradients.
    The head runs chunked (jaxtrain/model/loss.py): per chunk of R = B x C rows, logits (R, D, V),
    dx (R, V, D) and dW (D, R, V).
    """
    from jaxtrain.model.loss import chunk_length
    m, d = cfg.model, cfg.data
    B, L, D, F, V = d.global_batch_size, d.seq_len, m.d_model, m.mlp_dim, m.vocab_size
    N, K, H, layers = m.num_heads, m.num_kv_heads, m.head_dim, m.num_layers
    T = B * L
    out = []
    for name, i, o in (("wq", D, N * H), ("wk", D, K * H), ("wv", D, K * H), ("wo", N * H, D),
                       ("w_gate", D, F), ("w_up", D, F), ("w_down", F, D)):
        out += [(f"{name} forward", layers, 1, T, i, o), (f"{name} d_input", layers, 1, T, o, i),
                (f"{name} d_weight", layers, 1, i, T, o)]
    out += [("attention q.k", layers, B * N, L, H, L), ("attention p.v", layers, B * N, L, L, H),
            ("attention d_p", layers, B * N, L, H, L), ("attention d_v", layers, B * N, L, L, H),
            ("attention d_q", layers, B * N, L, L, H), ("attention d_k", layers, B * N, L, L, H)]
    C = chunk_length(B, L, V)
    R, chunks = B * C, L // C
    out += [(f"head logits (chunk {R} rows)", chunks, 1, R, D, V), ("head d_x", chunks, 1, R, V, D),
            ("head d_weight", chunks, 1, D, R, V)]
    return out


def time_matmul(batch: int, M: int, K: int, N: int, repeats: int = 5) -> float:
    """Best seconds of one jitted fp32 [batch, M, K] @ [batch, K, N]."""
    import jax
    import jax.numpy as jnp
    a = jnp.ones((batch, M, K), jnp.float32)
    b = jnp.ones((batch, K, N), jnp.float32)
    f = jax.jit(lambda a, b: jnp.einsum("bmk,bkn->bmn", a, b))
    f(a, b).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        f(a, b).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return best


def bounds(cfg, trainer, peak: float, step_time: float) -> dict:
    """Matmul floor of the step at standalone speeds, and the profiler's split of the real step."""
    from jaxtrain.observe.profiling import StepProfiler, summarize
    from jaxtrain.observe.throughput import flops_per_step
    rows, floor, matmul_flops = [], 0.0, 0.0
    for what, count, batch, M, K, N in matmul_shapes(cfg):
        t = time_matmul(batch, M, K, N)
        flops = 2.0 * batch * M * K * N
        rows.append({"matmul": what, "count": count, "shape": [batch, M, K, N], "ms": round(1e3 * t, 3),
                     "gflops_per_s": round(flops / t / 1e9, 1), "of_peak": round(flops / t / peak, 3)})
        floor += count * t
        matmul_flops += count * flops
    with tempfile.TemporaryDirectory() as tmp:
        profiler = StepProfiler([1, 2], str(Path(tmp) / "profile"))
        for step in (1, 2):
            profiler.before_step(step, trainer.compiled_step)
            trainer.step()
            profiler.after_step(step, trainer.state)
        split = summarize(tmp, top=12)
    model_flops = flops_per_step(cfg)
    return {
        "matmuls": rows, "matmul_flops_executed": matmul_flops, "matmul_floor_s": round(floor, 4),
        "matmul_floor_gflops_per_s": round(matmul_flops / floor / 1e9, 1),
        "mfu_bound_at_matmul_floor": round(model_flops / floor / peak, 4),
        "mfu_measured": round(model_flops / step_time / peak, 4),
        "profile_step_s": round(split["step_time_s"], 4),
        "profile_parts_s": {k: round(v, 4) for k, v in split["parts_s"].items() if v > 0},
        "profile_top_ops": [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in o.items()}
                            for o in split["top_ops"]],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="timed steps (after the first, which compiles)")
    parser.add_argument("--repeats", type=int, default=3, help="matmul peak measurements interleaved with the steps")
    parser.add_argument("--no-flags", action="store_true", help="run XLA without jaxtrain/runtime/xla_cpu.py")
    parser.add_argument("--bounds", action="store_true", help="also time every matmul shape alone and profile a step")
    parser.add_argument("overrides", nargs="*", help="config overrides, e.g. model.scan_layers=false")
    args = parser.parse_args()
    flags = configure_xla(not args.no_flags)
    load_start = loadavg()

    import jax

    from jaxtrain.config import load_config
    from jaxtrain.observe.throughput import flops_per_step, measure_matmul_peak
    from jaxtrain.trainer import Trainer

    cfg = load_config(REPO / "configs/bench/cpu-tiny.yaml", ["checkpoint.compilation_cache_dir=null", *args.overrides])
    trainer = Trainer(cfg, write_files=False)
    first = trainer.step()  # compile + first step
    peaks, step_times = [], []
    per_repeat = max(args.steps // args.repeats, 1)
    for _ in range(args.repeats):
        peaks.append(measure_matmul_peak())
        for _ in range(per_repeat):
            t = time.perf_counter()
            trainer.step()  # synchronous: reads the metrics, so the time covers the device work
            step_times.append(time.perf_counter() - t)
    peak = max(peaks)
    step = statistics.median(step_times)
    flops = flops_per_step(cfg)
    tokens = cfg.data.global_batch_size * cfg.data.seq_len
    result = {
        "bench": "cpu-tiny", "date": time.strftime("%Y-%m-%d %H:%M"), "machine": f"{platform.machine()} {os.cpu_count()} cores",
        "jax": jax.__version__, "python": platform.python_version(), "xla_flags": flags, "overrides": args.overrides,
        "params": trainer.num_params, "tokens_per_step": tokens, "first_loss": round(first["loss"], 6),
        "step_time_s": round(step, 4), "best_step_s": round(min(step_times), 4),
        "tokens_per_sec": round(tokens / step, 1), "model_tflops_per_sec": round(flops / step / 1e12, 4),
        "matmul_peak_tflops": round(peak / 1e12, 4), "mfu_vs_matmul_peak": round(flops / step / peak, 4),
        "compile_s": round(trainer.compile_s, 2), "load_avg_start": load_start, "load_avg_end": loadavg(),
    }
    if args.bounds:
        result["bounds"] = bounds(cfg, trainer, peak, step)
        print_bounds(result)
    print(json.dumps(result))


def print_bounds(result: dict) -> None:
    b = result["bounds"]
    print(f"cpu-tiny step {result['step_time_s']:.3f} s (median), matmul peak {result['matmul_peak_tflops'] * 1e3:.0f} "
          f"GFLOP/s, load {result['load_avg_start']} -> {result['load_avg_end']}", file=sys.stderr)
    print(f"{'matmul':34} {'count':>5} {'[batch, M, K, N]':>24} {'ms':>8} {'GFLOP/s':>8} {'of peak':>7}", file=sys.stderr)
    for r in b["matmuls"]:
        print(f"{r['matmul']:34} {r['count']:5d} {str(r['shape']):>24} {r['ms']:8.3f} {r['gflops_per_s']:8.1f} "
              f"{r['of_peak']:7.1%}", file=sys.stderr)
    print(f"matmul floor {b['matmul_floor_s']:.3f} s ({b['matmul_floor_gflops_per_s']:.0f} GFLOP/s over the executed "
          f"matmul FLOPs): MFU at most {b['mfu_bound_at_matmul_floor']:.1%} even if nothing else took time; "
          f"measured {b['mfu_measured']:.1%}", file=sys.stderr)
    print(f"profiled step {b['profile_step_s']:.3f} s: " + ", ".join(f"{k} {v * 1e3:.0f} ms"
                                                                  for k, v in b["profile_parts_s"].items()), file=sys.stderr)


if __name__ == "__main__":
    main()

"""Decoding speed: jaxtrain's KV-cache `generate` beside transformers' `generate` (KV cache on) on the
same weights, on the CPU.

A random ~20M-parameter Llama (d 384, 6 layers, 6 heads / 2 kv heads, MLP 1024, vocabulary 8192)
is built by transformers and read by jaxtrain from the same directory (`--hf`). For each batch
size, prompts of 64 random tokens are continued greedily (no end-of-text: every row runs to the
limit). Prefill time is a 1-token generate; per-token decode time is (T(N) - T(1)) / (N - 1) for
N new tokens, the same rule on both sides. Sides alternate within each round; medians over rounds.
Each program's own time is beside the wall clock of the whole timed call (time.perf_counter around
it, outside either library).

    python bench/bench_generate.py --rounds 3 --out bench/results/generate.json
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


def machine() -> dict:
    cpu = ""
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    return {"cpu": cpu, "cores": os.cpu_count(), "avx512": "avx512f" in flags, "python": platform.python_version(),
            "load_1min": os.getloadavg()[0]}


def build_hf(path: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=8192, hidden_size=384, intermediate_size=1024, num_hidden_layers=6,
                         num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--new", type=int, default=64, help="new tokens per row (N)")
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens per row")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--out", default=None)
    args = p.parse_args()

    import numpy as np
    import torch
    from transformers import LlamaForCausalLM

    from jaxtrain.infer.loading import from_hf

    torch.set_num_threads(os.cpu_count() or 1)
    results = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine(),
               "model": "random Llama d384 x6 layers, 6/2 heads, MLP 1024, V 8192", "prompt": args.prompt,
               "new": args.new, "batches": {}}
    with tempfile.TemporaryDirectory() as tmp:
        build_hf(Path(tmp))
        trained = from_hf(tmp)
        gen = trained.generator()
        n_params = sum(int(np.prod(x.shape)) for x in __import__("jax").tree_util.tree_leaves(trained.params))
        results["params"] = n_params
        hf = LlamaForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
        hf.generation_config.eos_token_id = None
        for b in map(int, args.batches.split(",")):
            rng = np.random.default_rng(b)
            prompts = rng.integers(0, 8192, (b, args.prompt)).tolist()

            def ours(n: int) -> float:
                t = time.perf_counter()
                out = gen.generate(prompts, n)
                assert all(len(c.tokens) == n for c in out)
                return time.perf_counter() - t

            def theirs(n: int) -> float:
                ids = torch.tensor(prompts)
                t = time.perf_counter()
                with torch.no_grad():
                    out = hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
                assert out.shape[1] == args.prompt + n
                return time.perf_counter() - t

            ours(1), ours(args.new), theirs(1), theirs(args.new)  # warm-up: compilation, allocations
            rounds = {"jaxtrain": {"t1": [], "tN": []}, "transformers": {"t1": [], "tN": []}}
            for r in range(args.rounds):
                order = [("jaxtrain", ours), ("transformers", theirs)]
                for name, fn in (order if r % 2 == 0 else order[::-1]):
                    rounds[name]["t1"].append(fn(1))
                    rounds[name]["tN"].append(fn(args.new))
            row = {}
            for name, t in rounds.items():
                t1, tn = statistics.median(t["t1"]), statistics.median(t["tN"])
                per_token = (tn - t1) / (args.new - 1)
                row[name] = {"prefill_s": t1, "decode_s_per_token": per_token, "decode_tokens_per_s": b / per_token,
                             "wall_s_total": sum(t["t1"]) + sum(t["tN"]), "rounds": t}
            row["decode_speedup"] = row["jaxtrain"]["decode_tokens_per_s"] / row["transformers"]["decode_tokens_per_s"]
            results["batches"][str(b)] = row
            print(f"batch {b}: prefill {row['jaxtrain']['prefill_s'] * 1e3:.1f} / {row['transformers']['prefill_s'] * 1e3:.1f} ms, "
                  f"decode {row['jaxtrain']['decode_tokens_per_s']:.0f} / {row['transformers']['decode_tokens_per_s']:.0f} "
                  f"tokens/s (jaxtrain / transformers): {row['decode_speedup']:.2f}x", file=sys.stderr)
    results["machine"]["load_1min_after"] = os.getloadavg()[0]
    text = json.dumps(results, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

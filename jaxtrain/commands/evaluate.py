"""`jaxtrain eval (RUN_DIR [--step N] | --hf DIR | --config FILE) --data PATH`: a trained model's mean
loss, perplexity and tokens over a whole held-out set (and bits per byte on text), as JSON;
`jaxtrain.infer.held_out` evaluates. One process per host like `jaxtrain train` (the same launcher
and environment), the run's mesh unless overrides change it.
"""

from __future__ import annotations

import json

from jaxtrain.commands.arguments import Parser, add_model_arguments, check_model_arguments
from jaxtrain.commands.startup import start_jax
from jaxtrain.config import load_config


def parser() -> Parser:
    p = Parser(prog="jaxtrain eval", description="Mean loss, perplexity and tokens of a trained model over a "
                                                 "whole held-out set (bits per byte for text).")
    add_model_arguments(p, config=True)
    p.add_argument("--data", required=True, metavar="PATH", help="the held-out set: prepare-data's token files, "
                   "or .txt / .jsonl text (read with the model's tokenizer)")
    p.add_argument("--json", action="store_true", help="the result as one JSON object (default: a line of text)")
    p.add_argument("overrides", nargs="*", help="dotted.key=value overrides, e.g. data.global_batch_size=16 mesh.fsdp=2")
    return p


def main(argv: list[str]) -> int:
    args = parser().parse_intermixed_args(argv)
    check_model_arguments(args)
    from jaxtrain.checkpoint.trained_run import (checkpoint_folder, load_run_config, resolve_run, restore_params,
                                                 restore_router_bias, run_tokenizer)

    # The model's config first (no JAX import): JAX starts with the flags and devices it asks for.
    step = None
    if args.hf:
        from jaxtrain.infer.loading import read_hf_dir
        run_cfg, host_params, tokenizer = read_hf_dir(args.hf)
    else:
        if args.config:
            run_cfg = load_config(args.config, need_data=False)
            run = resolve_run(run_cfg.run.output_dir, "run.output_dir")
        else:
            run = resolve_run(args.run_dir, "eval RUN_DIR")
            run_cfg = load_run_config(run, args.run_dir, "eval")
        _, step = checkpoint_folder(run, args.step)  # a missing run or step: exit 2 before JAX starts
    start_jax(args.cpu_devices, run_cfg)
    import jax
    import numpy as np

    if not args.hf:  # (reading meta.json goes through jaxtrain.data, which imports JAX)
        tokenizer = run_tokenizer(run_cfg)[:2]
    from jaxtrain.infer.held_out import eval_config, evaluate

    cfg = eval_config(run_cfg, args.data, tokenizer, tuple(args.overrides))
    if args.hf:
        def params_of(shardings):
            return jax.tree_util.tree_map(
                lambda host, s: jax.make_array_from_callback(host.shape, s, lambda i: np.asarray(host[i], np.float32)),
                host_params, shardings)
        result = evaluate(cfg, params_of)
    else:
        result = evaluate(cfg, lambda shardings: restore_params(run, cfg, step, shardings)[0],
                          lambda replicated: restore_router_bias(run, cfg, step, replicated))
    if jax.process_index() == 0:
        result = {"step": step, **result}
        if args.json:
            print(json.dumps(result))
        else:
            bpb = f", {result['bits_per_byte']:.4f} bits per byte" if "bits_per_byte" in result else ""
            print(f"eval: loss {result['loss']:.4f} (perplexity {result['perplexity']:.2f}) over "
                  f"{result['tokens']:,} tokens of {args.data}{bpb}" + (f" at step {step}" if step is not None else ""))
    return 0

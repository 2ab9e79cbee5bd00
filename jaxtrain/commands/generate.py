"""`jaxtrain generate (RUN_DIR [--step N] | --hf DIR) (--prompt TEXT ... | --prompts FILE)`: text out of a
trained model; `jaxtrain.infer` decodes.

Prompts are text, encoded with the tokenizer the run's data was made with (or the Hugging Face
directory's); with `--ids` each prompt is comma-separated token ids instead (a run on Markov data
has no tokenizer). One process, the devices of this host: `--mesh tensor=2,data=2` splits them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from jaxtrain.commands.arguments import Parser, add_model_arguments, check_model_arguments
from jaxtrain.commands.startup import set_cpu_devices, set_cpu_flags
from jaxtrain.config import ConfigError


def parser() -> Parser:
    p = Parser(prog="jaxtrain generate", description="Continue prompts with a trained model (KV-cache decoding).")
    add_model_arguments(p)
    p.add_argument("--prompt", action="append", default=[], metavar="TEXT", help="a prompt (repeatable)")
    p.add_argument("--prompts", metavar="FILE", help="prompts, one per line (.txt) or {\"prompt\": ...} per line (.jsonl)")
    p.add_argument("--ids", action="store_true", help="prompts are comma-separated token ids, output ids too")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="keep the smallest set reaching probability p (1: all)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (the same seed, the same text)")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT", help="end a prompt's text at this string (repeatable)")
    p.add_argument("--mesh", default="", metavar="AXIS=N,...", help="split this host's devices, e.g. tensor=2,data=2 "
                   "(data, fsdp, tensor; default: one device)")
    p.add_argument("--json", action="store_true", help="one JSON object per prompt")
    return p


def read_prompts(args) -> list[str]:
    """The prompts of --prompt and --prompts, in that order."""
    prompts = list(args.prompt)
    if args.prompts:
        path = Path(args.prompts).expanduser()
        if not path.is_file():
            raise ConfigError(f"--prompts file '{args.prompts}' does not exist")
        lines = [line for line in path.read_text().splitlines() if line.strip()]
        if path.suffix == ".jsonl":
            for n, line in enumerate(lines, 1):
                try:
                    prompts.append(json.loads(line)["prompt"])
                except (json.JSONDecodeError, KeyError, TypeError):
                    raise ConfigError(f"--prompts {args.prompts}:{n}: expected {{\"prompt\": \"...\"}}") from None
        else:
            prompts += lines
    if not prompts:
        raise ConfigError("no prompt: give --prompt TEXT or --prompts FILE")
    return prompts


def parse_ids(text: str, n: int) -> list[int]:
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise ConfigError(f"prompt {n} is not comma-separated token ids (--ids): {text!r}") from None


def parse_mesh(text: str) -> dict[str, int]:
    """'tensor=2,data=2' -> {'tensor': 2, 'data': 2}; only the axes decoding serves."""
    sizes = {}
    for part in filter(None, text.split(",")):
        axis, _, n = part.partition("=")
        if axis not in ("data", "fsdp", "tensor") or not n.isdigit() or int(n) < 1:
            raise ConfigError(f"--mesh: '{part}' is not AXIS=N with AXIS one of data, fsdp, tensor")
        sizes[axis] = int(n)
    return sizes


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    check_model_arguments(args)
    prompts = read_prompts(args)
    sizes = parse_mesh(args.mesh)
    if "jax" not in sys.modules:
        set_cpu_flags(args.cpu_devices)
    set_cpu_devices(args.cpu_devices)
    import jax

    from jaxtrain.infer.loading import from_hf, from_run
    from jaxtrain.infer.sampling import Sampling
    from jaxtrain.parallel.mesh import build_mesh
    from jaxtrain.parallel.mesh_shape import AXES

    sampling = Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    trained = from_hf(args.hf) if args.hf else from_run(args.run_dir, args.step)
    mesh = None
    if sizes:
        needed = 1
        for n in sizes.values():
            needed *= n
        if needed > jax.device_count():
            raise ConfigError(f"--mesh {args.mesh} needs {needed} devices; this host has {jax.device_count()}")
        mesh_cfg = trained.cfg.mesh.__class__(**{a: sizes.get(a, 1) for a in AXES}, rules=trained.cfg.mesh.rules)
        mesh = build_mesh(mesh_cfg, jax.devices()[:needed])
    ids = [parse_ids(p, n) for n, p in enumerate(prompts)] if args.ids else trained.encode(prompts)
    decode = trained.tokenizer.decode if trained.tokenizer is not None and not args.ids else None
    if args.stop and decode is None:
        raise ConfigError("--stop needs text: the run has no tokenizer, or --ids was given")
    completions = trained.generator(mesh).generate(ids, args.max_new_tokens, sampling, eos_id=trained.eos_id,
                                                   stop=args.stop, detokenize=decode)
    for prompt, c in zip(prompts, completions):
        if args.json:
            print(json.dumps({"prompt": prompt, "text": c.text, "tokens": c.tokens, "finish_reason": c.finish_reason}))
        elif c.text is not None:
            print(prompt + c.text)
        else:
            print(",".join(map(str, c.tokens)))
    return 0

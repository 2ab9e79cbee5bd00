"""`jaxtrain export-hf RUN_DIR --output DST [--step N] [--dtype ...]`: the parser, `main` and the
summary line; `hf/exporter.py` converts.
"""

from __future__ import annotations

import argparse
import os
import sys

from jaxtrain.hf.exporter import export_hf
from jaxtrain.hf.files import DTYPES


def main(argv: list[str]) -> int:
    """`jaxtrain export-hf RUN_DIR --output DST [--step N] [--dtype ...]` (argv without the
    subcommand). Returns 0; user errors raise ConfigError (exit 2)."""
    parser = argparse.ArgumentParser(prog="jaxtrain export-hf",
                                     description="Write a run's parameters as a Hugging Face Llama checkpoint "
                                                 "(config.json + safetensors) for transformers.")
    parser.add_argument("run_dir", help="jaxtrain run directory (config.yaml + checkpoints/): a local path, "
                                        "gs://BUCKET/PATH or s3://BUCKET/PATH")
    parser.add_argument("--output", required=True, help="new local directory to write (must not exist or be empty)")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest good one)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="tensor dtype (default: the imported source's, else fp32)")
    parser.add_argument("--max-shard-size", default="5GB",
                        help="split the weights into shards with an index above this size (default 5GB)")
    args = parser.parse_args(argv)
    # Conversion is host work: keep JAX off an accelerator that a training job may be using.
    if "jax" not in sys.modules:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    s = export_hf(args.run_dir, args.output, step=args.step, dtype=args.dtype, max_shard_size=args.max_shard_size)
    gone = s["missing_tokenizer"]
    missing = f" (the run's tokenizer '{gone}' is not there any more)" if gone else ""
    eos = "no eos id" if s["eos_token_id"] is None else f"eos id {s['eos_token_id']}"
    print(f"export-hf: step {s['step']} as {s['dtype']} into {s['output']} ({len(s['files'])} file(s)); "
          f"tokenizer: {', '.join(s['tokenizer']) or 'no files'}{missing}; {eos}"
          + (f"; dropped the {', '.join(s['dropped'])} parameters (multi-token prediction: the Hugging Face "
             "model has no such module)" if s.get("dropped") else ""))
    return 0

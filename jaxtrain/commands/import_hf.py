"""`jaxtrain import-hf SRC --output DIR`: the parser, `main` and the summary line; `hf/importer.py`
converts.
"""

from __future__ import annotations

import argparse
import os
import sys

from jaxtrain.hf.importer import import_hf


def main(argv: list[str]) -> int:
    """`jaxtrain import-hf SRC --output DIR` (argv without the subcommand). Returns 0; user errors
    raise ConfigError (the CLI prints one line and exits 2)."""
    parser = argparse.ArgumentParser(prog="jaxtrain import-hf",
                                     description="Convert a Hugging Face Llama checkpoint (safetensors) "
                                                 "into a jaxtrain checkpoint plus config.yaml.")
    parser.add_argument("source", help="Hugging Face model directory (config.json + *.safetensors)")
    parser.add_argument("--output", required=True, help="new directory to write (must not exist or be empty)")
    args = parser.parse_args(argv)
    # Conversion is host work: keep JAX off an accelerator that a training job may be using.
    if "jax" not in sys.modules:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    s = import_hf(args.source, args.output)
    print(f"import-hf: {s['num_params']:,} parameters ({s['source_dtype']} -> fp32) from {len(s['files'])} "
          f"safetensors file(s) into {s['output']}; copied {', '.join(s['tokenizer']) or 'no tokenizer files'}. "
          f"Start a run with: jaxtrain train --config {s['output']}/config.yaml run.output_dir=..."
          + (f" Skipped {len(s['ignored'])} tensor(s) transformers does not run (multi-token prediction layers, "
             f"e.g. {s['ignored'][0]})." if s.get("ignored") else ""))
    return 0

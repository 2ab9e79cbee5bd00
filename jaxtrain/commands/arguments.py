"""Command-line arguments shared by the verbs: `jaxtrain train`/`inspect`/`preflight`, and the
`train ...` part of `jaxtrain launch` and `jaxtrain recovery`.

A separate module so that every verb parses with the same rules (a bad flag is a ConfigError: one
line, exit 2). Overrides (`dotted.key=value`) may stand before or after any flag.
"""

from __future__ import annotations

import argparse

from jaxtrain.config import ConfigError


class Parser(argparse.ArgumentParser):
    """argparse that raises ConfigError (one line, exit 2 in the CLI) instead of printing usage."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(f"{self.prog}: {message}")


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """--config, the overrides and --cpu-devices: what `train`, `inspect` and `preflight` share."""
    p.add_argument("--config", required=True, help="YAML config file (configs/*.yaml)")
    p.add_argument("overrides", nargs="*", help="dotted.key=value overrides, e.g. train.steps=20")
    p.add_argument("--cpu-devices", type=int, default=None, metavar="N",
                   help="simulate N devices on the CPU (sets XLA's host device count)")


def train_parser(prog: str = "jaxtrain train") -> Parser:
    """The parser of `jaxtrain train`."""
    p = Parser(prog=prog, description="Train (one process per host); resumes from the run directory.")
    add_run_arguments(p)
    return p


def parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Parse with overrides allowed anywhere among the flags; checks --cpu-devices."""
    args = parser.parse_intermixed_args(argv)
    if getattr(args, "cpu_devices", None) is not None and args.cpu_devices < 1:
        raise ConfigError(f"--cpu-devices must be at least 1, got {args.cpu_devices}")
    return args


def add_model_arguments(p: argparse.ArgumentParser, *, config: bool = False) -> None:
    """What a verb that reads a trained model takes: RUN_DIR [--step N] or --hf DIR (or, with
    `config`, --config FILE, whose run.output_dir is the run), and --cpu-devices."""
    p.add_argument("run_dir", nargs="?", help="jaxtrain run directory (or import-hf directory): local, gs:// or s3://")
    p.add_argument("--hf", metavar="DIR", help="a Hugging Face Llama/Mixtral directory instead of a run")
    if config:
        p.add_argument("--config", metavar="FILE", help="the run's config file instead (its run.output_dir is read)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest good one)")
    p.add_argument("--cpu-devices", type=int, default=None, metavar="N", help="simulate N devices on the CPU")


def check_model_arguments(args: argparse.Namespace) -> None:
    """Exactly one model source; --step only with a run."""
    sources = [args.run_dir, args.hf] + ([args.config] if hasattr(args, "config") else [])
    if sum(s is not None for s in sources) != 1:
        named = "a run directory, --hf DIR" + (", --config FILE" if hasattr(args, "config") else "")
        raise ConfigError(f"give one of: {named}")
    if args.hf and args.step is not None:
        raise ConfigError("--step is for a run directory, not --hf")
    if getattr(args, "cpu_devices", None) is not None and args.cpu_devices < 1:
        raise ConfigError(f"--cpu-devices must be at least 1, got {args.cpu_devices}")

"""Command-line arguments shared by `jaxtrain train`/`inspect` and `jaxtrain launch`.

A separate module so that the CLI and the launcher parse `train ...` with the same rules without
importing each other. Overrides (`dotted.key=value`) may stand before or after any flag.
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

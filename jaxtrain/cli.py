"""The `jaxtrain` command: train, inspect, prepare-data, checkpoints, launch.

User errors (bad config, missing data, a mesh that does not fit the devices, an incompatible
checkpoint) print one line on stderr and exit 2, with nothing written. JAX is imported only
after `--cpu-devices` has configured XLA.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

_STARTED_AT = time.time()  # before JAX is imported: restart_to_first_step_s counts from here

from jaxtrain.config import ConfigError

EXIT_OK, EXIT_USAGE, EXIT_RESTART = 0, 2, 75


def _set_cpu_devices(n: int | None) -> None:
    """Simulate `n` devices on the CPU; must happen before JAX initializes its backends."""
    if n is None:
        return
    if "jax" in sys.modules:  # imported is fine (a notebook); started backends are too late
        from jax._src import xla_bridge
        if xla_bridge.backends_are_initialized():
            raise ConfigError("--cpu-devices must be given before JAX starts (JAX is already initialized)")
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    os.environ["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={n}"])
    os.environ["JAX_PLATFORMS"] = "cpu"


def _train(args: argparse.Namespace) -> int:
    from jaxtrain.config import load_config
    cfg = load_config(args.config, args.overrides)  # phase 1, before JAX starts
    _set_cpu_devices(args.cpu_devices)
    from jaxtrain import distributed
    distributed.initialize()
    from jaxtrain.trainer import Trainer
    trainer = Trainer(cfg, console=sys.stdout if sys.stdout.isatty() or args.progress else None,
                      started_at=_STARTED_AT)
    try:
        summary = trainer.fit()
    finally:
        trainer.close()
    return summary["exit_code"]


def _inspect(args: argparse.Namespace) -> int:
    from jaxtrain.config import load_config
    cfg = load_config(args.config, args.overrides)
    _set_cpu_devices(args.cpu_devices)
    from jaxtrain import distributed
    distributed.initialize()
    from jaxtrain.inspection import inspect_config
    print(inspect_config(cfg, per_parameter=args.parameters))
    return EXIT_OK


def _prepare_data(argv: list[str]) -> int:
    from jaxtrain.data.prepare import main
    return main(argv)


def _checkpoints(argv: list[str]) -> int:
    from jaxtrain.checkpoint import main
    return main(argv)


def _launch(argv: list[str]) -> int:
    from jaxtrain.launch import main
    return main(argv)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxtrain", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--config", required=True, help="YAML config file (configs/*.yaml)")
        p.add_argument("overrides", nargs="*", help="dotted.key=value overrides, e.g. train.steps=20")
        p.add_argument("--cpu-devices", type=int, default=None, metavar="N",
                       help="simulate N devices on the CPU (sets XLA's host device count)")

    train = sub.add_parser("train", help="train (one process per host); resumes from the run directory")
    common(train)
    train.add_argument("--progress", action="store_true", help="print progress lines even when not on a terminal")
    inspect = sub.add_parser("inspect", help="compile the step and report FLOPs, memory and collectives")
    common(inspect)
    inspect.add_argument("--parameters", action="store_true", help="also list every parameter's sharding")
    for name, text in (("prepare-data", "tokenize text/jsonl files into token files"),
                       ("checkpoints", "list the checkpoints of a run directory"),
                       ("launch", "start and supervise several local processes of one job")):
        sub.add_parser(name, help=text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    passthrough = {"prepare-data": _prepare_data, "checkpoints": _checkpoints, "launch": _launch}
    try:
        if argv and argv[0] in passthrough:
            return passthrough[argv[0]](argv[1:])
        args = build_parser().parse_args(argv)
        return {"train": _train, "inspect": _inspect}[args.command](args)
    except ConfigError as e:
        print(f"jaxtrain: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

"""The `train ...` command a launcher runs or reasons about, parsed once (phase 1), without JAX.

`jaxtrain launch [options] -- train --config PATH [key=value ...]` and
`jaxtrain recovery VERB [options] -- train ...` both take the trainer's own command line after
`--`; this module splits it off and parses it with the parser `jaxtrain train` uses, so the rules
are the same. It lives with the commands (not in `launch/`): it is the verbs' argument parsing, and
the supervisor itself takes any argv.
"""

from __future__ import annotations

import dataclasses
import sys

from jaxtrain.commands.arguments import parse, train_parser
from jaxtrain.config import Config, ConfigError, load_config


@dataclasses.dataclass(frozen=True)
class TrainCommand:
    """What the launched processes run, and what the launcher needs to know about it.

    Attributes:
      argv: the command of every process (`python -m jaxtrain train ...`).
      config: the --config path.
      overrides: the `key=value` overrides as given.
      cpu_devices: --cpu-devices, from the launcher or from `train` (None: not given).
      cfg: the phase-1 parsed config.
    """

    argv: list[str]
    config: str
    overrides: list[str]
    cpu_devices: int | None
    cfg: Config


def split_train_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """`[own options] -- train ...` -> (own options, the `train ...` part; empty without `--`)."""
    if "--" in argv:
        split = argv.index("--")
        return argv[:split], argv[split + 1:]
    return argv, []


def child_command(train_argv: list[str], cpu_devices: int | None, usage: str = "jaxtrain launch [options]") -> TrainCommand:
    """The command every process runs, with its config parsed (phase 1).

    Args:
      train_argv: what follows `--`: `train --config PATH [k=v ...] [--cpu-devices N]`.
      cpu_devices: the launcher's --cpu-devices (None: not given).
      usage: the verb and options part of the usage line in the error for a missing `train`.
    Returns:
      The command and what it was made of.
    Raises:
      ConfigError: not a `train` command, --cpu-devices given twice, or a bad config (phase 1).
    """
    if not train_argv or train_argv[0] != "train":
        raise ConfigError(f"expected `{usage} -- train --config PATH [key=value ...]`")
    args = parse(train_parser(), train_argv[1:])  # the same parser `jaxtrain train` uses: same rules
    if cpu_devices is not None and args.cpu_devices is not None:
        raise ConfigError("--cpu-devices given both to `launch` and to `train`: give it once")
    # Phase-1 config check here, once, so a typo fails fast instead of in P processes. Phase 2 (mesh
    # vs devices) needs JAX and happens in the children, which then exit 2.
    cfg = load_config(args.config, args.overrides)
    argv = [sys.executable, "-m", "jaxtrain", *train_argv]
    if cpu_devices is not None:
        argv += ["--cpu-devices", str(cpu_devices)]
    return TrainCommand(argv=argv, config=args.config, overrides=list(args.overrides),
                        cpu_devices=cpu_devices if cpu_devices is not None else args.cpu_devices, cfg=cfg)

"""`jaxtrain launch [options] -- train --config PATH [key=value ...]`: the parser and `main` of the
verb; `launch/supervisor.py` starts and supervises the processes.
"""

from __future__ import annotations

import argparse

from jaxtrain.commands.arguments import Parser, parse
from jaxtrain.commands.train_command import child_command, split_train_argv
from jaxtrain.config import ConfigError
from jaxtrain.launch.elastic import ShrinkRefused, shrink_planner
from jaxtrain.launch.supervisor import Supervisor


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="jaxtrain launch",
        description="Start and supervise P local processes of one job; restart it when a process dies.",
        epilog="example: jaxtrain launch --num-processes 2 --cpu-devices 2 -- train --config configs/tiny.yaml")
    parser.add_argument("--num-processes", type=int, required=True, metavar="P", help="processes in the job")
    parser.add_argument("--cpu-devices", type=int, default=None, metavar="N",
                        help="simulate N CPU devices in each process (passed on to `train`)")
    parser.add_argument("--max-restarts", type=int, default=3, metavar="R",
                        help="restarts of the whole job after failures (default 3; user errors never restart)")
    parser.add_argument("--port", type=int, default=0,
                        help="coordinator port of the first attempt; attempt n uses PORT+n (default: a free port)")
    parser.add_argument("--grace-period-s", type=float, default=10.0, metavar="S",
                        help="seconds between SIGTERM (or a forwarded signal) and SIGKILL when stopping "
                             "processes (default 10)")
    parser.add_argument("--isolate-after", type=int, default=0, metavar="K",
                        help="a slot that is the first to crash K attempts in a row is isolated: the job "
                             "continues from its checkpoint on one process fewer, same global batch "
                             "(default 0: never)")
    parser.add_argument("--devices-per-process", type=int, default=None, metavar="N",
                        help="devices each process drives, for planning an isolation (default: --cpu-devices)")
    return parser


def main(argv: list[str]) -> int:
    """`jaxtrain launch [options] -- train --config PATH [key=value ...]`.

    Args:
      argv: the arguments after `launch`.
    Returns:
      The exit code (see Supervisor.run).
    Raises:
      ConfigError: bad options or config (the CLI prints it and exits 2).
    """
    own, train_argv = split_train_argv(argv)
    try:
        args = parse(build_parser(), own)
    except SystemExit as e:  # --help
        return int(e.code or 0)
    if not train_argv:
        raise ConfigError("expected `jaxtrain launch [options] -- train --config PATH [key=value ...]`")
    train = child_command(train_argv, args.cpu_devices)
    devices = args.devices_per_process if args.devices_per_process is not None else train.cpu_devices
    if devices is not None and devices < 1:
        raise ConfigError(f"--devices-per-process must be at least 1, got {devices}")
    if args.isolate_after and devices is None:
        raise ConfigError("--isolate-after needs the devices of each process to shrink the mesh: "
                          "give --cpu-devices N or --devices-per-process N (the launcher never starts JAX to count them)")
    planner = shrink_planner(train.config, train.overrides, devices) if devices is not None else None
    supervisor = Supervisor(train.argv, args.num_processes, output_dir=train.cfg.run.output_dir,
                            max_restarts=args.max_restarts, port=args.port, grace_period_s=args.grace_period_s,
                            isolate_after=args.isolate_after, plan_isolation=planner)
    if args.isolate_after:
        try:  # say at once when isolation could never help, rather than after K failures
            planner(args.num_processes, [])
        except ShrinkRefused as e:
            supervisor.say(f"note: --isolate-after {args.isolate_after}: this job cannot lose a process: {e}")
    return supervisor.run()

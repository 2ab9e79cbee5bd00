"""`jaxtrain inspect --config PATH [key=value ...] [--parameters] [--json]`: compile the step from
shapes alone and print FLOPs, memory and collectives (`observe/inspection.py` does the work).

Named `inspect_cmd` so that the folder never shadows the standard library's `inspect`.
"""

from __future__ import annotations

import json

from jaxtrain.commands import startup
from jaxtrain.commands.arguments import Parser, add_run_arguments, parse
from jaxtrain.runtime.exit_codes import EXIT_OK


def main(argv: list[str]) -> int:
    """`jaxtrain inspect ...` (argv without the verb). Returns 0; user errors raise ConfigError."""
    from jaxtrain.config import load_config
    p = Parser(prog="jaxtrain inspect", description="Compile the step from shapes alone and report FLOPs, "
               "memory and collectives (no data is read, no parameter allocated).")
    add_run_arguments(p)
    p.add_argument("--parameters", action="store_true", help="also list every parameter's sharding")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    args = parse(p, argv)
    cfg = load_config(args.config, args.overrides, need_data=False)  # shapes only: an import's config too
    startup.start_jax(args.cpu_devices, cfg)
    from jaxtrain.observe.inspection import format_report, inspect_report
    report = inspect_report(cfg)
    print(json.dumps(report) if args.json else format_report(report, per_parameter=args.parameters))
    return EXIT_OK

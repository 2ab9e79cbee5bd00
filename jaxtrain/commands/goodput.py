"""`jaxtrain goodput RUN_DIR [--json]`: print where a run's wall time went (`observe/goodput.py`'s
`goodput` and `format_report`).
"""

from __future__ import annotations

import argparse
import json
import sys

from jaxtrain.commands.arguments import Parser, parse
from jaxtrain.observe.goodput import format_report, goodput
from jaxtrain.runtime.exit_codes import EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="jaxtrain goodput", description="Where a run's wall time went: productive training against "
               "start-up, checkpoints, restarts, hangs, re-done steps, data wait, evaluation and skipped steps.")
    p.add_argument("run_dir", help="the run directory (run.output_dir; local, gs:// or s3://)")
    p.add_argument("--json", action="store_true", help="print one JSON object (keys: docs/goodput.md)")
    return p


def main(argv: list[str]) -> int:
    """`jaxtrain goodput RUN_DIR [--json]`.

    Raises:
      ConfigError: not a run directory (the CLI prints it and exits 2).
    """
    args = parse(build_parser(), argv)
    report = goodput(args.run_dir)
    print(json.dumps(report) if args.json else format_report(report), file=sys.stdout)
    return EXIT_OK

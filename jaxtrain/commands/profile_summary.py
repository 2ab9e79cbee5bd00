"""`jaxtrain profile-summary RUN_DIR [--json] [--top N]`: print the split of a run's profiled steps
(`observe/profiling.py`'s `summarize` and `format_summary`).
"""

from __future__ import annotations

import json

from jaxtrain.commands.arguments import Parser  # bad usage: ConfigError, one line, exit 2
from jaxtrain.config import ConfigError
from jaxtrain.observe.profiling import format_summary, summarize


def main(argv: list[str]) -> int:
    """`jaxtrain profile-summary RUN_DIR [--json]`."""
    p = Parser(prog="jaxtrain profile-summary",
                                description="Split the profiled steps of a run (train.profile_steps) into compute, "
                                            "collectives, host wait and idle.")
    p.add_argument("run_dir", help="the run directory (run.output_dir) or its profile/ directory")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--top", type=int, default=15, help="how many of the most expensive ops to list")
    args = p.parse_args(argv)
    try:
        summary = summarize(args.run_dir, top=args.top)
    except FileNotFoundError as e:
        raise ConfigError(str(e)) from None
    print(json.dumps(summary) if args.json else format_summary(summary))
    return 0

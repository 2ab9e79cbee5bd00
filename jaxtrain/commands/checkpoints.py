"""`jaxtrain checkpoints DIR [--json]`: print the checkpoints of a run (`checkpoint/layout.py`'s
`list_checkpoints` finds and checks them).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Optional

from jaxtrain.checkpoint.layout import list_checkpoints
from jaxtrain.commands.arguments import Parser
from jaxtrain.config import ConfigError
from jaxtrain.runtime.exit_codes import EXIT_USAGE
from jaxtrain.storage.object_store import check_access
from jaxtrain.storage.paths import to_path
from jaxtrain.storage.small_files import forget_listings


def _human(n: Optional[int]) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


def main(argv: list[str]) -> int:
    """`jaxtrain checkpoints DIR [--json]`: print the checkpoints of a run.

    Args:
      argv: arguments after the subcommand.
    Returns:
      0, or 2 when DIR does not exist or cannot be reached (one line on stderr).
    """
    parser = Parser(prog="jaxtrain checkpoints",
                                     description="List checkpoints: step, status, size, time, mesh.")
    parser.add_argument("directory", help="a run directory or its checkpoints/ folder (local or gs://, s3://)")
    parser.add_argument("--json", action="store_true", help="print one JSON object per line")
    args = parser.parse_args(argv)
    try:
        check_access(args.directory, key="DIR")
    except ConfigError as e:
        print(f"jaxtrain checkpoints: {e}", file=sys.stderr)
        return EXIT_USAGE
    root = to_path(args.directory)
    forget_listings(root)
    if (root / "checkpoints").exists():
        root = root / "checkpoints"
    elif not root.exists():
        print(f"jaxtrain checkpoints: '{args.directory}' does not exist", file=sys.stderr)
        return EXIT_USAGE
    rows = list_checkpoints(os.fspath(root))
    if args.json:
        for r in rows:
            print(json.dumps(r))
        return 0
    print(f"{root}: {len(rows)} checkpoint folder(s)")
    print(f"{'STEP':>10}  {'STATUS':<8}  {'SIZE':>9}  {'SAVED (UTC)':<25}  {'MESH':<28}  {'PROCS':>5}  NOTE")
    for r in rows:
        mesh = ",".join(f"{k}={v}" for k, v in (r["mesh"] or {}).items()) or "-"
        print(f"{r['step']:>10}  {'good' if r['valid'] else 'damaged':<8}  {_human(r['bytes']):>9}  "
              f"{r['time'] or '-':<25}  {mesh:<28}  {r['process_count'] or '-':>5}  {r['reason'] or ''}")
    good = [r["step"] for r in rows if r["valid"]]
    print(f"latest good: {good[-1] if good else 'none'}")
    return 0

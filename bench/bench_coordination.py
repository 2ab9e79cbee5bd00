"""What each cross-process mechanism costs the coordination service at P = 8 ... 1,000 processes.

  python bench/bench_coordination.py [--processes 8 64 256 1000] [--json]

No machine here has 1,000 hosts: each process is a thread running the real jaxtrain function
against an in-memory fake coordination service that counts every call (`tests/coordination_stand_in.py`;
no JAX devices). Per operation, over all processes: coordinator calls (RPCs) and bytes, the most any
one process made, the keys it left in the store, the barrier ids it made, and for preflight the
programs each process compiles. A mechanism that is fine at P = 2 and O(P^2) at P = 1,000 shows as
rpcs_max_per_process growing with P. `--json`: one JSON object per line and measurement.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

from coordination_stand_in import Measurement, measure_all, simulate  # noqa: E402  (tests/)

COLUMNS = [("operation", 50), ("processes", 5), ("rpcs_total", 10), ("rpcs_max_per_process", 8),
           ("bytes_max_per_process", 10), ("keys_left", 6), ("barriers", 4), ("programs_compiled", 8),
           ("wall_s", 6)]
HEADER = ["operation", "P", "rpcs", "max/proc", "bytes/proc", "keys", "bar", "compiled", "wall_s"]


def row(m: Measurement) -> str:
    cells = []
    for (field, width), head in zip(COLUMNS, HEADER):
        value = getattr(m, field)
        text = "-" if value is None else str(value)
        cells.append(text.ljust(width) if field == "operation" else text.rjust(max(width, len(head))))
    line = " ".join(cells)
    if m.errors:
        line += f"  ({len(m.errors)} processes raised)"
    return line


def former_barrier(process_count: int) -> Measurement:
    """The host barrier as it was before (each process set its key, then read every peer's in turn):
    measured beside the current one so the table shows what changed."""
    def body(pid: int, kv) -> None:
        prefix = "jaxtrain/barrier/former/"
        kv.key_value_set(prefix + str(pid), "1", allow_overwrite=True)
        for peer in range(process_count):
            kv.blocking_key_value_get(prefix + str(peer), 60_000)

    return simulate("barrier, former design (reads every peer's key)", process_count, body)[0]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, nargs="+", default=[8, 64, 256, 1000])
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    parser.add_argument("--no-former", action="store_true",
                        help="skip the former barrier design (P^2 calls: ~30 s at P = 1,000 on 2 cores)")
    args = parser.parse_args(argv)
    if not args.json:
        print(" ".join(h.ljust(w) if h == "operation" else h.rjust(max(w, len(h)))
                       for (_, w), h in zip(COLUMNS, HEADER)))
    notes: dict[str, str] = {}
    for p in args.processes:
        for m in [*([] if args.no_former else [former_barrier(p)]), *measure_all(p)]:
            print(m.json() if args.json else row(m), flush=True)
            if m.note:
                notes[m.operation] = f"{m.note} (P = {p})"
    if not args.json:
        print("\nrpcs: coordinator calls of all processes; max/proc, bytes/proc: the most one process "
              "made/moved; keys: left in the store (negative: freed); bar: barrier ids made; compiled: "
              "programs each process compiles (preflight pair exchanges). Notes:")
        for operation, note in notes.items():
            print(f"  {operation}: {note}")


if __name__ == "__main__":
    main()

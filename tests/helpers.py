"""What many tests repeat: the repository's paths, a run log's lines, a free port, a small mesh.

Imported as `from helpers import ...` (tests/conftest.py puts tests/ on sys.path). Kept light:
no JAX import until `mesh_of` is called (tests/storage_servers.py, which bench/ uses too,
imports `free_port` from here).
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs/tiny.yaml")  # a str: it goes into argv lists as well as load_config


def read_jsonl(path: Path, missing_ok: bool = False) -> list[dict]:
    """A local .jsonl file's records, one per line; a missing file is [] with missing_ok, else an error."""
    if missing_ok and not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listened on a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mesh_of(*, axes: tuple[str, ...] | None = None, devices=None, **sizes):
    """A mesh over `axes` (jaxtrain's AXES by default), each axis `sizes.get(axis, 1)` long, on the
    first devices of `devices` (default jax.devices()), in order. Its axes are Auto, as the mesh
    `jaxtrain.parallel.mesh.build_mesh` makes (`jax.make_mesh` would make them Explicit, under which
    shard_map and sharding checks differ from a real run's)."""
    import jax
    import numpy as np
    from jax.sharding import Mesh

    if axes is None:
        from jaxtrain.parallel.mesh_shape import AXES as axes
    unknown = set(sizes) - set(axes)
    assert not unknown, f"mesh_of: no axis {sorted(unknown)} in {axes}"
    shape = tuple(sizes.get(a, 1) for a in axes)
    devices = list(devices if devices is not None else jax.devices())[:int(np.prod(shape))]
    return Mesh(np.array(devices).reshape(shape), axes)


def pack_at(batch: dict, bounds: tuple[int, ...]) -> dict:
    """`batch` with every row packed: documents start at 0 and at each of `bounds`, so segment ids
    and per-document positions are exercised, not just the causal mask (in place; returned)."""
    import numpy as np

    pos = np.arange(batch["segment_ids"].shape[-1])
    segment = np.searchsorted(np.array(bounds), pos, side="right") + 1
    batch["segment_ids"][:] = segment
    batch["positions"][:] = pos - np.array((0,) + tuple(bounds))[segment - 1]
    return batch


class Packed:
    """A trainer's data source with every batch packed at `bounds` (its order, position and state
    untouched: everything but `__next__` is the wrapped source's)."""

    def __init__(self, data, bounds: tuple[int, ...]):
        self.data, self.bounds = data, bounds

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        return pack_at(next(self.data), self.bounds)

    def __getattr__(self, name):
        return getattr(self.data, name)


def epoch_rows(cfg, process_count: int = 1) -> dict:
    """One epoch of rows in order through `build_train_data` (a config with data.shuffle=false): processes
    0..P-1 of P each read their share, each global batch their shares one after another; each field [rows, L]."""
    import numpy as np

    from jaxtrain.data import build_train_data
    from jaxtrain.data.packing import FIELDS

    shares = []
    for p in range(process_count):
        data = build_train_data(cfg, p, process_count)
        try:
            shares.append([next(data) for _ in range(data.num_batches)])
            n = data.num_sequences
        finally:
            data.close()
    return {k: np.concatenate([np.concatenate([s[b][k] for s in shares]) for b in range(len(shares[0]))])[:n]
            for k in FIELDS}

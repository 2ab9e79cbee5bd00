"""Write an imported model's parameters as checkpoint 0 piece by piece, never holding the model.

Why not jaxtrain's `Checkpointer`: Orbax saves a pytree of whole arrays (a numpy leaf is one
tensorstore write of the whole array; a jax.Array, even from `jax.make_array_from_callback` over
many CPU devices, has every shard materialised, in host memory, from its creation, and Orbax copies
whole arrays to the host, in batches of at least one leaf, before writing), so the peak would be
the whole fp32 model, or at best the largest stacked parameter. Orbax's extension point for how a
leaf is written is the type-handler registry: `StreamedLeaf` is a parameter described by its
pieces (`jaxtrain.hf.mapping.param_plan`), and `_StreamedLeafHandler` writes it with tensorstore
one piece at a time, each piece one whole zarr shard (so no shard is ever read back and merged).
Everything else is Orbax's own: the OCDBT databases and their merge, `_METADATA` (the leaves are
recorded as `np.ndarray`, as the in-memory import recorded them), `_CHECKPOINT_METADATA`, the JSON
extras; `commit.json` is written as the `Checkpointer` writes it. The result restores through
`restore_params_only` / `Checkpointer.restore` like any checkpoint; only the zarr shard shape
(one piece, e.g. one layer of a stacked parameter) differs, and tensorstore reads any shard shape.

Peak host memory: one piece (at most `PIECE_BYTES` of fp32, or one HF tensor that `_ROWS` does
not split: norm vectors) a few times over (the rows read, their fp32 upcast, the converted copy,
tensorstore's compressed buffer), independent of the model's size.
"""

from __future__ import annotations

import collections
import datetime
import json
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from etils import epath
from orbax.checkpoint._src.futures import future
from orbax.checkpoint._src.serialization import ocdbt_utils
from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils

from jaxtrain.checkpoint.layout import FORMAT, MARKER, list_files
from jaxtrain.config import ConfigError
from jaxtrain.hf.mapping import LeafPlan, Piece
from jaxtrain.storage.small_files import fsync_tree, write_atomic

# fp32 bytes of one piece of a parameter that `mapping._ROWS` lets split (an embedding's row block, a
# layer's projection or a part of it): the unit of reading, converting and writing.
PIECE_BYTES = 8 * 2**20
# Pieces being written while the next is read. 2 measured no faster on a 2-core machine (+30 MB
# peak); more cores may gain from overlapping reads with tensorstore's compression.
IN_FLIGHT = 1


class NonFiniteError(Exception):
    """A piece holds NaN or Inf (raised in Orbax's writer thread, turned into a ConfigError)."""


class StreamedLeaf:
    """A fp32 parameter Orbax writes piece by piece: its plan and how to read a piece's HF rows."""

    def __init__(self, plan: LeafPlan, read_rows: Callable[[str, int, int], np.ndarray]):
        self.plan = plan
        self.read_rows = read_rows
        self.shape = plan.shape
        self.dtype = np.dtype(np.float32)

    def piece(self, p: Piece) -> np.ndarray:
        """The fp32 block of piece `p`, shaped as its index, checked finite."""
        rows = self.read_rows(p.name, *p.rows).astype(np.float32, copy=False)
        shape = tuple(len(range(*s.indices(n))) for s, n in zip(p.index, self.shape))
        block = np.ascontiguousarray(p.convert(rows)).reshape(shape)
        del rows  # freed (unless the block is a view of it) before tensorstore copies the block
        if not np.isfinite(block).all():
            raise NonFiniteError(f"tensor '{p.name}' holds NaN or Inf values")
        return block


class _StreamedLeafHandler(ocp.type_handlers.NumpyHandler):
    """Orbax's numpy handler (same typestr, same metadata and restore) writing `StreamedLeaf`s piece by piece."""

    def __init__(self):
        super().__init__(deepcopy_host_arrays=False)

    async def serialize(self, values: Sequence[StreamedLeaf], infos: Sequence[Any],
                        args: Optional[Sequence[Any]] = None) -> Sequence[future.Future]:
        args = args or [ocp.SaveArgs()] * len(values)
        return [future.CommitFutureAwaitingContractedSignals(self._write(values, infos, args), name="jaxtrain_hf_import")]

    async def _write(self, values: Sequence[StreamedLeaf], infos: Sequence[Any], args: Sequence[Any]) -> None:
        pending: collections.deque = collections.deque()  # tensorstore write futures, oldest first
        for leaf, info, arg in zip(values, infos, args):
            await info.await_path_creation()
            spec = ts_utils.build_array_write_spec(
                info=info, arg=arg, global_shape=leaf.shape, local_shape=leaf.plan.block, dtype=leaf.dtype,
                use_ocdbt=info.is_ocdbt_checkpoint,
                process_index=ocdbt_utils.get_process_index_for_subdir(use_ocdbt=info.is_ocdbt_checkpoint))
            t = await ts.open(ts.Spec(spec.json), create=True, open=True, context=info.ts_context)
            for p in leaf.plan.pieces:
                # At most IN_FLIGHT pieces are being written while the next one is read (blocking).
                while len(pending) >= IN_FLIGHT:
                    await pending.popleft()
                pending.append(t[p.index].write(leaf.piece(p)))
        while pending:
            await pending.popleft()


def save_streamed(directory: Path, leaves: list[StreamedLeaf], extra: dict,
                  others: Optional[dict[str, list[StreamedLeaf]]] = None) -> None:
    """Write `{"params": <leaves>}` as committed checkpoint 0 in `directory` (a `checkpoints/` folder),
    in the layout jaxtrain's `Checkpointer` writes (Orbax's composite of `state` and `extra`, then
    `commit.json`). `others`: more state entries beside `params` (e.g. `moe`: DeepSeek-V3's routing
    bias, `moe.router_bias`), each from its leaves' paths.

    Raises:
      ConfigError: a piece holds NaN or Inf (what was written stays in `directory`: the importer's
        temporary folder, removed on any error).
    """
    _fixed_mmap_threshold()
    state: dict = {}
    for entry, entry_leaves in {"params": leaves, **(others or {})}.items():
        for leaf in entry_leaves:
            node = state.setdefault(entry, {})
            for key in leaf.plan.path[:-1]:
                node = node.setdefault(key, {})
            node[leaf.plan.path[-1]] = leaf
    # jax.Array's handler is there only because Orbax warns without one (no leaf uses it).
    registry = ocp.type_handlers.create_type_handler_registry(
        (StreamedLeaf, _StreamedLeafHandler()), (jax.Array, ocp.type_handlers.get_type_handler(jax.Array)))
    handler = ocp.CompositeCheckpointHandler(state=ocp.PyTreeCheckpointHandler(type_handler_registry=registry),
                                             extra=ocp.JsonCheckpointHandler())
    directory.mkdir(parents=True, exist_ok=True)
    folder = epath.Path(directory) / "0"
    meta = {"format": FORMAT, "step": 0, "time": datetime.datetime.now(datetime.timezone.utc).isoformat(
        timespec="seconds"), "unix_time": time.time(), "mesh": None, "process_count": jax.process_count(),
        "jaxtrain_version": _version(), "jax_version": jax.__version__}
    try:
        with ocp.Checkpointer(handler) as writer:
            writer.save(folder, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state),
                                                        extra=ocp.args.JsonSave(dict(extra))))
    except Exception as e:
        cause = e
        while cause is not None and not isinstance(cause, NonFiniteError):
            cause = cause.__cause__ or cause.__context__
        if cause is not None:
            raise ConfigError(f"the source weights hold NaN or Inf values ({cause}); nothing was imported") from None
        raise
    # The commit marker, as Checkpointer._commit writes it: after every file is durable.
    fsync_tree(folder)
    meta["files"] = list_files(folder)
    meta["bytes"] = sum(meta["files"].values())
    write_atomic(folder / MARKER, json.dumps(meta, indent=1))


def _fixed_mmap_threshold(nbytes: int = 2**20) -> None:
    """Make glibc serve every allocation of `nbytes` or more with its own mmap, returned at free.

    By default glibc raises that threshold to the size of the largest block freed (up to 32 MiB),
    so after the first piece every piece-sized buffer (ours, numpy's, tensorstore's) comes from the
    heap, whose freed space is kept: measured, the peak RSS then grows by ~100 MB more than the few
    pieces alive at a time. Setting the threshold also stops that adjustment. No-op off glibc.
    """
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(-3, nbytes)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


def _version() -> str:
    from jaxtrain.checkpoint.checkpointer import _version as version
    return version()

"""jax.Array leaves on s3:// through tensorstore's own `s3` driver: an Orbax TypeHandler.

Why this exists: Orbax 0.12 builds its tensorstore specs from the path string and knows only
gs:// and local files; an s3:// path goes to the `file` driver (it lands in a local folder named
`s3:`). Orbax's extension point for "how is a leaf written" is the type-handler registry, so S3
gets its own handler for jax.Array, registered only in the PyTree handler of s3:// checkpoints,
and that PyTree handler's `finalize` (Orbax's per-process merge opens its databases through the
file driver too). Orbax still writes everything else (tree metadata, JSON extras, the per-step
layout) through etils.epath, which reaches S3 through s3fs, and the commit protocol above it is
unchanged.

Format: Orbax's own OCDBT format, as on local disk and gs://, so a checkpoint copied out of the
bucket reads with stock Orbax and one copied into it reads here. Each process writes the chunks
it is assigned (below) into its own OCDBT database, `state/ocdbt.process_<i>/` (a manifest and a
few data files of up to `_TARGET_DATA_FILE_BYTES`, however many leaves and shards it holds);
process 0 writes each array's zarr (v2, zstd level 1) `.zarray` into its own. After Orbax's
write barrier, process 0 merges the P manifests into `state/manifest.ocdbt` (one atomic
transaction; the data files stay where they are and the merged B-tree points into them). So a
checkpoint is O(processes) objects, where the zarr layout it replaces wrote one object per shard
per leaf (2.4 million for 300 leaves FSDP-sharded over 8,000 devices, listed in a 150 MB
commit.json that every process read).

Who writes what: chunks are the saving sharding's shards, cut along one axis into equal slices
when the shard has replicas (and each slice would still hold `_MIN_SLICE_BYTES`), one slice per
replica, and halved further while a chunk exceeds `_MAX_CHUNK_BYTES`. Every chunk has exactly
one writer, so no two processes write one key. Which replica writes the first slice rotates with
the leaf's name, so replicated state (data parallelism) is written by all the hosts that hold it,
not by replica 0's host alone; a replica copies its shard to host memory only when it writes
part of it.

Restoring reads, for each local device, its index of the array, so any mesh and any number of
processes can read it (resharding is a different set of reads, nothing more). Checkpoints in the
layout s3:// had before (one zarr array per leaf at `state/<name>/`, one object per chunk: Orbax's
non-OCDBT format) still restore: Orbax's tree metadata says which format a checkpoint has.
"""

from __future__ import annotations

import asyncio
import math
import zlib
from typing import Any, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from etils import epath

from jaxtrain.storage import object_store

_MAX_CHUNK_BYTES = 256 * 2**20  # one OCDBT value per chunk; also bounds a restore's single reads
# A replicated shard is cut among its replicas only into slices at least this big: below it, one
# more writer saves less time than the extra B-tree entries and requests cost.
_MIN_SLICE_BYTES = 4 * 2**20
# OCDBT packs values into data files of about this size: Orbax's choice for GCS, and each file is
# one PUT, far below S3's 5 GB single-PUT limit.
_TARGET_DATA_FILE_BYTES = 400 * 2**20
PROCESS_PREFIX = "ocdbt.process_"  # Orbax's name for a process's database (ocdbt_process_spec)


def _context(concurrency: int = 32) -> ts.Context:
    # Requests in flight per process (tensorstore also retries failed requests itself), and a
    # cache for OCDBT's B-tree nodes so that opening many arrays does not read them again each.
    return ts.Context({"s3_request_concurrency": {"limit": concurrency},
                       "cache_pool#ocdbt": {"total_bytes_limit": 100_000_000}})


def _ocdbt_kvstore(url: str, *, write: bool) -> dict:
    """An OCDBT database on S3 at `url`, with Orbax's settings for writing it or reading it."""
    spec = {"driver": "ocdbt", "base": object_store.s3_kvstore(url), "cache_pool": "cache_pool#ocdbt"}
    if write:
        # One writer per database (this process), so the simple single-file manifest suffices,
        # and assume_config skips writing an empty manifest first; .zarray files stay inline in
        # the B-tree, chunks go to data files.
        spec.update(config={"max_inline_value_bytes": 1024, "max_decoded_node_bytes": 100_000_000,
                            "manifest_kind": "single"},
                    assume_config=True, target_data_file_size=_TARGET_DATA_FILE_BYTES)
    else:
        # Adjacent chunk reads in one data file become one ranged GET (Orbax does the same on gs://).
        spec.update(experimental_read_coalescing_threshold_bytes=1_000_000,
                    experimental_read_coalescing_merged_bytes=500_000_000_000,
                    experimental_read_coalescing_interval="1ms")
    return spec


def _chunk_shape(shard_shape: tuple[int, ...], itemsize: int) -> list[int]:
    """The shard shape, halved along its largest even dimension until a chunk is small enough.
    Halving keeps chunks tiling the shard exactly, so each chunk still has a single writer."""
    chunk = [max(1, d) for d in shard_shape]
    while math.prod(chunk) * itemsize > _MAX_CHUNK_BYTES:
        even = [i for i, d in enumerate(chunk) if d % 2 == 0]
        if not even:
            break
        i = max(even, key=lambda j: chunk[j])
        chunk[i] //= 2
    return chunk


def _replicas(v: jax.Array, shard_shape: tuple[int, ...]) -> int:
    """How many devices hold each shard of `v` (1 when the shards are not all alike)."""
    shards = math.prod(max(1, -(-d // max(s, 1))) for d, s in zip(v.shape, shard_shape))
    devices = len(v.sharding.device_set)
    return devices // shards if devices % shards == 0 else 1


def _split(shape: tuple[int, ...], shard_shape: tuple[int, ...], itemsize: int, replicas: int) -> tuple[int, int]:
    """(axis, writers): each shard is cut along `axis` into `writers` equal slices. Only an axis
    whose shards are all whole (the array's size there a multiple of the shard's) is cut."""
    most = min(replicas, math.prod(shard_shape) * itemsize // _MIN_SLICE_BYTES)
    for writers in range(most, 1, -1):
        for axis, (d, s) in enumerate(zip(shape, shard_shape)):
            if s % writers == 0 and d % s == 0:
                return axis, writers
    return 0, 1


class _Plan(NamedTuple):
    """One array's layout and this process's part of the writing."""
    chunks: list[int]
    # (region of the global array, key of the shard holding it in `sources`, region in the shard)
    pieces: list[tuple[tuple[slice, ...], tuple, tuple[slice, ...]]]
    sources: dict[tuple, Any]  # shard key -> its data on a local device, copying to the host

    def on_host(self) -> list[tuple[tuple[slice, ...], np.ndarray, tuple[slice, ...]]]:
        """The pieces with their shards' host copies (waits for the copies)."""
        host = {key: np.asarray(data) for key, data in self.sources.items()}
        return [(index, host[key], local) for index, key, local in self.pieces]


def _plan(v: jax.Array, name: str) -> _Plan:
    """Which chunks this process writes (see the module docstring), with their shards' copies to
    host memory started (one per distinct shard, whichever local replica holds it)."""
    itemsize = jnp.dtype(v.dtype).itemsize
    shard_shape = tuple(v.sharding.shard_shape(v.shape))
    replicas = _replicas(v, shard_shape)
    axis, writers = _split(tuple(v.shape), shard_shape, itemsize, replicas)
    first = zlib.crc32(name.encode()) % replicas  # the replica writing slice 0 rotates with the leaf
    step = shard_shape[axis] // writers if v.ndim else 0
    chunk_of = list(shard_shape)
    if v.ndim:
        chunk_of[axis] = step
    pieces, sources = [], {}
    for s in v.addressable_shards:
        j = (s.replica_id - first) % replicas
        if j >= writers:
            continue  # another replica writes this shard's part
        index = tuple(slice(sl.start or 0, d if sl.stop is None else sl.stop) for sl, d in zip(s.index, v.shape))
        key = tuple((sl.start, sl.stop) for sl in index)
        if key not in sources:
            s.data.copy_to_host_async()
            sources[key] = s.data
        local = tuple(slice(None) for _ in index)
        if writers > 1:
            start = index[axis].start + j * step
            index = index[:axis] + (slice(start, start + step),) + index[axis + 1:]
            local = local[:axis] + (slice(j * step, (j + 1) * step),) + local[axis + 1:]
        pieces.append((index, key, local))
    return _Plan(_chunk_shape(tuple(chunk_of), itemsize), pieces, sources)


class S3ArrayHandler(ocp.type_handlers.TypeHandler):
    """Writes and reads jax.Array leaves on s3:// in Orbax's OCDBT format (see the module docstring)."""

    def __init__(self, concurrency: int = 32):
        self._context = _context(concurrency)
        # Orbax looks this attribute up on the jax.Array handler (its own ArrayHandler has it) and
        # warns on every save when it is missing; None means "no per-array metadata files".
        self._array_metadata_store = None

    def typestr(self) -> str:
        return "jax.Array"  # Orbax's name for the type: the tree metadata reads the same either way

    def _read_spec(self, info: ocp.type_handlers.ParamInfo) -> dict:
        """Orbax's OCDBT format (what we write, and what a checkpoint saved on local disk or gs://
        and copied into the bucket holds), or the zarr layout of older s3:// checkpoints; Orbax
        says which in `info`, from the checkpoint's tree metadata."""
        directory = info.parent_dir.as_posix()
        if not info.is_ocdbt_checkpoint:
            return {"driver": "zarr", "kvstore": object_store.s3_kvstore(f"{directory}/{info.name}")}
        # Chunks equal to the fill value are stored too (Orbax's writers and ours), so a missing
        # one is lost data: raise, as Orbax does, instead of reading zeros.
        return {"driver": "zarr3" if info.use_zarr3 else "zarr",
                "kvstore": {**_ocdbt_kvstore(directory, write=False), "path": info.name},
                "fill_missing_data_reads": not info.raise_array_data_missing_error}

    async def _open(self, info: ocp.type_handlers.ParamInfo) -> ts.TensorStore:
        try:
            return await ts.open(self._read_spec(info), open=True, read=True, context=self._context)
        except ValueError as e:
            raise FileNotFoundError(f"array '{info.name}' of {info.parent_dir} cannot be opened: {e}") from e

    async def metadata(self, infos: Sequence[ocp.type_handlers.ParamInfo]) -> Sequence[ocp.metadata.ArrayMetadata]:
        stores = await asyncio.gather(*(self._open(info) for info in infos))
        return [ocp.metadata.ArrayMetadata(name=info.name, directory=info.parent_dir, shape=tuple(t.shape),
                                           sharding=None, dtype=jnp.dtype(t.dtype.numpy_dtype))
                for info, t in zip(infos, stores)]

    async def serialize(self, values: Sequence[jax.Array], infos: Sequence[ocp.type_handlers.ParamInfo],
                        args: Optional[Sequence[Any]] = None) -> Sequence[ocp.future.Future]:
        """Copy this process's part of every array to host memory now (the caller may then donate
        the arrays), and return one future that writes them into this process's database."""
        for v, info in zip(values, infos):
            if not isinstance(v, jax.Array):
                raise TypeError(f"'{info.name}': s3:// checkpoints hold jax.Array leaves, not {type(v).__name__}")
            if jax.dtypes.issubdtype(v.dtype, jax.dtypes.prng_key):
                raise TypeError(f"'{info.name}': save typed PRNG keys as jax.random.key_data(...) on s3://")
        plans = [_plan(v, info.name) for v, info in zip(values, infos)]  # all copies in flight at once
        pieces = [plan.on_host() for plan in plans]  # then collect them
        specs = [self._write_spec(v, info, plan.chunks) for v, info, plan in zip(values, infos, plans)]
        primary = jax.process_index() == 0

        async def write() -> None:
            for info in infos:  # Orbax creates the folders in the background; wait for them
                await info.await_path_creation()
            # All arrays at once: the database batches concurrent writes into a few commits, so
            # a process writes a few objects however many leaves it has.
            await asyncio.gather(*(self._write(spec, part, primary) for spec, part in zip(specs, pieces)))

        return [ocp.future.CommitFutureAwaitingContractedSignals(write(), name="jaxtrain_s3_array_write")]

    def _write_spec(self, v: jax.Array, info: ocp.type_handlers.ParamInfo, chunks: list[int]) -> dict:
        own = f"{info.parent_dir.as_posix()}/{PROCESS_PREFIX}{jax.process_index()}"
        return {"driver": "zarr", "kvstore": {**_ocdbt_kvstore(own, write=True), "path": info.name},
                "dtype": jnp.dtype(v.dtype).name, "store_data_equal_to_fill_value": True,
                "recheck_cached_data": False, "recheck_cached_metadata": False,
                "metadata": {"shape": list(v.shape), "chunks": chunks, "compressor": {"id": "zstd", "level": 1}}}

    async def _write(self, spec: dict, pieces: list, primary: bool) -> None:
        # The .zarray goes into process 0's database only (the merge brings it to the top);
        # the others write chunks under the same metadata without reading it.
        t = await ts.open(spec, create=primary, open=True, assume_metadata=not primary, context=self._context)
        await asyncio.gather(*(t[index].write(data[local]) for index, data, local in pieces))

    async def deserialize(self, infos: Sequence[ocp.type_handlers.ParamInfo],
                          args: Optional[Sequence[Any]] = None) -> Sequence[Any]:
        """Read each array straight into the sharding of its restore args (any mesh)."""
        args = args or [ocp.type_handlers.RestoreArgs()] * len(infos)
        return await asyncio.gather(*(self._read(info, arg) for info, arg in zip(infos, args)))

    async def _read(self, info: ocp.type_handlers.ParamInfo, arg: Any) -> Any:
        t = await self._open(info)
        shape = tuple(t.shape)
        dtype = jnp.dtype(arg.dtype) if getattr(arg, "dtype", None) is not None else jnp.dtype(t.dtype.numpy_dtype)
        wanted = getattr(arg, "global_shape", None) or getattr(arg, "shape", None)
        if wanted is not None and tuple(wanted) != shape:
            raise ValueError(f"'{info.name}' has shape {shape} in the checkpoint, not {tuple(wanted)}")
        sharding = getattr(arg, "sharding", None)
        if not isinstance(sharding, jax.sharding.Sharding):  # no target sharding: a host array
            return (await t.read()).astype(dtype)
        indices = sharding.addressable_devices_indices_map(shape)
        reads: dict[tuple, Any] = {}  # replicas on several local devices share one read
        for index in indices.values():
            key = tuple((s.start, s.stop) for s in index)
            if key not in reads:
                reads[key] = t[index].read()
        data = dict(zip(reads, await asyncio.gather(*reads.values())))
        arrays = [jax.device_put(data[tuple((s.start, s.stop) for s in index)].astype(dtype), device)
                  for device, index in indices.items()]
        return jax.make_array_from_single_device_arrays(shape, sharding, arrays)


async def merge_process_databases(directory: str, process_count: int) -> None:
    """Merge the per-process OCDBT databases of `directory` (a checkpoint's `state/`) into its
    top-level one, as Orbax's `merge_ocdbt_per_process_files` does on local disk and gs://: one
    atomic transaction that copies each process's B-tree entries (the data stay in its files).

    The processes are named by count, not found by listing: a process that had nothing to write
    has no database, which reads as empty."""
    context = _context()
    parent, *children = await asyncio.gather(
        ts.KvStore.open(_ocdbt_kvstore(directory, write=True), context=context),
        *(ts.KvStore.open(_ocdbt_kvstore(f"{directory}/{PROCESS_PREFIX}{i}", write=False), context=context)
          for i in range(process_count)))
    txn = ts.Transaction(atomic=True)
    await asyncio.gather(*(child.experimental_copy_range_to(parent.with_transaction(txn)) for child in children))
    await txn.commit_async()


def _refused(typestr: str, infos: Sequence[ocp.type_handlers.ParamInfo]) -> TypeError:
    return TypeError(f"'{infos[0].name}': s3:// checkpoints hold jax.Array leaves only ({typestr} is not "
                     "supported there); put it on a device with jax.device_put, or save to gs:// or disk")


class _Refuse(ocp.type_handlers.TypeHandler):
    """Stands in for Orbax's scalar handlers on s3://, which would write to a local folder named
    's3:' (they build file-driver specs from the path): fail with the reason instead."""

    def __init__(self, typestr: str):
        self._typestr = typestr

    def typestr(self) -> str:
        return self._typestr

    async def metadata(self, infos):
        raise _refused(self._typestr, infos)

    async def serialize(self, values, infos, args=None):
        raise _refused(self._typestr, infos)

    async def deserialize(self, infos, args=None):
        raise _refused(self._typestr, infos)


class _ReadNumpy(S3ArrayHandler):
    """numpy leaves on s3://: read (an `import-hf` checkpoint copied into a bucket holds them, in
    Orbax's OCDBT format), never written (saving them is refused, as with `_Refuse`)."""

    def typestr(self) -> str:
        return "np.ndarray"

    async def serialize(self, values, infos, args=None):
        raise _refused(self.typestr(), infos)


def s3_type_handlers() -> dict[type, ocp.type_handlers.TypeHandler]:
    """One handler for every leaf type Orbax supports: jax.Arrays through `S3ArrayHandler`, numpy
    arrays read-only, the rest (scalars, strings) refused."""
    own = {jax.Array: S3ArrayHandler(), np.ndarray: _ReadNumpy()}
    return {t: own.get(t) or _Refuse(ocp.type_handlers.get_type_handler(t).typestr())
            for t in ocp.type_handlers.supported_types()}


def s3_pytree_handler() -> ocp.PyTreeCheckpointHandler:
    """Orbax's PyTree handler for s3:// checkpoints: `s3_type_handlers`, the OCDBT format (zarr v2
    arrays, Orbax's default), and a `finalize` that merges the per-process databases over S3.

    Orbax's own finalize would open them through the file driver. It is replaced on the instance,
    not in a subclass: Orbax pairs PyTreeSave/PyTreeRestore arguments with the handler's exact
    class, and registering a subclass for them would change that pairing for every checkpoint."""
    registry = ocp.type_handlers.create_type_handler_registry(*s3_type_handlers().items())
    handler = ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=False, type_handler_registry=registry)

    def finalize(directory: epath.Path) -> None:
        # Process 0 only, past Orbax's write barrier: every process's database is complete.
        asyncio.run(merge_process_databases(directory.as_posix(), jax.process_count()))

    handler.finalize = finalize
    return handler

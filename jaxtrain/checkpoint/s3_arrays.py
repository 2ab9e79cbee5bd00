"""jax.Array leaves on s3:// through tensorstore's own `s3` driver: an Orbax TypeHandler.

Why this exists: Orbax 0.12 builds its tensorstore specs from the path string and knows only
gs:// and local files; an s3:// path goes to the `file` driver (it lands in a local folder named
`s3:`). Orbax's extension point for "how is a leaf written" is the type-handler registry, so S3
gets its own handler for jax.Array, registered only in the PyTree handler of s3:// checkpoints.
Orbax still writes everything else (tree metadata, JSON extras, the per-step layout) through
etils.epath, which reaches S3 through s3fs, and the commit protocol above it is unchanged.

Format: each leaf is a zarr (v2) array at `state/<name>/` with zstd level 1, the layout and
compression of Orbax's own non-OCDBT format (a copied checkpoint reads with stock Orbax). The
other way round works too: an OCDBT checkpoint that Orbax wrote to local disk or gs:// and that
was copied into an s3:// bucket is read through tensorstore's `ocdbt` driver over the same S3
kvstore.
Chunks are the saving sharding's shards (split further when one exceeds `_MAX_CHUNK_BYTES`), so
every process writes whole chunks of its own shards and no two processes touch one object;
only the replica-0 copy of each shard is written. Process 0 writes each array's `.zarray`.
Restoring reads, for each local device, its index of the array, so any mesh and any number of
processes can read it (resharding is a different set of reads, nothing more).
"""

from __future__ import annotations

import asyncio
import math
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts

from jaxtrain.checkpoint import storage

_MAX_CHUNK_BYTES = 256 * 2**20  # one object per chunk: far below S3's 5 GB single-PUT limit, and
# small enough that a big replicated array is written as several concurrent requests.


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


class S3ArrayHandler(ocp.type_handlers.TypeHandler):
    """Writes and reads jax.Array leaves as zarr arrays on s3:// (see the module docstring)."""

    def __init__(self, concurrency: int = 32):
        # Requests in flight per process; tensorstore also retries failed requests itself.
        self._context = ts.Context({"s3_request_concurrency": {"limit": concurrency}})
        # Orbax looks this attribute up on the jax.Array handler (its own ArrayHandler has it) and
        # warns on every save when it is missing; None means "no per-array metadata files".
        self._array_metadata_store = None

    def typestr(self) -> str:
        return "jax.Array"  # Orbax's name for the type: the tree metadata reads the same either way

    def _spec(self, info: ocp.type_handlers.ParamInfo) -> dict:
        return {"driver": "zarr", "kvstore": storage.s3_kvstore(f"{info.parent_dir.as_posix()}/{info.name}")}

    def _read_spec(self, info: ocp.type_handlers.ParamInfo) -> dict:
        """Our own format, or Orbax's OCDBT one: a checkpoint saved on local disk or gs:// and
        copied into the bucket (Orbax finds `manifest.ocdbt` and says so in `info`)."""
        if not info.is_ocdbt_checkpoint:
            return self._spec(info)
        return {"driver": "zarr3" if info.use_zarr3 else "zarr",
                "kvstore": {"driver": "ocdbt", "base": storage.s3_kvstore(info.parent_dir.as_posix()),
                            "path": info.name}}

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
        """Copy this process's replica-0 shards to host memory now (the caller may then donate
        the arrays), and return one future that writes them."""
        for v, info in zip(values, infos):
            if not isinstance(v, jax.Array):
                raise TypeError(f"'{info.name}': s3:// checkpoints hold jax.Array leaves, not {type(v).__name__}")
            if jax.dtypes.issubdtype(v.dtype, jax.dtypes.prng_key):
                raise TypeError(f"'{info.name}': save typed PRNG keys as jax.random.key_data(...) on s3://")
        shards = [[s for s in v.addressable_shards if s.replica_id == 0] for v in values]
        for s in (s for per in shards for s in per):
            s.data.copy_to_host_async()  # all transfers in flight at once, then collect them
        host = [[(s.index, np.asarray(s.data)) for s in per] for per in shards]
        specs = [self._write_spec(v, info) for v, info in zip(values, infos)]
        primary = jax.process_index() == 0

        async def write() -> None:
            for info in infos:  # Orbax creates the folders in the background; wait for them
                await info.await_path_creation()
            await asyncio.gather(*(self._write(spec, pieces, primary) for spec, pieces in zip(specs, host)))

        return [ocp.future.CommitFutureAwaitingContractedSignals(write(), name="jaxtrain_s3_array_write")]

    def _write_spec(self, v: jax.Array, info: ocp.type_handlers.ParamInfo) -> dict:
        dtype = jnp.dtype(v.dtype)
        chunks = _chunk_shape(v.sharding.shard_shape(v.shape), dtype.itemsize)
        return {**self._spec(info), "dtype": dtype.name,
                "metadata": {"shape": list(v.shape), "chunks": chunks, "compressor": {"id": "zstd", "level": 1}}}

    async def _write(self, spec: dict, pieces: list[tuple[tuple, np.ndarray]], primary: bool) -> None:
        if primary:  # the array's .zarray, once; chunk writes below do not need it to exist
            await ts.open(spec, create=True, open=True, context=self._context)
        t = await ts.open(spec, open=True, assume_metadata=True, context=self._context)
        await asyncio.gather(*(t[index].write(data) for index, data in pieces))

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
    """Orbax's PyTree handler for s3:// checkpoints, with `s3_type_handlers`; no OCDBT writes (its
    per-process merge at the end opens the checkpoint through the file driver)."""
    registry = ocp.type_handlers.create_type_handler_registry(*s3_type_handlers().items())
    return ocp.PyTreeCheckpointHandler(use_ocdbt=False, type_handler_registry=registry)

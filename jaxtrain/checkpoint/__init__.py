"""Asynchronous, atomic, multi-host checkpoints of the training state (Orbax + TensorStore).

Where things live: `checkpointer.py` (the Checkpointer: save/restore/retention/events),
`layout.py` (on-disk format, commit marker, discovery, the listing `jaxtrain checkpoints DIR` prints),
`local_tier.py` (the node-local tier every few steps, replicated to a peer:
`checkpoint.local_every_steps`), `replica_transfer.py` (its copies between hosts) and `s3_arrays.py`
(jax.Array leaves on s3://, which Orbax 0.12 cannot route; see there). Paths, buckets and atomic
small files are `jaxtrain.storage`; barriers and the compilation cache are `jaxtrain.runtime`.
Import the module that owns a name (`from jaxtrain.checkpoint.checkpointer import Checkpointer`):
this package has no facade, so importing it costs nothing.

The trainer owns one `Checkpointer` per run directory and calls it from every process, in the
same order (each method is collective):

    ckpt = Checkpointer(run_dir + "/checkpoints", cfg.checkpoint, on_event=events)
    step = ckpt.latest_step()                    # newest GOOD checkpoint, or None
    if step is not None:
        state, extra = ckpt.restore(step, abstract_state)   # straight into these shardings
    for ...:
        state, metrics = train_step(state, batch)
        if ckpt.should_save(step, last=step == total):      # same answer on every host
            ckpt.save(step, state, {"data": it.state(), ...})  # returns once the arrays are copied
    ckpt.wait()                                  # before exit: the last save is committed

Layout of `directory` (a local path, gs://bucket/... or s3://bucket/...; the bucket and the
credentials are checked when the Checkpointer is made, see `jaxtrain.storage.object_store.check_access`):

    <step>/                      one folder per checkpoint, named by the step (Orbax's own naming)
      state/                     the array pytree: OCDBT/zarr, one ocdbt.process_<i>/ per writer
                                 (s3:// too; older s3:// ones: a zarr array per leaf, <name>/)
      extra/metadata             the JSON extras (data iterator, resolved config, ...)
      _CHECKPOINT_METADATA, commit_success.txt    Orbax's own bookkeeping
      commit.json                OUR commit marker: written last, by process 0 only
    <step>.orbax-checkpoint-tmp/ a write in progress (or a crashed one); never read

A checkpoint exists only once `commit.json` exists and every file in its manifest is present
with the recorded size. Discovery (`latest_step`, `list_checkpoints`) ignores anything else.

Failure windows (what a kill, or a lost host, at each moment leaves behind):
  1. During the blocking copy or the background write: only a `<step>.orbax-checkpoint-tmp/`
     folder (on gs:// and s3://, which have no atomic rename, Orbax writes in place: a `<step>/`
     without commit files) and no marker -> invisible; the previous checkpoint is the latest.
     The next save of that step, or retention after the next commit, deletes the leftovers.
  2. After Orbax renamed the folder to `<step>/` but before `commit.json` is written: complete
     data, no marker -> invisible, reported as `checkpoint_damaged` ("no commit marker") by
     `latest_step`; one checkpoint's worth of progress is lost, nothing is corrupted.
  3. While writing `commit.json`: locally it is written to a temporary name, fsynced and renamed
     (atomic); on object stores a single object write is atomic. Either no marker or a whole one.
     Object stores list what is written (GCS and S3 have strong read-after-write consistency),
     so the manifest, taken from one listing after every process finished, is complete.
  4. Before the marker, every data file is fsynced (local disks), so a host crash (not just a
     process kill) cannot leave a marker that points at data still in the page cache.
  5. During retention: an old checkpoint loses its marker first, then its files (object by
     object on gs:// and s3://); a half-deleted folder is "uncommitted", never mistaken for good. The newest good checkpoint is never in
     the delete set, and retention runs only after a new checkpoint has committed.
  6. Files damaged after the commit (truncated, deleted, partial copy): the manifest check finds
     a missing file or a size change; `latest_step` reports `checkpoint_damaged` and falls back
     to the previous good one. Not caught: same-size bit flips (no checksums; too slow to hash
     hundreds of GB on every restart).
  7. Multi-host: if a process dies while writing, process 0's write-complete barrier times out
     after `barrier_timeout_s` with an error naming the missing process; no marker is written,
     and the error is raised by the next `save()`/`wait()` so the job can be restarted.
"""

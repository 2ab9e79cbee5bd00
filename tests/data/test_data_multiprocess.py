"""Two real JAX processes (gloo) assemble the same global batches as one process reading alone.

Each process builds only its rows with `build_train_data(cfg, i, 2)` and the global array with
`jax.make_array_from_process_local_data`; process 0 gathers it and saves it for comparison. A
second worker shares batch shards between the processes (a tensor pair across them), as a TPU
slice whose torus order runs the tensor ring over two hosts does: each reads `process_rows`.
The first worker also passes over a held-out set (`build_eval_data`) whose last global batch holds
no row of process 1: both finish, every row appears once, the padding counts nothing.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from helpers import free_port
from test_data import EOD, random_docs, write_tokens

from jaxtrain.config import load_config
from jaxtrain.data import build_train_data
from jaxtrain.data.packing import FIELDS

STEPS = 3

SHARED_WORKER = textwrap.dedent("""
    import json
    import os
    import sys
    import jax
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh

    port, pid, out, *overrides = sys.argv[1:]
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=int(pid),
                               initialization_timeout=60)
    from jaxtrain.config import load_config
    from jaxtrain.data import build_train_data
    from jaxtrain.parallel.mesh import AXES
    from jaxtrain.parallel.sharding import global_batch, process_rows

    cfg = load_config(None, overrides)
    a, b = (sorted((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id) for p in (0, 1))
    # data=4 x tensor=2: data 0 and 1 pair a device of each process, data 2 is process 0's only,
    # data 3 process 1's only. Process 0 holds batch shards 0, 1, 2; process 1 holds 0, 1, 3.
    grid = np.array([[a[0], b[0]], [a[1], b[1]], [a[2], a[3]], [b[2], b[3]]], dtype=object)
    mesh = Mesh(grid.reshape(tuple({"data": 4, "tensor": 2}.get(a, 1) for a in AXES)), AXES)
    rows = process_rows(mesh, cfg.mesh.rules, cfg.data.global_batch_size, jax.process_index())
    quarter = cfg.data.global_batch_size // 4
    want = [0, 1, 2] if jax.process_index() == 0 else [0, 1, 3]
    assert rows.tolist() == [r for s in want for r in range(s * quarter, (s + 1) * quarter)], rows
    data = build_train_data(cfg, jax.process_index(), jax.process_count(), rows=rows)
    saved = {}
    for step in range(%d):
        arrays = global_batch(next(data), mesh, cfg.mesh.rules, cfg.data.global_batch_size)
        for k, arr in arrays.items():
            assert arr.shape == (cfg.data.global_batch_size, cfg.data.seq_len), arr.shape
            saved[f"{k}_{step}"] = np.asarray(multihost_utils.process_allgather(arr, tiled=True))
    data.close()
    if jax.process_index() == 0:
        np.savez(out, **saved)
    jax.distributed.shutdown()
""" % STEPS)

WORKER = textwrap.dedent("""
    import json
    import os
    import sys
    import jax
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    port, pid, out, *overrides = sys.argv[1:]
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=int(pid),
                               initialization_timeout=60)
    from jaxtrain.config import load_config
    from jaxtrain.data import build_train_data

    cfg = load_config(None, overrides)
    data = build_train_data(cfg, jax.process_index(), jax.process_count())
    if os.environ.get("DATA_STATE"):  # resume here from a state another process count wrote
        data.set_state(json.loads(os.environ["DATA_STATE"]))
    # Devices ordered by process, so process p's devices hold the batch rows [p*b, (p+1)*b).
    sharding = NamedSharding(Mesh(np.array(jax.devices()), ("data",)), P("data"))
    saved = {}
    for step in range(%d):
        local = next(data)
        for k, v in local.items():
            arr = jax.make_array_from_process_local_data(sharding, v)
            assert arr.shape[0] == cfg.data.global_batch_size, arr.shape
            saved[f"{k}_{step}"] = np.asarray(multihost_utils.process_allgather(arr, tiled=True))
    data.close()
    from jaxtrain.data import build_eval_data
    held_out = build_eval_data(cfg, jax.process_index(), jax.process_count())
    if held_out is not None:  # one pass and one batch past it, as many batches in each process
        saved["eval_num_batches"] = np.array(held_out.num_batches)
        for step in range(held_out.num_batches + 1):
            for k, v in next(held_out).items():
                arr = jax.make_array_from_process_local_data(sharding, v)
                saved[f"eval_{k}_{step}"] = np.asarray(multihost_utils.process_allgather(arr, tiled=True))
        held_out.close()
    if jax.process_index() == 0:
        np.savez(out, **saved)
    jax.distributed.shutdown()
""" % STEPS)


@pytest.mark.multiprocess
@pytest.mark.parametrize("worker,devices", [(WORKER, 2), (SHARED_WORKER, 4)], ids=["own_rows", "shared_rows"])
def test_two_processes_build_the_same_global_batches(tmp_path, worker, devices):
    """Both workers: the training batches equal one process's. WORKER also passes over a held-out set of 11 rows:
    global batch 1 holds rows 8-10 in process 0's share and only padding in process 1's, and both finish."""
    corpus = write_tokens(tmp_path / "tok", random_docs(80))
    overrides = ["data.source=tokens", f"data.path={corpus}", "model.vocab_size=128", "data.seq_len=16",
                 "data.global_batch_size=8"]
    # 15 documents of 10 tokens + eod: 165 tokens, ceil(164 / 16) = 11 rows, the last holding 5 tokens.
    held_out = write_tokens(tmp_path / "eval", np.random.default_rng(7).integers(1, 90, size=(15, 10)).tolist())
    if worker is WORKER:
        overrides.append(f"data.eval={held_out}")
    out = tmp_path / "gathered.npz"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
           "PYTHONPATH": os.pathsep.join(sys.path)}
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", worker, str(port), str(i), str(out), *overrides], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=120)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("2-process data test timed out")
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)

    gathered = np.load(out)
    alone = build_train_data(load_config(None, overrides), 0, 1)
    for step in range(STEPS):
        expected = next(alone)
        for k in FIELDS:
            np.testing.assert_array_equal(gathered[f"{k}_{step}"], expected[k], err_msg=f"{k} at step {step}")
    alone.close()
    if worker is WORKER:
        assert_eval_pass_with_padding(gathered, np.fromfile(held_out / "part-0.bin", "<u2").astype(np.int64))


def assert_eval_pass_with_padding(gathered, stream: np.ndarray, seq_len: int = 16, batch: int = 8) -> None:
    """The gathered eval batches hold every row of the set once, in order (row i = stream tokens
    [i*L, i*L + L + 1), read here from the file), then padding rows with loss mask 0."""
    num_batches = int(gathered["eval_num_batches"])
    n = -(-(len(stream) - 1) // seq_len)
    assert (n, num_batches) == (11, 2)
    rows = {k: np.concatenate([gathered[f"eval_{k}_{b}"] for b in range(num_batches + 1)]) for k in FIELDS}
    real = rows["segment_ids"].any(axis=1)
    assert real.tolist() == [True] * n + [False] * ((num_batches + 1) * batch - n)
    assert not rows["segment_ids"][batch + batch // 2:2 * batch].any()  # process 1's share of batch 1: padding
    # Every row exactly once, in order: the rows' inputs, put together, are the whole stream.
    got = np.concatenate([t[s > 0] for t, s in zip(rows["tokens"], rows["segment_ids"])])
    np.testing.assert_array_equal(got, stream)
    # Padding counts nothing; every target inside a document counts once (all but those after an eod).
    for k in ("loss_mask", "segment_ids", "tokens", "targets"):
        assert not rows[k][~real].any(), k
    assert rows["loss_mask"].sum() == (len(stream) - 1) - np.count_nonzero(stream[:-1] == EOD)
    learned = np.concatenate([t[m > 0] for t, m in zip(rows["targets"], rows["loss_mask"])])
    np.testing.assert_array_equal(learned, stream[1:][stream[:-1] != EOD])


@pytest.mark.multiprocess
def test_a_mixture_resumed_on_two_processes_continues_the_one_process_order(tmp_path):
    """data.mixture drawn by one process for 5 batches; its state resumed by two real processes gives the
    batches the one process would have drawn next (rows, segment ids, masks and component tags)."""
    import json

    web = write_tokens(tmp_path / "web", random_docs(80, seed=1))
    code = write_tokens(tmp_path / "code", random_docs(40, seed=2))
    overrides = ["data.source=tokens", "model.vocab_size=128", "data.seq_len=16", "data.global_batch_size=8",
                 f"data.mixture=[{{path: '{web}', weight: 2}}, {{path: '{code}', weight: 1}}]",
                 "data.mixture_schedule=[{step: 6, weights: {code: 1}}]"]
    alone = build_train_data(load_config(None, overrides), 0, 1)
    for _ in range(5):
        next(alone)
    state = alone.get_state()
    expected = [next(alone) for _ in range(STEPS)]
    alone.close()
    out = tmp_path / "gathered.npz"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
           "PYTHONPATH": os.pathsep.join(sys.path), "DATA_STATE": json.dumps(state)}
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(port), str(i), str(out), *overrides], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    logs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)
    gathered = np.load(out)
    for step in range(STEPS):
        for k in (*FIELDS, "component"):
            np.testing.assert_array_equal(gathered[f"{k}_{step}"], expected[step][k], err_msg=f"{k} at step {step}")
    assert {int(c) for e in expected for c in e["component"]} == {0, 1}

"""Context parallelism (jaxtrain/parallel/context.py): attention over a sequence split across the
`context` mesh axis equals attention over the whole sequence, against the independent float64
attention (tests/independent_attention.py), forward and gradients; the zig-zag order balances the
causal work; the config refuses what cannot work, in one line.

Packed rows: document boundaries fall inside the chunks and documents cross the shard boundaries, so
the segment masking across ring blocks is exercised, not only the causal block structure.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TINY, mesh_of
from independent_attention import attention_fwd_bwd
from triton_stand_in import fake_jax_triton  # noqa: F401  (a fixture: Triton's kernels on the CPU)
from jax.sharding import NamedSharding
from trees import rel_err

from jaxtrain.config import ConfigError, load_config
from jaxtrain.model.attention import attend, resolve_attention
from jaxtrain.parallel import context
from jaxtrain.parallel.mesh_shape import AXES
from jaxtrain.parallel.sharding import Partitioning
from jaxtrain.config import DEFAULT_RULES

B, N, K, H = 4, 4, 2, 8


def packed_inputs(seed: int, L: int):
    rng = np.random.default_rng(seed)
    q, do = (rng.standard_normal((B, L, N, H), np.float32) for _ in range(2))
    k, v = (rng.standard_normal((B, L, K, H), np.float32) for _ in range(2))
    # Rows with different document layouts; boundaries off the chunk grid (chunks are L/16 long at
    # zig-zag context=8), one document spanning most of the row.
    bounds = [(3, 11, L - 5), (L // 2 + 1,), (), (1, 2, 7, L // 3)]
    seg = np.stack([np.searchsorted(np.array(b, dtype=np.int64), np.arange(L), side="right") + 1
                    for b in bounds]).astype(np.int32)
    return q, k, v, do, seg


# (context size, schedule, order, kernel, the other mesh axes filling some of the 8 devices)
CASES = [
    (2, "ring", "zigzag", "xla", {"data": 2, "tensor": 2}),
    (4, "ring", "zigzag", "xla", {"fsdp": 2}),
    (8, "ring", "zigzag", "xla", {}),
    (2, "ring", "plain", "xla", {"data": 2, "fsdp": 2}),
    (4, "ring", "plain", "xla", {"tensor": 2}),
    (8, "ring", "plain", "xla", {}),
    (4, "allgather", "zigzag", "xla", {"data": 2}),
    (8, "allgather", "plain", "xla", {}),
    (2, "ring", "zigzag", "pallas", {"tensor": 2}),
    (4, "ring", "plain", "pallas", {"data": 2}),
    (2, "allgather", "zigzag", "pallas", {"data": 2}),
    # Triton's kernels under the interpreter, through the stand-in for jax_triton.triton_call.
    (2, "ring", "zigzag", "triton", {"data": 2}),
    (4, "ring", "plain", "triton", {"tensor": 2}),
    (2, "allgather", "zigzag", "triton", {"fsdp": 2}),
]


@pytest.mark.parametrize("size,attention,order,implementation,others", CASES,
                         ids=[f"{c[0]}-{c[1]}-{c[2]}-{c[3]}-" + "-".join(f"{a}{n}" for a, n in c[4].items())
                              for c in CASES])
def test_context_attention_equals_independent_float64(size, attention, order, implementation, others, request):
    available = None
    if implementation == "triton":  # the stand-in runs it on the CPU, which kernels would not offer
        request.getfixturevalue("fake_jax_triton")
        available = ("xla", "pallas", "triton")
    L = 64 if implementation == "pallas" else 32  # pallas: chunks of >= 8 rows (one tile)
    q, k, v, do, seg = packed_inputs(size, L)
    schedule = context.ContextSchedule(size, attention, order)
    mesh = mesh_of(context=size, **others)
    part = Partitioning(mesh, dict(DEFAULT_RULES), None, schedule)
    perm = context.sequence_permutation(L, schedule)
    inverse = np.argsort(perm)

    def place(x, names):
        return jax.device_put(x[:, perm], NamedSharding(mesh, part.spec(names)))

    qkv = ("batch", "length", "heads", "head_dim")
    args = [place(q, qkv), place(k, ("batch", "length", "kv_heads", "head_dim")),
            place(v, ("batch", "length", "kv_heads", "head_dim"))]

    @jax.jit
    def run(q, k, v, seg, do):
        out, vjp = jax.vjp(lambda q, k, v: attend(q, k, v, seg, implementation, part, available=available),
                             q, k, v)
        return out, vjp(do)

    out, grads = run(*args, place(seg, ("batch", "length")), place(do, qkv))
    want = attention_fwd_bwd(q, k, v, do, causal=True, segment_ids=seg)
    for name, got, ref in zip(("out", "dq", "dk", "dv"), (out, *grads), want):
        got = np.asarray(got)[:, inverse]
        assert rel_err(got, ref) <= 1e-5, (name, rel_err(got, ref))


def test_zigzag_balances_the_causal_work():
    """Computed (unmasked) attention tiles per device over the ring: equal under zig-zag (at most one
    tile apart, the issue's bound), while under the plain order the last device does ~2x the average."""
    for size in (2, 4, 8):
        for tiles in (1, 4):
            zig = context.block_counts(context.ContextSchedule(size, "ring", "zigzag"), tiles)
            assert zig.max() - zig.min() <= 1, zig
            plain = context.block_counts(context.ContextSchedule(size, "ring", "plain"), 2 * tiles)
            assert plain.sum() == zig.sum()  # the same work (same tile size), distributed differently
            assert plain[-1] / plain.mean() > 2 * size / (size + 1) - 0.2, plain
            assert list(plain) == sorted(plain) and plain[0] < plain[-1]


def test_permutation_puts_each_devices_chunks_together():
    schedule = context.ContextSchedule(4, "ring", "zigzag")
    perm = context.sequence_permutation(16, schedule)
    assert list(perm) == [0, 1, 14, 15, 2, 3, 12, 13, 4, 5, 10, 11, 6, 7, 8, 9]
    x = np.arange(32).reshape(2, 16)
    got = context.permute_batch({"tokens": jnp.asarray(x)}, schedule)["tokens"]
    np.testing.assert_array_equal(np.asarray(got), x[:, perm])
    assert context.permute_batch({"t": x}, context.ContextSchedule(4, "ring", "plain"))["t"] is x


def test_config_refuses_what_context_parallelism_cannot_do():
    with pytest.raises(ConfigError, match=r"data.seq_len=36 is not divisible by 8 \(context.order=zigzag"):
        load_config(None, ["mesh.context=4", "data.seq_len=36", "model.max_seq_len=64"])
    load_config(None, ["mesh.context=4", "data.seq_len=36", "model.max_seq_len=64", "context.order=plain"])
    with pytest.raises(ConfigError, match="mesh.context=2 with mesh.stage=2"):
        load_config(None, ["mesh.context=2", "mesh.stage=2", "pipeline.microbatches=2"])
    with pytest.raises(ConfigError, match="context.order"):
        load_config(None, ["context.order=spiral"])
    with pytest.raises(ConfigError, match="context.attention"):
        load_config(None, ["context.attention=tree"])
    cfg = load_config(None, ["mesh.context=2", "model.attention=cudnn", "precision.policy=bf16"])
    sizes = {a: 1 for a in AXES} | {"context": 2}
    with pytest.raises(ConfigError, match="no blockwise form for context parallelism"):
        resolve_attention(cfg, "gpu", sizes, available=("xla", "triton", "cudnn"))
    triton = load_config(None, ["mesh.context=2", "model.attention=triton"])
    assert resolve_attention(triton, "gpu", sizes, available=("xla", "triton", "cudnn")) == "triton"
    assert resolve_attention(load_config(None, ["mesh.context=2", "model.attention=pallas"]), "cpu", sizes) == "pallas"


def test_local_checkpoint_meshes_compare_without_size_one_axes():
    from jaxtrain.checkpoint.local_tier import same_mesh
    old = {"data": 2, "stage": 1, "fsdp": 4, "tensor": 1}  # written before the context axis existed
    assert same_mesh(old, {"data": 2, "stage": 1, "fsdp": 4, "context": 1, "tensor": 1})
    assert not same_mesh(old, {"data": 2, "stage": 1, "fsdp": 2, "context": 2, "tensor": 1})
    assert not same_mesh(old, None) and same_mesh(None, None)


def test_a_bad_context_config_exits_2_with_one_line(tmp_path):
    import subprocess
    import sys
    out = tmp_path / "run"
    result = subprocess.run([sys.executable, "-m", "jaxtrain", "train", "--config", TINY,
                             f"run.output_dir={out}", "mesh.context=8", "mesh.data=1", "data.seq_len=24",
                             "--cpu-devices", "8"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "data.seq_len=24 is not divisible by 16 (context.order=zigzag" in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not out.exists()


def test_inspect_reports_the_ring_bytes_beside_their_theory():
    """`jaxtrain inspect`'s report: the schedule, the compiled collective-permute bytes within 2% of
    `ring_bytes_theory` (XLA may merge the two backward hops of identical segment ids), and the
    temporaries per device."""
    from jaxtrain.observe.inspection import inspect_report
    small = ["model.vocab_size=64", "model.d_model=32", "model.num_layers=2", "model.num_heads=4",
             "model.num_kv_heads=2", "model.head_dim=16", "model.mlp_dim=64", "data.seq_len=64",
             "data.global_batch_size=2", "mesh.data=2", "mesh.context=4", "model.attention=xla",
             "checkpoint.compilation_cache_dir=null"]
    report = inspect_report(load_config(None, small), jax.devices()[:8])
    ctx = report["context"]
    assert (ctx["size"], ctx["attention"], ctx["order"], ctx["chunk_len"]) == (4, "ring", "zigzag", 8)
    assert ctx["chunk_pairs_per_device_max_over_mean"] == 1.0
    assert ctx["ring_permute_bytes_theory"] > 0
    assert 0.98 <= ctx["ring_permute_ratio"] <= 1.0, ctx
    assert report["activation_bytes_per_device"] > 0

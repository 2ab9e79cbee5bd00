"""Attention kernels on CPU: dispatch, FLOP accounting, and the Pallas kernels (interpret mode)
against the XLA reference for outputs and dq, dk, dv.

Shapes are tiny on purpose: interpret mode compiles each kernel into a loop of XLA ops, and the
compile (~3 s per fwd+bwd configuration on 2 cores) dominates.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from jaxtrain.kernels import (
    IMPLEMENTATIONS,
    attention_flops,
    attention_training_flops,
    available_implementations,
    flash_attention,
    mha_reference,
    resolve_implementation,
)
from jaxtrain.kernels.pallas_attention import pallas_flash_attention
from jaxtrain.kernels.testing import TOLERANCE, assert_close, output_and_grads, random_inputs, reference_output_and_grads

# ------------------------------------------------------------------------------------------------
# Dispatch and FLOPs.
# ------------------------------------------------------------------------------------------------


def test_available_implementations_per_platform():
    assert available_implementations("cpu") == ("xla", "pallas")
    assert available_implementations("tpu") == ("xla", "pallas")
    gpu = available_implementations("gpu")
    assert gpu[0] == "xla" and "cudnn" in gpu and "pallas" not in gpu
    assert available_implementations("cuda") == gpu
    assert available_implementations() == ("xla", "pallas")  # this machine is CPU
    assert set(available_implementations("gpu")) <= set(IMPLEMENTATIONS)


def test_resolve_implementation():
    assert resolve_implementation("auto", "cpu") == "xla"
    assert resolve_implementation("auto", "tpu") == "pallas"
    assert resolve_implementation("auto", "gpu") in ("triton", "cudnn")
    assert resolve_implementation("pallas", "cpu") == "pallas"
    assert resolve_implementation("xla") == "xla"
    assert resolve_implementation("cudnn", "gpu") == "cudnn"


@pytest.mark.parametrize("name", ["triton", "cudnn"])
def test_unavailable_implementation_is_a_clear_error(name):
    with pytest.raises(ValueError) as err:
        resolve_implementation(name, "cpu")
    message = str(err.value)
    assert repr(name) in message and "'cpu'" in message and "xla, pallas" in message
    q, k, v, _, _ = random_inputs(0, 1, 8, 2, 1, 16)
    with pytest.raises(ValueError, match=name):
        flash_attention(q, k, v, implementation=name)


def test_unknown_implementation_and_bad_shapes():
    with pytest.raises(ValueError, match="unknown attention implementation 'flash'"):
        resolve_implementation("flash")
    q, k, v, _, _ = random_inputs(0, 1, 8, 3, 2, 16)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        flash_attention(q, k, v, implementation="xla")
    q, k, v, _, _ = random_inputs(0, 1, 8, 2, 1, 16)
    with pytest.raises(ValueError, match="segment_ids"):
        flash_attention(q, k, v, segment_ids=jnp.zeros((1, 7), jnp.int32), implementation="pallas")
    with pytest.raises(ValueError, match="segment_ids must be integers"):
        flash_attention(q, k, v, segment_ids=jnp.zeros((1, 8), jnp.float32), implementation="xla")
    q, k, v, _, _ = random_inputs(0, 1, 64, 2, 1, 16)
    with pytest.raises(ValueError, match="multiples of 8"):
        pallas_flash_attention(q, k, v, block_sizes=(12, 16))


def test_attention_flops():
    assert attention_flops(2, 8, 4, 16, causal=False) == 4 * 2 * 8 * 8 * 4 * 16
    assert attention_flops(2, 8, 4, 16, causal=True) == 2 * 2 * 8 * 8 * 4 * 16
    assert attention_training_flops(2, 8, 4, 16) == 3.5 * attention_flops(2, 8, 4, 16)
    assert attention_training_flops(2, 8, 4, 16, backward_factor=2.0) == 3.0 * attention_flops(2, 8, 4, 16)


def test_auto_and_xla_are_the_reference_on_cpu():
    q, k, v, _, seg = random_inputs(1, 2, 16, 4, 2, 16, segments=True)
    expected = mha_reference(q, k, v, causal=True, segment_ids=seg)
    for name in ("auto", "xla"):
        np.testing.assert_array_equal(flash_attention(q, k, v, segment_ids=seg, implementation=name), expected)


# ------------------------------------------------------------------------------------------------
# Pallas (interpret mode) against the reference: outputs and dq, dk, dv.
# ------------------------------------------------------------------------------------------------


def _check_pallas(seed, B, L, N, K, H, *, causal, segments, block_sizes, dtype=jnp.float32):
    q, k, v, do, seg = random_inputs(seed, B, L, N, K, H, dtype, segments)
    out, grads = output_and_grads(
        pallas_flash_attention, q, k, v, do, causal=causal, segment_ids=seg, block_sizes=block_sizes
    )
    ref_out, ref_grads = reference_output_and_grads(q, k, v, do, causal=causal, segment_ids=seg)
    tol = TOLERANCE[jnp.dtype(dtype).name]
    assert out.dtype == q.dtype and out.shape == q.shape
    assert_close("out", out, ref_out, tol)
    for name, g, ref in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert g.dtype == ref.dtype and g.shape == ref.shape, name
        assert_close(name, g, ref, tol)


@pytest.mark.parametrize("causal, segments, K", [(True, True, 2), (False, True, 1), (True, False, 4)])
def test_pallas_and_reference_match_an_independent_implementation(causal, segments, K):
    """Both the kernel and `mha_reference` (which is also the `xla` path) against float64 numpy with a
    hand-written backward: a shared mistake in the reference cannot hide here."""
    from independent_attention import attention_fwd_bwd
    q, k, v, do, seg = random_inputs(7, 2, 40, 4, K, 16, jnp.float32, segments)
    want = attention_fwd_bwd(q, k, v, do, causal=causal, segment_ids=seg)
    for name, attention, kwargs in (("pallas", pallas_flash_attention, {"block_sizes": (16, 32)}),
                                    ("reference", mha_reference, {})):
        out, grads = output_and_grads(attention, q, k, v, do, causal=causal, segment_ids=seg, **kwargs)
        for part, got, ref in zip(("out", "dq", "dk", "dv"), (out, *grads), want, strict=True):
            assert_close(f"{name} {part}", got, ref, TOLERANCE["float32"])


# (B, L, N, K, H, causal, segments, block_sizes): kv-head ratios 1, 2, 4; causal and not; with and
# without segments; lengths that are and are not multiples of the tiles; unequal q/kv tiles.
CASES = [
    (2, 64, 2, 2, 16, True, False, (16, 16)),
    (2, 40, 4, 2, 16, True, True, (16, 32)),
    (1, 50, 4, 1, 16, True, False, (32, 16)),
    (2, 33, 2, 2, 16, False, True, (16, 16)),
    (1, 64, 4, 2, 16, False, False, (32, 32)),
    (2, 17, 4, 1, 16, False, True, (16, 16)),
]


def _case_id(case):
    B, L, N, K, H, causal, segments, blocks = case
    return f"L{L}-N{N}K{K}-{'causal' if causal else 'full'}-{'seg' if segments else 'noseg'}-b{blocks[0]}x{blocks[1]}"


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_pallas_matches_reference_fp32(case):
    B, L, N, K, H, causal, segments, blocks = case
    _check_pallas(10, B, L, N, K, H, causal=causal, segments=segments, block_sizes=blocks)


@pytest.mark.parametrize("case", [CASES[1], CASES[5]], ids=_case_id)
def test_pallas_matches_reference_bf16(case):
    B, L, N, K, H, causal, segments, blocks = case
    _check_pallas(20, B, L, N, K, H, causal=causal, segments=segments, block_sizes=blocks, dtype=jnp.bfloat16)


@pytest.mark.parametrize(
    "B, L, N, K, H, causal, segments, blocks",
    [
        (1, 1, 2, 1, 16, True, False, (16, 16)),  # seq 1
        (1, 24, 2, 1, 64, False, True, (16, 16)),  # head_dim 64
        (1, 24, 2, 2, 128, True, True, (16, 16)),  # head_dim 128
        (1, 130, 2, 1, 16, True, True, None),  # default 128 tiles, L not a multiple
    ],
    ids=["seq1", "head_dim64", "head_dim128", "default-blocks-L130"],
)
def test_pallas_edge_cases(B, L, N, K, H, causal, segments, blocks):
    _check_pallas(30, B, L, N, K, H, causal=causal, segments=segments, block_sizes=blocks)


def test_pallas_segments_starting_mid_tile():
    # Documents begin at positions 5, 21, 13: inside 16-row tiles, in different places per row.
    L = 40
    seg = jnp.asarray(
        [[3] * 5 + [4] * 16 + [9] * 19, [0] * 13 + [1] * 27],
        jnp.int32,
    )
    q, k, v, do, _ = random_inputs(40, 2, L, 4, 2, 16)
    out, grads = output_and_grads(pallas_flash_attention, q, k, v, do, causal=True, segment_ids=seg, block_sizes=(16, 16))
    ref_out, ref_grads = reference_output_and_grads(q, k, v, do, causal=True, segment_ids=seg)
    assert_close("out", out, ref_out, 1e-5)
    for name, g, ref in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert_close(name, g, ref, 1e-5)


def test_pallas_fully_masked_rows_are_zero_not_nan():
    # Keys carry different segment ids from the queries, so queries of segment 5 see no key at all.
    L = 24
    q_seg = jnp.asarray([[1] * 8 + [2] * 8 + [5] * 8], jnp.int32)
    kv_seg = jnp.asarray([[1] * 8 + [2] * 8 + [7] * 8], jnp.int32)
    q, k, v, do, _ = random_inputs(50, 1, L, 2, 1, 16)
    kw = dict(causal=False, segment_ids=q_seg, kv_segment_ids=kv_seg)
    out, (dq, dk, dv) = output_and_grads(pallas_flash_attention, q, k, v, do, block_sizes=(16, 16), **kw)
    ref_out, ref_grads = reference_output_and_grads(q, k, v, do, **kw)
    assert_close("out", out, ref_out, 1e-5)
    for name, g, ref in zip(("dq", "dk", "dv"), (dq, dk, dv), ref_grads):
        assert_close(name, g, ref, 1e-5)
    np.testing.assert_array_equal(out[:, 16:], 0.0)
    np.testing.assert_array_equal(dq[:, 16:], 0.0)
    # Keys of segment 7 are seen by nobody: no gradient reaches them.
    np.testing.assert_array_equal(dk[:, 16:], 0.0)
    np.testing.assert_array_equal(dv[:, 16:], 0.0)


# ------------------------------------------------------------------------------------------------
# The Pallas path under the transformations a model uses: jit + grad + scan, shard_map.
# ------------------------------------------------------------------------------------------------


def test_pallas_through_public_api_under_jit_grad_and_scan():
    # Two "layers" scanned, as the model stacks layers; gradient w.r.t. the stacked inputs.
    B, L, N, K, H = 1, 24, 2, 1, 16
    q, k, v, _, seg = random_inputs(60, B, L, N, K, H, segments=True)
    q_stack = jnp.stack([q, 0.5 * q])

    def loss(q_stack, implementation):
        def layer(carry, q_layer):
            out = flash_attention(q_layer, k, v, segment_ids=seg, implementation=implementation,
                                  block_sizes=(16, 16))
            return carry + jnp.sum(out * out), None

        return jax.lax.scan(layer, 0.0, q_stack)[0]

    value, grad = jax.jit(jax.value_and_grad(functools.partial(loss, implementation="pallas")))(q_stack)
    ref_value, ref_grad = jax.jit(jax.value_and_grad(functools.partial(loss, implementation="xla")))(q_stack)
    assert_close("loss", value, ref_value, 1e-5)
    assert_close("dq_stack", grad, ref_grad, 1e-5)


def test_pallas_under_shard_map_data_and_tensor_parallel():
    # Batch over 'data'; q heads over 'tensor' with one kv head (MQA) replicated across 'tensor',
    # so dk/dv need a psum over 'tensor' that the custom VJP must leave to JAX.
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "tensor"))
    B, L, N, K, H = 2, 24, 4, 1, 16
    q, k, v, do, seg = random_inputs(70, B, L, N, K, H, segments=True)
    q_spec, kv_spec, seg_spec = P("data", None, "tensor", None), P("data", None, None, None), P("data", None)

    def sharded(q, k, v, segment_ids):
        return jax.shard_map(
            lambda q, k, v, s: pallas_flash_attention(q, k, v, segment_ids=s, block_sizes=(16, 16)),
            mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, seg_spec), out_specs=q_spec,
        )(q, k, v, segment_ids)

    out, grads = output_and_grads(sharded, q, k, v, do, segment_ids=seg)
    ref_out, ref_grads = reference_output_and_grads(q, k, v, do, causal=True, segment_ids=seg)
    assert_close("out", out, ref_out, 1e-5)
    for name, g, ref in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert_close(name, g, ref, 1e-5)


@pytest.mark.parametrize("platform, window", [("tpu", None), ("cuda", None), ("tpu", 256)],
                         ids=["tpu", "cuda", "tpu-window256"])
def test_pallas_kernels_lower_for_accelerators(monkeypatch, platform, window):
    # The compiled (interpret=False) path, lowered without the device: through Mosaic for TPU and
    # Pallas' Triton backend for NVIDIA GPUs. Lowering checks block shapes and the ops used;
    # compiling the lowered kernels still needs the device.
    from jax import export

    monkeypatch.setattr(jax, "default_backend", lambda: "tpu" if platform == "tpu" else "gpu")
    if platform == "tpu":
        # Mosaic asks the default device for its TPU generation; pretend to be a v5e.
        tpu_info = pytest.importorskip("jax._src.pallas.mosaic.tpu_info")
        if not (hasattr(tpu_info, "get_device_kind") and hasattr(tpu_info, "get_num_device_cores")):
            pytest.skip("this JAX's Mosaic has no get_device_kind/get_num_device_cores to stand in for")
        monkeypatch.setattr(tpu_info, "get_device_kind", lambda: "TPU v5e")
        monkeypatch.setattr(tpu_info, "get_num_device_cores", lambda: 1)
    else:
        # Newer JAX (0.12) asks the default device for its GPU generation; pretend to be an H200.
        # The module moved from jax._src.pallas.triton (0.12.0) to jax._src (0.12.1).
        try:
            from jax._src import gpu_info
        except ImportError:
            try:
                from jax._src.pallas.triton import gpu_info
            except ImportError:  # older JAX lowers for GPU without asking
                gpu_info = None
        if gpu_info is not None and hasattr(gpu_info, "get_device_kind"):
            monkeypatch.setattr(gpu_info, "get_device_kind", lambda: "NVIDIA H200")
            if hasattr(gpu_info, "get_device_platform"):
                monkeypatch.setattr(gpu_info, "get_device_platform", lambda: "gpu")
            if hasattr(gpu_info.get_gpu_info, "cache_clear"):
                gpu_info.get_gpu_info.cache_clear()
    B, L, N, K, H = 1, 1000, 4, 2, 128
    q = jax.ShapeDtypeStruct((B, L, N, H), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((B, L, K, H), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((B, L), jnp.int32)

    def fwd_bwd(q, k, v, s):
        out, vjp = jax.vjp(lambda q, k, v: pallas_flash_attention(q, k, v, segment_ids=s, interpret=False,
                                                                  window=window), q, k, v)
        return vjp(out)

    gpu_call = "__gpu$xla.gpu.triton"
    exported = export.export(
        jax.jit(fwd_bwd), platforms=[platform], disabled_checks=[export.DisabledSafetyCheck.custom_call(gpu_call)]
    )(q, kv, kv, seg)
    text = exported.mlir_module()
    assert text.count("tpu_custom_call" if platform == "tpu" else "xla.gpu.triton(") == 3  # fwd, dq, dkv

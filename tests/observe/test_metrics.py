"""Metrics plumbing: TensorBoard files TensorBoard itself can read, FLOP accounting, collective parsing."""

from __future__ import annotations

import jax
import pytest

from jaxtrain.config import load_config
from jaxtrain.observe.inspection import collective_bytes
from jaxtrain.observe.tensorboard import ScalarWriter, crc32c, read_scalars
from jaxtrain.observe.throughput import flops_per_step


def test_crc32c_known_answer():
    assert crc32c(b"123456789") == 0xE3069283  # the standard CRC-32C check value


def test_scalar_events_are_readable_by_tensorboard(tmp_path):
    writer = ScalarWriter(tmp_path)
    writer.scalars(1, {"train/loss": 2.5, "train/mfu": 0.25})
    writer.scalars(2, {"train/loss": 1.5})
    writer.close()
    (path,) = tmp_path.iterdir()
    assert read_scalars(path) == [(1, "train/loss", 2.5), (1, "train/mfu", 0.25), (2, "train/loss", 1.5)]
    event_accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator", reason="tensorboard (dev extra) not installed")
    acc = event_accumulator.EventAccumulator(str(tmp_path))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(1, 2.5), (2, 1.5)]
    # A flipped byte is caught by the record checksum.
    data = bytearray(path.read_bytes())
    data[-6] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="corrupt"):
        read_scalars(path)


def test_flops_per_step_matches_hand_count():
    cfg = load_config(None, ["model.vocab_size=100", "model.d_model=8", "model.num_layers=2", "model.num_heads=2",
                             "model.num_kv_heads=1", "model.head_dim=4", "model.mlp_dim=16", "data.seq_len=10",
                             "data.global_batch_size=3"])
    per_layer = 8 * 4 * (2 * 2 + 2 * 1) + 3 * 8 * 16  # q,o + k,v projections; gate, up, down
    matmul = 2 * per_layer + 8 * 100  # layers + output head
    attention_fwd = 4 * 3 * 10 * 10 * 2 * 4 / 2  # QK^T and PV, causal half
    assert flops_per_step(cfg) == 6 * matmul * 30 + 3 * 2 * attention_fwd
    # Gemma-style windows: layer 0 local (window 4: the band 10 * 4 - 4 * 4 / 2 of the scores), layer 1 global.
    windowed = cfg.with_overrides("model.sliding_window=4", "model.sliding_window_pattern=2")
    local_fwd = 4 * 3 * 2 * 4 * (10 * 4 - 4 * 4 / 2)
    assert flops_per_step(windowed) == 6 * matmul * 30 + 3 * (local_fwd + attention_fwd)
    # Multi-head latent attention (q latent 3, kv latent 5, rope 2 + nope 2 = head_dim 4, values 6) and one
    # multi-token-prediction module (eh_proj [16, 8], a dense layer, the head again).
    mla = cfg.with_overrides("model.num_kv_heads=2", "model.kv_lora_rank=5", "model.q_lora_rank=3",
                             "model.qk_rope_head_dim=2", "model.qk_nope_head_dim=2", "model.v_head_dim=6",
                             "model.mtp_depth=1")
    attention = 8 * 3 + 3 * 2 * 4 + 8 * (5 + 2) + 5 * 2 * (2 + 6) + 2 * 6 * 8  # q_a, q_b, kv_a, kv_b, o
    layer = attention + 3 * 8 * 16
    matmul = 2 * layer + 8 * 100 + (16 * 8 + layer + 8 * 100)
    mla_fwd = 2 * 3 * 10 * 10 * 2 * 4 / 2 + 2 * 3 * 10 * 10 * 2 * 6 / 2  # QK^T over 4 channels, PV over 6
    assert flops_per_step(mla) == 6 * matmul * 30 + 3 * 3 * mla_fwd


HLO = """
%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %ag = f32[16,4]{1,0} all-gather(f32[2,4]{1,0} %x), replica_groups=[1,8]<=[8], dimensions={0}
  %ar = (f32[8]{0}, bf16[4]{0}) all-reduce(f32[8]{0} %a, bf16[4]{0} %b), replica_groups={{0,1},{2,3},{4,5},{6,7}}, to_apply=%add
}
%cond (p: (s32[], f32[8])) -> pred[] {
  %c = pred[] constant(true)
}
ENTRY %main (a: f32[8], /*index=1*/b: f32[8]) -> f32[8] {
  %w = (s32[], f32[8]{0}) while(%t), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %rs = f32[2]{0} reduce-scatter(f32[16]{0} %y), replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0','axis_1'}, dimensions={0}
  %cp = f32[4]{0} collective-permute(f32[4]{0} %z), source_target_pairs={{0,1},{1,0}}
  %ar1 = f32[6]{0} all-reduce(f32[6]{0} %q), replica_groups={{0}}, to_apply=%add
}
"""


def test_collectives_inside_loops_count_per_trip_with_wire_bytes_per_group():
    got = collective_bytes(HLO, num_devices=8)
    # all-gather over 8: result x 7/8; all-reduce over pairs: 2 x size x 1/2; reduce-scatter over
    # 2 x 4 devices: input x 7/8; collective-permute: its buffer; a group of one moves nothing.
    assert got["all-gather"] == {"count": 3, "bytes": 3 * 16 * 4 * 4 * 7 / 8, "result_bytes": 3 * 16 * 4 * 4}
    assert got["all-reduce"] == {"count": 4, "bytes": 3 * 2 * (8 * 4 + 4 * 2) / 2, "result_bytes": 3 * 40 + 24}
    assert got["reduce-scatter"] == {"count": 1, "bytes": 16 * 4 * 7 / 8, "result_bytes": 2 * 4}
    assert got["collective-permute"] == {"count": 1, "bytes": 4 * 4, "result_bytes": 4 * 4}
    assert got["all-to-all"]["count"] == 0


def test_replica_group_sizes_in_every_spelling():
    from jaxtrain.observe.hlo import replica_group_size
    assert replica_group_size("replica_groups={{0,1,2},{3,4,5}}, to_apply=%add", 8) == 3
    assert replica_group_size("replica_groups=[4,2]<=[4,2]T(1,0), dimensions={0}", 8) == 2
    assert replica_group_size("replica_groups=mesh['axis_0'=4,'axis_1'=1,'axis_3'=2] {'axis_3'}, x", 8) == 2
    assert replica_group_size("replica_groups=mesh['axis_0'=4,'axis_1'=1,'axis_2'=2], device_ids=([2,4]T(1,0)) "
                              "{'axis_0'}, dimensions={0}", 8) == 4
    assert replica_group_size("replica_groups={}, to_apply=%add", 8) == 8


# d_model 1024, 4 layers, short sequences: parameters dominate memory and traffic.
INSPECT_MODEL = ["model.d_model=1024", "model.num_layers=4", "model.num_heads=8", "model.num_kv_heads=8",
                 "model.head_dim=128", "model.mlp_dim=2048", "model.vocab_size=1024", "model.attention=xla",
                 "data.seq_len=32", "data.global_batch_size=8", "checkpoint.compilation_cache_dir=null"]


@pytest.fixture(scope="module")
def inspect_json():
    """`jaxtrain inspect --json` on the 8 simulated devices, for fsdp=8 and data=8."""
    import io
    import json
    from contextlib import redirect_stdout

    from jaxtrain.commands import cli
    reports = {}
    for name, mesh in {"fsdp": ["mesh.data=1", "mesh.fsdp=8"], "data": ["mesh.data=8"]}.items():
        out = io.StringIO()
        with redirect_stdout(out):
            assert cli.main(["inspect", "--config", "configs/tiny.yaml", "--json", *INSPECT_MODEL, *mesh]) == 0
        reports[name] = json.loads(out.getvalue())
    return reports


def test_inspect_json_keys(inspect_json):
    r = inspect_json["fsdp"]
    for key in ("params", "flops_per_step", "peak_memory_bytes_per_device", "collectives", "collective_ops",
                "collective_bytes_theory", "collective_bytes_ratio"):
        assert key in r, key
    assert set(r["collectives"]) == {"all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all"}
    assert all(isinstance(v, (int, float)) for v in r["collectives"].values())  # kind -> bytes per step
    params = 4 * (4 * 1024 * 1024 + 3 * 1024 * 2048 + 2 * 1024) + 2 * 1024 * 1024 + 1024
    assert r["params"] == params


def test_fsdp_memory_is_a_fraction_of_data_parallel(inspect_json):
    fsdp, data = inspect_json["fsdp"], inspect_json["data"]
    assert fsdp["peak_memory_bytes_per_device"] <= 0.3 * data["peak_memory_bytes_per_device"], (
        fsdp["memory_bytes_per_device"], data["memory_bytes_per_device"])


def test_fsdp_collective_bytes_match_theory(inspect_json):
    r = inspect_json["fsdp"]
    param_bytes = 4 * r["params"]
    # The layout's theory is ~3 x parameter bytes x 7/8 (norm scales are not sharded: their gradients are
    # only all-reduced, 2 x instead of 3 x).
    assert 0.99 * 3 * param_bytes * 7 / 8 <= r["collective_bytes_theory"] <= 3 * param_bytes * 7 / 8
    assert 1 / 1.2 <= r["collective_bytes_ratio"] <= 1.2, r["collectives"]
    assert r["collectives"]["all-gather"] >= param_bytes * 7 / 8  # every weight gathered at least once


def test_data_parallel_gathers_no_parameters(inspect_json):
    r = inspect_json["data"]
    assert r["collectives"]["all-gather"] == 0 and r["collective_ops"]["all-gather"] == 0
    # Gradients are all-reduced once: 2 x parameter bytes x 7/8 (plus the loss scalars).
    assert 1 / 1.2 <= r["collective_bytes_ratio"] <= 1.2, r["collectives"]


def test_inspect_says_what_the_cpu_figures_overstate_and_undercount(inspect_json):
    """The caveats are in the output itself: XLA's attention holds [L, L] scores (the CPU's peak), and
    XLA's cost analysis counts the scanned layer body once (its FLOPs, beside the model's)."""
    from jaxtrain.observe.inspection import format_report
    r = inspect_json["data"]
    # data=8: 1 sequence and 8 heads per device, seq 32: one layer's fp32 scores
    assert r["attention_scores_bytes_per_device"] == 1 * 8 * 32 * 32 * 4
    assert r["flops_per_step_per_device"] == r["flops_per_step"] / 8
    scores, flops = r["notes"]
    assert "XLA's attention (the CPU's model.attention=auto) materialises the [L, L] scores: ~0.0312 MiB" in scores
    assert "fused kernel that never holds them" in scores
    assert "XLA's FLOPs count each loop body once, not once per trip (4 scanned layers)" in flops
    assert f"{r['flops_per_step'] / 8:.4g}" in flops
    text = format_report(r)
    assert f"note: {scores}" in text and f"note: {flops}" in text
    assert f"model FLOPs per step per device: {r['flops_per_step'] / 8:.4g}" in text


def test_inspect_reports_fsdp_all_gathers_and_parameter_specs():
    from jaxtrain.observe.inspection import inspect_config
    cfg = load_config(None, ["mesh.data=2", "mesh.fsdp=4", "model.d_model=64", "model.num_layers=2",
                             "data.global_batch_size=8", "data.seq_len=16", "checkpoint.compilation_cache_dir=null"])
    report = inspect_config(cfg, per_parameter=True)
    lines = {line.split()[0]: line for line in report.splitlines() if line.startswith("  ")}
    assert int(lines["all-gather"].split()[1]) > 0  # FSDP gathers weights...
    assert int(lines["all-reduce"].split()[1]) > 0  # ...and reduces gradients/loss
    assert "theory for the layout" in lines["total"]
    assert "P('stage', 'fsdp', 'tensor')" in lines["['blocks']['mlp']['w_gate']"]  # layers -> stage (size 1 here)
    assert "parameters: " in report and "memory per device" in report


def test_mfu_is_a_fraction_on_the_cpu():
    """Model FLOP/s over the measured matmul peak: above 0, at most 1 (the peak is a real upper bound)."""
    from jaxtrain.trainer import Trainer
    cfg = load_config("configs/tiny.yaml", ["mesh.data=1", "checkpoint.compilation_cache_dir=null", "train.steps=3"])
    trainer = Trainer(cfg, write_files=False, devices=jax.devices()[:1])
    trainer.step()  # compiles
    record = trainer.step()
    assert 0.0 < record["mfu"] <= 1.0, record
    assert record["tflops_per_device"] * 1e12 == pytest.approx(flops_per_step(cfg) / record["step_time_s"])


SLICED_HLO = """HloModule m, num_partitions=8
%fused_slice (p0: f32[64,256], p1: u32[]) -> f32[16,256] {
  %p0 = f32[64,256]{1,0} parameter(0)
  %p1 = u32[] parameter(1)
  %c = u32[] constant(0)
  ROOT %ds = f32[16,256]{1,0} dynamic-slice(%p0, %p1, %c), dynamic_slice_sizes={16,256}
}
ENTRY %main (a: f32[64,256], b: f32[64]) -> f32[16,256] {
  %a = f32[64,256]{1,0} parameter(0)
  %b = f32[64]{0} parameter(1)
  %ar = (f32[64,256]{1,0}, f32[64]{0}) all-reduce(%a, %b), replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
  %g0 = f32[64,256]{1,0} get-tuple-element(%ar), index=0
  %g1 = f32[64]{0} get-tuple-element(%ar), index=1
  %pid = u32[] partition-id()
  %f = f32[16,256]{1,0} fusion(%g0, %pid), kind=kLoop, calls=%fused_slice
  ROOT %n = f32[64]{0} negate(%g1)
}
"""


def test_cpu_all_reduce_that_is_only_sliced_counts_as_reduce_scatter():
    """data=2 x fsdp=4 on the CPU: a gradient all-reduced over all 8 devices and sliced 1/4 per device is
    a reduce-scatter over fsdp plus an all-reduce of the shard over data; the other element stays an
    all-reduce. As compiled, it is one all-reduce of everything."""
    grad, other = 64 * 256 * 4, 64 * 4
    got = collective_bytes(SLICED_HLO, sliced_as_reduce_scatter=True)
    assert got["reduce-scatter"]["bytes"] == grad * 3 / 4
    assert got["all-reduce"]["bytes"] == 2 * (grad / 4) * 1 / 2 + 2 * other * 7 / 8
    raw = collective_bytes(SLICED_HLO)
    assert raw["all-reduce"]["bytes"] == 2 * (grad + other) * 7 / 8 and raw["reduce-scatter"]["count"] == 0


def test_events_reach_every_sink_and_the_early_ones_first():
    """The run's one events object (jaxtrain/observe/runlog.py `Events`): what is written before a
    sink attaches reaches it first, in order; after the last sink nothing more is kept."""
    from jaxtrain.observe.runlog import Events, split_event
    events, log, exporter = Events(), [], []
    events("restore", 3, source="local")  # the capabilities' on_event(kind, step, **details)
    events.write({"kind": "checkpoint_damaged", "step": 2, "reason": "no commit marker"})
    events.attach(log.append)
    events("config_changed", 3)
    events.attach(lambda e: exporter.append(split_event(e)), last=True)
    events("start", 3, devices=2)
    assert [e["kind"] for e in log] == ["restore", "checkpoint_damaged", "config_changed", "start"]
    assert log[0] == {"kind": "restore", "step": 3, "source": "local"}
    assert exporter == [("restore", 3, {"source": "local"}), ("checkpoint_damaged", 2, {"reason": "no commit marker"}),
                        ("config_changed", 3, {}), ("start", 3, {"devices": 2})]
    assert events._early is None  # nothing kept once every sink is attached

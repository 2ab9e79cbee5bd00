"""Metrics plumbing: TensorBoard files TensorBoard itself can read, FLOP accounting, collective parsing."""

from __future__ import annotations

import pytest

from jaxtrain.config import load_config
from jaxtrain.inspection import collective_bytes
from jaxtrain.throughput import flops_per_step
from jaxtrain.tensorboard import ScalarWriter, crc32c, read_scalars


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


HLO = """
%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %ag = f32[16,4]{1,0} all-gather(f32[2,4]{1,0} %x), dimensions={0}
  %ar = (f32[8]{0}, bf16[4]{0}) all-reduce(f32[8]{0} %a, bf16[4]{0} %b), to_apply=%add
}
%cond (p: (s32[], f32[8])) -> pred[] {
  %c = pred[] constant(true)
}
ENTRY %main (a: f32[8], /*index=1*/b: f32[8]) -> f32[8] {
  %w = (s32[], f32[8]{0}) while(%t), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %rs = f32[2]{0} reduce-scatter(f32[16]{0} %y), dimensions={0}
}
"""


def test_collectives_inside_loops_count_per_trip():
    got = collective_bytes(HLO)
    assert got["all-gather"] == {"count": 3, "bytes": 3 * 16 * 4 * 4}
    assert got["all-reduce"] == {"count": 3, "bytes": 3 * (8 * 4 + 4 * 2)}
    assert got["reduce-scatter"] == {"count": 1, "bytes": 2 * 4}


def test_inspect_reports_fsdp_all_gathers_and_parameter_specs():
    from jaxtrain.inspection import inspect_config
    cfg = load_config(None, ["mesh.data=2", "mesh.fsdp=4", "model.d_model=64", "model.num_layers=2",
                             "data.global_batch_size=8", "data.seq_len=16", "checkpoint.compilation_cache_dir=null"])
    report = inspect_config(cfg, per_parameter=True)
    lines = {line.split()[0]: line for line in report.splitlines() if line.startswith("  ")}
    assert int(lines["all-gather"].split()[1]) > 0  # FSDP gathers weights...
    assert int(lines["all-reduce"].split()[1]) > 0  # ...and reduces gradients/loss
    assert "P('stage', 'fsdp', 'tensor')" in lines["['blocks']['mlp']['w_gate']"]  # layers -> stage (size 1 here)
    assert "parameters: " in report and "memory per device" in report

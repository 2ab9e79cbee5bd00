"""train.profile_steps and `jaxtrain profile-summary`: a real trace of a data x fsdp run on 8
simulated devices, split into parts that add up to the step time."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stdout

import pytest

from jaxtrain import cli
from jaxtrain.config import load_config
from jaxtrain.profiling import COLLECTIVE_KINDS, PARTS, _Event, _exclusive_segments, parse_hlo

RUN = ["mesh.data=2", "mesh.fsdp=4", "model.d_model=64", "model.num_layers=2", "model.num_heads=4",
       "model.num_kv_heads=2", "model.head_dim=16", "model.mlp_dim=128", "model.vocab_size=256",
       "model.attention=xla", "data.seq_len=32", "data.global_batch_size=16", "train.steps=6", "train.log_every=1",
       "train.profile_steps=[3,5]", "checkpoint.save_at_end=false", "checkpoint.compilation_cache_dir=null"]


@pytest.fixture(scope="module")
def profiled_run(tmp_path_factory):
    from jaxtrain.trainer import Trainer
    out = tmp_path_factory.mktemp("profiled")
    trainer = Trainer(load_config(None, RUN + [f"run.output_dir={out}"]))
    try:
        assert trainer.fit()["exit_code"] == 0
    finally:
        trainer.close()
    return out


def summary_json(run_dir) -> dict:
    out = io.StringIO()
    with redirect_stdout(out):
        assert cli.main(["profile-summary", str(run_dir), "--json"]) == 0
    return json.loads(out.getvalue())


def test_profile_steps_write_a_trace_and_the_step_hlo(profiled_run):
    profile = profiled_run / "profile"
    assert list(profile.glob("plugins/profile/*/*.xplane.pb"))
    assert (profile / "train_step.hlo.txt").read_text().startswith("HloModule")
    assert json.loads((profile / "profile.json").read_text())["steps"] == [3, 5]


def test_summary_parts_add_up_to_the_step_time(profiled_run):
    s = summary_json(profiled_run)
    assert s["steps"] == 3 and s["devices"] == 8
    assert set(s["parts_s"]) == set(PARTS)
    assert abs(sum(s["parts_s"].values()) - s["step_time_s"]) <= 0.05 * s["step_time_s"]
    assert s["parts_s"]["matmul"] > 0 and s["parts_s"]["attention"] > 0 and s["parts_s"]["elementwise"] > 0
    # FSDP over 4 gathers weights; gradients are reduced (the CPU lowers reduce-scatter as all-reduce).
    for kind in ("all-gather", "all-reduce"):
        c = s["collectives"][kind]
        assert c["time_s"] > 0 and c["ops"] > 0 and c["bytes"] > 0 and c["gbytes_per_s"] > 0, (kind, c)
    assert s["collectives"]["collective-permute"]["ops"] == 0
    assert s["collectives_s"] == pytest.approx(sum(s["collectives"][k]["time_s"] for k in COLLECTIVE_KINDS))
    # The trace's step time is the loop's step time (metrics.jsonl, same steps), give or take the
    # profiler's own overhead and a busy machine.
    records = [json.loads(line) for line in (profiled_run / "metrics.jsonl").read_text().splitlines()]
    logged = [r["step_time_s"] for r in records if r["step"] in (4, 5)]
    assert 0.3 * min(logged) <= s["step_time_s"] <= 3 * max(logged), (s["step_time_s"], logged)
    assert s["top_ops"] and s["top_ops"][0]["time_s"] >= s["top_ops"][-1]["time_s"]


def test_summary_collective_bytes_match_the_compiled_step(profiled_run):
    """What the trace's collectives moved equals what the HLO says one step moves (inspect's count)."""
    from jaxtrain.inspection import collective_bytes
    s = summary_json(profiled_run)
    want = collective_bytes((profiled_run / "profile" / "train_step.hlo.txt").read_text(), 8)
    for kind in COLLECTIVE_KINDS:
        assert s["collectives"][kind]["bytes"] == pytest.approx(want[kind]["bytes"], rel=1e-6), kind
        assert s["collectives"][kind]["ops"] == pytest.approx(want[kind]["count"]), kind


def test_summary_text_and_missing_trace(profiled_run, tmp_path, capsys):
    assert cli.main(["profile-summary", str(profiled_run)]) == 0
    text = capsys.readouterr().out
    assert "all-gather" in text and "host_wait" in text and "top ops" in text
    assert cli.main(["profile-summary", str(tmp_path)]) == 2
    assert "train.profile_steps" in capsys.readouterr().err


def test_exclusive_time_goes_to_the_innermost_op():
    """A while loop's time is its body ops' time; only the gaps between them stay the loop's."""
    ev = lambda s, e, op: _Event(s, e, op, "m", 0, 0, "t")
    pieces = _exclusive_segments([ev(0, 100, "while"), ev(10, 40, "dot"), ev(50, 90, "fusion"), ev(60, 70, "inner")])
    owned: dict[str, float] = {}
    for a, b, op in pieces:
        owned[op] = owned.get(op, 0) + b - a
    assert owned == {"while": 30, "dot": 30, "fusion": 30, "inner": 10}


def test_hlo_classification():
    hlo = """HloModule m, num_partitions=4
%fused_dot (p0: f32[4,4], p1: f32[4,4]) -> f32[4,4] {
  %p0 = f32[4,4]{1,0} parameter(0)
  %p1 = f32[4,4]{1,0} parameter(1)
  ROOT %d = f32[4,4]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
ENTRY %main (a: f32[4,4]) -> f32[4,4] {
  %a = f32[4,4]{1,0} parameter(0)
  %fusion.1 = f32[4,4]{1,0} fusion(%a, %a), kind=kOutput, calls=%fused_dot, metadata={op_name="jit(f)/mlp/dot_general"}
  %fusion.2 = f32[4,4]{1,0} fusion(%a, %a), kind=kOutput, calls=%fused_dot, metadata={op_name="jit(f)/closed_call/attention/dot_general"}
  %exp.3 = f32[4,4]{1,0} exponential(%a), metadata={op_name="jit(f)/exp"}
  %all-gather-start = (f32[1,4]{1,0}, f32[4,4]{1,0}) all-gather-start(f32[1,4]{1,0} %a), replica_groups={{0,1,2,3}}, dimensions={0}
  %all-gather-done = f32[4,4]{1,0} all-gather-done(%all-gather-start)
  ROOT %cc = f32[4,4]{1,0} custom-call(%a), custom_call_target="__cudnn$fmhaSoftmax"
}
"""
    ops = parse_hlo(hlo, 4)
    assert ops["fusion.1"].category == "matmul" and ops["fusion.2"].category == "attention"
    assert ops["exp.3"].category == "elementwise" and ops["cc"].category == "attention"
    assert ops["all-gather-start"].category == "all-gather" and ops["all-gather-start"].wire_bytes == 64 * 3 / 4
    assert ops["all-gather-done"].wire_bytes == 0  # an async pair is counted once


def test_runs_without_ids_are_split_at_the_largest_gaps():
    from jaxtrain.profiling import _runs_from_gaps
    ev = lambda s, e: _Event(s, e, "op", "m", -1, 0, "t")
    events = [ev(0, 10), ev(11, 20), ev(100, 110), ev(112, 118), ev(300, 310)]
    _runs_from_gaps(events, 3)
    assert [e.run for e in events] == [0, 0, 1, 1, 2]


def test_gpu_1b_script_runs_its_python_part_on_the_cpu(tmp_path):
    """tpu_gpu_setup/gpu/bench_gpu_1b.py: the plan of the real run, and the same code on a shrunken
    model with XLA attention on the CPU (one device), writing its JSON and markdown."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    script = Path(__file__).resolve().parents[1] / "tpu_gpu_setup" / "gpu" / "bench_gpu_1b.py"
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1", JAX_PLATFORMS="cpu")
    plan = subprocess.run([sys.executable, str(script), "--dry-run", "--out", str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert plan.returncode == 0, plan.stderr
    rows = [json.loads(line) for line in plan.stdout.splitlines()]
    assert [r["implementation"] for r in rows] == ["cudnn", "triton", "xla"]
    assert all(r["d_model"] == 2048 and r["seq_len"] == 4096 and r["policy"] == "bf16" for r in rows)
    run = subprocess.run([sys.executable, str(script), "--cpu", "--out", str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    (result,) = json.loads((tmp_path / "gpu_1b.json").read_text())["results"]
    assert result["status"] == "ok" and result["tokens_per_sec"] > 0 and 0 < result["mfu"] <= 1
    parts = result["profile"]["parts_s"]
    assert abs(sum(parts.values()) - result["profile"]["step_time_s"]) <= 0.05 * result["profile"]["step_time_s"]
    assert parts["attention"] > 0 and parts["matmul"] > 0
    assert "| xla | ok |" in (tmp_path / "gpu_1b.md").read_text()

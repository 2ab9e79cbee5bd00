"""train.profile_steps and `jaxtrain profile-summary`: a real trace of a data x fsdp run on 8
simulated devices, split into parts that add up to the step time."""

from __future__ import annotations

import io
import json
import statistics
from contextlib import redirect_stdout
from types import SimpleNamespace

import pytest

from jaxtrain.commands import cli
from jaxtrain.config import load_config
from jaxtrain.observe.profiling import (COLLECTIVE_KINDS, PARTS, StepProfiler, _Event, _exclusive_segments,
                                        events_from_planes, parse_hlo, summarize_events)

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


def test_summary_step_time_is_the_loops_step_time(profiled_run):
    """The trace's step time (window / steps) against the loop's own timer, metrics.jsonl.

    The parts summing to step_time_s proves nothing (summarize gives every instant of the window
    to some part), so the check here is independent of the trace: the median step time the loop
    logged. Median over the steps after the first (compilation): one of them (step 5, the last
    profiled) also holds stop_trace writing the trace (0.3-0.9 s), which the median ignores.
    Bounds 0.5x-2x: on the loaded 2-core machine the ratio measured 0.68-1.16 (steps of 20-70 ms,
    load 2.6-5.3); it is below 1 when the host is the bottleneck, because the host wait after the
    last profiled step is outside the window (at worst (steps-1)/steps = 2/3). A window that ran to
    the end of the trace (stop_trace), device times summed instead of averaged (8x) or a step
    count off by 2x or more falls outside. An off-by-one step count (4/3) is inside the noise of a
    3-step trace here: test_summary_collective_bytes_match_the_compiled_step (ops per step exact)
    and test_summary_attribution_on_synthetic_events (exact window) catch that.
    """
    s = summary_json(profiled_run)
    assert s["steps"] == 3 and s["devices"] == 8
    assert set(s["parts_s"]) == set(PARTS)
    assert s["parts_s"]["matmul"] > 0 and s["parts_s"]["attention"] > 0 and s["parts_s"]["elementwise"] > 0
    # FSDP over 4 gathers weights; gradients are reduced (the CPU lowers reduce-scatter as all-reduce).
    for kind in ("all-gather", "all-reduce"):
        c = s["collectives"][kind]
        assert c["time_s"] > 0 and c["ops"] > 0 and c["bytes"] > 0 and c["gbytes_per_s"] > 0, (kind, c)
    assert s["collectives"]["collective-permute"]["ops"] == 0
    assert s["collectives_s"] == pytest.approx(sum(s["collectives"][k]["time_s"] for k in COLLECTIVE_KINDS))
    records = [json.loads(line) for line in (profiled_run / "metrics.jsonl").read_text().splitlines()]
    logged = {r["step"]: r["step_time_s"] for r in records if r["step"] >= 2}
    assert sorted(logged) == [2, 3, 4, 5, 6]
    median = statistics.median(logged.values())
    assert 0.5 * median <= s["step_time_s"] <= 2.0 * median, (s["step_time_s"], logged)
    assert s["top_ops"] and s["top_ops"][0]["time_s"] >= s["top_ops"][-1]["time_s"]


def test_summary_collective_bytes_match_the_compiled_step(profiled_run):
    """What the trace's collectives moved equals what the HLO says one step moves (inspect's count)."""
    from jaxtrain.observe.inspection import collective_bytes
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


def _synthetic_run(offset: float, run: int, line: tuple[str, str]) -> list[_Event]:
    """One execution of module "m" on device 0, 100 ns long from `offset`:

        fusion.1 [0, 10)   gap [10, 15)   dot.2 [15, 20)   gap [20, 30)   fusion.3 [30, 40)

    the first gap precedes any dot of the execution (idle); the second follows dot.2 (on the CPU
    its async tail: a plain dot's event ends when its work is handed to the thread pool).
    """
    ev = lambda s, e, op: _Event(offset + s, offset + e, op, "m", run, 0, line)
    return [ev(0, 10, "fusion.1"), ev(15, 20, "dot.2"), ev(30, 40, "fusion.3")]


@pytest.mark.parametrize("host_trace", [True, False], ids=["cpu_host_plane", "device_plane"])
def test_summary_attribution_on_synthetic_events(host_trace):
    """Exact parts from known events: executions at 0 and 60, each 40 ns of ops with a gap before
    and after its dot, host wait between them; an execution cut short by the trace's start (-20)
    and one by its end (120) are left out, and the window is the two complete ones: [0, 100)."""
    line = ("/host:CPU", "tf_XLAEigen/1") if host_trace else ("/device:GPU:0", "XLA Ops")
    events = _synthetic_run(0, 0, line) + _synthetic_run(60, 1, line)
    events += [_Event(-20, -12, "fusion.3", "m", 7, 0, line), _Event(120, 130, "fusion.1", "m", 2, 0, line)]
    events += [_Event(-100, -90, "copy", "helper", 0, 0, line)]  # another module, with less op time: not the step
    s = summarize_events(events, {}, {"steps": [3, 4]})
    ns = 1e-9  # per step per device, in seconds
    assert s["module"] == "m" and s["steps"] == 2 and s["devices"] == 1
    assert s["step_time_s"] == pytest.approx(100 / 2 * ns)
    parts = {k: v for k, v in s["parts_s"].items() if v}
    if host_trace:  # the gap after dot.2 is dot.2's async tail (matmul), the one before it idle
        want = {"elementwise": 20, "matmul": 5 + 10, "idle": 5, "host_wait": 20 / 2}
    else:  # a device's ops are synchronous: both gaps inside the execution are idle
        want = {"elementwise": 20, "matmul": 5, "idle": 5 + 10, "host_wait": 20 / 2}
    assert parts == pytest.approx({k: v * ns for k, v in want.items()})
    assert s["sum_of_parts_s"] == pytest.approx(s["step_time_s"])
    top = {o["op"]: o["time_s"] for o in s["top_ops"]}
    assert top["dot.2"] == pytest.approx((15 if host_trace else 5) * ns)


def _plane(name: str, lines: dict[str, list[tuple[int, int, str, dict]]]) -> SimpleNamespace:
    """A look-alike of jax.profiler.ProfileData's plane: lines of (start_ns, end_ns, name, stats)."""
    return SimpleNamespace(name=name, lines=[
        SimpleNamespace(name=line, events=[SimpleNamespace(start_ns=a, end_ns=b, name=n, stats=list(st.items()))
                                           for a, b, n, st in events])
        for line, events in lines.items()])


def test_host_plane_ops_are_not_counted_beside_device_planes():
    """On a GPU the host threads that launch kernels may carry hlo_op/device_ordinal stats; with a
    device plane in the trace only the device's events are ops (else each op counts twice and
    launch time fills the device's waits). Without one (the CPU) the host plane's are the ops."""
    launch = {"hlo_op": "fusion.1", "hlo_module": "m", "device_ordinal": 0, "run_id": 5}
    host = _plane("/host:CPU", {"python": [(0, 3, "launch", launch)]})
    gpu = _plane("/device:GPU:0", {"XLA Modules": [(10, 50, "m(1)", {})],
                                   "XLA Ops": [(10, 30, "fusion.1", {"hlo_op": "fusion.1"}), (30, 50, "dot.2", {})],
                                   "Stream #7": [(10, 30, "kernel", {"hlo_op": "fusion.1"})]})
    events = events_from_planes([host, gpu])
    assert [(e.start, e.op, e.module, e.run, e.device, e.line[0]) for e in events] == [
        (10, "fusion.1", "m", 0, 0, "/device:GPU:0"), (30, "dot.2", "m", 0, 0, "/device:GPU:0")]
    (cpu,) = events_from_planes([host])
    assert (cpu.op, cpu.module, cpu.run, cpu.device) == ("fusion.1", "m", 5, 0)


def test_profiler_traces_local_paths_only():
    """paths.is_remote decides: a URL gets no trace, a local path that contains "://" does."""
    assert not StepProfiler([1, 2], "gs://bucket/run/profile").enabled
    assert not StepProfiler([1, 2], "s3://bucket/run/profile").enabled
    assert StepProfiler([1, 2], "/tmp/odd://name/profile").enabled
    assert not StepProfiler([], "/tmp/run/profile").enabled


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
    from jaxtrain.observe.profiling import _runs_from_gaps
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
    script = Path(__file__).resolve().parents[2] / "tpu_gpu_setup" / "gpu" / "bench_gpu_1b.py"
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

"""The console: short lines a person reads (start, progress, checkpoints, preemption), every detail
still in events.jsonl; the MFU denominator measured once per machine and read back after that."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import jax
import pytest
from helpers import TINY

from jaxtrain.runtime import env
from jaxtrain.config import load_config
from jaxtrain.observe import throughput
from jaxtrain.observe.runlog import RunLog, read_log
from jaxtrain.trainer import Trainer

SMALL = ["model.num_layers=1", "model.d_model=32", "model.mlp_dim=64", "data.global_batch_size=8", "data.seq_len=32"]

# A `start` event as the trainer writes it: every detail, most of which the console leaves out.
START = {"devices": 1, "processes": 1, "hosts": ["vm"], "train_steps": 300,
         "mesh": {"data": 1, "stage": 1, "fsdp": 1, "expert": 1, "context": 1, "tensor": 1},
         "pipeline": {"schedule": "none", "stages": 1, "microbatches": 1, "repeats": 1, "layers_per_stage": 2,
                      "iterations": 1, "bubble": 0.0, "passes_per_step": 1},
         "context": None, "params": 647488, "attention": "xla", "compile_s": 5.512, "started_at": 1.7e9,
         "entropy_floor": 1.12, "peak_flops_per_device": 1.3e11, "peak_source": "measured:cpu matmul",
         "version": "0.1.0", "xla_flags": ["--xla_cpu_experimental_ynn_fusion_type=dot,eltwise,reduce",
                                           "--xla_cpu_prefer_vector_width=512"],
         "host_malloc": {"mmap_max": 0, "trim_threshold": 1073741824, "top_pad": 67108864}}
RECORD = {"step": 50, "loss": 6.03521, "grad_norm": 0.7071, "learning_rate": 3e-4, "tokens_per_sec": 10607.2,
          "mfu": 0.2331, "step_time_s": 0.1, "eval_loss": 6.1773, "skipped": False}


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def lines(console: io.StringIO) -> list[str]:
    return console.getvalue().splitlines()


# ----------------------------------------------------------------------------- what each line says


def test_start_line_is_short_and_events_keep_every_detail(tmp_path):
    console = io.StringIO()
    log = RunLog(str(tmp_path), console=console)
    log.event("start", 0, **START)
    log.close()
    [line] = lines(console)
    assert len(line) < 200, line
    assert line.startswith("[start] 647,488 params, 1 device (mesh data=1)"), line
    assert "compiled in 5.5 s" in line and "steps 0 -> 300" in line and "resumed" not in line, line
    assert "loss floor 1.120" in line  # the Markov demo's target, once in the line a person reads
    [event] = read_log(tmp_path, "events.jsonl")
    assert {k: event[k] for k in START} == START  # nothing left out of the log


def test_start_line_of_a_resumed_run_and_a_larger_mesh(tmp_path):
    console = io.StringIO()
    log = RunLog(str(tmp_path), console=console)
    log.event("start", 134, **{**START, "devices": 8, "mesh": {**START["mesh"], "data": 2, "fsdp": 4}})
    [line] = lines(console)
    assert "8 devices (mesh data=2 fsdp=4)" in line and "steps 134 -> 300, resumed from step 134" in line, line


def test_progress_line_has_total_lr_grad_norm_and_eta(tmp_path, monkeypatch):
    from jaxtrain.observe import console as console_module
    now = [100.0]
    monkeypatch.setattr(console_module, "time", SimpleNamespace(monotonic=lambda: now[0]))
    console = io.StringIO()
    log = RunLog(str(tmp_path), console=console)
    log.event("start", 0, **START)
    now[0] += 10.0  # 50 steps in 10 s: 250 steps to go take 50 s
    log.metrics(RECORD)
    assert lines(console)[-1] == \
        "step  50/300  loss 6.0352  lr 3.0e-04  grad 0.707  tok/s 10,607  MFU 23.3%  eta 50s  eval 6.1773"
    now[0] += 26.0  # 100 steps in 36 s: 200 to go take 72 s
    log.metrics({**RECORD, "step": 100, "skipped_steps": 2})
    assert lines(console)[-1].endswith("  eta 1m12s  eval 6.1773  skipped 2"), lines(console)[-1]


def test_checkpoint_saves_and_preemption_are_shown(tmp_path):
    console = io.StringIO()
    log = RunLog(str(tmp_path), console=console)
    log.event("start", 0, **START)
    log.event("checkpoint_saved", 50, blocked_s=0.5, commit_s=0.8, bytes=1510301, deleted=[])
    log.event("signal", 134, signal="SIGINT")
    log.event("checkpoint_saved", 134, blocked_s=0.5, commit_s=0.8, bytes=1510301, deleted=[])
    log.event("preempted", 134, exit_code=75, skipped_steps=0)
    out = lines(console)[1:]
    assert out[0] == "[checkpoint] saved step 50"
    assert out[1].startswith("[signal] SIGINT at step 134"), out[1]
    assert out[2] == "[checkpoint] saved step 134"
    assert out[3] == "[preempted] saved step 134; run the same command to resume (exit 75 = restart me)", out[3]
    kinds = [e["kind"] for e in read_log(tmp_path, "events.jsonl")]
    assert kinds == ["start", "checkpoint_saved", "signal", "checkpoint_saved", "preempted"]


def test_preemption_without_a_new_checkpoint_names_the_last_one(tmp_path):
    console = io.StringIO()
    log = RunLog(str(tmp_path), console=console)
    log.event("checkpoint_saved", 100)
    log.event("preempted", 134, exit_code=75)
    assert lines(console)[-1].startswith("[preempted] at step 134, the last checkpoint is step 100; run the same"), \
        lines(console)


def test_other_events_stay_readable(tmp_path):
    console = io.StringIO()
    log = RunLog(str(tmp_path), console=console)
    log.event("straggler", 7, processes=[1], factor=1.734567, note=None, hosts={f"host-{i}": i for i in range(40)})
    [line] = lines(console)
    assert line.startswith("[straggler] step 7 processes=[1] factor=1.735 hosts={") and "note" not in line, line
    assert len(line) < 150, line  # a long value is cut short on the console, whole in events.jsonl
    assert len(read_log(tmp_path, "events.jsonl")[0]["hosts"]) == 40


def test_a_terminal_gets_the_progress_line_rewritten_in_place(tmp_path):
    console = Tty()
    log = RunLog(str(tmp_path), console=console)
    log.event("start", 0, **START)
    log.metrics(RECORD)
    log.metrics({**RECORD, "step": 60})
    log.event("checkpoint_saved", 60)
    text = console.getvalue()
    assert "\r\033[Kstep  50/300" in text and "\r\033[Kstep  60/300" in text
    assert "\r\033[K[checkpoint] saved step 60\n" in text
    assert text.count("\n") == 2  # the start and checkpoint lines stay; progress lines replace each other


# ----------------------------------------------------------------------------- a real run


@pytest.fixture
def peak_cache(tmp_path, monkeypatch) -> Path:
    """A peak cache of this test's own (never the user's ~/.cache)."""
    path = tmp_path / "cache" / "peak_flops.json"
    monkeypatch.setenv(env.PEAK_CACHE, str(path))
    return path


def tiny(tmp_path: Path, *extra: str):
    return load_config(TINY, [f"run.output_dir={tmp_path / 'run'}", "checkpoint.compilation_cache_dir=null", *SMALL,
                              *extra])


def test_fit_prints_by_default_and_peak_is_measured_once(tmp_path, peak_cache, capsys, monkeypatch):
    cfg = tiny(tmp_path, "train.steps=4", "train.log_every=2", "checkpoint.every_steps=2")
    trainer = Trainer(cfg, devices=jax.devices()[:1])  # no console= : a notebook's fit() shows progress
    trainer.fit()
    trainer.close()
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("[start] ") and "1 device" in out[0] and "compiled in" in out[0], out
    progress = [line for line in out if line.startswith("step ")]
    assert [line.split()[1] for line in progress] == ["2/4", "4/4"], out
    assert all(" lr " in line and " grad " in line and " eta " in line for line in progress), progress
    assert "[checkpoint] saved step 2" in out and "[checkpoint] saved step 4" in out, out
    assert out[-1].startswith("[done] step 4"), out
    first = trainer.peak_flops, trainer.peak_source
    assert first[1] == "measured:cpu matmul (measured now, cached)" and peak_cache.exists()

    # A second start on this machine reads the peak back: the same denominator, said to be cached.
    def measure(*args, **kwargs):
        raise AssertionError("the peak was measured again")

    monkeypatch.setattr(throughput, "measure_matmul_peak", measure)
    again = Trainer(cfg, write_files=False, devices=jax.devices()[:1])
    assert again.peak_flops == first[0] and again.peak_source.startswith("measured:cpu matmul (cached 2"), \
        again.peak_source
    again.close()


def test_a_corrupt_or_unwritable_peak_cache_never_stops_a_run(tmp_path, peak_cache):
    peak_cache.parent.mkdir()
    peak_cache.write_text('{"peaks": {"cpu": {"flops": "many"')  # torn, and not what we write
    cfg = tiny(tmp_path, "train.steps=1")
    trainer = Trainer(cfg, write_files=False, devices=jax.devices()[:1])
    assert trainer.peak_flops > 0 and trainer.peak_source == "measured:cpu matmul (measured now, cached)"
    trainer.close()
    assert len(json.loads(peak_cache.read_text())["peaks"]) == 1  # measured and written over
    # A cache under a file, not a folder: nothing can be written; the measured number is used.
    device = jax.devices()[0]
    peak, source = throughput.peak_flops_per_device(device, "fp32", cache_file=str(peak_cache / "sub" / "x.json"))
    assert peak > 0 and source == "measured:cpu matmul (measured now, not cached)"


def test_peak_cache_key_names_the_machine_dtype_and_flags_but_not_the_device_count():
    device = jax.devices()[0]
    a = throughput.peak_cache_key(device, "fp32", ["--xla_cpu_prefer_vector_width=512",
                                                   "--xla_force_host_platform_device_count=8"])
    assert a == throughput.peak_cache_key(device, "fp32", ["--xla_force_host_platform_device_count=1",
                                                           "--xla_cpu_prefer_vector_width=512"])
    assert a != throughput.peak_cache_key(device, "bf16", ["--xla_cpu_prefer_vector_width=512"])
    assert a != throughput.peak_cache_key(device, "fp32", ["--xla_cpu_prefer_vector_width=256"])


def test_peak_cache_file_honors_xdg_and_the_override():
    assert env.peak_cache_file({"HOME": "/home/u"}) == "/home/u/.cache/jaxtrain/peak_flops.json"
    assert env.peak_cache_file({"HOME": "/home/u", "XDG_CACHE_HOME": "/c"}) == "/c/jaxtrain/peak_flops.json"
    assert env.peak_cache_file({env.PEAK_CACHE: "/p.json", "XDG_CACHE_HOME": "/c"}) == "/p.json"
    assert env.peak_cache_file({env.PEAK_CACHE: ""}) is None  # measure at every start


@pytest.mark.slow
def test_ctrl_c_says_what_was_saved_and_how_to_resume(tmp_path):
    out = tmp_path / "run"
    # A slowed host (50 ms per step, same numerics) so the signal lands mid-run.
    command = [sys.executable, "-m", "jaxtrain", "train", "--config", TINY, f"run.output_dir={out}",
               "checkpoint.compilation_cache_dir=null", *SMALL, "train.steps=400", "train.log_every=1",
               "checkpoint.every_steps=1000", "chaos.slow_seconds=0.05", "--cpu-devices", "1"]
    environ = {**os.environ, env.PEAK_CACHE: str(tmp_path / "peak_flops.json")}
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environ)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if (out / "metrics.jsonl").exists() and len((out / "metrics.jsonl").read_text().splitlines()) >= 3:
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 75, stderr[-3000:]
    stopped = next(e for e in read_log(out, "events.jsonl") if e["kind"] == "preempted")["step"]
    assert f"[checkpoint] saved step {stopped}" in stdout.splitlines(), stdout[-2000:]
    assert stdout.splitlines()[-1] == (f"[preempted] saved step {stopped}; run the same command to resume "
                                       "(exit 75 = restart me)"), stdout[-2000:]

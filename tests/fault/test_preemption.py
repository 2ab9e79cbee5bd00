"""Stopping together without per-step host synchronisation: signal flags, agreed decisions at sync
points only, the same collective path on every process at start-up.

Run as a script (`python tests/fault/test_preemption.py worker PID PORT DIR`) it is one process of the
two-process job of `test_no_cross_process_call_on_ordinary_steps`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the workers run this file
from helpers import TINY, free_port  # noqa: E402

SMALL = ["model.num_layers=1", "model.d_model=32", "model.mlp_dim=64", "data.global_batch_size=4", "data.seq_len=16",
         "train.log_every=1"]


def test_signal_handler_only_sets_a_flag(monkeypatch):
    """No I/O in the handler: a SIGTERM that lands while the main thread writes to a stream must not
    write to it again (a reentrant write raises and would lose the emergency checkpoint)."""
    from jaxtrain.fault.preemption import StopSignals

    class Untouchable:
        def write(self, *a):
            raise AssertionError("the signal handler wrote to a stream")

        flush = write

    monkeypatch.setattr(sys, "stdout", Untouchable())
    monkeypatch.setattr(sys, "stderr", Untouchable())
    with StopSignals() as signals:
        os.kill(os.getpid(), signal.SIGTERM)
        assert signals.requested == "SIGTERM"
        with pytest.raises(KeyboardInterrupt):  # a second signal gives up waiting
            os.kill(os.getpid(), signal.SIGINT)
    monkeypatch.undo()
    assert signal.getsignal(signal.SIGTERM) is not signals._handle  # handlers restored on exit


def test_one_process_decides_at_every_step_without_any_collective():
    import jax

    from jaxtrain.config import MeshConfig
    from jaxtrain.fault.preemption import HostSync
    from jaxtrain.parallel.mesh import build_mesh
    sync = HostSync(build_mesh(MeshConfig(), jax.devices()[:1]), every=5, process_count=1)
    assert sync.poll(1, stop_requested=False, save_due=True).save
    assert sync.poll(2, stop_requested=True, save_due=False).stop
    assert sync.calls == []


# ----------------------------------------------------------------------------- two processes


def _worker(pid: int, port: int, out: str) -> None:
    """One process of the job: train with time-based saves always due, recording every cross-process
    call the main thread makes, by step."""
    os.environ.update({"JAXTRAIN_COORDINATOR": f"127.0.0.1:{port}", "JAXTRAIN_NUM_PROCESSES": "2",
                       "JAXTRAIN_PROCESS_ID": str(pid)})
    from jaxtrain.runtime import distributed
    distributed.initialize()
    from jaxtrain.checkpoint import checkpointer
    from jaxtrain.runtime import multihost
    from jaxtrain.config import load_config
    from jaxtrain.trainer import Trainer

    cfg = load_config(TINY, [f"run.output_dir={out}", "checkpoint.compilation_cache_dir=null", *SMALL,
                             "train.steps=12", "train.host_sync_every=4", "checkpoint.every_minutes=0.000001",
                             "checkpoint.every_steps=0", "checkpoint.async_save=false"])
    trainer = Trainer(cfg)
    calls: list[tuple[str, int]] = []
    real_client = multihost.client

    class Recorded:
        """The coordination-service client, recording the main thread's calls by training step."""

        def __init__(self, client):
            self._client = client

        def __getattr__(self, name):
            method = getattr(self._client, name)

            def call(*args, **kwargs):
                if threading.current_thread() is threading.main_thread():
                    calls.append((name, trainer._host_step))
                return method(*args, **kwargs)
            return call

    multihost.client = lambda: Recorded(real_client())
    checkpointer._client = multihost.client
    trainer.fit()
    trainer.close()
    print("RESULT " + json.dumps({"kv": calls, "reductions": trainer.host_sync.calls}), flush=True)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_no_cross_process_call_on_ordinary_steps(tmp_path):
    """Time-based saves are due at every step here; still, the processes talk only at sync steps
    (every 4th: one tiny all-reduce), on the step after (reading it; the agreed save's barriers), and
    at the end (and before the first step, at the start). Formerly every step asked process 0
    through the key-value store."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1", "JAX_PLATFORMS": "cpu"}
    port = free_port()
    procs = [subprocess.Popen([sys.executable, __file__, "worker", str(pid), str(port), str(tmp_path / "run")],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for pid in (0, 1)]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out[-3000:]
    for out in outputs:
        result = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])
        assert result["reductions"] == [4, 8, 12]
        steps_with_calls = {step for _, step in result["kv"]}
        assert steps_with_calls, "the saves' barriers were not recorded: is the recorder in place?"
        # Step 0 is the start, not an ordinary step (the preflight's matmul turns use host barriers).
        assert steps_with_calls - {0} <= {5, 9, 12}, result["kv"]
    saved = [json.loads(line)["step"] for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()
             if json.loads(line)["kind"] == "checkpoint_saved"]
    assert saved == [5, 9, 12]  # the agreed time-based saves, then the final one


def test_every_start_asks_for_the_latest_checkpoint_and_agrees_on_rollbacks(tmp_path, monkeypatch):
    """The latest-step and rollback-log agreements are collective calls: every process must make
    them on every start, whether or not it sees a checkpoints/ directory (formerly only a process
    that saw it asked, and waited for an answer process 0 never gave)."""
    import jax

    from jaxtrain.checkpoint.checkpointer import Checkpointer
    from jaxtrain.config import load_config
    from jaxtrain.trainer import Trainer

    asked = []
    agree = Checkpointer.agree
    monkeypatch.setattr(Checkpointer, "agree", lambda self, what, decide: asked.append(what) or agree(self, what, decide))
    latest = Checkpointer.latest_step
    monkeypatch.setattr(Checkpointer, "latest_step", lambda self, **kw: asked.append("latest") or latest(self, **kw))
    cfg = load_config(TINY, [*SMALL, f"run.output_dir={tmp_path / 'run'}", "checkpoint.compilation_cache_dir=null"])
    trainer = Trainer(cfg, devices=jax.devices()[:1])
    trainer.close()
    assert not (tmp_path / "run" / "checkpoints").exists()  # a fresh run: nothing on disk to look at
    assert asked == ["rollbacks", "latest"]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_fresh_start_with_a_late_process_takes_the_same_collective_path(tmp_path):
    """Process 1 starts 4 s late, after process 0 has long been training. Every process must ask for
    the latest checkpoint whatever the filesystem shows by then (formerly only a process that saw
    checkpoints/ asked, and waited for an answer process 0 never gave)."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update({"JAX_PLATFORMS": "cpu", "PYTHONPATH": os.pathsep.join(sys.path)})
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "jaxtrain", "launch", "--num-processes", "2", "--cpu-devices", "1",
                        "--max-restarts", "0", "--", "train", "--config", TINY, *SMALL, f"run.output_dir={out}",
                        "checkpoint.compilation_cache_dir=null", "train.steps=4", "checkpoint.every_steps=2",
                        "chaos.start_delay_s=4", "chaos.slow_process=1", "checkpoint.barrier_timeout_s=30"],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    kinds = [json.loads(line)["kind"] for line in (out / "events.jsonl").read_text().splitlines()]
    assert kinds[:2] == ["preflight", "start"] and kinds[-1] == "done" and "restart" not in kinds


if __name__ == "__main__":
    if sys.argv[1] == "worker":
        _worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])

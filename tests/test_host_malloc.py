"""jaxtrain/runtime/host_malloc.py: glibc keeps XLA:CPU's freed buffers, so a step stops paying page faults."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxtrain.runtime import host_malloc

REPO = Path(__file__).resolve().parents[1]

# A scanned dropless MoE step: its temporaries are over glibc's 32 MiB ceiling for serving from the
# heap, so with glibc's defaults they are mapped afresh at every step (~10,000 page faults per step
# on a 2-core EPYC); with the settings they stay (a few dozen). A step that runs on a thread whose
# malloc arena has not held the buffer yet pays its first touches once (under load, as on CI beside
# another test: once or twice in 300 steps, by step 25), so the mean is taken over 60 steps, where
# one such step adds ~170.
MEASURED_STEPS = 60
STEPS = """
import json, os, resource, sys, tempfile
MEASURED_STEPS = int(sys.argv[1])
from jaxtrain.runtime import host_malloc
done = host_malloc.retain_freed_memory()
from jaxtrain.runtime.xla_cpu import cpu_xla_flags, with_flags
os.environ["XLA_FLAGS"] = with_flags(os.environ.get("XLA_FLAGS", ""), cpu_xla_flags())
import jax
from jaxtrain.config import load_config
from jaxtrain.trainer import Trainer
cfg = load_config("configs/moe-tiny.yaml", [f"run.output_dir={tempfile.mkdtemp()}", "model.scan_layers=true",
                  "checkpoint.every_steps=0", "checkpoint.save_at_end=false", "train.steps=1000"])
trainer = Trainer(cfg, write_files=False, devices=jax.devices()[:1])
for _ in range(4):
    trainer.step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(MEASURED_STEPS):
    trainer.step()
print(json.dumps({"done": done,
                  "faults_per_step": (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / MEASURED_STEPS}))
"""


def _faults(env: dict) -> dict:
    env = {**{k: v for k, v in os.environ.items() if k not in host_malloc.USER_VARIABLES}, **env,
           "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    r = subprocess.run([sys.executable, "-c", STEPS, str(MEASURED_STEPS)], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_a_training_step_stops_paying_page_faults_for_its_own_buffers():
    glibc = _faults({"JAXTRAIN_HOST_MALLOC": "default"})
    kept = _faults({})
    assert glibc["done"] == {"left_alone": "JAXTRAIN_HOST_MALLOC=default"}
    assert kept["done"] == {"mmap_max": 0, "trim_threshold": 1 << 30, "top_pad": 64 << 20}
    if glibc["faults_per_step"] < 2000:
        pytest.skip(f"glibc's defaults cost only {glibc['faults_per_step']:.0f} page faults per step here")
    assert kept["faults_per_step"] < glibc["faults_per_step"] / 10, (glibc, kept)


@pytest.mark.parametrize("env, reason", [
    ({"MALLOC_TOP_PAD_": "0"}, "the user's own malloc settings"),
    ({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"}, "the user's own malloc settings"),
    ({"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"}, "another allocator is preloaded"),
    ({"JAXTRAIN_HOST_MALLOC": "default"}, "JAXTRAIN_HOST_MALLOC=default"),
])
def test_the_users_own_allocator_settings_are_left_alone(monkeypatch, env, reason):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert host_malloc.reason_to_leave_alone() == reason


def test_settings_apply_once_and_are_what_the_start_event_records(monkeypatch):
    for k in (*host_malloc.USER_VARIABLES, "GLIBC_TUNABLES", "LD_PRELOAD", "JAXTRAIN_HOST_MALLOC"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(host_malloc, "_applied", None)
    assert host_malloc.applied() is None
    first = host_malloc.retain_freed_memory()
    assert first == {"mmap_max": 0, "trim_threshold": 1 << 30, "top_pad": 64 << 20} == host_malloc.applied()
    monkeypatch.setenv("MALLOC_TOP_PAD_", "0")  # later changes do not re-run it
    assert host_malloc.retain_freed_memory() == first
    env = host_malloc.env_equivalent()
    assert env == {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 30), "MALLOC_TOP_PAD_": str(64 << 20)}

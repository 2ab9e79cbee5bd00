"""GPU counters in the run-time health check: the real `pynvml` bindings and observe/nvml.py over a
stand-in libnvidia-ml.so.1 (tests/observe/fake_nvml.c, compiled here: this machine has no GPU), the
warnings the health check raises from them, their Prometheus series, and the matmul re-measure.

The stand-in replaces the driver's library only; the bindings, the reader, the health check, the
exporter and the trainer's wiring are the shipped code.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pynvml = pytest.importorskip("pynvml")  # nvidia-ml-py: a dev dependency

from test_prometheus import SMALL, TINY, free_ports, scrape, value  # noqa: E402

from jaxtrain.observe.health import MIN_HISTORY, Health  # noqa: E402
from jaxtrain.observe.nvml import Nvml, throttle_names, visible_selection  # noqa: E402
from jaxtrain.observe.prometheus import Exporter  # noqa: E402

HERE = Path(__file__).resolve().parent
FAKE_ENV = ("FAKE_NVML_COUNT", "FAKE_NVML_BAD", "FAKE_NVML_ECC_PER_READ", "FAKE_NVML_THROTTLE",
            "FAKE_NVML_REMAP_PENDING", "FAKE_NVML_NO_ECC", "CUDA_VISIBLE_DEVICES")


@pytest.fixture(scope="session")
def fake_nvml_dir(tmp_path_factory) -> Path:
    """A directory holding the stand-in libnvidia-ml.so.1."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the stand-in NVML library (.ci/run installs gcc)")
    out = tmp_path_factory.mktemp("fake_nvml")
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(out / "libnvidia-ml.so.1"), str(HERE / "fake_nvml.c")],
                   check=True)
    return out


@pytest.fixture
def fake_nvml(fake_nvml_dir, monkeypatch):
    """pynvml bound to the stand-in (as if it had loaded the driver's library), the GPUs' state cleared."""
    for k in FAKE_ENV:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(pynvml, "nvmlLib", ctypes.CDLL(str(fake_nvml_dir / "libnvidia-ml.so.1")))
    monkeypatch.setattr(pynvml, "_nvmlGetFunctionPointer_cache", {})
    return monkeypatch


def test_visible_devices_are_indices_or_uuids():
    assert visible_selection(None) is None and visible_selection(" ") is None
    assert visible_selection("0,2") == [0, 2]
    assert visible_selection("GPU-8a1b,1") == ["GPU-8a1b", 1]
    assert visible_selection("1,x,2") == [1]  # CUDA stops at the first entry it cannot read
    assert throttle_names(0x04 | 0x01) == [] and throttle_names(0x40 | 0x80) == ["hw_thermal", "hw_power_brake"]


def test_counters_are_read_through_the_real_bindings(fake_nvml):
    fake_nvml.setenv("FAKE_NVML_BAD", "1")
    fake_nvml.setenv("FAKE_NVML_ECC_PER_READ", "2")
    fake_nvml.setenv("FAKE_NVML_THROTTLE", str(0x40 | 0x04))
    gpus, why = Nvml.open()
    assert gpus is not None, why
    first, second = gpus.read(), gpus.read()
    assert sorted(first) == [0, 1] and first[0]["uuid"] == "GPU-fake-0"
    assert first[0] == {"uuid": "GPU-fake-0", "ecc_uncorrected": 0, "ecc_corrected": 3, "remap_pending": 0,
                        "remap_failure": 0, "throttle": 0x04, "temperature_c": 45}
    assert (first[1]["ecc_uncorrected"], second[1]["ecc_uncorrected"]) == (2, 4)
    assert first[1]["throttle"] == 0x44 and first[1]["temperature_c"] == 91
    gpus.close()


@pytest.mark.parametrize("visible, picked", [("1", [1]), ("GPU-fake-1,0", [1, 0]), ("5", None)])
def test_cuda_visible_devices_pick_the_gpus(fake_nvml, visible, picked):
    fake_nvml.setenv("CUDA_VISIBLE_DEVICES", visible)
    gpus, why = Nvml.open()
    if picked is None:
        assert gpus is None and why == "NVML shows no GPU to this process"
    else:
        assert [index for index, _, _ in gpus.gpus] == picked and list(gpus.read()) == picked


def test_counters_a_gpu_does_not_support_are_left_out(fake_nvml):
    fake_nvml.setenv("FAKE_NVML_NO_ECC", "1")
    gpus, _ = Nvml.open()
    got = gpus.read()[0]
    assert "ecc_uncorrected" not in got and "ecc_corrected" not in got and got["temperature_c"] == 45
    h = Health(1, lambda *a, **k: None, memory=lambda: None, gpus=gpus)
    assert h.check(1)["warnings"] == []


def test_without_a_driver_nvml_is_off_with_one_reason(monkeypatch):
    if ctypes.util.find_library("nvidia-ml"):
        pytest.skip("this machine has the real NVML")
    monkeypatch.setattr(pynvml, "nvmlLib", None)
    monkeypatch.setattr(pynvml, "_nvmlGetFunctionPointer_cache", {})
    gpus, why = Nvml.open()
    assert gpus is None and why.startswith("NVML: ") and "Library Not Found" in why, why


def test_health_warns_when_ecc_counts_up_a_remap_waits_or_the_gpu_throttles(fake_nvml):
    """gpu_memory once uncorrected errors rise during the run (not for errors from before it);
    gpu_throttle while a hardware reason is set; the series carry the GPU; the event names it."""
    fake_nvml.setenv("FAKE_NVML_BAD", "1")
    events: list[dict] = []
    fake_nvml.setenv("FAKE_NVML_ECC_PER_READ", "7")
    gpus, _ = Nvml.open()
    gpus.read()  # 7 errors from before the run, and 7 more by the health check's first read
    h = Health(1, lambda kind, step, **d: events.append(d), memory=lambda: None, gpus=gpus)
    assert h.check(1)["warnings"] == []  # the baseline, whatever the count before it
    fake_nvml.setenv("FAKE_NVML_ECC_PER_READ", "5")  # 5 more at each read
    d = h.check(2)
    assert d["warnings"] == ["gpu_memory"] and d["gpus"]["1"]["ecc_uncorrected_in_run"] == 5, d
    assert d["gpus"]["0"]["ecc_uncorrected_in_run"] == 0 and events[-1] == d
    fake_nvml.setenv("FAKE_NVML_THROTTLE", str(0x08))
    d = h.check(3)
    assert d["warnings"] == ["gpu_memory", "gpu_throttle"] and d["gpus"]["1"]["throttle_reasons"] == ["hw_slowdown"]
    port = free_ports(1)
    x = Exporter(port=port, addr="127.0.0.1", health=h).start()
    try:
        m = scrape(port)
        assert value(m, "jaxtrain_health_warning", check="gpu_throttle") == 1
        assert value(m, "jaxtrain_health_gpu_ecc_uncorrected_in_run", gpu="1", uuid="GPU-fake-1") == 10
        assert value(m, "jaxtrain_health_gpu_ecc_uncorrected_in_run", gpu="0") == 0
        assert value(m, "jaxtrain_health_gpu_clock_event_reasons", gpu="1") == 8
    finally:
        x.close()

    fake_nvml.setenv("FAKE_NVML_ECC_PER_READ", "0")
    fake_nvml.setenv("FAKE_NVML_THROTTLE", "0")
    fake_nvml.setenv("FAKE_NVML_REMAP_PENDING", "1")
    assert h.check(4)["warnings"] == ["gpu_memory"]  # a pending remap (and the errors seen earlier)


def test_the_matmul_check_warns_when_the_device_slows():
    figures = iter([10.0, 10.5, 9.8, 10.1, 6.5])
    h = Health(1, lambda *a, **k: None, memory=lambda: None, matmul=lambda: next(figures))
    h.matmul_preflight = 12.0
    for step in range(1, MIN_HISTORY + 1):
        assert h.check(step)["warnings"] == []
    d = h.check(MIN_HISTORY + 1)  # 10.1 against the median 10.0
    assert d["warnings"] == [] and d["matmul_ratio"] == pytest.approx(1.01)
    d = h.check(MIN_HISTORY + 2)  # 6.5: 0.64 of the median of the earlier checks
    assert d["warnings"] == ["matmul"] and d["matmul_ratio"] == pytest.approx(6.5 / 10.05, abs=1e-4)  # rounded in the event
    assert d["matmul_preflight_ratio"] == pytest.approx(6.5 / 12.0, abs=1e-4)


def test_a_training_run_reports_gpu_counters_and_its_matmul_figure(tmp_path, fake_nvml_dir):
    """`jaxtrain train` with fault.health_nvml=always finds the stand-in driver through the dynamic
    linker (LD_LIBRARY_PATH), as a real job finds the driver's library: ECC errors counting up on
    GPU 0 are a gpu_memory warning in the `health` events; the matmul figure is measured for real."""
    env = {k: v for k, v in os.environ.items() if k not in FAKE_ENV and k != "XLA_FLAGS"}
    env.update({"LD_LIBRARY_PATH": f"{fake_nvml_dir}{os.pathsep}{env.get('LD_LIBRARY_PATH', '')}",
                "FAKE_NVML_BAD": "0", "FAKE_NVML_ECC_PER_READ": "1", "JAX_PLATFORMS": "cpu",
                "PYTHONPATH": os.pathsep.join(sys.path)})
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "jaxtrain", "train", "--config", TINY, f"run.output_dir={out}",
                        "train.steps=8", "fault.health_every_steps=2", "fault.health_nvml=always",
                        "checkpoint.save_at_end=false", *SMALL],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    health = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()
              if json.loads(line)["kind"] == "health"]
    assert [e["step"] for e in health] == [2, 4, 6, 8], health
    assert "gpu_memory" not in health[0]["warnings"] and all("gpu_memory" in e["warnings"] for e in health[1:]), health
    assert health[-1]["gpus"]["0"]["ecc_uncorrected_in_run"] == 3 and health[-1]["gpus"]["1"]["ecc_uncorrected"] == 0
    assert all(e["matmul_tflops"] > 0 for e in health) and "gpu_note" not in health[0]


def test_why_the_gpu_counters_are_off_is_said_once():
    """The trainer passes Nvml.open()'s reason (test_without_a_driver...) as gpu_note."""
    events: list[dict] = []
    h = Health(1, lambda kind, step, **d: events.append(d), memory=lambda: None,
               gpu_note="GPU counters off: NVML: Library Not Found")
    h.check(1)
    h.check(2)
    assert events[0]["gpu_note"] == "GPU counters off: NVML: Library Not Found" and "gpu_note" not in events[1]


def test_the_local_tier_disk_is_watched_beside_the_run_directory(tmp_path):
    """checkpoint.local_dir's file system (the trainer sets local_disk_path when the tier is on)."""
    from collections import namedtuple

    Usage = namedtuple("Usage", "total used free")
    usage = {str(tmp_path / "run"): Usage(100, 50, 50), str(tmp_path / "local"): Usage(100, 97, 3)}
    for d in usage:
        os.makedirs(d)
    h = Health(1, lambda *a, **k: None, memory=lambda: None, disk_path=str(tmp_path / "run"), disk=usage.get)
    assert h.check(1)["warnings"] == [] and "local_disk_free_ratio" not in h.values
    h.local_disk_path = str(tmp_path / "local")
    d = h.check(2)
    assert d["warnings"] == ["local_disk"] and d["local_disk_free_ratio"] == 0.03 and d["disk_free_ratio"] == 0.5

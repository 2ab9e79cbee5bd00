"""tpu_gpu_setup/gpu/check_all.sh, the one-call GPU check, run on the CPU with its Python stubbed.

No GPU here, so the stages' Python (install.sh's pip and import check, the `import jax` check,
check_attention.py, bench_gpu_1b.py) is a small bash stub (JAXTRAIN_GPU_CHECK_PYTHON) that
records its arguments and writes the files the real scripts write, or hangs when told to. What is
checked is the script's own logic: every stage runs under `timeout`, within the total budget, and
writes its logs and results under $OUT; a stage that hangs is cut and the next one still runs.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tpu_gpu_setup" / "gpu" / "check_all.sh"

# Stands in for python3. One line per call in $STUB_LOG: "<PYTHONPATH>|<arguments>".
# `exec sleep`: the stage's process is the sleep itself, so `timeout` ends it (and the pipe to tee).
STUB = r"""#!/usr/bin/env bash
printf '%s|%s\n' "${PYTHONPATH:-}" "$*" >> "$STUB_LOG"
out=""; prev=""
for a in "$@"; do [[ $prev == --out ]] && out=$a; prev=$a; done
case "$*" in
  "-c "*)  [[ -n ${STUB_HANG_JAX:-} ]] && exec sleep 60; echo "jax 0.0-stub [CudaDevice(id=0)]" ;;
  "-m pip "*) [[ -n ${STUB_HANG_PIP:-} ]] && exec sleep 60; echo "pip: installed" ;;
  "-") cat > /dev/null; echo "missing: nothing" ;;
  *check_attention.py*)
    [[ -n ${STUB_HANG_ATTENTION:-} ]] && exec sleep 60
    echo '{"correctness": [], "timings": []}' > "$out/attention_check.json"
    echo "| xla | ok |" > "$out/attention_check.md" ;;
  *bench_gpu_1b.py*)
    echo '{"results": []}' > "$out/gpu_1b.json"
    echo "| xla | ok |" > "$out/gpu_1b.md" ;;
  *) echo "stub: unexpected arguments: $*" >&2; exit 9 ;;
esac
"""


def run_check(tmp_path: Path, wheels: bool, total_s: int | None = None, **hang: str):
    """Run check_all.sh with the stub; returns (completed process, seconds, stub calls, OUT)."""
    stub = tmp_path / "python-stub"
    stub.write_text(STUB)
    stub.chmod(0o755)
    wheel_dir = tmp_path / "whl"
    wheel_dir.mkdir()
    if wheels:
        (wheel_dir / "jax_triton-0.3.1-py3-none-any.whl").write_bytes(b"")
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), JAXTRAIN_GPU_CHECK_PYTHON=str(stub), JAXTRAIN_GPU_CHECK_WHEELS=str(wheel_dir),
               SITE=str(tmp_path / "site"), STUB_LOG=str(tmp_path / "calls.log"), **hang)
    env.pop("PYTHONPATH", None)
    if total_s is not None:
        env["JAXTRAIN_GPU_CHECK_TOTAL_S"] = str(total_s)
    t = time.monotonic()
    done = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60)
    seconds = time.monotonic() - t
    log = tmp_path / "calls.log"
    calls = log.read_text().splitlines() if log.exists() else []
    return done, seconds, calls, out


def stage_timeouts(check_log: str) -> dict[str, tuple[int, int]]:
    """Stage name -> (seconds since the start when its step began, its timeout), from check_all.log."""
    out, offset = {}, 0
    for line in check_log.splitlines():
        m = re.match(r"== \[(\d+) s\]", line)
        if m:
            offset = int(m.group(1))
        m = re.match(r"\((\w+): timeout (-?\d+) s\)", line)
        if m:
            out[m.group(1)] = (offset, int(m.group(2)))
    return out


def assert_within_budget(timeouts: dict[str, tuple[int, int]], total_s: int, wrap_up_s: int) -> None:
    """Every step ends (by itself or by timeout) before the total budget less the wrap-up."""
    for name, (offset, t) in timeouts.items():
        assert 1 <= t and offset + t <= total_s - wrap_up_s, (name, offset, t)


def test_check_all_runs_every_stage_and_writes_its_files(tmp_path):
    done, seconds, calls, out = run_check(tmp_path, wheels=True)
    assert done.returncode == 0, done.stdout + done.stderr
    for name in ("check_all.log", "install.log", "jax_check.log", "check_attention.log", "bench_gpu_1b.log",
                 "attention_check.json", "attention_check.md", "gpu_1b.json", "gpu_1b.md"):
        assert (out / name).is_file(), name
    log = (out / "check_all.log").read_text()
    assert "jax 0.0-stub" in log and "0 stage(s) failed" in log
    # The default budget: 400 s in all (the caller allows 480); stages at their caps when the
    # earlier ones were quick, and the scripts told to stop starting new work well before them.
    timeouts = stage_timeouts(log)
    assert {k: t for k, (_, t) in timeouts.items()} == {"install": 44, "jax": 30, "check_attention": 140,
                                                        "bench_gpu_1b": 240}
    assert_within_budget(timeouts, 400, 10)
    args = [c.split("|", 1)[1] for c in calls]
    pip = next(a for a in args if a.startswith("-m pip install"))
    assert f"--target {tmp_path / 'site'}" in pip and "jax_triton-0.3.1-py3-none-any.whl" in pip
    assert "-" in args  # install.sh's import check, in the same Python
    assert f"tpu_gpu_setup/gpu/check_attention.py --quick --budget-s 84 --out {out}" in args
    assert f"tpu_gpu_setup/gpu/bench_gpu_1b.py --out {out} --budget-s 160" in args
    # The stages see the carried wheels first, then the checkout.
    bench_path = next(c.split("|", 1)[0] for c in calls if "bench_gpu_1b.py" in c)
    assert bench_path.split(":")[:2] == [str(tmp_path / "site"), str(REPO)]


def test_a_hung_stage_is_cut_and_the_next_gets_only_the_time_left(tmp_path):
    """Total 10 s (caps: install 1, jax 1, attention 3, gpu-1b 6, wrap-up 1): install and attention
    hang and are cut at their timeouts; gpu-1b still runs, with less than its cap."""
    done, seconds, calls, out = run_check(tmp_path, wheels=True, total_s=10, STUB_HANG_PIP="1",
                                          STUB_HANG_ATTENTION="1")
    log = (out / "check_all.log").read_text()
    assert done.returncode == 2, done.stdout + done.stderr  # two stages failed
    assert "install ran out of its 1 s (exit 124" in log
    assert "check_attention ran out of its 3 s (exit 124" in log
    timeouts = stage_timeouts(log)
    assert timeouts["install"][1] == 1 and timeouts["jax"][1] == 1 and timeouts["check_attention"][1] == 3
    assert timeouts["bench_gpu_1b"][1] < 6  # cut to what the total left
    assert_within_budget(timeouts, 10, 1)
    assert (out / "gpu_1b.json").is_file() and not (out / "attention_check.json").exists()
    assert seconds < 10 + 2, seconds


def test_without_jax_the_gpu_stages_are_skipped(tmp_path):
    """`import jax` hanging (a stuck CUDA start) is cut at its timeout and the GPU stages, which
    could only hang the same way, are skipped and counted; no wheels: install is skipped, not failed."""
    done, seconds, calls, out = run_check(tmp_path, wheels=False, total_s=10, STUB_HANG_JAX="1")
    log = (out / "check_all.log").read_text()
    assert done.returncode == 3, done.stdout + done.stderr  # jax failed, 2 stages skipped
    assert "no " in log and "wheels carried" in log
    assert "jax ran out of its 1 s" in log
    assert "check_attention skipped: jax did not start" in log and "bench_gpu_1b skipped: jax did not start" in log
    assert not any("check_attention.py" in c or "bench_gpu_1b.py" in c for c in calls)
    assert seconds < 5, seconds

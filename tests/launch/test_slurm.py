"""SLURM for real: `tpu_gpu_setup/gpu/slurm/train.sbatch` on a one-node cluster, 2 tasks on CPUs.

- uninterrupted: the sbatch script forms one 2-process, 4-device JAX job (jaxtrain.launch.distributed sees
  SLURM_NTASKS=2 and calls a bare `jax.distributed.initialize()`, which reads SLURM's environment);
- a task killed mid-run (chaos.kill_at_step on task 1): the script restarts the step inside the
  allocation, which resumes from its checkpoint and ends bitwise equal to the uninterrupted run;
- the same with in-allocation restarts off (STEP_RESTARTS=0): the script requeues the job, whose
  second run resumes and ends bitwise equal too. SLURM holds a requeued job back for its credential
  lifetime (`Reason=BeginTime`, about 2-3 minutes with the default `AuthInfo` cred_expire); the test
  releases it with `scontrol update StartTime=now` instead of waiting.

Leaving a failed node out (ISOLATE_AFTER: `srun --exclude` of the node, with the overrides that
`jaxtrain recovery decide` prints) needs two nodes: the script's logic for it runs here against
stand-in `srun`/`squeue`/`scontrol` commands that play a 2-node allocation (no cluster needed); a
real multi-node exclusion was not run. So does the blame of an exit 75: a hang event of the attempt
that names one task counts against that task's node; a plain exit 75 blames nobody. The drills
need a running cluster: on a Debian/Ubuntu machine, `tpu_gpu_setup/slurm_local/start_local_slurm.sh` (as root) starts a one-node one.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from trees import assert_trees_equal, final_params


REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs/tiny.yaml"
SBATCH = REPO / "tpu_gpu_setup/gpu/slurm/train.sbatch"
# Saves are synchronous so that "step 2 is committed before the kill after step 3" is certain.
DRILL = ["train.steps=6", "train.log_every=1", "data.global_batch_size=8", "checkpoint.every_steps=2",
         "checkpoint.async_save=false"]
KILL = ["chaos.kill_at_step=3", "chaos.kill_process=1"]

# Where CI could install SLURM (.ci/run sets JAXTRAIN_REQUIRE_SLURM=1 after starting it), a missing
# cluster is a failure; elsewhere (a laptop, a machine without root) the test says what is missing.
REQUIRED = os.environ.get("JAXTRAIN_REQUIRE_SLURM") == "1"
needs_slurm = pytest.mark.skipif(
    shutil.which("sbatch") is None and not REQUIRED,
    reason="no SLURM cluster on this machine (start one: sudo tpu_gpu_setup/slurm_local/start_local_slurm.sh)")


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture(scope="module")
def slurm_env(tmp_path_factory) -> dict[str, str]:
    """SLURM must be the source of the job's coordinates: no JAXTRAIN_* from outside. Devices come
    from --cpu-devices, not conftest's 8; `jaxtrain` is found next to this Python; a shared XLA cache."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAXTRAIN_")}
    env.update({"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "", "JAX_DISABLE_MOST_OPTIMIZATIONS": "1",
                "PYTHONPATH": os.pathsep.join(sys.path),
                "PATH": os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", ""),
                "JAX_COMPILATION_CACHE_DIR": str(tmp_path_factory.mktemp("xla_cache"))})
    return env


def sbatch(env: dict[str, str], cwd: Path, name: str, *overrides: str, wait: bool = True,
           **script_env: str) -> subprocess.Popen:
    """Submit the drill (2 tasks x 2 CPU devices on one node) and (`wait`) wait for it in the background."""
    out = cwd / "run"
    cmd = ["sbatch", *(["--wait"] if wait else []), f"--job-name={name}", "--gpus-per-node=0", "-N1", "--ntasks-per-node=2",
           "--time=20", f"--output={cwd}/slurm-%j.out", str(SBATCH), str(TINY), f"run.output_dir={out}", *DRILL,
           f"checkpoint.compilation_cache_dir={env['JAX_COMPILATION_CACHE_DIR']}", *overrides, "--cpu-devices", "2"]
    return subprocess.Popen(cmd, cwd=cwd, env={**env, **script_env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def finish(job: subprocess.Popen, cwd: Path, timeout: float = 480) -> str:
    """Wait for the job; returns the job's output file(s)."""
    try:
        out, _ = job.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        job.kill()
        raise
    log = "".join(p.read_text() for p in sorted(cwd.glob("slurm-*.out")))
    assert job.returncode == 0, (out + log)[-4000:]
    return log


@pytest.fixture(scope="module")
def reference(tmp_path_factory, slurm_env) -> Path:
    """The drill without a fault: the run directory."""
    cwd = tmp_path_factory.mktemp("slurm_reference")
    log = finish(sbatch(slurm_env, cwd, "jaxtrain-reference"), cwd)
    assert "jaxtrain: done" in log and "restarting" not in log
    return cwd / "run"


def assert_same_run(out: Path, reference: Path) -> list[dict]:
    """`out` resumed from step 2 and ends as `reference` did: the same losses, bitwise the same parameters."""
    events = read_jsonl(out / "events.jsonl")
    assert [e["restored_step"] for e in events if e["kind"] == "resume"] == [2]
    assert [e["processes"] for e in events if e["kind"] == "start"] == [2, 2]
    assert events[-1]["kind"] == "done" and events[-1]["step"] == 6
    want = {m["step"]: m for m in read_jsonl(reference / "metrics.jsonl")}
    got = read_jsonl(out / "metrics.jsonl")
    assert sorted({m["step"] for m in got}) == [1, 2, 3, 4, 5, 6]
    for m in got:
        assert (m["loss"], m["grad_norm"]) == (want[m["step"]]["loss"], want[m["step"]]["grad_norm"]), m["step"]
    assert_trees_equal(final_params(out), final_params(reference), "final parameter ")
    return events


@needs_slurm
@pytest.mark.multiprocess
@pytest.mark.slow
def test_sbatch_forms_one_two_process_job(reference):
    events = read_jsonl(reference / "events.jsonl")
    start = next(e for e in events if e["kind"] == "start")
    assert start["processes"] == 2 and start["devices"] == 4
    assert events[-1]["kind"] == "done" and events[-1]["step"] == 6


@needs_slurm
@pytest.mark.multiprocess
@pytest.mark.slow
def test_killed_task_restarts_the_step_inside_the_allocation(tmp_path, slurm_env, reference):
    log = finish(sbatch(slurm_env, tmp_path, "jaxtrain-step-restart", *KILL), tmp_path)
    assert "first failure: task 1 on node" in log and "(exit 137;" in log  # SIGKILLed by the drill
    assert "restarting the step inside the allocation (step restart 1 of 2)" in log
    assert "requeueing" not in log and "jaxtrain: done" in log
    # The exits file of attempt 0 names the task that died first (the wrapper's record).
    (state,) = (tmp_path / ".jaxtrain-slurm").iterdir()
    first = sorted((state / "exits.0").read_text().split("\n")[:-1])[0].split()
    assert first[1:] == ["1", first[2], "137"]
    assert_same_run(tmp_path / "run", reference)


@needs_slurm
@pytest.mark.multiprocess
@pytest.mark.slow
def test_killed_task_requeues_the_job(tmp_path, slurm_env, reference):
    # Not `sbatch --wait`: it may return (exit 1) the moment the first run ends in REQUEUED. The
    # job's own record says when it is really over.
    name = f"jaxtrain-requeue-{os.getpid()}"
    submit = sbatch(slurm_env, tmp_path, name, *KILL, wait=False, STEP_RESTARTS="0", MAX_REQUEUES="1")
    out, _ = submit.communicate(timeout=60)
    job_id = out.split()[-1]
    # Right after `scontrol requeue` the first run's record flickers (RUNNING or PENDING with
    # Restarts=1, then FAILED) before the job settles in PENDING/BeginTime. Only the requeued run,
    # seen RUNNING after we released it, ends the wait when it ends.
    releases, second_run, history, deadline, job = 0, False, [], time.time() + 480, {}
    waiting_since: float | None = None
    while time.time() < deadline:
        fields = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True).stdout.split()
        job = dict(f.split("=", 1) for f in fields if "=" in f)
        state = (job.get("JobState"), job.get("Reason"), job.get("Restarts"))
        if not history or history[-1] != state:
            history.append(state)
        if second_run and job.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL",
                                                  "OUT_OF_MEMORY"):
            break
        if job.get("JobState") == "PENDING" and job.get("Reason") == "BeginTime":
            # The requeued job waits (cred_expire, 120 s) for its old credential to expire; let it start
            # sooner, but not in the second of the requeue: slurmd revokes the old credential by time,
            # at 1-second granularity, and a launch within it fails ("credential revoked") as FAILED.
            waiting_since = waiting_since or time.time()
            if time.time() - waiting_since >= 3:
                subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], check=True)
                releases += 1
                waiting_since = None
        second_run |= releases > 0 and job.get("JobState") == "RUNNING"
        time.sleep(0.5)
    log = "".join(p.read_text() for p in sorted(tmp_path.glob("slurm-*.out")))
    assert job.get("JobState") == "COMPLETED" and job.get("ExitCode") == "0:0", (history, log[-3000:])
    assert releases and job.get("Restarts") == "1", (history, log[-3000:])
    assert "requeueing (requeue 1 of 1)" in log and "restarting the step" not in log
    assert "attempt 1 (requeue 1, step restart 0)" in log and "jaxtrain: done" in log
    assert_same_run(tmp_path / "run", reference)


# ----------------------------------------------------------------------------- the script's logic alone

FAKE_SRUN = r"""#!/bin/bash
# Plays a 2-node step: node-b's task crashes first until node-b is excluded; then the step succeeds.
{ printf 'ARGS'; printf ' %q' "$@"; echo; echo "ENV JAX_LOCAL_DEVICE_IDS=${JAX_LOCAL_DEVICE_IDS:-} XLA_FLAGS=${XLA_FLAGS:-}"; } >> "$FAKE_LOG"
if [[ "$*" == *--exclude=node-b* ]]; then
  echo "$(date +%s.%N) 0 node-a 0" >> "$JAXTRAIN_EXITS"; exit 0
fi
echo "$(date +%s.%N) 1 node-b 1" >> "$JAXTRAIN_EXITS"
echo "$(date +%s.%N) 0 node-a 137" >> "$JAXTRAIN_EXITS"
exit 137
"""


def fake_slurm(tmp_path: Path, srun: str) -> dict[str, str]:
    """The environment of a 2-node allocation whose srun, squeue and scontrol are stand-ins that log."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in {"srun": srun, "squeue": "#!/bin/bash\necho 10:00:00\n",
                       "scontrol": '#!/bin/bash\necho "scontrol $*" >> "$FAKE_LOG"\n'}.items():
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAXTRAIN_", "SLURM_", "JAX_", "XLA_"))}
    env.update({"PATH": f"{bin_dir}{os.pathsep}{os.path.dirname(sys.executable)}{os.pathsep}{env['PATH']}",
                "PYTHONPATH": os.pathsep.join(sys.path), "FAKE_LOG": str(tmp_path / "log"),
                "SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": "2", "SLURM_NTASKS": "2",
                "SLURM_JOB_NODELIST": "node-[a-b]", "SLURM_SUBMIT_DIR": str(tmp_path), "ISOLATE_AFTER": "2"})
    return env


@pytest.mark.parametrize("platform, devices, plan", [
    ("cpu", ["--cpu-devices", "2"], "mesh.data=-1 train.grad_accum=2"),  # 2 x 2 devices -> 1 x 2, batch 8
    ("gpu", [], "mesh.data=-1 train.grad_accum=2"),  # 2 nodes x 8 GPUs -> 1 x 8, batch 16 (configs/tiny.yaml)
])
def test_a_node_failing_first_twice_is_left_out_of_the_allocation(tmp_path, platform, devices, plan):
    env = fake_slurm(tmp_path, FAKE_SRUN)
    env.update({"JAX_PLATFORMS": "cpu"} if platform == "cpu" else {"SLURM_GPUS_ON_NODE": "8"})
    overrides = ["data.global_batch_size=8"] if platform == "cpu" else []
    r = subprocess.run(["bash", str(SBATCH), str(TINY), *overrides, *devices], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "first failure: task 1 on node node-b (exit 1; 2 attempt(s) in a row)" in r.stdout
    assert f"isolating node node-b: continuing on 1 node(s) with {plan}" in r.stdout
    calls = [line[5:] for line in (tmp_path / "log").read_text().splitlines() if line.startswith("ARGS ")]
    assert len(calls) == 3 and "--exclude" not in calls[0] + calls[1]
    assert calls[2].startswith("--kill-on-bad-exit=1 --nodes=1 --ntasks=1 --exclude=node-b bash -c ")
    assert calls[2].endswith(" ".join([*overrides, *devices, plan]))  # the shrink overrides come last and win
    env_lines = [line for line in (tmp_path / "log").read_text().splitlines() if line.startswith("ENV ")]
    if platform == "gpu":  # what the script does for GPU clusters is still done
        assert all("JAX_LOCAL_DEVICE_IDS=0,1,2,3,4,5,6,7" in e and "latency_hiding" in e for e in env_lines)
    else:
        assert all("JAX_LOCAL_DEVICE_IDS= " in e and "xla_gpu" not in e for e in env_lines)


def test_a_requeued_job_keeps_its_isolated_node_out_of_the_new_allocation(tmp_path):
    # node-b crashes twice and is isolated; on the node left, the step then fails for another reason
    # with no step restarts left: the job is requeued, and the requeued job must exclude node-b.
    env = fake_slurm(tmp_path, FAKE_SRUN.replace('"$JAXTRAIN_EXITS"; exit 0', '"$JAXTRAIN_EXITS"; exit 1')
                     .replace('node-a 0" >>', 'node-a 1" >>'))
    env.update({"JAX_PLATFORMS": "cpu", "STEP_RESTARTS": "1", "MAX_REQUEUES": "1"})
    r = subprocess.run(["bash", str(SBATCH), str(TINY), "data.global_batch_size=8", "--cpu-devices", "2"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "isolating node node-b" in r.stdout and "requeueing (requeue 1 of 1)" in r.stdout
    calls = [line for line in (tmp_path / "log").read_text().splitlines() if line.startswith("scontrol ")]
    assert [c for c in calls if "show job" not in c][-2:] == [
        "scontrol requeue 4242", "scontrol update JobId=4242 ExcNodeList=node-b"], calls


FAKE_EXIT_75_SRUN = r"""#!/bin/bash
# Plays a 2-node step in which every task exits 75 ("restart me") until node-b is excluded. With
# FAKE_HANG set, the run first logs a hang event that names process 1 (node-b) as furthest behind.
{ printf 'ARGS'; printf ' %q' "$@"; echo; } >> "$FAKE_LOG"
if [[ "$*" == *--exclude=node-b* ]]; then
  echo "$(date +%s.%N) 0 node-a 0" >> "$JAXTRAIN_EXITS"; exit 0
fi
if [[ -n "${FAKE_HANG:-}" ]]; then
  echo "{\"time\": $(date +%s.%N), \"step\": 3, \"kind\": \"hang\", \"process\": 0, \"behind\": [1]}" >> "$FAKE_EVENTS"
fi
echo "$(date +%s.%N) 0 node-a 75" >> "$JAXTRAIN_EXITS"
echo "$(date +%s.%N) 1 node-b 75" >> "$JAXTRAIN_EXITS"
exit 75
"""


@pytest.mark.parametrize("hang", [True, False])
def test_a_node_the_runs_hang_events_blame_is_left_out_and_a_plain_exit_75_blames_nobody(tmp_path, hang):
    """Exit 75 alone (a preemption) is no evidence against a node; a hang event of this attempt
    naming one process is, as in `jaxtrain launch`. An older hang event (before the attempt) is not."""
    run = tmp_path / "run"
    run.mkdir()
    old = {"time": time.time() - 3600, "step": 1, "kind": "hang", "process": 0, "behind": [1]}
    (run / "events.jsonl").write_text(json.dumps(old) + "\n")
    env = fake_slurm(tmp_path, FAKE_EXIT_75_SRUN)
    env.update({"JAX_PLATFORMS": "cpu", "FAKE_EVENTS": str(run / "events.jsonl")})
    if hang:
        env["FAKE_HANG"] = "1"
    r = subprocess.run(["bash", str(SBATCH), str(TINY), "data.global_batch_size=8", f"run.output_dir={run}",
                        "--cpu-devices", "2"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    if hang:
        assert r.returncode == 0, r.stdout + r.stderr
        assert "first failure: task 1 on node node-b (exit 75, blamed by the run's events; 1 attempt(s) in a row)" \
            in r.stdout
        assert "(exit 75, blamed by the run's events; 2 attempt(s) in a row)" in r.stdout
        assert "isolating node node-b: continuing on 1 node(s) with mesh.data=-1 train.grad_accum=2" in r.stdout
    else:
        assert r.returncode == 75, r.stdout + r.stderr
        assert r.stdout.count("first failure: task 0 on node node-a (exit 75; 0 attempt(s) in a row)") == 3
        assert "isolating" not in r.stdout and "blamed" not in r.stdout and "requeueing" in r.stdout

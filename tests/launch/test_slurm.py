"""SLURM for real: `tpu_gpu_setup/gpu/slurm/train.sbatch` on a one-node cluster, 2 tasks on CPUs.

- uninterrupted: the sbatch script forms one 2-process, 4-device JAX job (jaxtrain.runtime.distributed sees
  SLURM_NTASKS=2 and calls a bare `jax.distributed.initialize()`, which reads SLURM's environment);
- a task killed mid-run (chaos.kill_at_step on task 1): the script restarts the step inside the
  allocation, which resumes from its checkpoint and ends bitwise equal to the uninterrupted run;
- the same with in-allocation restarts off (STEP_RESTARTS=0): the script requeues the job, whose
  second run resumes and ends bitwise equal too. SLURM holds a requeued job back for its credential
  lifetime (`Reason=BeginTime`, about 2-3 minutes with the default `AuthInfo` cred_expire); the test
  releases it with `scontrol update StartTime=now` instead of waiting;
- the time limit (`--time=3 --signal=TERM@60`, slow: about 3 minutes): the task wrapper outlives the
  SIGTERM, the trainer saves and exits 75, the requeue is not counted (the attempt saved), and the
  requeued run resumes from the emergency checkpoint.

The task wrapper alone (its SIGTERM handling, its records, its SIGKILL of the step on a crash) is
tested without a cluster; the stand-in `srun` below runs it around a stand-in trainer too.
Leaving a failed node out (ISOLATE_AFTER: `srun --exclude` of the node, with the overrides that
`jaxtrain recovery decide` prints) needs two nodes: the script's logic for it runs here against
stand-in `srun`/`squeue`/`scontrol`/`scancel` commands that play a 2-node allocation (no cluster
needed), as does a requeue that keeps an isolated node out; a real multi-node exclusion was not run. So does the blame of an exit 75: a hang event of the attempt
that names one task counts against that task's node; a plain exit 75 blames nobody. The drills
need a running cluster: on a Debian/Ubuntu machine, `tpu_gpu_setup/slurm_local/start_local_slurm.sh` (as root) starts a one-node one.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import REPO, TINY, read_jsonl
from trees import assert_trees_equal, final_params


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
           options: tuple[str, ...] = ("--time=20",), **script_env: str) -> subprocess.Popen:
    """Submit the drill (2 tasks x 2 CPU devices on one node) and (`wait`) wait for it in the background."""
    out = cwd / "run"
    cmd = ["sbatch", *(["--wait"] if wait else []), f"--job-name={name}", "--gpus-per-node=0", "-N1", "--ntasks-per-node=2",
           *options, f"--output={cwd}/slurm-%j.out", str(SBATCH), TINY, f"run.output_dir={out}", *DRILL,
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
    events = read_jsonl(out / "events.jsonl", missing_ok=True)
    assert [e["restored_step"] for e in events if e["kind"] == "resume"] == [2]
    assert [e["processes"] for e in events if e["kind"] == "start"] == [2, 2]
    assert events[-1]["kind"] == "done" and events[-1]["step"] == 6
    want = {m["step"]: m for m in read_jsonl(reference / "metrics.jsonl", missing_ok=True)}
    got = read_jsonl(out / "metrics.jsonl", missing_ok=True)
    assert sorted({m["step"] for m in got}) == [1, 2, 3, 4, 5, 6]
    for m in got:
        assert (m["loss"], m["grad_norm"]) == (want[m["step"]]["loss"], want[m["step"]]["grad_norm"]), m["step"]
    assert_trees_equal(final_params(out), final_params(reference), "final parameter ")
    return events


@needs_slurm
@pytest.mark.multiprocess
@pytest.mark.slow
def test_sbatch_forms_one_two_process_job(reference):
    events = read_jsonl(reference / "events.jsonl", missing_ok=True)
    start = next(e for e in events if e["kind"] == "start")
    assert start["processes"] == 2 and start["devices"] == 4
    assert events[-1]["kind"] == "done" and events[-1]["step"] == 6


@needs_slurm
@pytest.mark.multiprocess
@pytest.mark.slow
def test_killed_task_restarts_the_step_inside_the_allocation(tmp_path, slurm_env, reference):
    log = finish(sbatch(slurm_env, tmp_path, "jaxtrain-step-restart", *KILL), tmp_path)
    assert "first failure: task 1 on node" in log and "(exit 137;" in log  # SIGKILLed by the drill
    # Attempt 0 saved step 2 before the kill (it started fresh): progress, so the restart is not
    # counted against STEP_RESTARTS (it was "step restart 1 of 2" before progress was counted).
    assert ("restarting the step inside the allocation (not counted: the attempt saved step 2, past its fresh "
            "start; 0 of 2 step restarts counted)") in log
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
    # Progress (step 2 saved), so not counted against MAX_REQUEUES (it was "requeue 1 of 1" before).
    assert "requeueing (not counted: the attempt saved step 2, past its fresh start; 0 of 1 requeues counted)" in log
    assert "restarting the step" not in log
    assert "attempt 1 (requeue 1, step restart 0)" in log and "jaxtrain: done" in log
    assert_same_run(tmp_path / "run", reference)


def job_record(job_id: str) -> dict[str, str]:
    fields = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True).stdout.split()
    return dict(f.split("=", 1) for f in fields if "=" in f)


@needs_slurm
@pytest.mark.multiprocess
@pytest.mark.slow
def test_the_time_limit_signal_saves_an_emergency_checkpoint_and_the_requeued_job_resumes_from_it(
        tmp_path, slurm_env):
    """A 3-minute job with `--signal=TERM@60`: SLURM signals the step 1-2 minutes in (the signal may
    come up to a minute early, the resolution of slurmctld's time-limit loop: with `--time=2` it came
    ~30 s in, which a slower start-up of the trainer would not survive); each task's wrapper
    outlives the signal, the trainer saves at an agreed step and exits 75 (a `preempted` event);
    the script requeues the job, not
    counted against MAX_REQUEUES=1 (the attempt saved past where it started), and the requeued job
    resumes from that checkpoint. The run is far longer than the limit, so the test cancels the job
    once the requeued run has trained a step past the checkpoint."""
    name = f"jaxtrain-time-limit-{os.getpid()}"
    submit = sbatch(slurm_env, tmp_path, name, "train.steps=1000000", "checkpoint.every_steps=1000000", wait=False,
                    options=("--time=3", "--signal=TERM@60"), MAX_REQUEUES="1")
    out, _ = submit.communicate(timeout=60)
    job_id = out.split()[-1]
    run = tmp_path / "run"
    resumed_past, saved, history, deadline, waiting_since = False, None, [], time.time() + 400, None
    try:
        while time.time() < deadline and not resumed_past:
            job = job_record(job_id)
            state = (job.get("JobState"), job.get("Reason"), job.get("Restarts"))
            if not history or history[-1] != state:
                history.append(state)
            if job.get("JobState") == "PENDING" and job.get("Reason") == "BeginTime":  # as in the requeue test
                waiting_since = waiting_since or time.time()
                if time.time() - waiting_since >= 3:
                    subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], check=True)
                    waiting_since = None
            events = read_jsonl(run / "events.jsonl", missing_ok=True) if run.exists() else []
            preempted = [e for e in events if e.get("kind") == "preempted"]
            if preempted:
                saved = preempted[0]["step"]
                resumes = [e for e in events if e.get("kind") == "resume"]
                steps = [m["step"] for m in read_jsonl(run / "metrics.jsonl", missing_ok=True)]
                resumed_past = bool(resumes) and steps[-1:] > [saved] and steps.count(saved + 1) >= 1
            if job.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT") and job.get("Restarts") == "1" \
                    and not resumed_past:
                break
            time.sleep(1.0)
    finally:
        subprocess.run(["scancel", job_id])
        while job_record(job_id).get("JobState") in ("RUNNING", "PENDING", "COMPLETING", "REQUEUED"):
            time.sleep(1.0)
    log = "".join(p.read_text() for p in sorted(tmp_path.glob("slurm-*.out")))
    assert resumed_past, (history, log[-4000:])
    events = read_jsonl(run / "events.jsonl", missing_ok=True)
    first_run = events[:next(i for i, e in enumerate(events) if e["kind"] == "preempted") + 1]
    assert [e["step"] for e in first_run if e["kind"] == "checkpoint_saved"][-1:] == [saved], first_run[-5:]
    assert [e["restored_step"] for e in events if e["kind"] == "resume"] == [saved]
    (state,) = (tmp_path / ".jaxtrain-slurm").iterdir()
    assert sorted(line.split()[3] for line in (state / "exits.0").read_text().splitlines()) == ["75", "75"]
    assert "attempt 0 ended with exit 75" in log
    assert "requeueing (not counted: the attempt saved step" in log and "0 of 1 requeues counted" in log, log[-3000:]
    assert "attempt 1 (requeue 1, step restart 0)" in log


# ----------------------------------------------------------------------------- the script's logic alone

def task_wrapper() -> str:
    """train.sbatch's task wrapper (`bash -c "$TASK_WRAPPER" jaxtrain-task COMMAND...`), read from the script."""
    match = re.search(r"^TASK_WRAPPER='(.*?)'$", SBATCH.read_text(), re.M | re.S)
    assert match, "TASK_WRAPPER not found in train.sbatch"
    return match.group(1)


# Plays the trainer's SIGTERM handling (jaxtrain/fault/preemption.py): note the signal, finish the
# step and save (1 s here), exit 75; a second signal would be "stop now" (exit 130 here).
SAVING_TRAINER = r"""
import os, signal, sys, time
signals = []
def handle(signum, frame):
    signals.append(signum)
    if len(signals) > 1:
        sys.exit(130)
signal.signal(signal.SIGTERM, handle)
signal.signal(signal.SIGINT, handle)  # as StopSignals does (a background child of bash starts with INT ignored)
open(sys.argv[1], "w").close()  # ready
deadline = time.time() + 30
while not signals and time.time() < deadline:
    time.sleep(0.05)
time.sleep(1.0)  # the emergency checkpoint
sys.exit(75 if signals else 1)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_the_task_wrapper_outlives_sigterm_and_records_the_trainers_exit_75(tmp_path, sig):
    """slurmstepd signals every process of the step (the time limit's --signal=TERM@180, scancel
    --signal=TERM, a preemption): the wrapper must wait for the trainer's emergency save, record its
    exit 75 and exit 75 itself, not die at once and leave no record. The signal goes to the wrapper's
    whole process group, as slurmstepd sends it; the trainer gets it exactly once."""
    exits, ready = tmp_path / "exits", tmp_path / "ready"
    exits.touch()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scancel").write_text(f'#!/bin/bash\necho "scancel $*" >> {tmp_path}/scancel\n')
    (bin_dir / "scancel").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "JAXTRAIN_EXITS": str(exits),
           "SLURM_PROCID": "1", "SLURMD_NODENAME": "node-b", "SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0"}
    wrapper = subprocess.Popen(["bash", "-c", task_wrapper(), "jaxtrain-task", sys.executable, "-c", SAVING_TRAINER,
                                str(ready)], env=env, start_new_session=True)
    try:
        deadline = time.time() + 30
        while not ready.exists() and time.time() < deadline:
            time.sleep(0.05)
        assert ready.exists()
        os.killpg(wrapper.pid, sig)
        assert wrapper.wait(timeout=30) == 75
    finally:
        if wrapper.poll() is None:
            os.killpg(wrapper.pid, signal.SIGKILL)
    (record,) = exits.read_text().splitlines()
    assert record.split()[1:] == ["1", "node-b", "75"]
    assert not (tmp_path / "scancel").exists()  # a 75 is no crash: the step is not SIGKILLed


@pytest.mark.parametrize("code, killed", [(0, False), (2, False), (78, False), (1, True), (137, True)])
def test_the_task_wrapper_records_each_exit_and_kills_the_step_on_a_crash(tmp_path, code, killed):
    exits = tmp_path / "exits"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scancel").write_text(f'#!/bin/bash\necho "scancel $*" >> {tmp_path}/scancel\n')
    (bin_dir / "scancel").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "JAXTRAIN_EXITS": str(exits),
           "SLURM_PROCID": "0", "SLURMD_NODENAME": "node-a", "SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "3"}
    r = subprocess.run(["bash", "-c", task_wrapper(), "jaxtrain-task", "bash", "-c", f"exit {code}"], env=env,
                       timeout=30)
    assert r.returncode == code
    assert exits.read_text().split()[1:] == ["0", "node-a", str(code)]
    assert (tmp_path / "scancel").exists() == killed
    if killed:
        assert (tmp_path / "scancel").read_text() == "scancel --signal=KILL 4242.3\n"


# A stand-in srun that plays a 2-node step (node-a, node-b; a node given to --exclude is left out)
# and runs train.sbatch's real task wrapper around each task, so the exits records are the
# wrapper's own. The trainer is replaced by $FAKE_TASK, a script that plays the scenario from
# SLURMD_NODENAME, SLURM_PROCID and FAKE_EXCLUDED (the nodes excluded from this step). srun's exit
# code is the highest of its tasks'.
FAKE_SRUN = r"""#!/bin/bash
{ printf 'ARGS'; printf ' %q' "$@"; echo; echo "ENV JAX_LOCAL_DEVICE_IDS=${JAX_LOCAL_DEVICE_IDS:-} XLA_FLAGS=${XLA_FLAGS:-}"; } >> "$FAKE_LOG"
exclude=""
while [[ "$1" != bash ]]; do [[ "$1" == --exclude=* ]] && exclude=${1#--exclude=}; shift; done
wrapper=$3; shift 4   # bash -c WRAPPER jaxtrain-task; what is left is the trainer's command
pids=(); task=0
for node in node-a node-b; do
  [[ ",$exclude," == *",$node,"* ]] && continue
  SLURM_PROCID=$task SLURMD_NODENAME=$node SLURM_STEP_ID=0 FAKE_EXCLUDED=$exclude \
    bash -c "$wrapper" jaxtrain-task bash "$FAKE_TASK" "$@" &
  pids+=($!); task=$((task + 1))
done
rc=0
for pid in "${pids[@]}"; do wait "$pid"; r=$?; (( r > rc )) && rc=$r; done
exit $rc
"""

# node-b's task crashes first until node-b is excluded; then the step succeeds.
NODE_B_CRASHES = r"""
[[ -n "$FAKE_EXCLUDED" ]] && exit 0
[[ "$SLURMD_NODENAME" == node-b ]] && exit 1
sleep 0.5; exit 137   # node-a: killed once its peer crashed (the wrapper's scancel)
"""


def test_an_isolation_survives_a_requeue_that_ends_the_script_at_once(tmp_path):
    """The isolated node is recorded in the job's state before `scontrol requeue`, which may end the
    script at once (here it does: the stand-in SIGKILLs it), and the next allocation, given the same
    nodes, leaves it out of its steps from its first attempt on, with the smaller job's overrides."""
    env = fake_slurm(tmp_path, NODE_B_CRASHES.replace('[[ -n "$FAKE_EXCLUDED" ]] && exit 0',
                                                      '[[ -n "$FAKE_EXCLUDED" ]] && exit 1'))
    env.update({"JAX_PLATFORMS": "cpu", "STEP_RESTARTS": "1", "MAX_REQUEUES": "1", "FAKE_REQUEUE_KILLS": "1"})
    script = ["bash", str(SBATCH), TINY, "data.global_batch_size=8", "--cpu-devices", "2"]
    r = subprocess.run(script, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == -9 and "isolating node node-b" in r.stdout, r.stdout + r.stderr
    log = (tmp_path / "log").read_text()
    assert "excluded at requeue: node-b" in log and "ExcNodeList" not in log  # the script died first
    # The requeued job: same job id, the same two nodes, and now every task succeeds.
    (tmp_path / "task.sh").write_text("exit 0\n")
    r = subprocess.run(script, cwd=tmp_path, env={**env, "SLURM_RESTART_COUNT": "1"}, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "this allocation has the isolated node(s) node-b again: leaving them out" in r.stdout
    calls = [line[5:] for line in (tmp_path / "log").read_text().splitlines() if line.startswith("ARGS ")]
    assert len(calls) == 4 and calls[3].startswith("--kill-on-bad-exit=0 --nodes=1 --ntasks=1 --exclude=node-b ")
    assert calls[3].endswith("--cpu-devices 2 mesh.data=-1 train.grad_accum=2")


FAKE_SCONTROL = r"""#!/bin/bash
echo "scontrol $*" >> "$FAKE_LOG"
if [[ "$1 $2" == "show hostnames" ]]; then echo node-a; echo node-b; fi
if [[ "$1" == requeue ]]; then
  excluded="$JAXTRAIN_SLURM_STATE/excluded"
  [[ -s "$excluded" ]] && echo "excluded at requeue: $(head -1 "$excluded")" >> "$FAKE_LOG"
  # SLURM may end the batch script the moment it is requeued (the race of the isolated node's exclusion)
  [[ -n "${FAKE_REQUEUE_KILLS:-}" ]] && kill -KILL "$PPID"
fi
exit 0
"""


def fake_slurm(tmp_path: Path, task: str) -> dict[str, str]:
    """The environment of a 2-node allocation whose srun (FAKE_SRUN, running `task` in train.sbatch's
    wrapper on each node), squeue, scontrol and scancel are stand-ins that log."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (tmp_path / "task.sh").write_text(task)
    for name, body in {"srun": FAKE_SRUN, "squeue": "#!/bin/bash\necho 10:00:00\n", "scontrol": FAKE_SCONTROL,
                       "scancel": '#!/bin/bash\necho "scancel $*" >> "$FAKE_LOG"\n'}.items():
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAXTRAIN_", "SLURM_", "JAX_", "XLA_"))}
    env.update({"PATH": f"{bin_dir}{os.pathsep}{os.path.dirname(sys.executable)}{os.pathsep}{env['PATH']}",
                "PYTHONPATH": os.pathsep.join(sys.path), "FAKE_LOG": str(tmp_path / "log"),
                "SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": "2", "SLURM_NTASKS": "2",
                "SLURM_JOB_NODELIST": "node-[a-b]", "SLURM_SUBMIT_DIR": str(tmp_path), "ISOLATE_AFTER": "2",
                "FAKE_TASK": str(tmp_path / "task.sh")})
    return env


@pytest.mark.parametrize("platform, devices, plan", [
    ("cpu", ["--cpu-devices", "2"], "mesh.data=-1 train.grad_accum=2"),  # 2 x 2 devices -> 1 x 2, batch 8
    ("gpu", [], "mesh.data=-1 train.grad_accum=2"),  # 2 nodes x 8 GPUs -> 1 x 8, batch 16 (configs/tiny.yaml)
])
def test_a_node_failing_first_twice_is_left_out_of_the_allocation(tmp_path, platform, devices, plan):
    env = fake_slurm(tmp_path, NODE_B_CRASHES)
    env.update({"JAX_PLATFORMS": "cpu"} if platform == "cpu" else {"SLURM_GPUS_ON_NODE": "8"})
    overrides = ["data.global_batch_size=8"] if platform == "cpu" else []
    r = subprocess.run(["bash", str(SBATCH), TINY, *overrides, *devices], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "first failure: task 1 on node node-b (exit 1; 2 attempt(s) in a row)" in r.stdout
    assert f"isolating node node-b: continuing on 1 node(s) with {plan}" in r.stdout
    calls = [line[5:] for line in (tmp_path / "log").read_text().splitlines() if line.startswith("ARGS ")]
    assert len(calls) == 3 and "--exclude" not in calls[0] + calls[1]
    assert calls[2].startswith("--kill-on-bad-exit=0 --nodes=1 --ntasks=1 --exclude=node-b bash -c ")
    assert calls[2].endswith(" ".join([*overrides, *devices, plan]))  # the shrink overrides come last and win
    # The real wrapper ran each task: node-b's crash SIGKILLed the step, and its record came first.
    assert "scancel --signal=KILL 4242.0" in (tmp_path / "log").read_text()
    first = (tmp_path / ".jaxtrain-slurm/4242/exits.0").read_text().splitlines()
    assert [line.split()[1:] for line in first] == [["1", "node-b", "1"], ["0", "node-a", "137"]]
    env_lines = [line for line in (tmp_path / "log").read_text().splitlines() if line.startswith("ENV ")]
    if platform == "gpu":  # what the script does for GPU clusters is still done
        assert all("JAX_LOCAL_DEVICE_IDS=0,1,2,3,4,5,6,7" in e and "latency_hiding" in e for e in env_lines)
    else:
        assert all("JAX_LOCAL_DEVICE_IDS= " in e and "xla_gpu" not in e for e in env_lines)


def test_a_requeued_job_keeps_its_isolated_node_out_of_the_new_allocation(tmp_path):
    # node-b crashes twice and is isolated; on the node left, the step then fails for another reason
    # with no step restarts left: the job is requeued, and the requeued job must exclude node-b.
    env = fake_slurm(tmp_path, NODE_B_CRASHES.replace('[[ -n "$FAKE_EXCLUDED" ]] && exit 0',
                                                      '[[ -n "$FAKE_EXCLUDED" ]] && exit 1'))
    env.update({"JAX_PLATFORMS": "cpu", "STEP_RESTARTS": "1", "MAX_REQUEUES": "1"})
    r = subprocess.run(["bash", str(SBATCH), TINY, "data.global_batch_size=8", "--cpu-devices", "2"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "isolating node node-b" in r.stdout and "requeueing (requeue 1 of 1)" in r.stdout
    calls = [line for line in (tmp_path / "log").read_text().splitlines() if line.startswith("scontrol ")]
    assert [c for c in calls if "show job" not in c][-2:] == [
        "scontrol requeue 4242", "scontrol update JobId=4242 ExcNodeList=node-b"], calls


# Every task exits 75 ("restart me") until node-b is excluded. With FAKE_HANG set, node-a's task
# first logs a hang event that names process 1 (node-b) as furthest behind.
EVERY_TASK_EXITS_75 = r"""
[[ -n "$FAKE_EXCLUDED" ]] && exit 0
if [[ "$SLURMD_NODENAME" == node-a ]]; then
  if [[ -n "${FAKE_HANG:-}" ]]; then
    echo "{\"time\": $(date +%s.%N), \"step\": 3, \"kind\": \"hang\", \"process\": 0, \"behind\": [1]}" >> "$FAKE_EVENTS"
  fi
  exit 75
fi
sleep 0.3; exit 75
"""


@pytest.mark.parametrize("hang", [True, False])
def test_a_node_the_runs_hang_events_blame_is_left_out_and_a_plain_exit_75_blames_nobody(tmp_path, hang):
    """Exit 75 alone (a preemption) is no evidence against a node; a hang event of this attempt
    naming one process is, as in `jaxtrain launch`. An older hang event (before the attempt) is not."""
    run = tmp_path / "run"
    run.mkdir()
    old = {"time": time.time() - 3600, "step": 1, "kind": "hang", "process": 0, "behind": [1]}
    (run / "events.jsonl").write_text(json.dumps(old) + "\n")
    env = fake_slurm(tmp_path, EVERY_TASK_EXITS_75)
    env.update({"JAX_PLATFORMS": "cpu", "FAKE_EVENTS": str(run / "events.jsonl")})
    if hang:
        env["FAKE_HANG"] = "1"
    r = subprocess.run(["bash", str(SBATCH), TINY, "data.global_batch_size=8", f"run.output_dir={run}",
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

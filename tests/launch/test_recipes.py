"""The Kubernetes JobSet and the TPU launch script, checked offline (no cluster, no TPU, no gcloud).

- `tpu_gpu_setup/kubernetes/jobset.yaml`: its pod template and Job spec are validated as a
  batch/v1 Job against the core Kubernetes schemas (kubernetes-validate, offline, strict: unknown
  fields fail); the JobSet's own fields against a small JSON schema written here from the JobSet
  v1alpha2 API (jobset.x-k8s.io, `api/jobset/v1alpha2/jobset_types.go`): no PyPI package ships the
  JobSet CRD's OpenAPI schema. The failure rules say what docs/launch.md says (2 and 78 fail the
  JobSet, a disruption is ignored), and the `JAXTRAIN_*` environment it sets, resolved as the
  kubelet would, is what `jaxtrain.runtime.distributed` reads to form one job.
- `tpu_gpu_setup/tpu/launch.sh`: run with a stand-in `gcloud` on PATH that records its arguments;
  the per-worker command it sends is then run in a shell with stand-in `curl` (the metadata
  server) and `~/venv/bin/python`, which records its environment and arguments.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

from jaxtrain.runtime import env
from jaxtrain.runtime.exit_codes import EXIT_HUMAN, EXIT_USAGE

kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate (dev extra)")

REPO = Path(__file__).resolve().parents[2]
JOBSET = REPO / "tpu_gpu_setup/kubernetes/jobset.yaml"
TPU_LAUNCH = REPO / "tpu_gpu_setup/tpu/launch.sh"
K8S_VERSION = "1.30.0"  # podFailurePolicy (onPodConditions DisruptionTarget) is GA since 1.31, beta since 1.26

# The JobSet v1alpha2 fields this recipe uses, from the API's Go types (JobSetSpec, Network,
# FailurePolicy, FailurePolicyRule, ReplicatedJob); additionalProperties false: a misspelt field
# fails here as it would be rejected (or silently dropped) by the controller.
JOBSET_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "jobset.x-k8s.io/v1alpha2"},
        "kind": {"const": "JobSet"},
        "metadata": {"type": "object", "required": ["name"],
                     "properties": {"name": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
                                             "maxLength": 63}}},
        "spec": {
            "type": "object",
            "required": ["replicatedJobs"],
            "additionalProperties": False,
            "properties": {
                "network": {"type": "object", "additionalProperties": False,
                            "properties": {"enableDNSHostnames": {"type": "boolean"},
                                           "subdomain": {"type": "string"},
                                           "publishNotReadyAddresses": {"type": "boolean"}}},
                "failurePolicy": {
                    "type": "object", "additionalProperties": False,
                    "properties": {
                        "maxRestarts": {"type": "integer", "minimum": 0},
                        "restartStrategy": {"enum": ["Recreate", "BlockingRecreate"]},
                        "rules": {"type": "array", "items": {
                            "type": "object", "required": ["name", "action"], "additionalProperties": False,
                            "properties": {
                                "name": {"type": "string", "pattern": "^[a-zA-Z]([-_a-zA-Z0-9]*[a-zA-Z0-9])?$",
                                         "maxLength": 128},
                                "action": {"enum": ["FailJobSet", "RestartJobSet",
                                                    "RestartJobSetAndIgnoreMaxRestarts"]},
                                "onJobFailureReasons": {"type": "array", "items": {"enum": [
                                    "BackoffLimitExceeded", "DeadlineExceeded", "PodFailurePolicy",
                                    "MaxFailedIndexesExceeded"]}},
                                "targetReplicatedJobs": {"type": "array", "items": {"type": "string"}},
                            }}},
                    }},
                "successPolicy": {"type": "object"},
                "startupPolicy": {"type": "object"},
                "suspend": {"type": "boolean"},
                "ttlSecondsAfterFinished": {"type": "integer", "minimum": 0},
                "replicatedJobs": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "required": ["name", "template"], "additionalProperties": False,
                    "properties": {"name": {"type": "string"}, "replicas": {"type": "integer", "minimum": 0},
                                   "template": {"type": "object", "required": ["spec"],
                                                "properties": {"metadata": {"type": "object"},
                                                               "spec": {"type": "object"}}}}}},
            },
        },
    },
}


@pytest.fixture(scope="module")
def jobset() -> dict:
    (doc,) = [d for d in yaml.safe_load_all(JOBSET.read_text()) if d]
    return doc


def workers(jobset: dict) -> dict:
    (replicated,) = jobset["spec"]["replicatedJobs"]
    return replicated


def container(jobset: dict) -> dict:
    (train,) = workers(jobset)["template"]["spec"]["template"]["spec"]["containers"]
    return train


def test_the_jobset_fields_follow_the_v1alpha2_api(jobset):
    jsonschema.validate(jobset, JOBSET_SCHEMA)


def test_the_jobs_it_creates_are_valid_batch_v1_jobs(jobset):
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "jaxtrain-workers-0"},
           "spec": workers(jobset)["template"]["spec"]}
    kubernetes_validate.validate(job, K8S_VERSION, strict=True)  # raises ValidationError


def test_the_schema_checks_would_catch_a_mistake(jobset):
    """The validators are not vacuous: a misspelt field, a wrong type fail."""
    bad = json.loads(json.dumps(jobset))
    bad["spec"]["failurePolicy"]["maxRestart"] = 3
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, JOBSET_SCHEMA)
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "x"},
           "spec": json.loads(json.dumps(workers(jobset)["template"]["spec"]))}
    job["spec"]["podFailurePolicy"]["rules"][0]["onPodCondition"] = job["spec"]["podFailurePolicy"]["rules"][0].pop(
        "onPodConditions")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(job, K8S_VERSION, strict=True)


def test_the_failure_rules_stop_on_2_and_78_and_ignore_disruptions(jobset):
    job = workers(jobset)["template"]["spec"]
    rules = job["podFailurePolicy"]["rules"]
    # The first matching rule wins: a disrupted pod is ignored whatever its exit code.
    assert rules[0] == {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}
    (fail,) = [r for r in rules if r["action"] == "FailJob"]
    assert fail["onExitCodes"] == {"containerName": container(jobset)["name"], "operator": "In",
                                   "values": [EXIT_USAGE, EXIT_HUMAN]}
    # backoffLimit 0: one failed pod fails the Job; podFailurePolicy needs restartPolicy Never.
    assert job["backoffLimit"] == 0 and job["template"]["spec"]["restartPolicy"] == "Never"
    policy = jobset["spec"]["failurePolicy"]
    assert policy["maxRestarts"] >= 1
    assert [r["action"] for r in policy["rules"] if "PodFailurePolicy" in r.get("onJobFailureReasons", [])] == [
        "FailJobSet"]


def resolve_env(entries: list[dict], annotations: dict[str, str]) -> dict[str, str]:
    """The container environment as the kubelet sets it: values, and fieldRefs to the pod's annotations."""
    resolved = {}
    for entry in entries:
        if "value" in entry:
            resolved[entry["name"]] = str(entry["value"])
        else:
            path = entry["valueFrom"]["fieldRef"]["fieldPath"]
            assert path.startswith("metadata.annotations['") and path.endswith("']"), path
            resolved[entry["name"]] = annotations[path[len("metadata.annotations['"):-2]]
    return resolved


@pytest.mark.parametrize("index", [0, 1])
def test_the_environment_it_sets_is_what_distributed_py_reads(jobset, monkeypatch, index):
    from jaxtrain.runtime import distributed

    job = workers(jobset)["template"]["spec"]
    pods = job["parallelism"]
    assert job["completions"] == pods and job["completionMode"] == "Indexed"
    annotations = {"batch.kubernetes.io/job-completion-index": str(index), "jobset.sigs.k8s.io/restart-attempt": "2"}
    pod_env = resolve_env(container(jobset)["env"], annotations)
    names = {n for n in pod_env if n.startswith("JAXTRAIN_")}
    assert names <= set(env.ALL), names - set(env.ALL)
    for name in list(os.environ):
        if name.startswith("JAXTRAIN_"):
            monkeypatch.delenv(name)
    for name, value in pod_env.items():
        monkeypatch.setenv(name, value)
    # Pod 0's stable name in the headless service: <jobset>-<replicatedJob>-<jobIndex>-<podIndex>.<jobset>
    name, rj = jobset["metadata"]["name"], workers(jobset)["name"]
    port = container(jobset)["ports"][0]["containerPort"]
    assert jobset["spec"]["network"]["enableDNSHostnames"] is True
    assert distributed.cluster_env() == {"coordinator_address": f"{name}-{rj}-0-0.{name}:{port}",
                                         "num_processes": pods, "process_id": index}
    assert pod_env[env.RESTART_ATTEMPT] == "2"
    command = container(jobset)["command"]
    assert command[:3] == ["jaxtrain", "train", "--config"] and f"mesh.dcn_data={pods}" in command


# ----------------------------------------------------------------------------- the TPU launch script

FAKE_GCLOUD = r"""#!/bin/bash
"$FAKE_PYTHON" -c 'import json, sys; print(json.dumps(sys.argv[1:]))' "$@" >> "$FAKE_LOG"
case "$*" in
  *" describe "*) echo "10.0.0.7 10.0.0.8 10.0.0.9" ;;
esac
"""


def run_tpu_launch(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, list[list[str]]]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "gcloud").write_text(FAKE_GCLOUD)
    (bin_dir / "gcloud").chmod(0o755)
    log = tmp_path / "gcloud.log"
    run_env = {k: v for k, v in os.environ.items() if not k.startswith("JAXTRAIN_")}
    run_env.update({"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "FAKE_LOG": str(log),
                    "FAKE_PYTHON": sys.executable, "TPU_NAME": "jt-v5p", "ZONE": "us-east5-a"})
    r = subprocess.run(["bash", str(TPU_LAUNCH), *args], env=run_env, capture_output=True, text=True, timeout=60)
    calls = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return r, calls


def test_the_tpu_launch_script_starts_jaxtrain_train_on_every_worker_with_the_job_coordinates(tmp_path):
    overrides = ["run.output_dir=gs://bucket/runs/8b", "train.steps=10", "run.name=a b"]  # a space survives
    r, calls = run_tpu_launch(tmp_path, "configs/llama3-8b.yaml", *overrides)
    assert r.returncode == 0, r.stderr
    describe, ssh = calls
    assert describe[:5] == ["compute", "tpus", "tpu-vm", "describe", "jt-v5p"]
    assert ssh[:5] == ["compute", "tpus", "tpu-vm", "ssh", "jt-v5p"] and "--worker=all" in ssh
    assert ssh[ssh.index("--zone") + 1] == "us-east5-a"
    remote = ssh[ssh.index("--command") + 1]

    # Run the per-worker command as worker 2 would: the metadata server says 2.
    home = tmp_path / "home"
    (home / "jaxtrain").mkdir(parents=True)
    (home / "venv/bin").mkdir(parents=True)
    record = tmp_path / "worker.json"
    (home / "venv/bin/python").write_text(
        f"#!{sys.executable}\nimport json, os, sys\n"
        f"json.dump({{'argv': sys.argv[1:], 'cwd': os.getcwd(), "
        f"'env': {{k: v for k, v in os.environ.items() if k.startswith('JAXTRAIN_')}}}}, open({str(record)!r}, 'w'))\n")
    (home / "venv/bin/python").chmod(0o755)
    bin_dir = tmp_path / "worker-bin"
    bin_dir.mkdir()
    (bin_dir / "curl").write_text('#!/bin/bash\n[[ "$*" == *agent-worker-number* ]] && echo 2\n')
    (bin_dir / "curl").chmod(0o755)
    worker_env = {k: v for k, v in os.environ.items() if not k.startswith("JAXTRAIN_")}
    worker_env.update({"HOME": str(home), "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"})
    w = subprocess.run(["bash", "-c", remote + "\nwait"], env=worker_env, capture_output=True, text=True, timeout=60)
    assert w.returncode == 0 and "worker 2 started" in w.stdout, w.stdout + w.stderr
    seen = json.loads(record.read_text())
    assert seen["argv"] == ["-m", "jaxtrain", "train", "--config", "configs/llama3-8b.yaml", *overrides]
    assert seen["cwd"] == str(home / "jaxtrain")
    assert set(seen["env"]) <= set(env.ALL)
    assert seen["env"] == {env.COORDINATOR: "10.0.0.7:8476", env.NUM_PROCESSES: "3", env.PROCESS_ID: "2"}
    assert (home / "train.pid").read_text().strip().isdigit()


def test_the_tpu_launch_coordinates_are_what_distributed_py_reads(tmp_path, monkeypatch):
    from jaxtrain.runtime import distributed

    for name, value in {env.COORDINATOR: "10.0.0.7:8476", env.NUM_PROCESSES: "3", env.PROCESS_ID: "2"}.items():
        monkeypatch.setenv(name, value)
    assert distributed.cluster_env() == {"coordinator_address": "10.0.0.7:8476", "num_processes": 3, "process_id": 2}


@pytest.mark.parametrize("args, code, want", [
    ([], 2, "usage: launch.sh CONFIG"),
    (["--bogus"], 2, "usage: launch.sh CONFIG"),
])
def test_the_tpu_launch_script_usage_errors(tmp_path, args, code, want):
    r, calls = run_tpu_launch(tmp_path, *args)
    assert r.returncode == code and want in r.stderr and calls == []


def test_the_tpu_launch_stop_sends_sigterm_to_every_worker(tmp_path):
    r, calls = run_tpu_launch(tmp_path, "--stop")
    (ssh,) = calls
    assert r.returncode == 0 and "--worker=all" in ssh and "kill -TERM" in ssh[ssh.index("--command") + 1]

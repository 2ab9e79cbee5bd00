"""Live monitoring: the Prometheus exporter alone, inside the loop (no transfer, no recompile), on a
real two-process job scraped while it trains, the shipped monitoring files checked by promtool,
and a real Prometheus server whose shipped alert rules fire on drills."""

from __future__ import annotations

import collections
import json
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml
from helpers import REPO, TINY
from prometheus_client.parser import text_string_to_metric_families

from jaxtrain.fault.stragglers import Stragglers
from jaxtrain.config import ConfigError, load_config
from jaxtrain.observe.prometheus import Exporter, local_index, textfile_path

MONITORING = REPO / "tpu_gpu_setup" / "monitoring"
SMALL = ["model.num_layers=1", "model.d_model=32", "model.mlp_dim=64", "data.global_batch_size=8",
         "data.seq_len=16", "train.log_every=1"]


def free_ports(n: int) -> int:
    """A base port with n consecutive free ports after it (the processes of one machine)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n >= 65535:
            continue
        ok = True
        for p in range(base, base + n):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", p))
                except OSError:
                    ok = False
        if ok:
            return base
    raise RuntimeError("no free ports")


def scrape(port: int, timeout: float = 2.0) -> dict[str, list[tuple[dict, float]]]:
    """name -> [(labels, value)] of one /metrics scrape."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as r:
        text = r.read().decode()
    out: dict[str, list[tuple[dict, float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((sample.labels, sample.value))
    return out


def value(metrics: dict, name: str, **labels: str) -> float | None:
    for got, v in metrics.get(name, []):
        if all(got.get(k) == w for k, w in labels.items()):
            return v
    return None


# ----------------------------------------------------------------------------- the exporter alone


class FakeWatchdog:
    enabled = True

    def __init__(self):
        self.beat = {"step": 3, "phase": "step", "beat": time.time() - 7.0}

    def heartbeat(self):
        return dict(self.beat)

    def deadline_s(self, phase):
        return {"step": 60.0}.get(phase)


class FakeStragglers:
    """The last compared window of a 3-process job; the ratio is the real Stragglers.ratio."""
    last_table = np.array([[0.1, 0.0, 4, 0.3], [0.3, 0.0, 4, 0.3], [0.1, 0.0, 4, 0.3]])
    ratio = Stragglers.ratio


class FakeCheckpointer:
    last_commit = None


def test_exporter_serves_what_the_loop_hands_it_with_the_run_labels():
    port = free_ports(2)
    ck = FakeCheckpointer()
    x = Exporter(port=port, addr="127.0.0.1", run="r1", process_index=1, process_count=3, host="h0", local=1,
                 attempt=2, watchdog=FakeWatchdog(), checkpointer=ck, rollbacks=[object()],
                 stragglers=FakeStragglers()).start()
    try:
        x.on_step(7, {"loss": 2.5, "grad_norm": 0.75, "loss_scale": 1.0, "learning_rate": 1e-3, "skipped_steps": 1,
                      "tokens": 128.0, "spike": 0.0})
        x.on_record({"step": 7, "tokens_per_sec": 1234.0, "mfu": 0.25, "step_time_s": 0.1, "tflops_per_device": 1.0})
        for wall in (0.01, 0.02, 5.0):
            x.on_iteration(wall, 0.001)
        x.on_event("spike", 7, {"loss": 9.0})
        x.on_event("straggler", 7, {"process": 1})
        x.on_event("straggler", 7, {"process": 0})
        m = scrape(port + 1)  # port + local index
        labels = {"run": "r1", "process": "1", "host": "h0"}
        assert value(m, "jaxtrain_step", **labels) == 7
        assert value(m, "jaxtrain_loss", **labels) == 2.5 and value(m, "jaxtrain_grad_norm") == 0.75
        assert value(m, "jaxtrain_tokens_per_second") == 1234.0 and value(m, "jaxtrain_mfu") == 0.25
        assert value(m, "jaxtrain_skipped_steps") == 1 and value(m, "jaxtrain_restart_attempt") == 2
        assert value(m, "jaxtrain_rollbacks") == 1 and value(m, "jaxtrain_spikes_total") == 1
        assert value(m, "jaxtrain_events_total", kind="straggler") == 2
        assert value(m, "jaxtrain_straggler_reports_total") == 1  # only the one naming process 1
        assert value(m, "jaxtrain_straggler_ratio") == pytest.approx(3.0)  # 0.3 / median(0.1, 0.1)
        assert value(m, "jaxtrain_step_seconds_count") == 3 and value(m, "jaxtrain_step_seconds_sum") == \
            pytest.approx(5.03)
        assert value(m, "jaxtrain_step_seconds_bucket", le="0.016") == 1  # histogram buckets, not a mean
        assert value(m, "jaxtrain_watchdog_phase", phase="step") == 1
        assert value(m, "jaxtrain_watchdog_phase", phase="idle") == 0
        assert 6.5 < value(m, "jaxtrain_watchdog_seconds_since_beat") < 30
        assert value(m, "jaxtrain_watchdog_deadline_seconds") == 60
        before = value(m, "jaxtrain_seconds_since_checkpoint")
        assert value(m, "jaxtrain_checkpoint_step") is None  # nothing committed yet
        ck.last_commit = (5, time.time() - 1.0, 0.02, 0.5)
        m = scrape(port + 1)
        assert 0.9 < value(m, "jaxtrain_seconds_since_checkpoint") < 5 and value(m, "jaxtrain_checkpoint_step") == 5
        assert value(m, "jaxtrain_checkpoint_blocking_seconds") == 0.02
        assert value(m, "jaxtrain_checkpoint_write_seconds") == 0.5
        assert before >= 0
        with pytest.raises(OSError):
            scrape(port)  # the base port belongs to the machine's first process, not this one
    finally:
        x.close()


def test_a_taken_port_is_a_warning_and_an_inert_exporter_does_nothing(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        warnings: list[str] = []
        x = Exporter(port=s.getsockname()[1], addr="127.0.0.1", warn=warnings.append).start()
        assert x.port == 0 and "cannot serve /metrics" in warnings[0]  # training goes on
        x.close()
    off = Exporter()
    assert not off.enabled
    off.on_step(1, {"loss": 1.0})
    off.on_iteration(0.1, 0.0)
    assert off.step == 0
    off.close()


def test_the_textfile_is_written_atomically_per_process(tmp_path):
    assert textfile_path("/x/j.prom", 3, 4) == "/x/j-p3.prom"
    assert textfile_path("/x/j-{process}.prom", 3, 4) == "/x/j-3.prom"
    assert textfile_path("/x/j.prom", 0, 1) == "/x/j.prom"
    path = tmp_path / "node" / "jaxtrain.prom"
    x = Exporter(textfile=str(path), run="t", process_index=1, process_count=2).start()
    x.on_step(11, {"loss": 1.5})
    x.close()
    written = tmp_path / "node" / "jaxtrain-p1.prom"
    m = {s.name: s.value for f in text_string_to_metric_families(written.read_text()) for s in f.samples}
    assert m["jaxtrain_step"] == 11 and m["jaxtrain_loss"] == 1.5
    assert [p.name for p in written.parent.iterdir()] == ["jaxtrain-p1.prom"]  # no temporary left behind


def test_local_index_counts_the_processes_on_the_same_machine():
    hosts = ["a", "a", "b", "a", "b"]
    assert [local_index(hosts, i) for i in range(5)] == [0, 1, 0, 2, 1]


def test_config_refuses_bad_monitoring_keys():
    with pytest.raises(ConfigError, match="observe.prometheus_port"):
        load_config(TINY, ["observe.prometheus_port=70000"])
    with pytest.raises(ConfigError, match=r"must end in \.prom"):
        load_config(TINY, ["observe.prometheus_textfile=/tmp/x.txt"])
    assert load_config(TINY, ["observe.prometheus_port=9400"]).observe.prometheus_port == 9400


def test_health_checks_warn_before_a_failure_and_are_published():
    from collections import namedtuple

    from jaxtrain.observe.health import Health

    Usage = namedtuple("Usage", "total used free")
    events: list[tuple] = []
    memory = [(50.0, 100.0)]
    disk = [Usage(1000, 500, 500)]
    h = Health(2, lambda kind, step, **d: events.append((kind, step, d)), disk_path="/",
               memory=lambda: memory[0], disk=lambda _: disk[0])
    for step in range(1, 9):  # four healthy windows of 0.1 s steps
        h.after_step(step, 0.1)
    assert [e[1] for e in events] == [2, 4, 6, 8] and events[-1][2]["warnings"] == []
    assert events[-1][2]["step_time_ratio"] == 1.0 and events[-1][2]["disk_free_ratio"] == 0.5
    memory[0], disk[0] = (5.0, 100.0), Usage(1000, 990, 10)  # memory pressure, a disk filling
    h.after_step(9, 0.3)
    h.after_step(10, 0.3)  # a device getting slower: 3x the running median
    kind, step, d = events[-1]
    assert kind == "health" and step == 10 and d["warnings"] == ["disk", "memory", "step"], d
    assert d["step_time_ratio"] == pytest.approx(3.0)
    port = free_ports(1)
    x = Exporter(port=port, addr="127.0.0.1", health=h).start()
    try:
        m = scrape(port)
        assert value(m, "jaxtrain_health_warning", check="disk") == 1
        assert value(m, "jaxtrain_health_host_memory_available_ratio") == 0.05
    finally:
        x.close()
    off = Health(0, lambda *a, **k: events.append(a))
    n = len(events)
    off.after_step(2, 1.0)
    assert len(events) == n  # 0 = off


def real_preflight_report() -> dict:
    """The in-process preflight on 2 of the simulated devices (one process, a data axis of 2): the
    report run_preflight returns and logs, small sizes (about 1 s)."""
    from jax.sharding import Mesh

    from jaxtrain.fault.preflight import run_preflight

    logged: list[tuple] = []
    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    report = run_preflight(load_config(TINY), mesh, ["h0"], lambda kind, step, **d: logged.append((kind, d)),
                           matmul_n=64, mbytes=0.01, repeats=1)
    assert logged == [("preflight", report)]
    return report


def four_process_report(real: dict) -> dict:
    """The report of a 4-process job on 2 hosts whose process 3 has a bad network card (its two
    inter-node pairs 15x slower), with the real report's keys and the real verdict (preflight_plan)."""
    from jaxtrain.fault.preflight_plan import verdict

    hosts = ["a", "a", "b", "b"]
    pairs = {(0, 1): 9.0, (2, 3): 8.8, (0, 2): 1.4, (1, 2): 1.5, (0, 3): 0.1, (1, 3): 0.1}
    links = verdict(pairs, hosts, 0.7)
    matmul = [1.5, 1.6, 1.55, real["matmul_tflops"][0]]
    named = sorted(links["named"])
    report = {**real, "processes": 4, "hosts": hosts, "matmul_tflops": matmul,
              "median_matmul_tflops": float(np.median(matmul)),
              "axes_gbps": {**real["axes_gbps"], "fsdp": {"all_reduce_gbps": 0.25, "all_gather_gbps": 0.5}},
              "pairs_gbps": {f"{i}-{j}": v for (i, j), v in pairs.items()}, "named": named,
              "named_hosts": [hosts[p] for p in named], "slow_pairs": links["slow_pairs"],
              "slow_pair_hosts": [[hosts[i], hosts[j]] for i, j in links["slow_pairs"]],
              "named_for_links": links["named"], "reference_gbps": links["reference_gbps"], "rounds": 3, "rails": 1}
    assert set(report) == set(real)
    assert named == [3] and links["slow_pairs"] == [[0, 3], [1, 3]], links
    assert set(links["reference_gbps"]) == {"intra_node", "inter_node"}  # the exporter's `link` label values
    return report


def real_profile_summary() -> dict:
    """profiling.summarize_events's split of two executions on two devices (milliseconds: an
    elementwise fusion 30, an all-reduce of 4 MB wire bytes 20, a fusion 10; 40 of host wait between
    the executions): per step per device 40 ms elementwise, 20 all-reduce, 20 host wait."""
    from jaxtrain.observe.profiling import HloOp, _Event, summarize_events

    ms, line = 1e6, ("/host:CPU", "tf_XLAEigen/1")
    events = [_Event((offset + a) * ms, (offset + b) * ms, op, "jit_step", run, device, line)
              for device in (0, 1) for run, offset in ((0, 0), (1, 100))
              for a, b, op in ((0, 30, "fusion.1"), (30, 50, "all-reduce.5"), (50, 60, "fusion.3"))]
    hlo = {"all-reduce.5": HloOp("all-reduce.5", "all-reduce", "all-reduce", 4e6, "")}
    return summarize_events(events, hlo, {"steps": [3, 4], "platform": "cpu"}, top=0)


def test_preflight_and_profile_figures_are_published():
    """A real single-process preflight report, a 4-process one of the same shape (process 3 named
    for its links), and a real profile summary: each process publishes its own figures."""
    real = real_preflight_report()
    four = four_process_report(real)
    summary = real_profile_summary()
    assert summary["step_time_s"] == pytest.approx(0.08) and summary["collectives_s"] == pytest.approx(0.02)
    port = free_ports(2)
    solo = Exporter(port=port, addr="127.0.0.1", run="r", process_index=0, host="h0").start()
    bad = Exporter(port=port, addr="127.0.0.1", run="r", process_index=3, process_count=4, host="b", local=1).start()
    try:
        assert value(scrape(port), "jaxtrain_preflight_named") is None  # nothing before the check
        solo.on_preflight(real)
        solo.on_profile(summary)
        bad.on_preflight(four)
        m = scrape(port)
        assert value(m, "jaxtrain_preflight_matmul_tflops", process="0") == real["matmul_tflops"][0] > 0
        assert value(m, "jaxtrain_preflight_matmul_median_tflops") == real["median_matmul_tflops"]
        for op in ("all-reduce", "all-gather"):
            got = value(m, "jaxtrain_preflight_axis_gbps", axis="data", op=op)
            assert got == real["axes_gbps"]["data"][op.replace("-", "_") + "_gbps"] and got > 0, op
        assert value(m, "jaxtrain_preflight_named") == 0 and value(m, "jaxtrain_preflight_slow_links") == 0
        assert "jaxtrain_preflight_link_gbps" not in m and "jaxtrain_preflight_link_min_gbps" not in m  # no pairs
        parts = {labels["part"]: (labels["group"], v) for labels, v in m["jaxtrain_profile_seconds"]}
        assert parts["elementwise"] == ("compute", pytest.approx(0.04))
        assert parts["all-reduce"] == ("collective", pytest.approx(0.02))
        assert parts["host_wait"] == ("wait", pytest.approx(0.02)) and parts["idle"] == ("wait", 0.0)
        assert sum(v for _, v in parts.values()) == pytest.approx(0.08)
        assert value(m, "jaxtrain_profile_step_time_seconds") == pytest.approx(0.08)
        assert value(m, "jaxtrain_profile_collective_fraction") == pytest.approx(0.25)
        assert value(m, "jaxtrain_profile_collective_gbps", op="all-reduce") == pytest.approx(0.2)  # 4 MB / 20 ms
        assert [labels["op"] for labels, _ in m["jaxtrain_profile_collective_gbps"]] == ["all-reduce"]
        assert value(m, "jaxtrain_profile_step") == 4 and value(m, "jaxtrain_profile_steps") == 2

        m = scrape(port + 1)  # process 3, the machine's second
        assert value(m, "jaxtrain_preflight_matmul_tflops", process="3") == real["matmul_tflops"][0]
        assert value(m, "jaxtrain_preflight_named") == 1 and value(m, "jaxtrain_preflight_slow_links") == 2
        links = {(labels["peer"], labels["link"]): v for labels, v in m["jaxtrain_preflight_link_gbps"]}
        assert links == {("0", "inter_node"): 0.1, ("1", "inter_node"): 0.1, ("2", "intra_node"): 8.8}
        assert value(m, "jaxtrain_preflight_link_min_gbps") == 0.1
        assert value(m, "jaxtrain_preflight_link_reference_gbps", link="inter_node") == pytest.approx(1.45)
        assert value(m, "jaxtrain_preflight_link_reference_gbps", link="intra_node") == pytest.approx(8.9)
        assert value(m, "jaxtrain_preflight_axis_gbps", axis="fsdp", op="all-gather") == 0.5
        assert "jaxtrain_profile_seconds" not in m  # only the profiling process has a profile
    finally:
        solo.close()
        bad.close()


# ----------------------------------------------------------------------------- inside the loop


def test_the_endpoint_adds_no_transfer_and_no_recompile_while_scraped(tmp_path):
    """The loop under jax.transfer_guard('disallow') with the endpoint on and scraped every 20 ms;
    steps 3-4 profiled, their split published once summarized (off the loop)."""
    from jaxtrain.trainer import Trainer

    port = free_ports(1)
    cfg = load_config(TINY, [f"run.output_dir={tmp_path}", "train.steps=6", "train.log_every=2",
                             "checkpoint.every_steps=3", "checkpoint.save_at_end=false",
                             f"observe.prometheus_port={port}", "observe.prometheus_addr=127.0.0.1",
                             f"observe.prometheus_textfile={tmp_path}/m.prom", "fault.health_every_steps=2",
                             "train.profile_steps=[3,4]", *SMALL[:5]])
    trainer = Trainer(cfg, devices=jax.devices()[:2])
    seen: list[float] = []
    stop = threading.Event()

    def scraper() -> None:
        while not stop.is_set():
            try:
                seen.append(value(scrape(port), "jaxtrain_step"))
            except OSError:
                pass
            time.sleep(0.02)

    t = threading.Thread(target=scraper, daemon=True)
    t.start()
    try:
        with jax.transfer_guard("disallow"):
            trainer.fit()
        time.sleep(0.1)
    finally:
        stop.set()
        t.join()
        trainer.close()
    compiled = trainer.compiled_step
    assert trainer.step_count == 6 and trainer.compiled_step is compiled
    assert len(seen) > 3 and max(seen) == 6, seen  # it was scraped while training
    m = {s.name: s.value for f in text_string_to_metric_families((tmp_path / "m.prom").read_text()) for s in f.samples}
    assert m["jaxtrain_step"] == 6 and m["jaxtrain_checkpoint_step"] == 6
    assert m["jaxtrain_profile_step"] == 4 and m["jaxtrain_profile_steps"] >= 1  # close() waited for the summary
    assert 0 < m["jaxtrain_profile_collective_fraction"] < 1  # data=2: the gradients' all-reduce
    assert m["jaxtrain_profile_step_time_seconds"] > 0
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    health = [e for e in events if e["kind"] == "health"]
    assert [e["step"] for e in health] == [2, 4, 6] and "host_memory_available_ratio" in health[0], health
    # Every event of the run is counted by kind, also those raised before the exporter existed and
    # those the trainer writes itself (start, done): they missed the count before.
    counted = {s.labels["kind"]: s.value for f in text_string_to_metric_families((tmp_path / "m.prom").read_text())
               for s in f.samples if s.name == "jaxtrain_events_total"}
    assert counted == dict(collections.Counter(e["kind"] for e in events)), (counted, [e["kind"] for e in events])
    assert {"start", "done", "checkpoint_saved"} <= set(counted), counted


# ----------------------------------------------------------------------------- two processes


def launch(env: dict, out: Path, *overrides: str, restarts: int = 0) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "jaxtrain", "launch", "--num-processes", "2",
                             "--cpu-devices", "1", "--max-restarts", str(restarts), "--grace-period-s", "2", "--",
                             "train", "--config", TINY, *SMALL, f"run.output_dir={out}",
                             f"checkpoint.compilation_cache_dir={env['CACHE']}", "observe.prometheus_addr=127.0.0.1",
                             *overrides], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def scrape_until_done(job: subprocess.Popen, ports: list[int], timeout: float = 300) -> list[dict]:
    """Samples (time, port, metrics) of every port until the job ends."""
    samples = []
    deadline = time.time() + timeout
    while job.poll() is None and time.time() < deadline:
        for port in ports:
            try:
                samples.append({"time": time.time(), "port": port, "m": scrape(port, timeout=1.0)})
            except OSError:
                pass
        time.sleep(0.1)
    if job.poll() is None:
        job.kill()
    return samples


@pytest.mark.multiprocess
@pytest.mark.slow
def test_both_processes_are_scraped_while_training_and_the_values_move(tmp_path, child_env):
    port = free_ports(2)
    out = tmp_path / "run"
    job = launch(child_env, out, "train.steps=60", "checkpoint.every_steps=20", "chaos.slow_process=0",
                 "chaos.slow_seconds=0.05", f"observe.prometheus_port={port}", "fault.straggler_every=10")
    samples = scrape_until_done(job, [port, port + 1])
    _, err = job.communicate()
    assert job.returncode == 0, err[-3000:]
    for process, p in enumerate((port, port + 1)):
        mine = [s["m"] for s in samples if s["port"] == p]
        steps = [value(m, "jaxtrain_step") for m in mine]
        assert len(mine) > 5 and steps[-1] > steps[0] and steps == sorted(steps), (process, steps)
        run = load_config(TINY).run.name
        assert None not in {value(m, "jaxtrain_step", process=str(process), run=run) for m in mine}
        assert max(value(m, "jaxtrain_tokens_per_second") or 0 for m in mine) > 0
        # seconds since the last checkpoint resets at a save: it falls while the committed step rises
        ck = [(value(m, "jaxtrain_checkpoint_step"), value(m, "jaxtrain_seconds_since_checkpoint")) for m in mine]
        resets = [i for i in range(1, len(ck)) if ck[i][1] < ck[i - 1][1] and (ck[i][0] or 0) > (ck[i - 1][0] or 0)]
        assert resets, (process, ck)
        assert {c for c, _ in ck if c is not None} >= {20, 40}, ck
    ratios = [value(s["m"], "jaxtrain_straggler_ratio") for s in samples if s["port"] == port]
    assert max(r or 0 for r in ratios) > 1.5, ratios  # process 0 sleeps 50 ms more per step


# ----------------------------------------------------------------------------- the shipped files


def promtool() -> str:
    tool = shutil.which("promtool")
    if tool is None:
        pytest.skip("promtool not installed (Debian's `prometheus` package; .ci/run installs it where apt is available)")
    return tool


def test_promtool_accepts_the_shipped_rules_and_configs():
    tool = promtool()
    r = subprocess.run([tool, "check", "rules", str(MONITORING / "alerts.yml")], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    r = subprocess.run([tool, "check", "config", "prometheus-slurm.yml"], capture_output=True, text=True,
                       cwd=MONITORING)
    assert r.returncode == 0, r.stdout + r.stderr


def test_promtool_accepts_the_kubernetes_config():
    tool = promtool()
    r = subprocess.run([tool, "check", "config", "prometheus-kubernetes.yml"], capture_output=True, text=True,
                       cwd=MONITORING)
    if "field kubernetes_sd_configs not found" in r.stdout + r.stderr:
        pytest.skip("this promtool is built without Kubernetes service discovery (Debian's package strips it)")
    assert r.returncode == 0, r.stdout + r.stderr


def test_promtool_unit_tests_of_the_alert_rules():
    """promtool's own rule tests (alerts_test.yml): each alert fires on its series and not on healthy ones."""
    tool = promtool()
    r = subprocess.run([tool, "test", "rules", "alerts_test.yml"], capture_output=True, text=True, cwd=MONITORING)
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_dashboard_and_manifests_are_well_formed():
    dash = json.loads((MONITORING / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    assert len(dash["panels"]) >= 8 and all("jaxtrain_" in e for e in exprs)
    for required in ("jaxtrain_step", "jaxtrain_tokens_per_second", "jaxtrain_mfu", "jaxtrain_seconds_since_checkpoint",
                     "jaxtrain_straggler_ratio", "jaxtrain_watchdog_seconds_since_beat"):
        assert any(required in e for e in exprs), required
    docs = list(yaml.safe_load_all((MONITORING / "servicemonitor.yaml").read_text()))
    kinds = {d["kind"] for d in docs}
    assert {"Service", "ServiceMonitor"} <= kinds, kinds


# ----------------------------------------------------------------------------- a real Prometheus


class PrometheusServer:
    """Debian's prometheus on loopback, with the shipped SLURM scrape config (file_sd targets) and the
    shipped alert rules; scrape and rule evaluation every second."""

    def __init__(self, tmp: Path, targets: list[str]):
        binary = shutil.which("prometheus")
        if binary is None:
            pytest.skip("prometheus not installed (Debian's `prometheus` package; .ci/run installs it where apt is "
                        "available)")
        config = yaml.safe_load((MONITORING / "prometheus-slurm.yml").read_text())
        config["global"].update(scrape_interval="1s", evaluation_interval="1s")
        config["rule_files"] = [str(MONITORING / r) for r in config["rule_files"]]
        (tmp / "targets").mkdir(parents=True)
        sd = config["scrape_configs"][0]["file_sd_configs"][0]
        sd["files"] = [str(tmp / f) for f in sd["files"]]
        (tmp / "targets" / "run.json").write_text(json.dumps([{"targets": targets, "labels": {"slurm_job": "t"}}]))
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.port = free_ports(1)
        self.log = open(tmp / "prometheus.log", "w")
        self.proc = subprocess.Popen([binary, f"--config.file={tmp / 'prometheus.yml'}",
                                      f"--storage.tsdb.path={tmp / 'data'}",
                                      f"--web.listen-address=127.0.0.1:{self.port}"], stdout=self.log, stderr=self.log)
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                self.api("status/runtimeinfo")
                return
            except OSError:
                time.sleep(0.5)
        raise RuntimeError("prometheus did not come up: " + (tmp / "prometheus.log").read_text()[-2000:])

    def api(self, path: str, **params: str) -> dict:
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        with urllib.request.urlopen(url, timeout=5) as r:
            return json.loads(r.read())["data"]

    def firing(self) -> list[dict]:
        return [a for a in self.api("alerts")["alerts"] if a["state"] == "firing"]

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)
        self.log.close()


def watch_alerts(server: PrometheusServer, job: subprocess.Popen, timeout: float = 400) -> tuple[dict, set[int]]:
    """alertname -> the set of label dicts seen firing while the job ran; and the processes Prometheus scraped."""
    seen: dict[str, list[dict]] = {}
    scraped: set[int] = set()
    deadline = time.time() + timeout
    while job.poll() is None and time.time() < deadline:
        try:
            for a in server.firing():
                seen.setdefault(a["labels"]["alertname"], []).append(a["labels"])
            for r in server.api("query", query="jaxtrain_step")["result"]:
                scraped.add(int(r["metric"]["process"]))
        except OSError:
            pass
        time.sleep(0.5)
    if job.poll() is None:
        job.kill()
    job.communicate()
    return seen, scraped


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_real_prometheus_scrapes_the_run_and_the_shipped_alerts_fire_on_drills(tmp_path, child_env):
    """Prometheus (shipped scrape config and rules) scrapes a two-process job: a slow process raises
    JaxtrainStraggler for that process only, three spikes raise JaxtrainSpikeStorm, and a hung process
    raises JaxtrainHangSuspected (half its 20 s step deadline) before the watchdog ends the job."""
    port = free_ports(2)
    server = PrometheusServer(tmp_path / "prom", [f"127.0.0.1:{port}", f"127.0.0.1:{port + 1}"])
    try:
        drill = launch(child_env, tmp_path / "drill", "train.steps=40", f"observe.prometheus_port={port}",
                       "chaos.slow_process=1", "chaos.slow_seconds=0.3", "fault.straggler_every=4",
                       "chaos.spike_at_steps=[12, 14, 16]", "stability.min_history=5", "stability.max_spikes=0")
        seen, scraped = watch_alerts(server, drill)
        assert drill.returncode == 0 and scraped == {0, 1}, (drill.returncode, scraped)
        assert {a["process"] for a in seen.get("JaxtrainStraggler", [])} == {"1"}, seen
        assert seen.get("JaxtrainSpikeStorm"), seen
        assert "JaxtrainHangSuspected" not in seen and "JaxtrainNoCheckpoint" not in seen, seen

        hang = launch(child_env, tmp_path / "hang", "train.steps=40", f"observe.prometheus_port={port}",
                      "chaos.hang_at_step=6", "chaos.hang_process=1", "fault.hang_timeout_s=20")
        seen, scraped = watch_alerts(server, hang)
        assert hang.returncode == 75, hang.returncode  # the watchdog ended it, after the alert
        assert "1" in {a["process"] for a in seen.get("JaxtrainHangSuspected", [])}, seen
    finally:
        server.close()

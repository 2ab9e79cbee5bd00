"""Live metrics for Prometheus: a `/metrics` endpoint per process and an optional textfile.

`observe.prometheus_port` (0 = off) starts prometheus_client's HTTP server on a daemon thread, on
port `prometheus_port + local index` (the processes sharing a machine, counted in the job's host
table, each get their own port). `observe.prometheus_textfile` writes the same metrics, atomically
(a temporary file renamed into place), every TEXTFILE_EVERY_S seconds and at the end, for
node_exporter's textfile collector.

The loop never waits for a scrape and a scrape never touches the device. The loop hands over
values it already holds as Python numbers (the step's metrics, read one step late; the metrics
record of a log step; each iteration's wall time and data wait; the events it raises): a few dict
assignments and two histogram observations per step. Everything else is read on the scrape thread
from host-side state: the watchdog's heartbeat, the checkpointer's last commit, the straggler
check's last gathered table, the rollback count, and `device.memory_stats()` (an allocator query
of the runtime, no transfer, no sync; absent on the CPU). Two figures arrive once, as plain dicts
the exporter reduces on arrival: the preflight report (`on_preflight`, at start-up) and the split of
the profiled steps (`on_profile`, from the profiler's summary thread once its trace is written).

Every series carries the labels `run` (run.name), `process` and `host`. Names start with
`jaxtrain_`; what each means is in docs/monitoring.md, the alert rules built on them in
tpu_gpu_setup/monitoring/.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Callable, Iterable, Sequence

from prometheus_client import CollectorRegistry, Histogram, start_http_server, write_to_textfile
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from jaxtrain.observe.profiling import COLLECTIVE_KINDS, COMPUTE_KINDS, WAIT_KINDS

_log = logging.getLogger(__name__)

LABELS = ("run", "process", "host")
TEXTFILE_EVERY_S = 10.0  # node_exporter reads the file at its own scrape; a few seconds stale is fine
# Step time and data wait, in seconds: 1 ms .. ~2 min, doubling (the step of a tiny CPU test to a
# stalled step of a large run).
TIME_BUCKETS = tuple(0.001 * 2 ** k for k in range(18)) + (float("inf"),)
PHASES = ("startup", "compile", "step", "checkpoint", "idle")

# metrics.jsonl fields published from the log steps' records (gauge name, help).
RECORD_GAUGES = {
    "tokens_per_sec": ("jaxtrain_tokens_per_second", "Tokens per second over the last log interval"),
    "mfu": ("jaxtrain_mfu", "Model FLOPs utilisation over the last log interval (0..1)"),
    "tflops_per_device": ("jaxtrain_tflops_per_device", "Model TFLOP/s per device over the last log interval"),
    "step_time_s": ("jaxtrain_step_time_seconds", "Mean step time over the last log interval"),
}
# The step's own metrics, published from every step (gauge name, help).
STEP_GAUGES = {
    "loss": ("jaxtrain_loss", "Training loss of the last finished step"),
    "grad_norm": ("jaxtrain_grad_norm", "Global gradient norm of the last finished step"),
    "loss_scale": ("jaxtrain_loss_scale", "Loss scale (fp16; 1 otherwise)"),
    "learning_rate": ("jaxtrain_learning_rate", "Learning rate of the last finished step"),
    "skipped_steps": ("jaxtrain_skipped_steps", "Steps whose update was not applied, over the whole run"),
}
# The profile summary's parts by group (the `group` label of jaxtrain_profile_seconds): summing a
# group gives compute, collective or wait time per step; summing all gives the step time.
PROFILE_GROUPS = {**{k: "compute" for k in COMPUTE_KINDS}, **{k: "collective" for k in COLLECTIVE_KINDS},
                  **{k: "wait" for k in WAIT_KINDS}}


def local_index(hosts: Sequence[str], process_index: int) -> int:
    """This process's index among the job's processes on its own machine (its port offset)."""
    return list(hosts[:process_index]).count(hosts[process_index])


def _number(v: Any) -> float | None:
    """A finite float, or None (a report's NaN or missing figure is no sample)."""
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if f == f and f not in (float("inf"), float("-inf")) else None


def preflight_figures(report: dict[str, Any], me: int) -> dict[str, Any]:
    """Process `me`'s figures from a preflight report (`fault.preflight.run_preflight`'s return, the
    `preflight` event): its matmul rate and the job's median, the pairs touching it by peer and link
    kind (intra_node / inter_node) and the slowest of them, the verdict's reference per link kind,
    its per-axis collective bandwidths, whether it was named, and how many slow pairs touch it."""
    hosts = list(report.get("hosts") or [])
    links: dict[str, tuple[str, float]] = {}  # peer -> (link kind, GB/s)
    for pair, gbps in (report.get("pairs_gbps") or {}).items():
        i, j = (int(p) for p in pair.split("-"))
        v = _number(gbps)
        if me in (i, j) and v is not None:
            # preflight_plan.pair_class's kinds (not imported: fault already uses observe)
            kind = "unknown" if max(i, j) >= len(hosts) else "intra_node" if hosts[i] == hosts[j] else "inter_node"
            links[str(i + j - me)] = (kind, v)
    # axes_gbps: axis -> {"all_reduce_gbps", "all_gather_gbps"}; the op label as the profile spells it
    axes = {(axis, op.removesuffix("_gbps").replace("_", "-")): _number(v)
            for axis, ops in (report.get("axes_gbps") or {}).items() for op, v in ops.items()}
    matmul = list(report.get("matmul_tflops") or [])
    return {"matmul_tflops": _number(matmul[me]) if me < len(matmul) else None,
            "median_matmul_tflops": _number(report.get("median_matmul_tflops")),
            "links": links, "link_min_gbps": min((v for _, v in links.values()), default=None),
            "reference_gbps": {k: _number(v) for k, v in (report.get("reference_gbps") or {}).items()},
            "axes": {k: v for k, v in axes.items() if v is not None},
            "named": me in (report.get("named") or ()),
            "slow_links": sum(1 for pair in (report.get("slow_pairs") or ()) if me in pair)}


def profile_figures(summary: dict[str, Any]) -> dict[str, Any]:
    """What the metrics take from a profile summary (`observe.profiling.summarize`): seconds per step
    of each part (averaged over the profiled devices), the step time, the collectives' share of it,
    each collective kind's achieved GB/s, the last profiled step and the steps averaged."""
    step_time = _number(summary.get("step_time_s"))
    collectives = _number(summary.get("collectives_s"))
    profiled = summary.get("profiled_steps") or []
    return {"parts": {p: v for p, v in ((p, _number(v)) for p, v in (summary.get("parts_s") or {}).items())
                      if v is not None},
            "step_time_s": step_time,
            "collective_fraction": collectives / step_time if step_time and collectives is not None else None,
            "gbps": {k: v for k, v in ((k, _number((c or {}).get("gbytes_per_s")))
                                       for k, c in (summary.get("collectives") or {}).items()) if v is not None},
            "step": _number(profiled[-1]) if profiled else None, "steps": _number(summary.get("steps"))}


def textfile_path(template: str, process_index: int, process_count: int) -> str:
    """`{process}` in the path becomes the process index; without it, a multi-process job's files
    get `-p<index>` before `.prom` (processes sharing a node must not overwrite each other)."""
    if "{process}" in template:
        return template.replace("{process}", str(process_index))
    if process_count > 1:
        return f"{template[:-len('.prom')]}-p{process_index}.prom"
    return template


class Exporter:
    """The metrics of one process. Construct, `start()`, feed from the loop, `close()` at the end.

    With neither a port nor a textfile it is inert: every method returns at once.
    """

    def __init__(self, *, port: int = 0, addr: str = "", textfile: str | None = None, run: str = "run",
                 process_index: int = 0, process_count: int = 1, host: str = "", local: int = 0,
                 attempt: int = 0, watchdog: Any = None, checkpointer: Any = None, rollbacks: Any = None,
                 stragglers: Any = None, devices: Iterable[Any] = (), checkpoint_every: tuple[int, float] = (0, 0.0),
                 health: Any = None, warn: Callable[[str], None] | None = None):
        self.enabled = port > 0 or bool(textfile)
        self.port = port + local if port > 0 else 0
        self.addr = addr
        self.textfile = textfile_path(textfile, process_index, process_count) if textfile else None
        self.labels = {"run": run, "process": str(process_index), "host": host}
        self.process_index, self.attempt = process_index, attempt
        self.watchdog, self.checkpointer, self.rollbacks, self.stragglers = watchdog, checkpointer, rollbacks, stragglers
        self.devices = list(devices)
        self.checkpoint_every = checkpoint_every  # (checkpoint.every_steps, checkpoint.every_minutes)
        self.health = health  # an observe.health.Health (fault.health_every_steps), or None
        self._warn = warn or _log.warning  # `jaxtrain: warning: ...` on stderr (observe/console.py)
        self.started_at = time.time()
        # Written by the loop thread, read by the scrape thread: plain assignments of Python numbers.
        self.step = 0
        self.step_values: dict[str, float] = {}
        self.record_values: dict[str, float] = {}
        self.events: dict[str, int] = {}  # kind -> events this process raised or saw
        self.straggler_reports = 0  # straggler events naming this process
        # Set once, each a new dict (an assignment the scrape thread sees whole): preflight_figures()
        # of the start-up check (multi-process jobs), profile_figures() of the profiled steps
        # (train.profile_steps; the profiling process only, the first).
        self.preflight: dict[str, Any] | None = None
        self.profile: dict[str, Any] | None = None
        self.registry = CollectorRegistry(auto_describe=True)
        self.step_seconds = Histogram("jaxtrain_step_seconds", "Wall time of each loop iteration (one step)",
                                      LABELS, registry=self.registry, buckets=TIME_BUCKETS).labels(**self.labels)
        self.data_wait = Histogram("jaxtrain_data_wait_seconds", "Time each step waited for its batch",
                                   LABELS, registry=self.registry, buckets=TIME_BUCKETS).labels(**self.labels)
        self.registry.register(_Snapshot(self))
        self._server: Any = None
        self._stop = threading.Event()
        self._writer: threading.Thread | None = None

    # -- life cycle

    def start(self) -> "Exporter":
        """Serve /metrics (and start the textfile writer). A port that is taken is a warning, not a
        failure: monitoring must never stop a training run."""
        if self.port:
            try:
                self._server, _ = start_http_server(self.port, addr=self.addr, registry=self.registry)
            except OSError as e:
                self._warn(f"observe.prometheus_port: cannot serve /metrics on port {self.port}: {e}")
                self.port = 0
        if self.textfile:
            self._writer = threading.Thread(target=self._write_loop, name="jaxtrain-prometheus-textfile", daemon=True)
            self._writer.start()
        return self

    def close(self) -> None:
        """Write the textfile one last time and stop serving."""
        if not self.enabled:
            return
        self._stop.set()
        if self._writer is not None:
            self._writer.join(timeout=5)
            self._writer = None
        if self.textfile:
            self.write_textfile()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def write_textfile(self) -> None:
        """The metrics, atomically, into observe.prometheus_textfile (a failure is one warning line)."""
        try:
            os.makedirs(os.path.dirname(os.path.abspath(self.textfile)), exist_ok=True)
            write_to_textfile(self.textfile, self.registry)  # a temporary file renamed into place
        except OSError as e:
            self._warn(f"observe.prometheus_textfile: cannot write {self.textfile}: {e}")

    def _write_loop(self) -> None:
        while not self._stop.wait(TEXTFILE_EVERY_S):
            self.write_textfile()

    # -- the loop's side (cheap, Python values only)

    def on_step(self, step: int, values: dict[str, Any]) -> None:
        """A finished step's metrics, already read to the host by the loop."""
        if not self.enabled:
            return
        self.step = step
        self.step_values = {k: float(values[k]) for k in STEP_GAUGES if k in values}

    def on_record(self, record: dict[str, Any]) -> None:
        """A log step's metrics.jsonl record (throughput over the log interval)."""
        if self.enabled:
            self.record_values = {k: float(record[k]) for k in RECORD_GAUGES if k in record}

    def on_iteration(self, wall_s: float, data_wait_s: float) -> None:
        """One loop iteration's wall time and its batch's data wait."""
        if self.enabled:
            self.step_seconds.observe(wall_s)
            self.data_wait.observe(data_wait_s)

    def on_event(self, kind: str, step: int, details: dict[str, Any]) -> None:
        """An event the loop raised (counted by kind; straggler reports about this process too)."""
        if not self.enabled:
            return
        self.events[kind] = self.events.get(kind, 0) + 1
        if kind == "straggler" and details.get("process") == self.process_index:
            self.straggler_reports += 1

    def on_preflight(self, report: dict[str, Any]) -> None:
        """The preflight report (`run_preflight`'s return): this process's figures are taken out now,
        once, so that a scrape reads plain numbers."""
        if self.enabled:
            self.preflight = preflight_figures(report, self.process_index)

    def on_profile(self, summary: dict[str, Any]) -> None:
        """The split of the profiled steps (`profiling.summarize`'s dict). Called from the profiler's
        summary thread, after the trace is written: the loop does not wait for the summary."""
        if self.enabled:
            self.profile = profile_figures(summary)

    # -- read on the scrape thread

    def straggler_ratio(self) -> float | None:
        """This process's mean busy time over the median of the others' in the last compared window."""
        ratio = getattr(self.stragglers, "ratio", None)
        return None if ratio is None else ratio(self.process_index)

    def checkpoint_interval_s(self) -> float | None:
        """The expected seconds between periodic checkpoints (None: none are configured, or the step
        time is not known yet): every_minutes, or every_steps x the last logged step time."""
        steps, minutes = self.checkpoint_every
        by_steps = steps * self.record_values["step_time_s"] if steps > 0 and "step_time_s" in self.record_values \
            else None
        candidates = [v for v in (minutes * 60 if minutes > 0 else None, by_steps) if v is not None]
        return min(candidates) if candidates else None

    def last_commit(self) -> tuple[int, float, float, float] | None:
        """(step, wall time, blocking s, write s) of this process's last committed checkpoint."""
        return getattr(self.checkpointer, "last_commit", None)


class _Snapshot(Collector):
    """Builds the gauges and counters at each scrape from the exporter's host-side state."""

    def __init__(self, exporter: Exporter):
        self.x = exporter

    def collect(self) -> Iterable[Any]:
        x, now = self.x, time.time()
        keys, values = list(x.labels), list(x.labels.values())

        def gauge(name: str, doc: str, value: float | None, extra: dict[str, str] | None = None) -> Any:
            g = GaugeMetricFamily(name, doc, labels=keys + list(extra or {}))
            if value is not None:
                g.add_metric(values + list((extra or {}).values()), value)
            return g

        yield gauge("jaxtrain_step", "Last finished optimizer step", x.step)
        for k, (name, doc) in STEP_GAUGES.items():
            yield gauge(name, doc, x.step_values.get(k))
        for k, (name, doc) in RECORD_GAUGES.items():
            yield gauge(name, doc, x.record_values.get(k))
        yield gauge("jaxtrain_restart_attempt", "Restart attempt of the job (0 = first)", x.attempt)
        yield gauge("jaxtrain_start_time_seconds", "Unix time this process started its run", x.started_at)

        events = CounterMetricFamily("jaxtrain_events", "Events raised or seen by this process, by kind",
                                     labels=keys + ["kind"])
        for kind, n in sorted(x.events.items()):
            events.add_metric(values + [kind], n)
        yield events
        spikes = CounterMetricFamily("jaxtrain_spikes", "Loss or gradient-norm spikes flagged", labels=keys)
        spikes.add_metric(values, x.events.get("spike", 0))
        yield spikes
        reports = CounterMetricFamily("jaxtrain_straggler_reports", "Straggler reports naming this process",
                                      labels=keys)
        reports.add_metric(values, x.straggler_reports)
        yield reports
        if x.rollbacks is not None:
            yield gauge("jaxtrain_rollbacks", "Rollbacks to an earlier checkpoint over the whole run", len(x.rollbacks))
        yield gauge("jaxtrain_straggler_ratio", "This process's busy time over the median of the others "
                    "(last window compared)", x.straggler_ratio())

        commit = x.last_commit()
        since = now - (commit[1] if commit is not None else x.started_at)
        yield gauge("jaxtrain_seconds_since_checkpoint", "Seconds since this process's last committed "
                    "checkpoint (since the process started, before its first)", since)
        yield gauge("jaxtrain_checkpoint_interval_seconds", "Expected seconds between periodic checkpoints",
                    x.checkpoint_interval_s())
        if commit is not None:
            yield gauge("jaxtrain_checkpoint_step", "Step of the last committed checkpoint", commit[0])
            yield gauge("jaxtrain_checkpoint_blocking_seconds", "Time the last save blocked the loop", commit[2])
            yield gauge("jaxtrain_checkpoint_write_seconds", "Time from the last save's start to its commit",
                        commit[3])

        if x.watchdog is not None and getattr(x.watchdog, "enabled", False):
            beat = x.watchdog.heartbeat()
            phase = GaugeMetricFamily("jaxtrain_watchdog_phase", "1 for the phase the loop is in",
                                      labels=keys + ["phase"])
            for p in PHASES:
                phase.add_metric(values + [p], 1.0 if beat["phase"] == p else 0.0)
            yield phase
            yield gauge("jaxtrain_watchdog_seconds_since_beat", "Seconds since the loop last reported progress",
                        max(0.0, now - beat["beat"]))
            yield gauge("jaxtrain_watchdog_deadline_seconds", "Hang deadline of the current phase (0 = none)",
                        x.watchdog.deadline_s(beat["phase"]) or 0.0)

        in_use = GaugeMetricFamily("jaxtrain_device_memory_bytes", "Device memory in use", labels=keys + ["device"])
        peak = GaugeMetricFamily("jaxtrain_device_memory_peak_bytes", "Peak device memory in use",
                                 labels=keys + ["device"])
        limit = GaugeMetricFamily("jaxtrain_device_memory_limit_bytes", "Device memory the allocator may use",
                                  labels=keys + ["device"])
        for d in x.devices:
            stats = _memory_stats(d)
            for family, key in ((in_use, "bytes_in_use"), (peak, "peak_bytes_in_use"), (limit, "bytes_limit")):
                if key in stats:
                    family.add_metric(values + [str(d.id)], float(stats[key]))
        yield from (in_use, peak, limit)
        yield from _preflight_families(x.preflight, keys, values, gauge)
        yield from _profile_families(x.profile, keys, values, gauge)

        if x.health is not None and x.health.every > 0:
            for k, v in dict(x.health.values).items():
                yield gauge(f"jaxtrain_health_{k}", f"Health check figure {k} (fault.health_every_steps)", v)
            warning = GaugeMetricFamily("jaxtrain_health_warning", "1 while a health check warns",
                                        labels=keys + ["check"])
            for check, w in sorted(dict(x.health.warnings).items()):
                warning.add_metric(values + [check], 1.0 if w else 0.0)
            yield warning
            yield from _gpu_families(keys, values, dict(getattr(x.health, "gpu_values", {})))


# NVML's counters per GPU (observe/nvml.py): (counter, gauge name, help).
GPU_GAUGES = (
    ("ecc_uncorrected", "jaxtrain_health_gpu_ecc_uncorrected", "Volatile uncorrected ECC errors (NVML)"),
    ("ecc_uncorrected_in_run", "jaxtrain_health_gpu_ecc_uncorrected_in_run",
     "Uncorrected ECC errors since this process's first health check"),
    ("ecc_corrected", "jaxtrain_health_gpu_ecc_corrected", "Volatile corrected ECC errors (NVML)"),
    ("remap_pending", "jaxtrain_health_gpu_remap_pending", "1 while a row remap waits for a GPU reset"),
    ("remap_failure", "jaxtrain_health_gpu_remap_failure", "1 when a row remap failed"),
    ("throttle", "jaxtrain_health_gpu_clock_event_reasons", "NVML clock-event reasons bitmask"),
    ("temperature_c", "jaxtrain_health_gpu_temperature_celsius", "GPU temperature"),
)


def _gpu_families(keys: list[str], values: list[str], gpus: dict[int, dict[str, Any]]) -> Iterable[Any]:
    """One gauge per NVML counter, a series per GPU (labels gpu = NVML index, uuid)."""
    if not gpus:
        return
    for counter, name, doc in GPU_GAUGES:
        g = GaugeMetricFamily(name, doc, labels=keys + ["gpu", "uuid"])
        for index, gpu in sorted(gpus.items()):
            if counter in gpu:
                g.add_metric(values + [str(index), str(gpu.get("uuid", ""))], float(gpu[counter]))
        yield g


def _preflight_families(pf: dict[str, Any] | None, keys: list[str], values: list[str],
                        gauge: Callable[..., Any]) -> Iterable[Any]:
    """The preflight's figures of this process (none before the check ran, or without one)."""
    if pf is None:
        return
    yield gauge("jaxtrain_preflight_matmul_tflops", "Preflight matmul TFLOP/s of this process's slowest local device",
                pf["matmul_tflops"])
    yield gauge("jaxtrain_preflight_matmul_median_tflops", "Median preflight matmul TFLOP/s over the job's processes",
                pf["median_matmul_tflops"])
    yield gauge("jaxtrain_preflight_named", "1 when the preflight named this process (slow matmul or links)",
                1.0 if pf["named"] else 0.0)
    yield gauge("jaxtrain_preflight_slow_links", "Preflight slow pairs touching this process", pf["slow_links"])
    links = GaugeMetricFamily("jaxtrain_preflight_link_gbps", "Preflight exchange GB/s per rail between this "
                              "process and a peer (the slower end's figure)", labels=keys + ["peer", "link"])
    for peer, (kind, gbps) in sorted(pf["links"].items(), key=lambda kv: int(kv[0])):
        links.add_metric(values + [peer, kind], gbps)
    yield links
    yield gauge("jaxtrain_preflight_link_min_gbps", "Slowest preflight pair touching this process, GB/s",
                pf["link_min_gbps"])
    reference = GaugeMetricFamily("jaxtrain_preflight_link_reference_gbps", "Median GB/s of the job's pairs of "
                                  "a link kind touching no named process (the preflight verdict's reference)",
                                  labels=keys + ["link"])
    for kind, gbps in sorted(pf["reference_gbps"].items()):
        if gbps is not None:
            reference.add_metric(values + [kind], gbps)
    yield reference
    axes = GaugeMetricFamily("jaxtrain_preflight_axis_gbps", "Preflight collective GB/s per device over a mesh "
                             "axis, as this process timed it", labels=keys + ["axis", "op"])
    for (axis, op), gbps in sorted(pf["axes"].items()):
        axes.add_metric(values + [axis, op], gbps)
    yield axes


def _profile_families(pr: dict[str, Any] | None, keys: list[str], values: list[str],
                      gauge: Callable[..., Any]) -> Iterable[Any]:
    """The split of the profiled steps (none until a trace of train.profile_steps was summarized)."""
    if pr is None:
        return
    parts = GaugeMetricFamily("jaxtrain_profile_seconds", "Seconds per step per device of each part of the "
                              "profiled steps (they sum to the step time)", labels=keys + ["group", "part"])
    for part, seconds in pr["parts"].items():
        parts.add_metric(values + [PROFILE_GROUPS.get(part, "other"), part], seconds)
    yield parts
    yield gauge("jaxtrain_profile_step_time_seconds", "Step time over the profiled steps", pr["step_time_s"])
    yield gauge("jaxtrain_profile_collective_fraction", "Share of the profiled step time in collectives (0..1)",
                pr["collective_fraction"])
    gbps = GaugeMetricFamily("jaxtrain_profile_collective_gbps", "Achieved GB/s per device of each collective "
                             "kind in the profiled steps (wire bytes from the HLO over its time)",
                             labels=keys + ["op"])
    for op, v in pr["gbps"].items():
        gbps.add_metric(values + [op], v)
    yield gbps
    yield gauge("jaxtrain_profile_step", "Last step of the profiled range (train.profile_steps)", pr["step"])
    yield gauge("jaxtrain_profile_steps", "Complete steps the profile figures average", pr["steps"])


def _memory_stats(device: Any) -> dict[str, Any]:
    """The runtime allocator's counters (GPU, TPU); {} where the platform has none (CPU)."""
    try:
        return device.memory_stats() or {}
    except Exception:  # noqa: BLE001 -- an unsupported platform or a runtime without the query
        return {}

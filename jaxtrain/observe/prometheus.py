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
of the runtime, no transfer, no sync; absent on the CPU).

Every series carries the labels `run` (run.name), `process` and `host`. Names start with
`jaxtrain_`; what each means is in docs/monitoring.md, the alert rules built on them in
tpu_gpu_setup/monitoring/.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any, Callable, Iterable, Sequence

from prometheus_client import CollectorRegistry, Histogram, start_http_server, write_to_textfile
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

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


def local_index(hosts: Sequence[str], process_index: int) -> int:
    """This process's index among the job's processes on its own machine (its port offset)."""
    return list(hosts[:process_index]).count(hosts[process_index])


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
        self._warn = warn or (lambda m: print(f"jaxtrain: warning: {m}", file=sys.stderr, flush=True))
        self.started_at = time.time()
        # Written by the loop thread, read by the scrape thread: plain assignments of Python numbers.
        self.step = 0
        self.step_values: dict[str, float] = {}
        self.record_values: dict[str, float] = {}
        self.events: dict[str, int] = {}  # kind -> events this process raised or saw
        self.straggler_reports = 0  # straggler events naming this process
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

        if x.health is not None and x.health.every > 0:
            for k, v in dict(x.health.values).items():
                yield gauge(f"jaxtrain_health_{k}", f"Health check figure {k} (fault.health_every_steps)", v)
            warning = GaugeMetricFamily("jaxtrain_health_warning", "1 while a health check warns",
                                        labels=keys + ["check"])
            for check, w in sorted(dict(x.health.warnings).items()):
                warning.add_metric(values + [check], 1.0 if w else 0.0)
            yield warning


def _memory_stats(device: Any) -> dict[str, Any]:
    """The runtime allocator's counters (GPU, TPU); {} where the platform has none (CPU)."""
    try:
        return device.memory_stats() or {}
    except Exception:  # noqa: BLE001 -- an unsupported platform or a runtime without the query
        return {}

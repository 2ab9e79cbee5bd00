"""The training loop: wires config, mesh, state, step, data, checkpoints and logs together.

Usable whole (`Trainer(cfg).fit()`) or step by step from a notebook:

    trainer = Trainer(load_config("configs/tiny.yaml", ["train.steps=50"]))
    metrics = trainer.step()          # one optimizer step, metrics as Python numbers
    model = trainer.model()           # an nnx.Module holding a copy of the current parameters

Order of work (abstract first, nothing built unsharded): phase-2 checks -> mesh -> state layout
(shapes and shardings, `jaxtrain.train.state`) -> data -> restore-or-init directly into those
shardings -> compile the step once -> loop.

The loop itself is wiring. Each step: queue it on the device, then read the previous step's
metrics (one step late, so the device is never idle waiting for the host), then let the
capabilities act: evaluation (`evaluation.py`), throughput accounting (`throughput.py`), fault
drills (`chaos.py`), the agreed stop/save decision (`preemption.py`), checkpoints
(`checkpoint/`). A new capability is an object the loop calls, not a branch in it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import threading
import time
from pathlib import Path
from typing import IO, Any, Iterator

import jax
from flax import nnx

from jaxtrain import __version__
from jaxtrain.runtime import env, host_malloc
from jaxtrain.checkpoint.checkpointer import CheckpointError, Checkpointer, CheckpointTier, restore_params_only
from jaxtrain.runtime.compilation_cache import enable_compilation_cache
from jaxtrain.checkpoint.checkpointer import restore_latest_read_only, saved_entries
from jaxtrain.runtime.compilation_cache import last_compile_s, shared_cache_run_dir
from jaxtrain.checkpoint.local_tier import LocalTier
from jaxtrain.storage.paths import is_remote, join
from jaxtrain.storage.object_store import check_access
from jaxtrain.config import Config, ConfigError
from jaxtrain.data import build_train_data
from jaxtrain.data.pipeline import TrainData
from jaxtrain.runtime.exit_codes import EXIT_HUMAN, EXIT_OK, EXIT_RESTART
from jaxtrain.fault.chaos import Chaos
from jaxtrain.fault.preemption import HostSync, StopSignals, agree_on_startup_stop
from jaxtrain.fault.preflight import local_matmul_check, run_preflight
from jaxtrain.fault.stragglers import Stragglers, job_hosts
from jaxtrain.fault.step_marks import StepMarks, wanted as step_marks_wanted, with_step_marks
from jaxtrain.fault.watchdog import Watchdog
from jaxtrain.model.attention import resolve_attention
from jaxtrain.model.llama import Transformer
from jaxtrain.observe.profiling import StepProfiler
from jaxtrain.observe.console import install_stderr_logging
from jaxtrain.observe.health import Health
from jaxtrain.observe.nvml import Nvml
from jaxtrain.observe.prometheus import Exporter, local_index
from jaxtrain.observe.runlog import Events, RunLog, split_event
from jaxtrain.observe.throughput import Throughput, flops_per_step, peak_flops_per_device
from jaxtrain.parallel import context, pipeline
from jaxtrain.parallel.mesh import build_mesh, slice_count, validate_against_devices
from jaxtrain.parallel.sharding import global_batch, process_rows
from jaxtrain.infer.loading import tokenizer_of
from jaxtrain.infer.samples import TrainingSamples
from jaxtrain.train.config_changes import check_resume
from jaxtrain.train.evaluation import EvalResult, Evaluator, PendingEval
from jaxtrain.train.precision import compute_dtype
from jaxtrain.train.rollback import RollbackLimit, RollbackLog, RollbackRequest, Rollbacks, SpikeGuard
from jaxtrain.train.state import State, build_layout
from jaxtrain.train.step import BATCH_KEYS

log = logging.getLogger(__name__)  # `jaxtrain: ...` lines on stderr (observe/console.install_stderr_logging)


def check_run_paths(cfg: Config) -> None:
    """The run directory is a directory (or does not exist yet) on reachable storage; init_from too.
    Object stores are checked here (credentials, bucket), before anything is written."""
    output_dir = cfg.run.output_dir
    check_access(output_dir, key="run.output_dir")
    if not is_remote(output_dir) and Path(output_dir).exists() and not Path(output_dir).is_dir():
        raise ConfigError(f"run.output_dir='{output_dir}' is an existing file, not a directory")
    if cfg.checkpoint.init_from:
        check_access(cfg.checkpoint.init_from, key="checkpoint.init_from")


# After an exception in a multi-process job, how long abort() gives this process's own cleanup
# before it exits anyway (what is left is a write nobody could commit: it needs the other processes).
ABORT_GRACE_S = 1.0

# Metrics of every step copied into metrics.jsonl as they are (besides throughput and eval_loss).
RECORDED = ("loss", "grad_norm", "learning_rate", "loss_scale", "skipped_steps", "spike", "loss_z", "grad_norm_z",
            "loss_rise", "loss_divergence")
MOE_RECORDED = ("moe_aux_loss", "router_z_loss", "moe_max_load", "moe_dropped_fraction")  # model.num_experts > 0
MTP_RECORDED = ("mtp_loss",)  # model.mtp_depth > 0


def _rule_axes(target) -> list[str]:
    """The mesh axes of one rules-table entry (a name, a list of names, or None)."""
    return [a for a in (target if isinstance(target, list) else [target]) if a is not None]


@dataclasses.dataclass
class _Pending:
    """A step queued on the device whose metrics have not been read yet."""

    step: int
    metrics: dict  # device values
    data_wait_s: float
    evaluation: PendingEval | None
    eval_s: float = 0.0  # host seconds spent queueing this step's evaluation
    batch: int | None = None  # the data position of the batch it drew (where a rollback must skip past)
    values: dict | None = None  # the metrics as Python values, once read


class Trainer:
    """One training run. Construction validates, builds the sharded state and restores or initialises it."""

    def __init__(self, cfg: Config, *, console: IO[str] | str | None = "auto", write_files: bool = True,
                 devices: list[jax.Device] | None = None, started_at: float | None = None):
        """Args:
          cfg: the validated config.
          console: where progress lines go ("auto": stdout, so that fit() in a notebook shows them;
            None: nowhere; only process 0 prints). On a terminal the line is rewritten
            in place; elsewhere every logged step is one plain line.
          write_files: False keeps the run directory untouched (notebooks, tests); a run directory
            that holds checkpoints is still restored from (read-only), never trained from scratch.
          devices: the devices to build the mesh on (default: all of the job's devices).
          started_at: wall time the process started (for restart_to_first_step_s).
        Raises:
          ConfigError: anything the user can fix; raised before anything is written.
        """
        # First of all: a SIGTERM during start-up (restore, preflight, the first compile) must be
        # read, not taken by JAX's own handler and lost (fit() acts on it before the first step).
        self.signals = StopSignals().install()
        install_stderr_logging()  # the drills' notices and the library's warnings reach a notebook too
        try:
            self._build(cfg, console=console, write_files=write_files, devices=devices, started_at=started_at)
        except BaseException:
            self.signals.restore()
            raise

    def _build(self, cfg: Config, *, console: IO[str] | str | None, write_files: bool, devices: list[jax.Device] | None,
               started_at: float | None) -> None:
        """The construction proper (see __init__), with the signal handlers already ours."""
        self.cfg = cfg
        self._started_at = started_at if started_at is not None else time.time()
        self.process_index, self.process_count = jax.process_index(), jax.process_count()
        # Before the first jit: a restarted run loads its compiled step instead of recompiling. `auto`
        # puts it in the run directory when the job spans hosts (JAX writes it from process 0 only).
        cache_run_dir = shared_cache_run_dir(cfg.run.output_dir if write_files else None, self.process_count,
                                             one_machine=env.launcher_slot() is not None)
        self._cache_dir = enable_compilation_cache(cfg.checkpoint.compilation_cache_dir, cache_run_dir)
        devices = list(devices) if devices is not None else jax.devices()
        # Phase-2 validation: needs the devices and processes, runs before anything is written.
        self.mesh_sizes = validate_against_devices(cfg, len(devices), self.process_count,
                                                   under_launcher=env.launcher_slot() is not None,
                                                   num_slices=slice_count(devices))
        self.attention = resolve_attention(cfg, devices[0].platform, self.mesh_sizes)
        if write_files:
            check_run_paths(cfg)
        self.mesh = build_mesh(cfg.mesh, devices)
        self.layout = build_layout(cfg, self.mesh)
        self.rules, self.graphdef, self.logical = cfg.mesh.rules, self.layout.graphdef, self.layout.logical
        self.num_params = self.layout.num_params
        self.evaluator = Evaluator(cfg, self.layout, self.process_index, self.process_count)
        self.samples = (TrainingSamples(cfg, self.mesh, tokenizer_of(cfg), compute_dtype(cfg))
                        if cfg.train.sample_every else None)
        # Every event of the run, the `on_event` of each capability: kept until the log and the
        # exporter exist, then written to both (observe/runlog.py `Events`).
        self.events = Events()
        self.chaos = Chaos(cfg.chaos, self.process_index, self.events, attempt=env.restart_attempt(),
                           slot=env.launcher_slot())
        self.log: RunLog | None = None
        self.exporter: Exporter | None = None  # observe.prometheus_*: built once the sources exist

        # Data next: a missing or bad corpus is a user error and must stop us before any file is written.
        self.rows = process_rows(self.mesh, self.rules, cfg.data.global_batch_size, self.process_index)
        self.data: TrainData = build_train_data(cfg, self.process_index, self.process_count, rows=self.rows)
        self.compiled_step = None  # compiled on first use (see _compile)

        # Restore or init. Every process takes the same path of collective calls whatever the
        # filesystem shows: the latest-step agreement runs on all of them, also on a fresh run
        # (where it agrees on "none"). The watchdog covers it with the start-up deadline (a restore
        # with the checkpoint deadline).
        self.output_dir = cfg.run.output_dir
        # write_files=False (notebooks, tests): no watchdog at all. Not fault.hang_timeout_s=0, which
        # turns off only the step deadline.
        self.watchdog = Watchdog(cfg.fault, output_dir=self.output_dir, process_index=self.process_index,
                                 process_count=self.process_count, attempt=env.restart_attempt(),
                                 enabled=write_files)
        # Host callbacks in the step time-stamp each device's progress for hang blame (step_marks.py).
        self.step_marks = (StepMarks(len(self.mesh.local_devices), self.chaos.in_step)
                           if step_marks_wanted(cfg, self.process_count, self.mesh.devices.flat[0].platform) else None)
        self.watchdog.marks = self.step_marks
        self.evaluator.on_progress = self.watchdog.progress
        self.watchdog.beat(0, "startup")
        self.watchdog.start()
        self.guard = SpikeGuard(cfg.stability, self.events)
        try:
            self.chaos.at_start()
            self.hosts = job_hosts(self.process_index, self.process_count, host=env.host_name())
            self._restore_or_init(write_files)
            self._resume_guard()
        except BaseException:
            self.watchdog.stop()  # a user error (exit 2) is not a hang
            raise

        # Only now, with every user error behind us, does anything reach the disk.
        self.log = RunLog(str(self.output_dir), console=console, enabled=self.process_index == 0 and write_files)
        self.log.write_config(cfg)
        log = self.log
        self.events.attach(lambda event: log.event(**event))  # the events so far first

        self._host_step = self.step_count  # the host's count, so it never has to read the device's step
        # Measured peaks are kept per machine (env.peak_cache_file): runs there get comparable MFU.
        self.peak_flops, self.peak_source = peak_flops_per_device(
            devices[0], cfg.precision.policy, cache_file=env.peak_cache_file(),
            xla_flags=os.environ.get("XLA_FLAGS", "").split())
        self.throughput = Throughput(flops_per_step(cfg), self.peak_flops, self.mesh.size, self._host_step)
        self.profiler = StepProfiler(cfg.train.profile_steps, join(self.output_dir, "profile"), cfg.train.steps,
                                     enabled=self.process_index == 0 and write_files)
        self.stragglers = Stragglers(cfg.fault, self.mesh, self.process_index, self.process_count, self.hosts,
                                     self.events)
        self.health = self._make_health(cfg)
        o = cfg.observe  # live metrics for Prometheus (observe/prometheus.py): host-side values only
        self.exporter = Exporter(port=o.prometheus_port, addr=o.prometheus_addr, textfile=o.prometheus_textfile,
                                 run=cfg.run.name, process_index=self.process_index, process_count=self.process_count,
                                 host=self.hosts[self.process_index], local=local_index(self.hosts, self.process_index),
                                 attempt=env.restart_attempt(), watchdog=self.watchdog, checkpointer=self.checkpointer,
                                 rollbacks=self.rollbacks, stragglers=self.stragglers, devices=self.mesh.local_devices,
                                 checkpoint_every=(cfg.checkpoint.every_steps, cfg.checkpoint.every_minutes),
                                 health=self.health).start()
        exporter = self.exporter  # the events so far (restore, checkpoint_damaged, ...) first; no sink follows
        self.events.attach(lambda event: exporter.on_event(*split_event(event)), last=True)
        # The split of the profiled steps, summarized off the loop once the trace is written (only
        # when someone reads it: the summary costs host time).
        self.profiler.on_summary = self.exporter.on_profile if self.exporter.enabled else None
        self._waiting_s = 0.0  # this iteration's time waiting on the device or on peers (straggler accounting)
        self._data_wait_since_log = 0.0  # data wait summed over the steps since the last metrics record
        self._fit_start = self._host_step
        self.watchdog.beat(self._host_step, "idle")  # built: no deadline until fit() runs
        self._stop_details: dict = {}  # what the event of an early stop says besides its kind
        self._startup_syncs = 0  # start-up stop agreements made so far (each needs its own keys)
        self.host_sync = HostSync(self.mesh, cfg.train.host_sync_every, self.process_count)
        self._pending: _Pending | None = None

    # ------------------------------------------------------------------ building

    def _restore_or_init(self, write_files: bool) -> None:
        """(1) this run's own latest good checkpoint, (2) the parameters of checkpoint.init_from,
        (3) fresh; straight into the layout's shardings. A mismatched checkpoint is a ConfigError
        raised before anything is written."""
        cfg = self.cfg
        checkpoint_dir = join(self.output_dir, "checkpoints")
        self.checkpointer = Checkpointer(checkpoint_dir, cfg.checkpoint, on_event=self.events) if write_files else None
        record = RollbackLog(checkpoint_dir, primary=self.process_index == 0,
                             agree=self.checkpointer.agree) if write_files else None
        self.rollbacks = Rollbacks(cfg.stability, self.checkpointer, record, self.events, guard=self.guard)
        self.rollbacks.finish_interrupted()
        self.resumed_from: int | None = None
        self._config_checked = False  # the stored config is compared once, before the first restore
        latest = self.checkpointer.latest_step() if self.checkpointer is not None else None
        # checkpoint.local_every_steps: the local tier, restored first when newer (checkpoint/local_tier.py)
        self.local = (LocalTier(cfg.checkpoint, self.output_dir, on_event=self.events)
                      if write_files and cfg.checkpoint.local_every_steps > 0 else None)
        self.resume_source: str | None = None
        if self.local is not None and self._restore_local(latest):
            return
        if not write_files and self._restore_read_only(checkpoint_dir):
            return
        if latest is not None:
            self._check_config_changes(latest, latest)
            with self.watchdog.phase("checkpoint"):  # a restore gets the checkpoint deadline, not start-up's
                self._restore_from(self.checkpointer, latest)
            self.resumed_from, self.resume_source = latest, "persistent"
        else:
            self.state = self.layout.init()
            if cfg.checkpoint.init_from:
                abstract = self.abstract_state()
                params = restore_params_only(cfg.checkpoint.init_from, abstract["params"])
                self.state = {**self.state, "params": params}
                # The routing bias too, where the source holds one (a DeepSeek-V3 import's
                # e_score_correction_bias): it chooses the experts the weights were trained with.
                if "moe" in self.state and "moe" in saved_entries(cfg.checkpoint.init_from):
                    moe = restore_params_only(cfg.checkpoint.init_from, abstract["moe"], subtree="moe")
                    self.state = {**self.state, "moe": moe}
                self.events("init_from", 0, path=cfg.checkpoint.init_from)

    def _restore_read_only(self, checkpoint_dir: str) -> bool:
        """write_files=False on a trained run directory: its newest good checkpoint, read without
        writing anything (a notebook reading a run must see the trained model, not a fresh one)."""
        if not is_remote(checkpoint_dir) and not Path(checkpoint_dir).is_dir():
            return False
        found = restore_latest_read_only(checkpoint_dir, self.abstract_state())
        if found is None:
            return False
        self.resumed_from, self.state, extra = found
        self.data.set_state(extra["data"])
        self.resume_source = "persistent"
        self.events("restore_read_only", self.resumed_from, path=checkpoint_dir)
        return True

    def _restore_local(self, persistent: int | None) -> bool:
        """Restore the local tier's newest step complete on every process if it is newer than the
        persistent step `persistent` (every process agrees); False: use the persistent tier."""
        with self.watchdog.phase("checkpoint"):
            plan, reason = self.local.plan(persistent, self.abstract_state())
            if plan is not None:
                self._check_config_changes(plan.step, persistent)
                try:
                    self._restore_from(self.local, plan.step)
                except CheckpointError as e:  # some process could not: every process falls back
                    reason = str(e)
                else:
                    self.resumed_from, self.resume_source = plan.step, plan.source
                    return True
        if reason != "no local checkpoints":
            self.events("local_tier_fallback", persistent or 0, reason=reason, persistent_step=persistent)
        return False

    def _restore_from(self, tier: CheckpointTier, step: int) -> None:
        """The state and the data position of checkpoint `step` of `tier` (a restart, a rollback)."""
        self.state, extra = tier.restore(step, self.abstract_state())
        self.data.set_state(extra["data"])

    def _check_config_changes(self, step: int, persistent: int | None) -> None:
        """Before the first restore of this run's own checkpoint `step`: a change of what was already
        trained stops the run (ConfigError, nothing written yet); any change is recorded as a
        `config_changed` event (jaxtrain/train/config_changes.py). Once: a local restore that falls
        back to the persistent tier was checked when it was planned."""
        if self._config_checked:
            return
        self._config_checked = True
        changed = check_resume(self.cfg, join(self.output_dir, "checkpoints"), step, persistent=persistent,
                               agree=self.checkpointer.agree)
        if changed is not None:
            self.events("config_changed", step, **changed)

    def abstract_state(self) -> State:
        """Shapes, dtypes and shardings of the train state, without allocating it."""
        return self.layout.abstract_state()

    @property
    def state_shardings(self) -> dict:
        return self.layout.state_shardings

    @property
    def batch_sharding(self):
        return self.layout.batch_sharding

    @property
    def optimizer(self):
        return self.layout.optimizer

    def _compile(self) -> None:
        """Compile the train step once, ahead of time, with explicit shardings and donated state.

        Under the watchdog's compile deadline, not start-up's: a healthy cold compile longer than
        fault.startup_timeout_s would otherwise be killed at every attempt and never be cached. The
        deadline is sized from the longest compile recorded in the cache folder (read here, still
        under the start-up deadline, so a stalled filesystem is caught; once per process)."""
        with self.watchdog.compiling(last_compile_s(self._cache_dir)):
            t = time.perf_counter()
            marks = self.step_marks
            lowered = self.layout.lower_train_step(
                None if marks is None else lambda fn: with_step_marks(fn, self.mesh, marks))
            self.compiled_step = lowered.compile()
            self.compile_s = time.perf_counter() - t

    # ------------------------------------------------------------------ stepping

    @property
    def step_count(self) -> int:
        return int(jax.device_get(self.state["step"]))  # a host sync: not for the hot loop

    def _dispatch(self) -> _Pending:
        """Queue one step on the device (and its evaluation, if due, on the parameters it produces)."""
        if self.compiled_step is None:
            self._compile()
        position, step = self.data.position, self._host_step + 1
        local = self.chaos.corrupt(position, step, next(self.data), self.cfg.model.vocab_size)
        wait = float(self.data.last_wait_s)
        batch = global_batch({k: local[k] for k in BATCH_KEYS}, self.mesh, self.rules,
                             self.cfg.data.global_batch_size)
        # The numerics drills' loss factor (NaN, spike_factor or 1): an input of the step, never a recompile.
        chaos = self.layout.chaos_factor(self.chaos.batch_factor(position, step) if self.layout.chaos_drills else 1.0)
        with self._waiting():  # a full queue or a collective can block the dispatch itself
            self.state, metrics = self.compiled_step(self.state, batch, chaos)
        self._host_step += 1
        self._data_wait_since_log += wait
        # Queued before the next step donates this state: eval_loss at step N is of step N's parameters.
        evaluation, eval_s = None, 0.0
        if self.evaluator.due(self._host_step):
            t = time.perf_counter()
            with self._waiting():
                evaluation = self.evaluator.dispatch(self.state["params"], router_bias=self._router_bias())
            eval_s = time.perf_counter() - t
        if self.samples is not None and self.samples.due(self._host_step):
            self._write_samples(self._host_step)
        return _Pending(self._host_step, metrics, wait, evaluation, eval_s, batch=position)

    def _write_samples(self, step: int) -> None:
        """train.sample_every: the prompts continued by this step's parameters, into events.jsonl
        (`samples`) and TensorBoard's text tab. Host-synchronous (a periodic look, like a log line);
        the step's time leaves the throughput figures."""
        with self._waiting():
            samples = self.samples.run(step, self.state["params"], self._router_bias())
        self.events("samples", step, samples=samples)
        self.log.texts(step, {f"samples/{i}": s["prompt"] + (s["text"] if s["text"] is not None else
                                                           " ".join(map(str, s["tokens"])))
                              for i, s in enumerate(samples)})
        self.throughput.exclude(step)

    def _values(self, pending: _Pending) -> dict:
        """A finished step's metrics as Python values (a host sync on that step, which the loop
        does one step late: by then the device has the next step queued)."""
        if pending.values is None:
            with self._waiting():  # for the device (and, inside its collectives, the other processes)
                pending.values = {k: v.item() for k, v in jax.device_get(pending.metrics).items()}
        return pending.values

    @contextlib.contextmanager
    def _waiting(self) -> Iterator[None]:
        """Time spent here is not this process's own work: the straggler check leaves it out, so
        that a process waiting on its device or on slower peers is not itself called slow."""
        t = time.perf_counter()
        try:
            yield
        finally:
            self._waiting_s += time.perf_counter() - t

    def _record(self, pending: _Pending) -> dict:
        """The metrics.jsonl record of a finished step."""
        values, d = self._values(pending), self.cfg.data
        record = {"step": pending.step, "time": time.time(), **{k: values[k] for k in RECORDED},
                  **{k: values[k] for k in MOE_RECORDED + MTP_RECORDED if k in values},
                  **self.throughput.record(pending.step, values["tokens"]),
                  "skipped": bool(values["skipped"]), "data_wait_s": pending.data_wait_s,
                  "data_wait_interval_s": self._data_wait_since_log,  # summed since the last record
                  "tokens_per_step": d.global_batch_size * d.seq_len,
                  **self.data.batch_stats(pending.batch)}  # a mixture's rows and tokens per component
        self._data_wait_since_log = 0.0
        if self.cfg.stability.z_loss > 0:
            record["z_loss"] = values["z_loss"]
        if pending.evaluation is not None:
            t = time.perf_counter()
            record["eval_loss"], record["eval_tokens"] = self.evaluator.read(pending.evaluation)
            record["eval_s"] = pending.eval_s + time.perf_counter() - t  # queueing it + waiting for it
            record["eval_dispatch_s"] = pending.eval_s  # the queueing part, inside step_time_s (goodput)
            self.throughput.exclude(pending.step)  # evaluation time is not step time
        return record

    def _observe(self, pending: _Pending | None, *, force_log: bool = False) -> RollbackRequest | None:
        """Read a dispatched step's metrics: the spike guard sees every step; log steps are logged."""
        if pending is None:
            return None
        request = self.guard.observe(pending.step, self._values(pending), batch=pending.batch)
        self.exporter.on_step(pending.step, self._values(pending))
        step, train = pending.step, self.cfg.train
        if force_log or step % train.log_every == 0 or step == train.steps or pending.evaluation is not None:
            record = self._record(pending)
            self.log.metrics(record)
            self.exporter.on_record(record)
        return request

    def step(self) -> dict:
        """Run one step and return its metrics (synchronous: for notebooks and tests).

        The Trainer holds SIGINT/SIGTERM from its construction on (see __init__), so outside fit()
        a pending stop request interrupts here, as Ctrl-C would have."""
        if self.signals.requested is not None:
            self.signals.requested = None
            raise KeyboardInterrupt
        self._observe(self._take_pending())
        self._skip_rolled_back_batches()
        self.throughput.restart(self._host_step)
        pending = self._dispatch()
        self.guard.observe(pending.step, self._values(pending), batch=pending.batch)
        return self._record(pending)

    def _take_pending(self) -> _Pending | None:
        pending, self._pending = self._pending, None
        return pending

    def evaluate(self, num_batches: int | None = None) -> float | None:
        """Mean loss per token of the current parameters on the held-out data, or None without one.
        `num_batches`: None = train.eval_batches, 0 = the whole set, N = a cap (Evaluator.dispatch).
        `eval_result` also gives the number of tokens counted."""
        return self.evaluator.evaluate(self.state["params"], num_batches, self._router_bias())

    def eval_result(self, num_batches: int | None = None) -> EvalResult | None:
        """Like `evaluate`, with the tokens counted: (loss, tokens), or None without held-out data."""
        return self.evaluator.run(self.state["params"], num_batches, self._router_bias())

    def model(self) -> Transformer:
        """A model holding a copy of the current parameters (for inference in a notebook).

        A copy, because the next step donates the state's buffers: a module over them would hold
        deleted arrays after `step()` or `fit()`.
        """
        return nnx.merge(self.graphdef, jax.tree_util.tree_map(lambda x: x.copy(), self.state["params"]))

    # ------------------------------------------------------------------ the loop

    def fit(self) -> dict:
        """Train until train.steps (or a preemption signal). Returns {"step", "exit_code"}."""
        try:
            return self._fit()
        finally:
            self.watchdog.beat(self._host_step, "idle")  # also after an exception: no deadline outside fit()

    def _fit(self) -> dict:
        if self._stop_before_first_step() or not self._preflight():
            return {"step": self._host_step, "exit_code": EXIT_RESTART}
        self.watchdog.beat(self._host_step, "startup")  # compile and first step: the start-up deadline
        if self.compiled_step is None:
            self._compile()
        if self._stop_before_first_step():  # a signal during preflight or the first compile
            return {"step": self._host_step, "exit_code": EXIT_RESTART}
        self._log_start()
        stop: str | None = None  # why the loop ends early: "preempted" or "rollback_limit"
        with self.signals:
            while self._host_step < self.cfg.train.steps and stop is None:
                stop = self._iteration()
            if stop != "rollback_limit":  # (after a rollback limit, the queued step belongs to no run)
                self._observe(self._take_pending(), force_log=True)
            if self.checkpointer is not None:
                with self.watchdog.phase("checkpoint"):
                    self.checkpointer.wait()  # the last checkpoint is committed before we report done
            if self.local is not None and stop is None:  # finished: the local tier goes (never uploaded)
                self.local.clear()
            elif self.local is not None:  # preempted: kept, but the persistent checkpoint just saved is newer
                self.local.wait()
        jax.block_until_ready(self.state)
        skipped = int(jax.device_get(self.state["stability"]["skipped_steps"]))
        if stop is not None:
            # A spent rollback budget would hit the same wall after a restart: "a human is needed" (78),
            # which every recipe treats like a user error; a preemption asks to be restarted (75).
            code = EXIT_HUMAN if stop == "rollback_limit" else EXIT_RESTART
            self.events(stop, self._host_step, exit_code=code, skipped_steps=skipped, **self._stop_details)
            return {"step": self._host_step, "exit_code": code}
        details = {"stragglers": dict(self.stragglers.reports)} if self.process_count > 1 else {}
        self.events("done", self._host_step, skipped_steps=skipped, rollbacks=len(self.rollbacks), **details)
        return {"step": self._host_step, "exit_code": EXIT_OK}

    def _iteration(self) -> str | None:
        """One turn of the loop: queue step N+1, read step N, let each capability act. Returns a
        reason to stop ("preempted", "rollback_limit") or None."""
        t0, self._waiting_s = time.perf_counter(), 0.0
        self._skip_rolled_back_batches()
        previous = self._take_pending()
        self.profiler.before_step(self._host_step + 1, self.compiled_step)  # train.profile_steps
        self._pending = self._dispatch()
        step = self._pending.step
        request = self._observe(previous)  # reads step N's metrics (blocks until it is done)
        self.profiler.after_step(step, self.state)
        if previous is not None:
            self.watchdog.beat(previous.step)
        if request is not None:
            return None if self._roll_back(request) else "rollback_limit"
        if step == self._fit_start + 1 and self.resumed_from is not None:
            with self._waiting():
                self._report_resume()
        self.chaos.after_step(step, self.state)
        if self.signals.requested and not self.signals.reported:
            self.signals.reported = True
            self.events("signal", step, signal=self.signals.requested)
        time_due = self.checkpointer is not None and self.checkpointer.time_due()
        with self._waiting():  # the agreement, and a save's barriers and all-finite check, wait on peers
            decision = self.host_sync.poll(step, self.signals.requested is not None, time_due)
            with self.watchdog.phase("checkpoint"):
                self._maybe_save(step, last=step == self.cfg.train.steps, time_due=decision.save, force=decision.stop)
        wall = time.perf_counter() - t0
        # The first step after a (re)start waits for the slowest process to arrive: not a measure of anyone.
        if step > self._fit_start + 1:
            self.stragglers.after_step(step, wall - self._waiting_s, self._pending.data_wait_s, wall)
        self.exporter.on_iteration(wall, self._pending.data_wait_s)
        self.health.after_step(step, wall - self._waiting_s)
        return "preempted" if decision.stop else None

    def _stop_before_first_step(self) -> bool:
        """A start-up sync point: True when some process was asked to stop (SIGTERM/SIGINT since the
        Trainer's construction began, or JAX's preemption notice before that); then `signal` and
        `preempted` are logged and fit() returns 75 at once. Nothing needs saving: no step has run
        since the restore (or the init). Every process reaches the same answer (a key-value
        agreement, see `preemption.agree_on_startup_stop`); at start-up only, never in the loop."""
        self._startup_syncs += 1
        with self.watchdog.phase("startup"):
            asked = agree_on_startup_stop(self.signals.requested, self.process_index, self.process_count,
                                          name=f"{self._startup_syncs}", timeout_s=self.cfg.fault.startup_timeout_s)
        if not asked:
            return False
        self.signals.reported = True
        self.events("signal", self._host_step, signal=next(iter(asked.values())), processes=sorted(asked),
                    before_first_step=True)
        self.events("preempted", self._host_step, exit_code=EXIT_RESTART, before_first_step=True)
        log.error(f"asked to stop during start-up ({', '.join(f'process {p}: {v}' for p, v in asked.items())}); "
                  "exiting 75 before the first step")
        return True

    def _make_health(self, cfg: Config) -> Health:
        """The run-time health check (fault.health_every_steps), with the matmul re-measure of the
        local devices and, where asked and NVML answers, the GPU counters."""
        f = cfg.fault
        if f.health_every_steps <= 0:
            return Health(0, self.events)
        gpus, note = None, ""
        platform = self.mesh.local_devices[0].platform
        if f.health_nvml == "always" or (f.health_nvml == "auto" and platform == "gpu"):
            gpus, note = Nvml.open()
        health = Health(f.health_every_steps, self.events,
                        disk_path=None if is_remote(self.output_dir) else str(self.output_dir),
                        matmul=local_matmul_check(list(self.mesh.local_devices)), gpus=gpus,
                        gpu_note=f"GPU counters off: {note}" if note else "")
        if self.local is not None:  # built by the restore, before the health check
            health.local_disk_path = str(self.local.root)  # node-local storage filling up
        return health

    def _preflight(self) -> bool:
        """The health check of a multi-process job (fault.preflight); False: stop (exit 75)."""
        if not (self.cfg.fault.preflight and self.process_count > 1):
            return True
        with self.watchdog.phase("startup"):
            report = run_preflight(self.cfg, self.mesh, self.hosts, self.events)  # counted by the exporter too
        self.exporter.on_preflight(report)  # the report is plain Python: no device on the scrape thread
        self.health.matmul_preflight = report["matmul_tflops"][self.process_index]
        if report["named"] and self.cfg.fault.preflight_action == "exit":
            self.events("preflight_failed", self._host_step, named=report["named"], hosts=report["named_hosts"],
                        exit_code=EXIT_RESTART)
            return False
        return True

    def _log_start(self) -> None:
        self._fit_start = self._host_step
        self.events("start", self._host_step, devices=self.mesh.size, processes=self.process_count,
                    hosts=self.hosts, mesh=self.mesh_sizes, pipeline=pipeline.describe(self.cfg, self.mesh_sizes),
                    context=context.describe(self.cfg, self.mesh_sizes),
                    params=self.num_params, attention=self.attention,
                    compile_s=round(self.compile_s, 3), started_at=self._started_at,
                    train_steps=self.cfg.train.steps, entropy_floor=self.data.entropy_floor,
                    peak_flops_per_device=self.peak_flops, peak_source=self.peak_source, version=__version__,
                    # what XLA was started with (`jaxtrain train` adds jaxtrain/runtime/xla_cpu.py's on the CPU)
                    xla_flags=os.environ.get("XLA_FLAGS", "").split(), host_malloc=host_malloc.applied(),
                    **self._moe_start())
        self.throughput.restart(self._host_step)

    def _router_bias(self):
        """The MoE routing bias of the state (None for a dense model)."""
        return self.state["moe"]["router_bias"] if "moe" in self.state else None

    def _moe_start(self) -> dict:
        """The `start` event's `moe_dispatch` (model.num_experts > 0): which dispatch the MoE layers run
        (jaxtrain/parallel/experts.py `dispatch_kind`: capacity; dropless-ragged_dot / dropless-tiled,
        or with expert parallelism dropless-ragged_all_to_all / dropless-dense-all_to_all, on GPU/TPU / CPU)."""
        m = self.cfg.model
        if m.num_experts <= 0:
            return {}
        from jaxtrain.parallel.experts import dispatch_kind
        ways = math.prod(self.mesh_sizes[a] for a in _rule_axes(self.cfg.mesh.rules.get("experts")))
        platform = self.mesh.devices.flat[0].platform
        return {"moe_dispatch": dispatch_kind(m.capacity_factor, ways, platform), "expert_parallel": ways}

    # ------------------------------------------------------------------ rollback

    def _skip_rolled_back_batches(self) -> None:
        """Before each draw: never a batch that a rollback left behind (also after a restart)."""
        n = self.rollbacks.batches_to_skip(self.data.position)
        if n:
            self.data.skip_batches(n)

    def _resume_guard(self) -> None:
        """The spike guard's count of spikes in a row from the state just restored (a host sync:
        after a restore only), so its spike_rebaseline events match the step's re-baselines."""
        if self.cfg.stability.guard:
            self.guard.resume(int(jax.device_get(self.state["stability"]["spike_run"])))

    def _roll_back(self, request: RollbackRequest) -> bool:
        """Restore the last committed checkpoint before the first spike (rollback.Rollbacks decides
        which, records the data range to skip and discards the newer checkpoints; the next draw skips
        that range). False when stability.max_rollbacks is spent (exit 78)."""
        try:
            plan = self.rollbacks.plan(request)
        except RollbackLimit as e:
            self._stop_details = {"spike_steps": list(request.spike_steps), "message": str(e)}
            log.error(str(e))
            return False
        if plan is None:
            return True
        self._pending = None  # the step queued after the last spike is thrown away with its state
        with self.watchdog.phase("checkpoint"):
            # Restored before the rollback is recorded: the record needs the target's data position.
            # Nothing is discarded yet, so dying here only means the same rollback next time.
            self._restore_from(self.checkpointer, plan.to_step)
            record, discarded = self.rollbacks.commit(plan, data_from=self.data.position)
        self._host_step = plan.to_step
        if self.local is not None:  # no local step after the rollback's target may win a restart
            self.local.discard_after(plan.to_step)
        self.guard.reset()
        self._resume_guard()
        self.events("rollback", plan.at_step, from_step=plan.at_step, to_step=plan.to_step,
                    batches_skipped=record["skip_batches"], data_from=record["data_from"],
                    data_to=record["data_to"], spike_steps=list(plan.spike_steps),
                    spike_batches=list(plan.spike_batches), discarded_checkpoints=discarded,
                    rollbacks=len(self.rollbacks))
        self.throughput.exclude(plan.to_step)
        return True

    def _report_resume(self) -> None:
        jax.block_until_ready(self.state)  # once: the restart is only over when a step has run
        source = {} if self.local is None else {"source": self.resume_source}  # local, peer or persistent
        self.events("resume", self.resumed_from, restored_step=self.resumed_from,
                    restart_to_first_step_s=round(time.time() - self._started_at, 3),
                    compile_s=round(self.compile_s, 3), **source)

    def _maybe_save(self, step: int, *, last: bool, time_due: bool = False, force: bool = False) -> None:
        """The persistent tier when it is due (or `force`d), else the local tier when due: never both."""
        if self.checkpointer is None:
            return
        tier: CheckpointTier
        if force or self.checkpointer.should_save(step, last=last, time_due=time_due):
            tier, extra = self.checkpointer, {
                "data": self.data.get_state(), "config": self.cfg.to_dict(),
                "metadata": {"time": time.time(), "mesh": self.mesh_sizes, "processes": self.process_count,
                             "version": __version__}}
        elif self.local is not None and self.local.should_save(step, last=last):
            tier, extra = self.local, {"data": self.data.get_state()}  # the rest of the host state is in the arrays
        else:
            return
        tier.save(step, self.state, json.loads(json.dumps(extra, default=_plain)))

    def save(self) -> None:
        """Checkpoint the current state now (notebooks) and wait until it is committed."""
        if self.checkpointer is None:
            raise RuntimeError("this Trainer was built with write_files=False: it has no checkpoint directory")
        self._maybe_save(self._host_step, last=False, force=True)
        self.checkpointer.wait()

    def close(self) -> None:
        """Wait for the checkpoint in flight, stop the data threads and the watchdog, close the logs.

        Only after a normal end: its barriers wait for every process. After an exception, abort()."""
        self.signals.restore()
        self.watchdog.stop()
        for tier in (self.checkpointer, self.local):
            if tier is not None:
                tier.close()
        self.checkpointer = None
        self.profiler.close()  # a trace still running stopped; a summary being computed reaches the exporter
        if self.exporter is not None:
            self.exporter.close()
        self.health.close()
        self.data.close()
        if self.log is not None:
            self.log.close()

    def abort(self, grace_s: float = ABORT_GRACE_S) -> None:
        """Release this process's resources after an exception, waiting for no other process.

        The others may be blocked in a device collective waiting for this one: close()'s barriers
        would wait out checkpoint.barrier_timeout_s (with no watchdog) and then fail naming a
        healthy process, hiding the real error. Here the checkpointer takes its failing exit (no
        barrier; the write in flight may finish), the data threads and the logs are closed. With
        several processes all of it runs in a daemon thread given `grace_s`, so that nothing in it
        can keep a failing process alive; a single process has no peer to wait for and finishes
        its save in flight (committed: its barriers are no-ops). Never raises."""
        self.signals.restore()
        multi = self.process_count > 1

        def release() -> None:
            try:
                checkpointer, self.checkpointer = self.checkpointer, None
                if checkpointer is not None and multi:
                    checkpointer.__exit__(RuntimeError, None, None)  # its failing exit: no barrier
                elif checkpointer is not None:
                    checkpointer.close()
                self.data.close()
                if self.log is not None:
                    self.log.close()
            except BaseException as e:  # noqa: BLE001 -- the error being handled is the one to report
                log.error(f"cleanup after the error failed too: {type(e).__name__}: {e}")

        if self.exporter is not None:
            self.exporter.close()
        if not multi:
            release()
        else:
            t = threading.Thread(target=release, name="jaxtrain-abort", daemon=True)
            t.start()
            t.join(grace_s)
        self.watchdog.stop()


def _plain(x: Any) -> Any:
    """JSON fallback for numpy scalars in iterator states."""
    return x.item() if hasattr(x, "item") else str(x)

"""The training loop: wires config, mesh, model, step, data, checkpoints and logs together.

Usable whole (`Trainer(cfg).fit()`) or step by step from a notebook:

    trainer = Trainer(load_config("configs/tiny.yaml", ["train.steps=50"]))
    metrics = trainer.step()          # one optimizer step, metrics as Python numbers
    model = trainer.model()           # an nnx.Module holding the current parameters

Order of work (abstract first, nothing built unsharded): phase-2 config checks -> mesh ->
abstract model (`nnx.eval_shape`) -> shardings from the rules table -> restore-or-init directly
into those shardings -> compile the step once -> loop.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import IO, Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import kernels
from jaxtrain import __version__
from jaxtrain.checkpoint import Checkpointer, enable_compilation_cache, restore_params_only, to_path
from jaxtrain.config import Config, ConfigError, save_config
from jaxtrain.data import build_eval_data, build_train_data
from jaxtrain.mesh import build_mesh, validate_against_devices
from jaxtrain.metrics import RunLog, flops_per_step, peak_flops_per_device
from jaxtrain.model import Transformer, logical_axes
from jaxtrain.sharding import batch_sharding, global_batch, param_shardings
from jaxtrain.step import compute_dtype, make_eval_step, make_optimizer, make_train_step

BATCH_KEYS = ("tokens", "targets", "segment_ids", "positions", "loss_mask")
EXIT_RESTART = 75  # "restart me": preempted after an emergency checkpoint


def check_attention_available(cfg: Config, platform: str) -> str:
    """Resolve `model.attention` for this platform, as a ConfigError when unavailable."""
    try:
        return kernels.resolve_implementation(cfg.model.attention, platform)
    except ValueError as e:
        raise ConfigError(f"model.attention={cfg.model.attention}: {e}") from None


class Trainer:
    """One training run. Construction validates, builds the sharded state and compiles the step."""

    def __init__(self, cfg: Config, *, console: IO[str] | None = None, write_files: bool = True,
                 devices: list[jax.Device] | None = None, started_at: float | None = None):
        """Args:
          cfg: the validated config.
          console: where the live progress line goes (None: nowhere).
          write_files: False keeps the run directory untouched (notebooks, tests).
          devices: the devices to build the mesh on (default: all of the job's devices).
          started_at: wall time the process started (for restart_to_first_step_s).
        """
        self.cfg = cfg
        self._started_at = started_at if started_at is not None else time.time()
        # Before the first jit: a restarted run loads its compiled step instead of recompiling.
        enable_compilation_cache(cfg.checkpoint.compilation_cache_dir)
        self.process_index, self.process_count = jax.process_index(), jax.process_count()
        devices = list(devices) if devices is not None else jax.devices()
        # Phase-2 validation: needs the device count, runs before anything is written.
        self.mesh_sizes = validate_against_devices(cfg, len(devices))
        self.attention = check_attention_available(cfg, devices[0].platform)
        self.mesh = build_mesh(cfg.mesh, devices)
        self.rules = cfg.mesh.rules

        # Abstract model -> logical axes -> shardings. Nothing is allocated yet.
        model_cfg = cfg.model
        dtype = compute_dtype(cfg)
        abstract = nnx.eval_shape(lambda: Transformer(model_cfg, rngs=nnx.Rngs(cfg.run.seed), dtype=dtype))
        self.graphdef, abstract_params = nnx.split(abstract)
        self.logical = logical_axes(abstract_params)
        abstract_params = nnx.to_pure_dict(abstract_params)
        self.param_shardings = param_shardings(self.logical, abstract_params, self.mesh, self.rules)
        self.num_params = sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(abstract_params))

        self.optimizer = make_optimizer(cfg)
        replicated = NamedSharding(self.mesh, P())
        abstract_opt = jax.eval_shape(self.optimizer.init, abstract_params)
        opt_shardings = optax.tree_map_params(
            self.optimizer, lambda _, s: s, abstract_opt, self.param_shardings,
            transform_non_params=lambda _: replicated)
        self.state_shardings = {"step": replicated, "params": self.param_shardings,
                                "opt_state": opt_shardings, "rng": replicated}
        self.batch_sharding = batch_sharding(self.mesh, self.rules)
        self.eval_step = jax.jit(make_eval_step(self.graphdef, self.mesh, self.rules),
                                 in_shardings=(self.param_shardings, self.batch_sharding),
                                 out_shardings=(replicated, replicated))

        # Data next: a missing or bad corpus is a user error and must stop us before any file is written.
        self.data = build_train_data(cfg, self.process_index, self.process_count)
        self.compiled_step = None  # compiled on first use (see _compile)

        # Restore or init, in this order: (1) this run's own latest good checkpoint, (2) the
        # parameters of checkpoint.init_from, (3) fresh. Both restores go straight into the
        # shardings above; a mismatched checkpoint is a ConfigError raised before we write.
        self.output_dir = Path(cfg.run.output_dir)
        self._events: list[tuple[str, int, dict]] = []  # events raised before the log exists
        self.checkpointer: Checkpointer | None = None
        self.resumed_from: int | None = None
        checkpoint_dir = f"{str(cfg.run.output_dir).rstrip('/')}/checkpoints"
        if write_files and to_path(checkpoint_dir).exists():
            self.checkpointer = self._make_checkpointer(checkpoint_dir)
            latest = self.checkpointer.latest_step()
            if latest is not None:
                self.state, extra = self.checkpointer.restore(latest, self.abstract_state())
                self.data.set_state(extra["data"])
                self.resumed_from = latest
        if self.resumed_from is None:
            self.state = self._init_state()
            if cfg.checkpoint.init_from:
                params = restore_params_only(cfg.checkpoint.init_from, self.abstract_state()["params"])
                self.state = {**self.state, "params": params}
                self._events.append(("init_from", 0, {"path": cfg.checkpoint.init_from}))

        primary = self.process_index == 0 and write_files
        if primary:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            save_config(cfg, self.output_dir / "config.yaml")
        self.log = RunLog(str(self.output_dir), console=console, enabled=primary)
        for kind, step, details in self._events:
            self.log.event(kind, step, **details)
        self._events = []
        if write_files and self.checkpointer is None:
            self.checkpointer = self._make_checkpointer(checkpoint_dir)
        self.flops_per_step = flops_per_step(cfg)
        self.peak_flops, self.peak_source = peak_flops_per_device(devices[0], cfg.precision.policy)
        self._pending: tuple[int, dict, float] | None = None  # last step's device metrics, read one step late
        self._host_step = self.step_count
        self._last_log = (self._host_step, time.perf_counter())
        self._stop_requested = False

    # ------------------------------------------------------------------ building

    def _init_fn(self) -> dict:
        cfg = self.cfg
        model = Transformer(cfg.model, rngs=nnx.Rngs(cfg.run.seed), dtype=compute_dtype(cfg))
        params = nnx.to_pure_dict(nnx.state(model))
        return {"step": jnp.int32(0), "params": params, "opt_state": self.optimizer.init(params),
                "rng": jax.random.key_data(jax.random.key(cfg.run.seed))}

    def _init_state(self) -> dict:
        # Built directly in its shardings: no device ever holds the whole model.
        return jax.jit(self._init_fn, out_shardings=self.state_shardings)()

    def abstract_state(self) -> dict:
        """Shapes, dtypes and shardings of the train state, without allocating it."""
        return jax.tree_util.tree_map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                      jax.eval_shape(self._init_fn), self.state_shardings)

    def _make_checkpointer(self, directory: str) -> Checkpointer:
        def on_event(kind: str, step: int, **details: Any) -> None:
            if getattr(self, "log", None) is None:
                self._events.append((kind, step, details))
            else:
                self.log.event(kind, step, **details)
        return Checkpointer(directory, self.cfg.checkpoint, on_event=on_event)

    def _abstract_batch(self) -> dict:
        d = self.cfg.data
        shape = (d.global_batch_size, d.seq_len)
        return {k: jax.ShapeDtypeStruct(shape, jnp.float32 if k == "loss_mask" else jnp.int32,
                                        sharding=self.batch_sharding) for k in BATCH_KEYS}

    def _compile(self) -> None:
        """Compile the train step once, ahead of time, with explicit shardings and donated state."""
        replicated = NamedSharding(self.mesh, P())
        step_fn = make_train_step(self.cfg, self.graphdef, self.optimizer, self.mesh, self.rules)
        jitted = jax.jit(step_fn, in_shardings=(self.state_shardings, self.batch_sharding),
                         out_shardings=(self.state_shardings, replicated), donate_argnums=0)
        t = time.perf_counter()
        self.lowered_step = jitted.lower(self.abstract_state(), self._abstract_batch())
        self.compiled_step = self.lowered_step.compile()
        self.compile_s = time.perf_counter() - t

    # ------------------------------------------------------------------ stepping

    @property
    def step_count(self) -> int:
        return int(jax.device_get(self.state["step"]))  # a host sync: not for the hot loop

    def _next_batch(self) -> tuple[dict, float]:
        local = next(self.data)
        wait = float(getattr(self.data, "last_wait_s", 0.0))
        return global_batch({k: local[k] for k in BATCH_KEYS}, self.mesh, self.rules), wait

    def _dispatch(self) -> int:
        """Queue one step on the device; returns the step number it produces."""
        if self.compiled_step is None:
            self._compile()
        batch, wait = self._next_batch()
        self.state, metrics = self.compiled_step(self.state, batch)
        self._host_step += 1  # the host's count, so it never has to read the device's step
        self._pending = (self._host_step, metrics, wait)
        return self._host_step

    def _record(self, step: int, metrics: dict, wait: float) -> dict:
        """Turn a finished step's device metrics into a log record (reads them: a host sync)."""
        values = {k: v.item() for k, v in jax.device_get(metrics).items()}
        now = time.perf_counter()
        last_step, last_time = self._last_log
        steps = max(step - last_step, 1)
        step_time = (now - last_time) / steps
        self._last_log = (step, now)
        n_dev = self.mesh.size
        tflops_per_device = self.flops_per_step / step_time / n_dev / 1e12
        d = self.cfg.data
        return {
            "step": step, "loss": values["loss"], "grad_norm": values["grad_norm"],
            "learning_rate": values["learning_rate"], "loss_scale": values["loss_scale"],
            "step_time_s": step_time, "tokens_per_sec": values["tokens"] / step_time,
            "tflops_per_device": tflops_per_device, "mfu": tflops_per_device * 1e12 / self.peak_flops,
            "skipped": bool(values["skipped"]), "data_wait_s": wait,
            "tokens_per_step": d.global_batch_size * d.seq_len,
        }

    def step(self) -> dict:
        """Run one step and return its metrics (synchronous: for notebooks and tests)."""
        self._log_step(self._take_pending(), force=False)
        self._last_log = (self._host_step, time.perf_counter())
        self._dispatch()
        return self._record(*self._take_pending())

    def _take_pending(self) -> tuple[int, dict, float] | None:
        pending, self._pending = self._pending, None
        return pending

    def _log_step(self, pending: tuple[int, dict, float] | None, force: bool) -> None:
        """Log a dispatched step's metrics if it is a log step. The loop calls this for step N
        after queueing step N+1, so reading N's metrics never leaves the device idle."""
        if pending is None:
            return
        step = pending[0]
        if force or step % self.cfg.train.log_every == 0 or step == self.cfg.train.steps:
            record = self._record(*pending)
            if self.cfg.train.eval_every and step % self.cfg.train.eval_every == 0:
                record["eval_loss"] = self.evaluate()
                self._last_log = (step, time.perf_counter())  # evaluation time is not step time
            self.log.metrics(record)

    def evaluate(self, num_batches: int | None = None) -> float | None:
        """Mean loss per token on the held-out data (data.eval), or None without one."""
        data = build_eval_data(self.cfg, self.process_index, self.process_count)
        if data is None:
            return None
        total, count = 0.0, 0.0
        for _ in range(num_batches or self.cfg.train.eval_batches):
            local = next(data)
            batch = global_batch({k: local[k] for k in BATCH_KEYS}, self.mesh, self.rules)
            loss_sum, tokens = jax.device_get(self.eval_step(self.state["params"], batch))
            total, count = total + float(loss_sum), count + float(tokens)
        if hasattr(data, "close"):
            data.close()
        return total / max(count, 1.0)

    def model(self) -> Transformer:
        """The model with the current parameters (for inference in a notebook)."""
        return nnx.merge(self.graphdef, self.state["params"])

    # ------------------------------------------------------------------ the loop

    def fit(self) -> dict:
        """Train until train.steps (or a preemption signal). Returns {"step", "exit_code"}."""
        cfg = self.cfg
        start = self._host_step
        if self.compiled_step is None:
            self._compile()
        self.log.event("start", start, devices=self.mesh.size, processes=self.process_count,
                       mesh=self.mesh_sizes, params=self.num_params, attention=self.attention,
                       compile_s=round(self.compile_s, 3), entropy_floor=getattr(self.data, "entropy_floor", None),
                       peak_flops_per_device=self.peak_flops, peak_source=self.peak_source, version=__version__)
        self._last_log = (start, time.perf_counter())
        # Fault drills fire on the first attempt only; `jaxtrain launch` counts restarts.
        chaos_on = int(os.environ.get("JAXTRAIN_RESTART_ATTEMPT", "0")) == 0
        stop = False
        with _PreemptionSignals(self):
            while self._host_step < cfg.train.steps and not stop:
                previous = self._take_pending()
                step = self._dispatch()
                self._log_step(previous, force=False)
                if step == start + 1 and self.resumed_from is not None:
                    jax.block_until_ready(self.state)  # once: the restart is only over when a step has run
                    self.log.event("resume", self.resumed_from, restored_step=self.resumed_from,
                                   restart_to_first_step_s=round(time.time() - self._started_at, 3),
                                   compile_s=round(self.compile_s, 3))
                if chaos_on and step == cfg.chaos.kill_at_step and self.process_index == cfg.chaos.kill_process:
                    jax.block_until_ready(self.state)
                    os.kill(os.getpid(), signal.SIGKILL)  # fault drill: die without any cleanup
                if cfg.chaos.slow_seconds > 0 and self.process_index == cfg.chaos.slow_process:
                    time.sleep(cfg.chaos.slow_seconds)  # straggler drill: a slow host, same numerics
                stop = self._agreed_stop()
                self._maybe_save(step, last=step == cfg.train.steps, force=stop)
            self._log_step(self._take_pending(), force=True)
            if self.checkpointer is not None:
                self.checkpointer.wait()  # the last checkpoint is committed before we report done
        jax.block_until_ready(self.state)
        if stop:
            self.log.event("preempted", self._host_step, exit_code=EXIT_RESTART)
            return {"step": self._host_step, "exit_code": EXIT_RESTART}
        self.log.event("done", self._host_step)
        return {"step": self._host_step, "exit_code": 0}

    def _maybe_save(self, step: int, *, last: bool, force: bool = False) -> None:
        if self.checkpointer is None:
            return
        if self.checkpointer.should_save(step, last=last) or force:
            extra = {"data": self.data.get_state(), "config": self.cfg.to_dict(),
                     "metadata": {"time": time.time(), "mesh": self.mesh_sizes, "processes": self.process_count,
                                  "version": __version__}}
            self.checkpointer.save(step, self.state, json.loads(json.dumps(extra, default=_plain)))

    def save(self) -> None:
        """Checkpoint the current state now (notebooks) and wait until it is committed."""
        if self.checkpointer is None:
            raise RuntimeError("this Trainer was built with write_files=False: it has no checkpoint directory")
        self._maybe_save(self._host_step, last=False, force=True)
        self.checkpointer.wait()

    def _agreed_stop(self) -> bool:
        """Whether every process should stop after this step (a preemption signal reached any).

        One process alone: its own flag. Several: each process's flag goes into a tiny global
        array whose max is read one step late, so all processes stop after the same step
        without a per-step host barrier.
        """
        if self.process_count == 1:
            return self._stop_requested
        flags = np.full((len(self.mesh.local_devices),), self._stop_requested, dtype=np.int32)
        all_devices = NamedSharding(self.mesh, P(self.mesh.axis_names))
        agreed = jnp.max(jax.make_array_from_process_local_data(all_devices, flags))
        previous, self._stop_future = getattr(self, "_stop_future", None), agreed
        return bool(jax.device_get(previous)) if previous is not None else False

    def close(self) -> None:
        if self.checkpointer is not None:
            self.checkpointer.wait()
            self.checkpointer.close()
            self.checkpointer = None
        if hasattr(self.data, "close"):
            self.data.close()
        self.log.close()


class _PreemptionSignals:
    """SIGTERM/SIGINT during fit(): finish the step, save an emergency checkpoint, exit 75.

    A second signal gives up waiting (KeyboardInterrupt). Only the main thread can install
    handlers; elsewhere (a notebook's worker thread) signals keep their default behaviour.
    """

    def __init__(self, trainer: Trainer):
        self.trainer, self.previous = trainer, {}

    def _handle(self, signum, frame) -> None:
        if self.trainer._stop_requested:
            raise KeyboardInterrupt
        self.trainer._stop_requested = True
        self.trainer.log.event("signal", self.trainer._host_step, signal=signal.Signals(signum).name)

    def __enter__(self) -> "_PreemptionSignals":
        import threading
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def _plain(x: Any) -> Any:
    """JSON fallback for numpy scalars in iterator states."""
    return x.item() if hasattr(x, "item") else str(x)

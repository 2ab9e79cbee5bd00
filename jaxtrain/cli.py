"""The `jaxtrain` command: train, inspect, launch, prepare-data, checkpoints, and more.

User errors (bad config, missing data, a mesh that does not fit the devices, an incompatible
checkpoint) print one line on stderr and exit 2, with nothing written. JAX is imported only
after `--cpu-devices` has configured XLA.
"""

from __future__ import annotations

import json
import os
import sys
import time

_STARTED_AT = time.time()  # before JAX is imported: restart_to_first_step_s counts from here

from jaxtrain.runtime import env  # noqa: E402
from jaxtrain.arguments import Parser, add_run_arguments, parse, train_parser  # noqa: E402
from jaxtrain.storage.object_store import TransientStorageError  # noqa: E402  (no JAX import)
from jaxtrain.config import Config, ConfigError  # noqa: E402
from jaxtrain.runtime.exit_codes import EXIT_OK, EXIT_RESTART, EXIT_USAGE  # noqa: E402


def _set_cpu_devices(n: int | None) -> None:
    """Simulate `n` devices on the CPU; must happen before JAX initializes its backends."""
    if n is None:
        return
    if "jax" in sys.modules:  # imported is fine (a notebook); started backends are too late
        from jax._src import xla_bridge
        if xla_bridge.backends_are_initialized():
            raise ConfigError("--cpu-devices must be given before JAX starts (JAX is already initialized)")
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    os.environ["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={n}"])
    os.environ["JAX_PLATFORMS"] = "cpu"


def _set_cpu_flags(cpu_devices: int | None, cfg: Config | None = None) -> None:
    """On the CPU, XLA's faster CPU paths (jaxtrain/runtime/xla_cpu.py: YNNPACK for elementwise ops and
    reductions too, wide vectors): 10-15% less step time, the same numerics to fp32 rounding.
    Flags the user set win; machines with an accelerator are left alone. `cfg` picks the flags that
    config runs with (no elementwise fusions under sequence parallelism)."""
    from jaxtrain.runtime.xla_cpu import cpu_xla_flags, with_flags
    if _on_cpu(cpu_devices):
        os.environ["XLA_FLAGS"] = with_flags(os.environ.get("XLA_FLAGS", ""), cpu_xla_flags(cfg))


def _on_cpu(cpu_devices: int | None) -> bool:
    """Whether this process runs JAX on the CPU (simulated devices asked for, JAX_PLATFORMS=cpu, or
    no sign of a GPU or TPU)."""
    from jaxtrain.runtime.xla_cpu import has_accelerator_hint
    return cpu_devices is not None or os.environ.get("JAX_PLATFORMS", "") == "cpu" or not has_accelerator_hint()


def _start_jax(cpu_devices: int | None, cfg: Config) -> None:
    """Configure XLA and the host's malloc for `cfg`, then join the job. Joining waits for every
    process for up to fault.startup_timeout_s (the start-up deadline covers distributed init; pods
    of one job may start minutes apart)."""
    if _on_cpu(cpu_devices):  # XLA:CPU's buffers are malloc'd at every step (jaxtrain/runtime/host_malloc.py)
        from jaxtrain.runtime.host_malloc import retain_freed_memory
        retain_freed_memory()
    if "jax" not in sys.modules:  # flags are read when the backend starts: too late in a notebook
        _set_cpu_flags(cpu_devices, cfg)
    _set_cpu_devices(cpu_devices)
    from jaxtrain.runtime import distributed
    distributed.initialize(timeout_s=cfg.fault.startup_timeout_s)


def _train(argv: list[str]) -> int:
    from jaxtrain.config import load_config
    args = parse(train_parser(), argv)
    cfg = load_config(args.config, args.overrides)  # phase 1, before JAX starts
    _start_jax(args.cpu_devices, cfg)
    from jaxtrain.trainer import Trainer
    # Progress goes to stdout whatever it is: a terminal gets one line rewritten in place,
    # anything else (SLURM output files, Kubernetes logs, CI, `| tee`) one plain line per log step.
    trainer = Trainer(cfg, console=sys.stdout, started_at=_STARTED_AT)
    try:
        summary = trainer.fit()
    except BaseException as e:
        # Recorded first, while nothing else can fail: the launchers compare it with the next attempt's.
        _record_error(cfg.run.output_dir, trainer.process_index, getattr(trainer, "_host_step", -1), e)
        # No barrier after an error: the other processes may be stuck in a collective waiting for
        # this one, and close() would wait out checkpoint.barrier_timeout_s, then hide the cause.
        trainer.abort()
        if trainer.process_count > 1:
            _exit_now(_report_failure(e))
        raise  # one process: main() maps it (2, 75, 130) or Python prints it and exits 1
    trainer.close()
    return summary["exit_code"]


ERROR_EVENT_TIMEOUT_S = 0.5  # the `error` event may delay a failing process's exit by this much at most
ERROR_MESSAGE_CHARS = 200


def error_details(e: BaseException) -> dict:
    """The `error` event's fields for exception `e`: `type` (its class name), `message` (its first line,
    at most ERROR_MESSAGE_CHARS characters) and `where` (the innermost traceback frame in the jaxtrain
    package, as 'jaxtrain/path/file.py:function'; '?' when none is)."""
    import traceback
    package = os.path.dirname(os.path.abspath(__file__))
    where = "?"
    for frame in traceback.extract_tb(e.__traceback__):
        path = os.path.abspath(frame.filename)
        if path.startswith(package + os.sep):
            rel = os.path.relpath(path, os.path.dirname(package)).replace(os.sep, "/")
            where = f"{rel}:{frame.name}"
    lines = str(e).strip().splitlines()
    message = lines[0] if lines else ""
    if len(message) > ERROR_MESSAGE_CHARS:
        message = message[:ERROR_MESSAGE_CHARS - 3] + "..."
    return {"type": type(e).__name__, "message": message, "where": where}


def _record_error(output_dir: str | None, process: int, step: int, e: BaseException) -> None:
    """Append an `error` event (process, type, message, where, step) to the run's events.jsonl, so
    that the launchers can tell the same deterministic failure coming back (`policy.error_signature`).

    Best effort: never raises, and waits at most ERROR_EVENT_TIMEOUT_S (a hung filesystem must not
    keep a failing process alive). Interrupts and exits are no errors, and a user error (exit 2, never
    restarted) writes nothing, as ever; a remote run directory gets nothing (`append_event` skips it:
    the launchers read local files only)."""
    if isinstance(e, (KeyboardInterrupt, SystemExit, ConfigError)) or output_dir is None:
        return
    import threading

    from jaxtrain.observe.runlog import append_event  # imported already by the Trainer

    def write() -> None:
        try:
            append_event(output_dir, "error", step, process=process, **error_details(e))
        except BaseException as failed:  # noqa: BLE001 -- the error being handled is the one to report
            print(f"jaxtrain: could not record the error event: {type(failed).__name__}: {failed}", file=sys.stderr)

    t = threading.Thread(target=write, name="jaxtrain-error-event", daemon=True)
    t.start()
    t.join(ERROR_EVENT_TIMEOUT_S)


def _report_failure(e: BaseException) -> int:
    """Print why the run failed (the traceback, or one line for a user error) and return the exit code:
    2 for a user error, 75 for a known transient error, 130 for an interrupt, else 1."""
    if isinstance(e, ConfigError):
        print(f"jaxtrain: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    if isinstance(e, KeyboardInterrupt):
        print("jaxtrain: interrupted", file=sys.stderr)
        return 130
    import traceback
    traceback.print_exception(e, file=sys.stderr)
    if isinstance(e, TransientStorageError):
        print(f"jaxtrain: storage unavailable (transient), restart me: {e}", file=sys.stderr)
        return EXIT_RESTART
    print(f"jaxtrain: process failed: {type(e).__name__}: {e}; exiting 1 at once", file=sys.stderr)
    return 1


def _exit_now(code: int) -> None:
    """End a failing process of a multi-process job now: no atexit handlers (jax.distributed's
    shutdown waits for every process), no joins of non-daemon threads."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _inspect(argv: list[str]) -> int:
    from jaxtrain.config import load_config
    p = Parser(prog="jaxtrain inspect", description="Compile the step from shapes alone and report FLOPs, "
               "memory and collectives (no data is read, no parameter allocated).")
    add_run_arguments(p)
    p.add_argument("--parameters", action="store_true", help="also list every parameter's sharding")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    args = parse(p, argv)
    cfg = load_config(args.config, args.overrides, need_data=False)  # shapes only: an import's config too
    _start_jax(args.cpu_devices, cfg)
    from jaxtrain.observe.inspection import format_report, inspect_report
    report = inspect_report(cfg)
    print(json.dumps(report) if args.json else format_report(report, per_parameter=args.parameters))
    return EXIT_OK


def _preflight(argv: list[str]) -> int:
    """`jaxtrain preflight --config PATH [key=value ...] [--cpu-devices N] [--json]`: the check alone."""
    from jaxtrain.config import load_config
    from jaxtrain.runtime.exit_codes import EXIT_RESTART
    p = Parser(prog="jaxtrain preflight", description="Measure every process's devices and links; name the bad ones.")
    add_run_arguments(p)
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    args = parse(p, argv)
    cfg = load_config(args.config, args.overrides)
    _start_jax(args.cpu_devices, cfg)
    import jax

    from jaxtrain.fault.preflight import run_preflight
    from jaxtrain.fault.stragglers import job_hosts
    from jaxtrain.parallel.mesh import build_mesh, validate_against_devices
    validate_against_devices(cfg, jax.device_count(), jax.process_count())
    mesh = build_mesh(cfg.mesh, jax.devices())
    hosts = job_hosts(jax.process_index(), jax.process_count(), host=env.host_name())
    report = run_preflight(cfg, mesh, hosts, lambda *a, **k: None)
    if jax.process_index() == 0:
        if args.json:
            print(json.dumps(report))
        else:
            print(f"matmul TFLOP/s per process: {report['matmul_tflops']} (median {report['median_matmul_tflops']})")
            for axis, b in report["axes_gbps"].items():
                print(f"mesh axis {axis}: all-reduce {b['all_reduce_gbps']} GB/s, all-gather {b['all_gather_gbps']} GB/s")
            for pair, v in report["pairs_gbps"].items():
                print(f"processes {pair}: {v} GB/s")
            print(f"below {report['factor']} x median: processes {report['named'] or 'none'}; "
                  f"pairs {report['slow_pairs'] or 'none'}")
    return EXIT_RESTART if report["named"] and cfg.fault.preflight_action == "exit" else EXIT_OK


def _passthrough(module: str):
    """A verb whose module parses its own arguments: `main(argv) -> int`."""
    def run(argv: list[str]) -> int:
        import importlib
        return importlib.import_module(module).main(argv)
    return run


COMMANDS = {
    "train": (_train, "train (one process per host); resumes from the run directory"),
    "inspect": (_inspect, "compile the step from shapes alone; report FLOPs, memory and collectives"),
    "launch": (_passthrough("jaxtrain.launch.supervisor"), "start and supervise several local processes of one job"),
    "recovery": (_passthrough("jaxtrain.launch.recovery_cli"), "for scheduler scripts: after a failed attempt, restart, isolate a node or give up"),
    "prepare-data": (_passthrough("jaxtrain.data.prepare"), "tokenize text/jsonl files into token files"),
    "checkpoints": (_passthrough("jaxtrain.checkpoint.layout"), "list the checkpoints of a run directory"),
    "preflight": (_preflight, "measure every process's devices and links; name the bad ones"),
    "profile-summary": (_passthrough("jaxtrain.observe.profiling"), "split a run's profiled steps into compute, collectives and waits"),
    "import-hf": (_passthrough("jaxtrain.hf.importer"), "convert a Hugging Face Llama checkpoint for jaxtrain"),
    "export-hf": (_passthrough("jaxtrain.hf.exporter"), "write a run's parameters as a Hugging Face Llama checkpoint"),
    "goodput": (_passthrough("jaxtrain.observe.goodput"), "where a run's wall time went: productive steps, start-up, restarts, ..."),
}


def usage() -> str:
    verbs = "\n".join(f"  {name:<14} {text}" for name, (_, text) in COMMANDS.items())
    return f"usage: jaxtrain COMMAND [ARGS]  (jaxtrain COMMAND --help for its arguments)\ncommands:\n{verbs}"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return EXIT_OK if argv else EXIT_USAGE
    command = COMMANDS.get(argv[0])
    try:
        if command is None:
            raise ConfigError(f"unknown command '{argv[0]}'; commands: {', '.join(COMMANDS)}")
        return command[0](argv[1:])
    except ConfigError as e:
        print(f"jaxtrain: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except TransientStorageError as e:  # a 5xx, throttling or timeout, retried: restart, do not stop the job
        print(f"jaxtrain: storage unavailable (transient), restart me: {e}", file=sys.stderr)
        return EXIT_RESTART
    except SystemExit as e:  # --help of a subcommand
        return int(e.code or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

"""Where step time goes: capture a profiler trace of chosen steps, and split it into parts.

Capture: `train.profile_steps: [a, b]` makes the training loop record a JAX profiler trace of
steps a..b into `<output_dir>/profile/` (`StepProfiler`, called by the loop before and after each
step). Next to the trace it writes the compiled train step's HLO (`train_step.hlo.txt`: op
kinds, shapes and replica groups, which a CPU trace does not carry) and `profile.json` (steps,
devices, process). With an `on_summary` callback (the trainer's: the Prometheus exporter's
`on_profile`, when it is on) it also splits the trace (`summarize`) on a daemon thread once the
trace is written, and hands the callback the summary: the loop never waits for it.

Summary: `jaxtrain profile-summary RUN_DIR [--json]` (`summarize`) reads the trace that
`jax.profiler` wrote (`plugins/profile/<time>/<host>.xplane.pb`, read with
`jax.profiler.ProfileData`, no TensorBoard or xprof needed) and splits each profiled step, per
device, into:

  compute       matmul (dots, convolutions and fusions containing them, GEMM custom calls),
                attention (ops under the model's `attention` name scope, fused attention kernels),
                elementwise (every other op: fusions, reductions, copies, ...);
  collectives   all-reduce, all-gather, reduce-scatter, collective-permute, all-to-all: time, wire
                bytes (from the HLO, as `jaxtrain inspect` counts them) and achieved bandwidth;
  host_wait     the device idle between two executions of the step (waiting for the host to
                dispatch the next step: data, Python, logging);
  idle          the device idle inside an execution (between its ops).

On the CPU, XLA runs plain `dot` ops (Eigen) asynchronously: the op's trace event ends when its
work is handed to the thread pool, and the device then looks idle until the next op starts. Such
a gap inside an execution is counted to the latest dot begun in that execution (its async tail),
not to idle.

How the parts add up to the step time: the profiled window runs from the first op of the first
profiled step to the last op of the last one (an execution the trace cut short is left out);
step time = window / steps. Each instant of a
device's window is given to the innermost op running on each of its threads (time shared evenly
when several threads run ops of the same device at once), or to host_wait/idle when none runs.
So, per device, the parts sum to the window exactly; the report averages over devices. The host
wait after the last profiled step is outside the window (not counted).

On the CPU, simulated devices share the cores, so an op's time includes waiting for a core; a
collective's time includes waiting at its rendezvous for the other devices (that is what makes
"bandwidth" on the CPU a synchronisation figure, not a wire speed).

Nothing here imports JAX at module import: `jaxtrain` stays light until a trace is read.
"""

from __future__ import annotations

import bisect
import json
import logging
import re
import threading
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Iterable

from jaxtrain.storage.paths import is_remote  # imports nothing heavy
from jaxtrain.observe.hlo import COLLECTIVE_KINDS, collective, collective_kind, read_module

_log = logging.getLogger(__name__)

COMPUTE_KINDS = ("matmul", "attention", "elementwise")
WAIT_KINDS = ("host_wait", "idle")
PARTS = COMPUTE_KINDS + COLLECTIVE_KINDS + WAIT_KINDS

HLO_FILE = "train_step.hlo.txt"
META_FILE = "profile.json"
_CONTROL_FLOW = ("while", "conditional", "call")
_MATMUL_TARGETS = re.compile(r"gemm|matmul|cublas|onednn|mkl|xnn|dot", re.I)
_ATTENTION_TARGETS = re.compile(r"fmha|flash|attention|triton|pallas|mosaic|splash", re.I)
_ATTENTION_SCOPE = re.compile(r"(^|/)attention(/|$)|\(attention\)")


# ---------------------------------------------------------------------------------- capture

class StepProfiler:
    """Records a profiler trace of the steps `profile_steps = [first, last]` (inclusive).

    The loop calls `before_step(n, compiled)` before dispatching step n and `after_step(n, state)`
    once step n is dispatched. The trace starts before step `first`; after step `last` it waits
    for the device (once) so the trace holds all of that step, then stops. Steps are annotated
    (`StepTraceAnnotation`) so TensorBoard/xprof show them as steps too. A no-op without
    profile_steps or when not `enabled` (processes other than the first write nothing).
    """

    SUMMARY_WAIT_S = 10.0  # close() waits this long for a summary still being computed

    def __init__(self, profile_steps: Iterable[int] | None, directory: str, total_steps: int | None = None,
                 enabled: bool = True, on_summary: Callable[[dict], None] | None = None):
        """Args:
          profile_steps: [first, last] (train.profile_steps), or empty for no trace.
          directory: where the trace goes (`<output_dir>/profile`); a local path (a run directory
            in object storage gets no trace: the profiler and the summary read local files).
          total_steps: the run's last step (train.steps): a trace asked for past it stops there.
          enabled: False on processes that should not trace.
          on_summary: called with `summarize`'s dict (top_ops left empty) once the trace is written,
            from a daemon thread; None: no summary is computed during the run.
        """
        steps = list(profile_steps or [])
        self.first, self.last = (steps[0], steps[-1]) if steps else (None, None)
        if self.last is not None and total_steps is not None:
            self.last = min(self.last, total_steps)
        self.directory = directory
        # The profiler writes local files: a run directory in object storage gets no trace. A local
        # path that merely contains "://" somewhere is still local (paths.is_remote is the one test).
        self.enabled = enabled and self.first is not None and not is_remote(directory)
        self.active = False
        self._annotation = None
        self.on_summary = on_summary
        self._summarizer: threading.Thread | None = None

    def before_step(self, step: int, compiled: Any = None) -> None:
        """Start the trace before step `first`; annotate every profiled step."""
        if not self.enabled or step < self.first or step > self.last:
            return
        import jax
        if step == self.first and not self.active:
            Path(self.directory).mkdir(parents=True, exist_ok=True)
            if compiled is not None:  # op kinds, shapes and replica groups for the summary
                (Path(self.directory) / HLO_FILE).write_text(compiled.as_text())
            meta = {"steps": [self.first, self.last], "devices": jax.local_device_count(),
                    "process_index": jax.process_index(), "platform": jax.devices()[0].platform,
                    "device_kind": jax.devices()[0].device_kind, "jax": jax.__version__}
            (Path(self.directory) / META_FILE).write_text(json.dumps(meta))
            jax.profiler.start_trace(self.directory)
            self.active = True
        if self.active:
            self._annotation = jax.profiler.StepTraceAnnotation("train", step_num=step)
            self._annotation.__enter__()

    def after_step(self, step: int, state: Any = None) -> None:
        """Close the step's annotation; after step `last`, wait for the device and stop the trace."""
        if not self.active:
            return
        import jax
        if self._annotation is not None:
            self._annotation.__exit__(None, None, None)
            self._annotation = None
        if step >= self.last:
            jax.block_until_ready(state)  # the last profiled step's device work belongs in the trace
            jax.profiler.stop_trace()
            self.active = False
            self.enabled = False
            if self.on_summary is not None:
                # Off the loop: reading a large run's trace takes seconds of host time (0.13 s for a
                # 2-device CPU test); it reads files only, never a device.
                self._summarizer = threading.Thread(target=self._summarize, name="jaxtrain-profile-summary",
                                                    daemon=True)
                self._summarizer.start()

    def _summarize(self) -> None:
        """The summary thread: split the trace just written and hand it over; a failure is one warning."""
        try:
            summary = summarize(self.directory, top=0)
        except Exception as e:  # noqa: BLE001 -- a trace we cannot read must not end the run
            _log.warning(f"train.profile_steps: no summary of the trace: {type(e).__name__}: {e}")
            return
        self.on_summary(summary)

    def close(self) -> None:
        """Stop a trace still running (the run ended before step `last`; no summary of a cut trace),
        and wait up to SUMMARY_WAIT_S for a summary still being computed."""
        if self.active:
            import jax
            if self._annotation is not None:
                self._annotation.__exit__(None, None, None)
            jax.profiler.stop_trace()
            self.active = False
        if self._summarizer is not None:
            self._summarizer.join(self.SUMMARY_WAIT_S)
            self._summarizer = None


# ---------------------------------------------------------------------------------- HLO facts

class HloOp:
    """What the summary needs to know about one HLO instruction."""

    __slots__ = ("name", "opcode", "category", "wire_bytes", "scope")

    def __init__(self, name: str, opcode: str, category: str, wire_bytes: float, scope: str):
        self.name, self.opcode, self.category, self.wire_bytes, self.scope = name, opcode, category, wire_bytes, scope


def parse_hlo(text: str, num_devices: int) -> dict[str, HloOp]:
    """Instruction name -> HloOp for every instruction of an (optimized) HLO module text (read, and
    its collectives' bytes counted, by `hlo`, as `jaxtrain inspect` counts them)."""
    computations, _ = read_module(text)
    has_dot = {comp: any(i.opcode in ("dot", "convolution") for i in instructions)
               for comp, instructions in computations.items()}

    ops: dict[str, HloOp] = {}
    for comp, instructions in computations.items():
        for instruction in instructions:
            name, opcode, rhs = instruction.name, instruction.opcode, instruction.rhs
            scope_m = re.search(r'op_name="([^"]*)"', rhs)
            scope = scope_m.group(1) if scope_m else ""
            kind = collective_kind(opcode)
            nbytes = 0.0
            if kind is not None:
                category = kind
                moved = collective(instruction, num_devices)  # None for an async pair's -done
                nbytes = moved.wire_bytes if moved is not None else 0.0
            elif opcode == "custom-call":
                target = re.search(r'custom_call_target="([^"]*)"', rhs)
                target = target.group(1) if target else ""
                category = ("attention" if _ATTENTION_TARGETS.search(target) or _ATTENTION_SCOPE.search(scope)
                            else "matmul" if _MATMUL_TARGETS.search(target) else "elementwise")
            elif opcode in ("dot", "convolution") or (opcode == "fusion" and any(
                    has_dot.get(c, False) for c in re.findall(r"calls=%?([\w.\-]+)", rhs))):
                category = "attention" if _ATTENTION_SCOPE.search(scope) else "matmul"
            elif _ATTENTION_SCOPE.search(scope) and opcode not in _CONTROL_FLOW:
                category = "attention"
            else:
                category = "elementwise"
            ops[name] = HloOp(name, opcode, category, nbytes, scope)
    return ops


def classify_by_name(name: str) -> str:
    """The category of an op known only by name (no HLO text): XLA's default names say the opcode."""
    base = re.sub(r"[.\d]+$", "", name.split(":")[-1]).strip()
    kind = collective_kind(base)
    if kind is not None:
        return kind
    if re.search(r"fmha|flash|attention", name, re.I):
        return "attention"
    if re.search(r"\b(dot|convolution|gemm|cublas|matmul)", name, re.I):
        return "matmul"
    return "elementwise"


# ---------------------------------------------------------------------------------- trace

class _Event:
    __slots__ = ("start", "end", "op", "module", "run", "device", "line")

    def __init__(self, start, end, op, module, run, device, line):
        self.start, self.end, self.op, self.module, self.run, self.device, self.line = start, end, op, module, run, device, line


def find_trace(run_or_profile_dir: str | Path) -> Path:
    """The newest `*.xplane.pb` under RUN_DIR/profile (or under the given profile directory)."""
    root = Path(run_or_profile_dir)
    candidates = [root / "profile", root]
    for base in candidates:
        found = sorted(base.glob("plugins/profile/*/*.xplane.pb"), key=lambda p: p.stat().st_mtime)
        if found:
            return found[-1]
    raise FileNotFoundError(f"no profiler trace (plugins/profile/*/*.xplane.pb) under {root}/profile or {root}; "
                            "set train.profile_steps=[a,b] and train again")


def read_events(trace_path: Path) -> list[_Event]:
    """Op events from an xplane file, as `jax.profiler` wrote it (see `events_from_planes`)."""
    import jax
    data = jax.profiler.ProfileData.from_file(str(trace_path))
    return events_from_planes(data.planes)


_DEVICE_PLANE = re.compile(r"/device:[A-Z]+:(\d+)")


def events_from_planes(planes: Iterable[Any]) -> list[_Event]:
    """Op events from the planes of a trace (`jax.profiler.ProfileData(...).planes`, or look-alikes
    with `.name`, `.lines`; lines with `.name`, `.events`; events with `.start_ns`, `.end_ns`,
    `.name`, `.stats` as (name, value) pairs).

    CPU: there is no device plane; the host plane's thunk events carry the stats hlo_op,
    hlo_module, device_ordinal and run_id, and they are the ops.
    GPU/TPU: a plane per device (/device:GPU:n); its "XLA Ops" line when present (executions from
    its "XLA Modules" line), else the kernels on its stream lines that carry an hlo_op stat
    (executions from a run_id stat, or found later from the gaps between steps). When any device
    plane exists, the host plane's events are not ops: on a GPU the host threads that launch the
    kernels may carry hlo_op and device_ordinal stats too, and counting them beside the kernels
    would count each op twice (once at launch time on the host, once when it ran on the device)
    and fill the device's host wait and idle with launch time.
    """
    planes = list(planes)
    has_device_planes = any(_DEVICE_PLANE.match(plane.name) for plane in planes)
    events: list[_Event] = []
    for plane in planes:
        device_plane = _DEVICE_PLANE.match(plane.name)
        if device_plane:
            device = int(device_plane.group(1))
            lines = {line.name: line for line in plane.lines}
            modules = sorted((e.start_ns, e.end_ns, re.sub(r"\(\d+\)$", "", e.name))
                             for e in (lines["XLA Modules"].events if "XLA Modules" in lines else []))
            starts = [m[0] for m in modules]
            for line in ([lines["XLA Ops"]] if "XLA Ops" in lines else plane.lines):
                for e in line.events:
                    stats = dict(e.stats)
                    if line.name != "XLA Ops" and "hlo_op" not in stats:
                        continue  # not an XLA kernel (memcpy, another program's work)
                    i = bisect.bisect_right(starts, e.start_ns) - 1
                    if i >= 0 and e.start_ns <= modules[i][1]:
                        module, run = modules[i][2], i
                    else:
                        module, run = str(stats.get("hlo_module", "?")), stats.get("run_id", -1)
                    events.append(_Event(e.start_ns, e.end_ns, str(stats.get("hlo_op", e.name)), module, run, device,
                                         (plane.name, line.name)))
        elif plane.name.startswith("/host:") and not has_device_planes:
            for line in plane.lines:
                for e in line.events:
                    stats = dict(e.stats)
                    if "hlo_op" not in stats or "device_ordinal" not in stats:
                        continue
                    events.append(_Event(e.start_ns, e.end_ns, str(stats["hlo_op"]), str(stats.get("hlo_module", "?")),
                                         stats.get("run_id", -1), int(stats["device_ordinal"]),
                                         (plane.name, line.name)))
    return events


def _runs_from_gaps(events: list[_Event], steps: int) -> None:
    """Number executions by the `steps - 1` largest gaps between ops (for traces without run ids)."""
    ordered = sorted(events, key=lambda e: e.start)
    gaps, end = [], ordered[0].end
    for i, e in enumerate(ordered[1:], 1):
        if e.start > end:
            gaps.append((e.start - end, i))
        end = max(end, e.end)
    cuts = sorted(i for _, i in sorted(gaps, reverse=True)[:max(steps - 1, 0)])
    run = 0
    for i, e in enumerate(ordered):
        while run < len(cuts) and i >= cuts[run]:
            run += 1
        e.run = run


def _exclusive_segments(events: list[_Event]) -> list[tuple[float, float, str]]:
    """Events of one thread -> (start, end, op) pieces of time owned by the innermost running op."""
    events = sorted(events, key=lambda e: (e.start, -e.end))
    out: list[tuple[float, float, str]] = []
    stack: list[_Event] = []
    cursor = None

    def emit(until):
        nonlocal cursor
        if stack and cursor is not None and until > cursor:
            out.append((cursor, until, stack[-1].op))
        cursor = until

    for e in events:
        while stack and stack[-1].end <= e.start:  # close ops that ended before this one starts
            emit(stack[-1].end)
            stack.pop()
        emit(e.start)
        stack.append(e)
    while stack:
        emit(stack[-1].end)
        stack.pop()
    return out


def summarize(run_dir: str | Path, top: int = 15) -> dict:
    """Split the profiled steps of a run into compute, collectives, host wait and idle.

    Returns a JSON-able dict: `step_time_s`, `parts_s` (part -> seconds per step, averaged over
    devices; they sum to step_time_s), `compute_s`, `collectives` (kind -> {time_s, ops, bytes,
    gbytes_per_s}: per step per device), `top_ops`, and where the numbers come from.
    Raises:
      FileNotFoundError: no trace under the run directory.
    """
    run_dir = Path(run_dir)
    trace = find_trace(run_dir)
    profile_dir = trace.parents[3]
    meta = json.loads((profile_dir / META_FILE).read_text()) if (profile_dir / META_FILE).exists() else {}
    events = read_events(trace)
    if not events:
        raise FileNotFoundError(f"{trace} holds no XLA op events (was a step running while it was traced?)")
    devices = sorted({e.device for e in events})
    hlo_path = profile_dir / HLO_FILE
    hlo = parse_hlo(hlo_path.read_text(), len(devices)) if hlo_path.exists() else {}
    split = summarize_events(events, hlo, meta, top=top)
    return {"trace": str(trace), "hlo": str(hlo_path) if hlo else None, **split}


def summarize_events(events: list[_Event], hlo: dict[str, HloOp], meta: dict, top: int = 15) -> dict:
    """The split of `summarize`, from op events already read (no files: unit tests feed it
    synthetic events).

    Args:
      events: op events of the trace (`read_events`), any modules and executions.
      hlo: instruction name -> HloOp of the train step (`parse_hlo`); empty: ops classified by name.
      meta: profile.json (`steps` [first, last] tells how many executions to cut a trace without
        run ids into).
      top: how many of the most expensive ops to list.
    Returns the dict of `summarize` without "trace" and "hlo".
    """
    devices = sorted({e.device for e in events})

    # The train step is the module with the most op time (evaluation or tiny helper jits are not).
    module_time: dict[str, float] = defaultdict(float)
    for e in events:
        module_time[e.module] += e.end - e.start
    module = max(module_time, key=module_time.get)
    events = [e for e in events if e.module == module]
    if len({e.run for e in events}) == 1 and meta.get("steps"):
        _runs_from_gaps(events, meta["steps"][1] - meta["steps"][0] + 1)
    # An execution cut by the trace's start or end (the loop runs one step ahead, so the step
    # before the first profiled one may still be finishing) has fewer ops than the others: drop it.
    ops_per_run: dict[Any, int] = defaultdict(int)
    for e in events:
        ops_per_run[e.run] += 1
    complete = {r for r, n in ops_per_run.items() if n >= 0.95 * max(ops_per_run.values())}
    events = [e for e in events if e.run in complete]
    runs = sorted(complete, key=lambda r: min(e.start for e in events if e.run == r))
    start = min(e.start for e in events)
    end = max(e.end for e in events)
    window = end - start
    steps = len(runs)

    def category(op: str) -> str:
        known = hlo.get(op)
        return known.category if known is not None else classify_by_name(op)

    host_trace = not events[0].line[0].startswith("/device:")  # the CPU backend's thunks, not a GPU/TPU plane

    def is_async(op: str) -> bool:
        known = hlo.get(op)
        opcode = known.opcode if known is not None else re.sub(r"[.\d]+$", "", op)
        return host_trace and opcode in ("dot", "convolution")

    parts = {p: 0.0 for p in PARTS}
    op_time: dict[str, float] = defaultdict(float)
    op_count: dict[str, int] = defaultdict(int)
    collective_ops: dict[str, int] = defaultdict(int)
    collective_bytes: dict[str, float] = defaultdict(float)
    for device in devices:
        mine = [e for e in events if e.device == device]
        for e in mine:
            op_count[e.op] += 1
            kind = category(e.op)
            if kind in COLLECTIVE_KINDS and e.op in hlo and not hlo[e.op].opcode.endswith("-done"):
                collective_ops[kind] += 1
                collective_bytes[kind] += hlo[e.op].wire_bytes
        by_line: dict[Any, list[_Event]] = defaultdict(list)
        for e in mine:
            by_line[e.line].append(e)
        segments = [s for line in by_line.values() for s in _exclusive_segments(line)]
        # Sweep: each instant goes to the ops running then (shared evenly), or to a wait.
        spans = {}  # run -> (first op start, last op end) on this device
        for e in mine:
            s, t = spans.get(e.run, (e.start, e.end))
            spans[e.run] = (min(s, e.start), max(t, e.end))
        span_list = sorted(spans.values())
        # XLA's CPU runtime runs plain dots (Eigen) asynchronously: their trace event ends when the
        # work is handed to the thread pool, and the device looks idle until the next op starts.
        asynchronous = sorted((e.start, e.op) for e in mine if is_async(e.op))
        async_starts, async_ops = [t for t, _ in asynchronous], [op for _, op in asynchronous]
        boundaries = sorted({start, end} | {p for s in segments for p in s[:2]} | {p for s in span_list for p in s})
        opens = defaultdict(list)
        closes = defaultdict(list)
        for s in segments:
            opens[s[0]].append(s[2])
            closes[s[1]].append(s[2])
        running: dict[str, int] = defaultdict(int)
        active = 0
        for a, b in zip(boundaries, boundaries[1:]):
            for op in closes.get(a, ()):
                running[op] -= 1
                active -= 1
                if not running[op]:
                    del running[op]
            for op in opens.get(a, ()):
                running[op] += 1
                active += 1
            dt = b - a
            if dt <= 0:
                continue
            if active:
                for op, n in running.items():
                    share = dt * n / active
                    parts[category(op)] += share
                    op_time[op] += share
            else:
                span = next(((s, t) for s, t in span_list if s <= a and b <= t), None)
                if span is None:
                    parts["host_wait"] += dt
                    continue
                # Inside an execution: the async tail of the latest dot begun in it, or idle.
                i = bisect.bisect_right(async_starts, a) - 1
                if i >= 0 and async_starts[i] >= span[0]:
                    op = async_ops[i]
                    parts[category(op)] += dt
                    op_time[op] += dt
                else:
                    parts["idle"] += dt

    n = len(devices) * max(steps, 1)
    per_step = lambda x: x / n / 1e9  # ns summed over devices and steps -> seconds per step per device
    step_time = window / max(steps, 1) / 1e9
    parts_s = {p: per_step(v) for p, v in parts.items()}
    collectives = {}
    for kind in COLLECTIVE_KINDS:
        t = parts_s[kind]
        b = collective_bytes[kind] / n
        collectives[kind] = {"time_s": t, "ops": collective_ops[kind] / n, "bytes": b,
                             "gbytes_per_s": (b / t / 1e9) if t > 0 and b > 0 else None}
    ranked = sorted(op_time.items(), key=lambda kv: -kv[1])[:top]
    top_ops = [{"op": op, "category": category(op), "time_s": per_step(t), "share": per_step(t) / step_time if step_time else 0.0,
                "count_per_step": op_count[op] / n,
                "scope": hlo[op].scope if op in hlo else ""} for op, t in ranked]
    return {
        "module": module, "steps": steps,
        "devices": len(devices), "platform": meta.get("platform"), "profiled_steps": meta.get("steps"),
        "step_time_s": step_time, "parts_s": parts_s,
        "compute_s": sum(parts_s[k] for k in COMPUTE_KINDS),
        "collectives_s": sum(parts_s[k] for k in COLLECTIVE_KINDS),
        "sum_of_parts_s": sum(parts_s.values()), "collectives": collectives, "top_ops": top_ops,
    }


def format_summary(s: dict) -> str:
    """The text form of `summarize`."""
    step = s["step_time_s"]
    pct = lambda x: f"{100 * x / step:5.1f}%" if step else "  n/a"
    lines = [f"trace: {s['trace']}",
             f"module {s['module']}: {s['steps']} step(s) on {s['devices']} device(s); step time {step * 1e3:.2f} ms "
             f"(parts sum to {s['sum_of_parts_s'] * 1e3:.2f} ms)", ""]
    lines.append(f"  {'compute':<22} {s['compute_s'] * 1e3:10.2f} ms {pct(s['compute_s'])}")
    for k in COMPUTE_KINDS:
        lines.append(f"    {k:<20} {s['parts_s'][k] * 1e3:10.2f} ms {pct(s['parts_s'][k])}")
    lines.append(f"  {'collectives':<22} {s['collectives_s'] * 1e3:10.2f} ms {pct(s['collectives_s'])}")
    for k in COLLECTIVE_KINDS:
        c = s["collectives"][k]
        bw = f"{c['gbytes_per_s']:.2f} GB/s" if c["gbytes_per_s"] else "-"
        lines.append(f"    {k:<20} {c['time_s'] * 1e3:10.2f} ms {pct(c['time_s'])}  {c['ops']:6.0f} ops  "
                     f"{c['bytes'] / 2**20:9.2f} MiB  {bw}")
    for k in WAIT_KINDS:
        lines.append(f"  {k:<22} {s['parts_s'][k] * 1e3:10.2f} ms {pct(s['parts_s'][k])}")
    lines += ["", "top ops (per step per device):"]
    for o in s["top_ops"]:
        lines.append(f"  {o['op']:<32} {o['category']:<18} {o['time_s'] * 1e3:9.2f} ms {100 * o['share']:5.1f}%  "
                     f"x{o['count_per_step']:.0f}  {o['scope'][-60:]}")
    if not s.get("hlo"):
        lines.append("(no train_step.hlo.txt beside the trace: ops classified by name, no collective bytes)")
    return "\n".join(lines)

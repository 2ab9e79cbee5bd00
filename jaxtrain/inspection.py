"""`jaxtrain inspect`: compile the step from shapes alone and report where time and memory go.

Nothing is allocated and no data is read: the state and the batch are `ShapeDtypeStruct`s, so
`jaxtrain inspect --config configs/llama3-70b.yaml` works on a laptop. Reports parameters, model FLOPs per step, XLA's own FLOP count, memory per device, every
parameter's sharding (optional) and collective traffic per step by kind, read from the compiled
HLO. Collectives inside loops (the layer scan, gradient accumulation) are multiplied by the
loop's trip count when XLA records it (`known_trip_count`).
"""

from __future__ import annotations

import math
import re
import time
from collections import defaultdict

import jax

from jaxtrain.config import Config
from jaxtrain.sharding import logical_to_spec

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_DTYPE_BYTES = {"f64": 8, "s64": 8, "u64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "s16": 2,
                "u16": 2, "s8": 1, "u8": 1, "pred": 1, "f8e4m3fn": 1, "f8e5m2": 1}
_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")
_SHAPE = re.compile(r"\b([a-z]+\d*[a-z0-9]*)\[([\d,]*)\]")


def _shape_bytes(text: str) -> int:
    total = 0
    for dtype, dims in _SHAPE.findall(text):
        if dtype in _DTYPE_BYTES:
            total += _DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
    return total


def collective_bytes(hlo_text: str) -> dict[str, dict[str, float]]:
    """{kind: {"count": ops executed per step, "bytes": result bytes per step per device}}."""
    ops_by_comp: dict[str, list[str]] = defaultdict(list)
    current, entry = None, None
    for line in hlo_text.splitlines():
        m = _COMPUTATION.match(line)
        if m and " = " not in line.split("{")[0]:
            current = m.group(1)
            if line.startswith("ENTRY"):
                entry = current
            continue
        if current is not None and " = " in line:
            ops_by_comp[current].append(line)

    totals: dict[str, dict[str, float]] = {k: {"count": 0, "bytes": 0} for k in COLLECTIVES}
    seen: set[tuple[str, int]] = set()

    def visit(comp: str, times: int, depth: int = 0) -> None:
        if depth > 50 or (comp, times) in seen:
            return
        seen.add((comp, times))
        for op in ops_by_comp.get(comp, []):
            lhs, rhs = op.split(" = ", 1)
            kind = next((k for k in COLLECTIVES if re.search(rf"\b{k}(-start)?\(", rhs)), None)
            if kind is not None:
                result_type = rhs.split(f" {kind}")[0]
                totals[kind]["count"] += times
                totals[kind]["bytes"] += times * _shape_bytes(result_type)
            trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', rhs)
            for callee in re.findall(r"(?:body|calls|to_apply|condition|branch_computations)=\{?%?([\w.\-]+)", rhs):
                visit(callee, times * (int(trips.group(1)) if trips and "body=" in rhs else 1), depth + 1)

    if entry is not None:
        visit(entry, 1)
    return totals


def inspect_report(cfg: Config, devices: list[jax.Device] | None = None) -> dict:
    """Compile the train step from shapes alone (no data read, no parameter allocated) and report.

    Returns a JSON-able dict: `params`, `flops_per_step`, `xla_flops_per_device`, `mesh`,
    `peak_memory_bytes_per_device` and its parts, `collectives` (kind -> {count, bytes} per step
    per device), `compile_s` and `parameters` (name -> shape, logical axes, spec, bytes per device).
    Raises:
      ConfigError: the same phase-2 errors as `jaxtrain train` (mesh, divisibility, attention).
    """
    from jaxtrain.mesh import build_mesh, validate_against_devices
    from jaxtrain.state import build_layout
    from jaxtrain.throughput import flops_per_step
    from jaxtrain.trainer import resolve_attention

    devices = list(devices) if devices is not None else jax.devices()
    sizes = validate_against_devices(cfg, len(devices), jax.process_count())
    attention = resolve_attention(cfg, devices[0].platform, sizes)
    mesh = build_mesh(cfg.mesh, devices)
    layout = build_layout(cfg, mesh)
    t = time.perf_counter()
    compiled = layout.lower_train_step().compile()
    report: dict = {"devices": len(devices), "device_kind": devices[0].device_kind, "mesh": sizes,
                    "attention": attention, "params": layout.num_params, "flops_per_step": flops_per_step(cfg),
                    "compile_s": round(time.perf_counter() - t, 3)}
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    report["xla_flops_per_device"] = float(cost["flops"]) if cost and "flops" in cost else None
    mem = compiled.memory_analysis()
    if mem is not None:
        report["memory_bytes_per_device"] = {
            "arguments": mem.argument_size_in_bytes, "temporaries": mem.temp_size_in_bytes,
            "outputs": mem.output_size_in_bytes, "aliased": mem.alias_size_in_bytes}
        report["peak_memory_bytes_per_device"] = (mem.argument_size_in_bytes + mem.temp_size_in_bytes
                                                  + mem.output_size_in_bytes - mem.alias_size_in_bytes)
    report["collectives"] = collective_bytes(compiled.as_text())
    abstract_params = layout.abstract_state()["params"]
    params = {}
    for path, x in jax.tree_util.tree_flatten_with_path(abstract_params)[0]:
        names = _at(layout.logical, path)
        shard = x.sharding.shard_shape(x.shape)
        params[jax.tree_util.keystr(path)] = {
            "shape": list(x.shape), "logical": list(names), "spec": str(logical_to_spec(names, layout.rules)),
            "bytes_per_device": math.prod(shard) * x.dtype.itemsize}
    report["parameters"] = params
    return report


def format_report(report: dict, per_parameter: bool = False) -> str:
    """The text form of `inspect_report`."""
    lines = [f"devices: {report['devices']} ({report['device_kind']})   mesh: {report['mesh']}   "
             f"attention: {report['attention']}",
             f"parameters: {report['params']:,}",
             f"model FLOPs per step: {report['flops_per_step']:.4g}   compile: {report['compile_s']:.1f} s"]
    if report.get("xla_flops_per_device") is not None:
        lines.append(f"XLA FLOPs per step per device: {report['xla_flops_per_device']:.4g}")
    mem = report.get("memory_bytes_per_device")
    if mem is not None:
        gib = 1 / 2**30
        lines.append(f"memory per device: arguments {mem['arguments'] * gib:.3f} GiB, temporaries "
                     f"{mem['temporaries'] * gib:.3f} GiB, outputs {mem['outputs'] * gib:.3f} GiB (aliased "
                     f"{mem['aliased'] * gib:.3f} GiB); peak ~ {report['peak_memory_bytes_per_device'] * gib:.3f} GiB")
    lines.append("collectives per step (per device):")
    for kind, v in report["collectives"].items():
        lines.append(f"  {kind:<20} {int(v['count']):>6} ops  {v['bytes'] / 2**20:>10.2f} MiB")
    if per_parameter:
        lines.append("parameters (logical axes -> PartitionSpec, bytes per device):")
        for name, p in report["parameters"].items():
            lines.append(f"  {name:<36} {str(tuple(p['shape'])):<22} {str(tuple(p['logical'])):<44} "
                         f"{p['spec']:<36} {p['bytes_per_device']:,}")
    return "\n".join(lines)


def inspect_config(cfg: Config, per_parameter: bool = False) -> str:
    """`inspect_report` as text (the `jaxtrain inspect` output)."""
    return format_report(inspect_report(cfg), per_parameter)


def _at(tree, path):
    for k in path:
        tree = tree[k.key]
    return tree

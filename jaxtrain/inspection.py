"""`jaxtrain inspect`: compile the step without training and report where time and memory go.

Reports parameters, model FLOPs per step, XLA's own FLOP count, memory per device, every
parameter's sharding (optional) and collective traffic per step by kind, read from the compiled
HLO. Collectives inside loops (the layer scan, gradient accumulation) are multiplied by the
loop's trip count when XLA records it (`known_trip_count`).
"""

from __future__ import annotations

import math
import re
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


def inspect_config(cfg: Config, per_parameter: bool = False) -> str:
    """Build the trainer (no files written), compile its step and return a text report."""
    from jaxtrain.metrics import flops_per_step
    from jaxtrain.trainer import Trainer

    trainer = Trainer(cfg, write_files=False)
    trainer._compile()
    compiled = trainer.compiled_step
    lines = [f"devices: {trainer.mesh.size} ({jax.devices()[0].device_kind})   mesh: {trainer.mesh_sizes}",
             f"parameters: {trainer.num_params:,}",
             f"model FLOPs per step: {flops_per_step(cfg):.4g}   compile: {trainer.compile_s:.1f} s"]
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    if cost and "flops" in cost:
        lines.append(f"XLA FLOPs per step per device: {cost['flops']:.4g}")
    mem = compiled.memory_analysis()
    if mem is not None:
        gib = 1 / 2**30
        lines.append(f"memory per device: arguments {mem.argument_size_in_bytes * gib:.3f} GiB, "
                     f"temporaries {mem.temp_size_in_bytes * gib:.3f} GiB, outputs {mem.output_size_in_bytes * gib:.3f} GiB "
                     f"(aliased {mem.alias_size_in_bytes * gib:.3f} GiB); peak ~ "
                     f"{(mem.argument_size_in_bytes + mem.temp_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes) * gib:.3f} GiB")
    lines.append("collectives per step (per device):")
    for kind, v in collective_bytes(compiled.as_text()).items():
        lines.append(f"  {kind:<20} {int(v['count']):>6} ops  {v['bytes'] / 2**20:>10.2f} MiB")
    if per_parameter:
        lines.append("parameters (logical axes -> PartitionSpec, bytes per device):")
        flat = jax.tree_util.tree_flatten_with_path(trainer.state["params"])[0]
        for path, x in flat:
            names = _at(trainer.logical, path)
            spec = logical_to_spec(names, trainer.rules)
            shard_bytes = x.addressable_shards[0].data.nbytes
            lines.append(f"  {jax.tree_util.keystr(path):<36} {str(tuple(x.shape)):<22} {str(names):<44} "
                         f"{str(spec):<36} {shard_bytes:,}")
    return "\n".join(lines)


def _at(tree, path):
    for k in path:
        tree = tree[k.key]
    return tree

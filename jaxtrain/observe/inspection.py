"""`jaxtrain inspect`: compile the step from shapes alone and report where time and memory go.

Nothing is allocated and no data is read: the state and the batch are `ShapeDtypeStruct`s, so
`jaxtrain inspect --config configs/llama3-70b.yaml` works on a laptop. Reports parameters, the pipeline schedule, model FLOPs per step, XLA's own FLOP count, memory per device, every
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
import jax.numpy as jnp

from jaxtrain.config import Config
from jaxtrain.observe.hlo import (COLLECTIVE_KINDS as COLLECTIVES, Instruction, collective, read_module, shape_bytes,
                                  split_tuple, wire_bytes)
from jaxtrain.parallel import context, pipeline
from jaxtrain.parallel.mesh import describe_crossings
from jaxtrain.parallel.sharding import logical_to_spec


def collective_bytes(hlo_text: str, num_devices: int | None = None,
                     sliced_as_reduce_scatter: bool = False) -> dict[str, dict[str, float]]:
    """{kind: {"count", "bytes", "result_bytes"}} per step per device, from an optimized HLO module.

    `count`: ops executed per step. `bytes`: wire bytes one device sends, with each op's replica
    group size n: all-gather result x (n-1)/n, reduce-scatter input x (n-1)/n, all-reduce
    2 x size x (n-1)/n (a ring's reduce-scatter + all-gather), all-to-all size x (n-1)/n,
    collective-permute its buffer. `result_bytes`: the ops' result sizes, summed. Ops inside
    loops (the layer scan, gradient accumulation) count once per trip when XLA records the trip
    count (`known_trip_count`). An async pair (`-start`/`-done`) counts once. Each op's bytes are
    `hlo.collective`'s, as `profile-summary` counts them.

    The XLA CPU backend has no reduce-scatter of its own: SPMD partitioning's reduce-scatter (FSDP's
    gradient reduction) stays an all-reduce whose result each device only slices its part of
    (GPU and TPU backends turn that pattern into a reduce-scatter). With `sliced_as_reduce_scatter`,
    such an all-reduce (each tuple element of a combined one whose every use is a dynamic slice of
    1/k of it) is counted as what it implements: a reduce-scatter over k devices (input x (k-1)/k,
    half of what an all-reduce moves), and when the group n is larger (data x fsdp: reduced over
    all, sliced over fsdp) an all-reduce of the 1/k shard over the other n/k devices. Without it
    (the default), everything counts as the program runs it.
    """
    if num_devices is None:
        m = re.search(r"num_partitions=(\d+)", hlo_text)
        num_devices = int(m.group(1)) if m else 1
    ops_by_comp, entry = read_module(hlo_text)

    totals: dict[str, dict[str, float]] = {k: {"count": 0, "bytes": 0, "result_bytes": 0} for k in COLLECTIVES}
    seen: set[tuple[str, int]] = set()
    finder = _SliceFinder(ops_by_comp)

    def add(kind: str, times: int, result: int, wire: float) -> None:
        totals[kind]["count"] += times
        totals[kind]["result_bytes"] += times * result
        totals[kind]["bytes"] += times * wire

    def visit(comp: str, times: int, depth: int = 0) -> None:
        if depth > 50 or (comp, times) in seen:
            return
        seen.add((comp, times))
        for op in ops_by_comp.get(comp, []):
            rhs = op.rhs
            moved = collective(op, num_devices)  # None for an async pair's -done
            if moved is not None:
                kind, result, group, wire = moved.kind, moved.result_bytes, moved.group, moved.wire_bytes
                if kind == "all-reduce" and sliced_as_reduce_scatter and group > 1:
                    # An element each device slices to 1/k: a reduce-scatter over k devices, then (when
                    # the group is larger, e.g. data x fsdp) an all-reduce of the shard over group/k.
                    for nbytes, k in finder.sliced_elements(comp, op.name, op.result_type):
                        if group % k:
                            continue
                        add("reduce-scatter", times, nbytes // k, wire_bytes("reduce-scatter", nbytes // k, k, nbytes))
                        if group > k:
                            add("all-reduce", times, nbytes // k, wire_bytes("all-reduce", nbytes // k, group // k))
                        result -= nbytes
                    if result <= 0:
                        continue
                    wire = wire_bytes(kind, result, group)  # what is left of it
                add(kind, times, result, wire)
            trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', rhs)
            for callee in re.findall(r"(?:body|calls|to_apply|condition|branch_computations)=\{?%?([\w.\-]+)", rhs):
                visit(callee, times * (int(trips.group(1)) if trips and "body=" in rhs else 1), depth + 1)

    if entry is not None:
        visit(entry, 1)
    return totals


def _users(ops: list[Instruction]) -> dict[str, list[tuple[Instruction, list[str]]]]:
    """Instruction name -> [(user, user's operand names)] in one computation."""
    out: dict[str, list[tuple[Instruction, list[str]]]] = defaultdict(list)
    for op in ops:
        operands = re.findall(r"%([\w.\-]+)", op.operands or "")
        for operand in set(operands):
            out[operand].append((op, operands))
    return out


class _SliceFinder:
    """Whether a value is only ever dynamically sliced down to 1/k of it (through bitcasts, copies
    and into fusions): the signature of a reduce-scatter that the CPU backend left an all-reduce."""

    def __init__(self, ops_by_comp: dict[str, list[Instruction]]):
        self.users = {comp: _users(ops) for comp, ops in ops_by_comp.items()}
        self.params = {comp: {int(m.group(1)): op.name for op in ops
                              if op.opcode == "parameter" and (m := re.search(r"parameter\((\d+)\)", op.rhs))}
                       for comp, ops in ops_by_comp.items()}

    def slice_factor(self, comp: str, value: str, nbytes: int, depth: int = 0) -> int:
        """k when every use of `value` (nbytes) is a dynamic slice of nbytes / k (k > 1), else 0."""
        consumers = self.users.get(comp, {}).get(value, [])
        if not consumers or depth > 8:
            return 0
        factors = set()
        for user, operands in consumers:
            opcode, rhs = user.opcode, user.rhs
            if opcode == "dynamic-slice" and operands and operands[0] == value:
                part = shape_bytes(user.result_type)
                factors.add(nbytes // part if part and nbytes % part == 0 else 0)
            elif opcode in ("bitcast", "copy", "reshape"):
                factors.add(self.slice_factor(comp, user.name, nbytes, depth + 1))
            elif opcode == "fusion":
                callee = re.search(r"calls=%?([\w.\-]+)", rhs)
                inner = self.params.get(callee.group(1), {}) if callee else {}
                positions = [i for i, o in enumerate(operands) if o == value]
                factors.update(self.slice_factor(callee.group(1), inner[i], nbytes, depth + 1) if i in inner else 0
                               for i in positions or [-1])
            else:
                return 0
        return factors.pop() if len(factors) == 1 and min(factors) > 1 else 0

    def sliced_elements(self, comp: str, name: str, result_type: str) -> list[tuple[int, int]]:
        """(bytes, k) of the elements of all-reduce `name` (a tuple when XLA combined several) that
        are only sliced to 1/k."""
        if not result_type.strip().startswith("("):
            nbytes = shape_bytes(result_type)
            k = self.slice_factor(comp, name, nbytes)
            return [(nbytes, k)] if k else []
        elements = split_tuple(result_type)
        out = []
        for user, _ in self.users.get(comp, {}).get(name, []):  # get-tuple-element(%name), index=i
            index = re.search(r"get-tuple-element\(.*index=(\d+)", user.rhs)
            if index:
                nbytes = shape_bytes(elements[int(index.group(1))])
                k = self.slice_factor(comp, user.name, nbytes)
                if k:
                    out.append((nbytes, k))
        return out


def inspect_report(cfg: Config, devices: list[jax.Device] | None = None) -> dict:
    """Compile the train step from shapes alone (no data read, no parameter allocated) and report.

    Returns a JSON-able dict: `params`, `flops_per_step`, `xla_flops_per_device`, `mesh`,
    `mesh_crossings` (axis -> {crosses_hosts, crosses_slices}: `mesh.axis_crossings`),
    `pipeline` (the schedule, S, M, R and bubble: `pipeline.describe`, as in the `start` event),
    `peak_memory_bytes_per_device` and its parts, `collectives` (kind -> wire bytes per step per
    device, as `collective_bytes` counts them: a CPU all-reduce that implements a reduce-scatter
    counts as that reduce-scatter), `collective_ops` (kind -> ops per step),
    `collectives_as_compiled` (the same, every op counted as the program runs it),
    `collective_bytes_total`, `collective_bytes_theory` (what the layout needs for parameters and
    gradients, `collective_theory`) and `collective_bytes_ratio` (total / theory), `compile_s`
    and `parameters` (name -> shape, logical axes, spec, bytes per device); `flops_per_step_per_device`
    (model FLOPs / devices), `attention_scores_bytes_per_device` (one layer's [B, N, L, L] fp32 scores
    when the attention is XLA's, which builds them; else None) and `notes` (caveats on reading the
    figures, printed as they are: `report_notes`).
    Raises:
      ConfigError: the same phase-2 errors as `jaxtrain train` (mesh, divisibility, attention).
    """
    from jaxtrain.model.attention import resolve_attention
    from jaxtrain.observe.throughput import flops_per_step
    from jaxtrain.parallel.mesh import axis_crossings, build_mesh, slice_count, validate_against_devices
    from jaxtrain.train.state import build_layout

    devices = list(devices) if devices is not None else jax.devices()
    sizes = validate_against_devices(cfg, len(devices), jax.process_count(), num_slices=slice_count(devices))
    attention = resolve_attention(cfg, devices[0].platform, sizes)
    mesh = build_mesh(cfg.mesh, devices)
    layout = build_layout(cfg, mesh)
    t = time.perf_counter()
    compiled = layout.lower_train_step().compile()
    report: dict = {"devices": len(devices), "device_kind": devices[0].device_kind, "mesh": sizes,
                    "mesh_crossings": axis_crossings(mesh),  # per axis: crosses_hosts, crosses_slices
                    "pipeline": pipeline.describe(cfg, sizes), "attention": attention,
                    "params": layout.num_params, "flops_per_step": flops_per_step(cfg),
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
    hlo = compiled.as_text()
    traffic = collective_bytes(hlo, len(devices), sliced_as_reduce_scatter=True)
    report["collectives"] = {kind: v["bytes"] for kind, v in traffic.items()}
    report["collective_ops"] = {kind: v["count"] for kind, v in traffic.items()}
    report["collectives_as_compiled"] = {kind: v["bytes"] for kind, v in collective_bytes(hlo, len(devices)).items()}
    abstract_params = layout.abstract_state()["params"]
    params = {}
    for path, x in jax.tree_util.tree_flatten_with_path(abstract_params)[0]:
        names = _at(layout.logical, path)
        shard = x.sharding.shard_shape(x.shape)
        params[jax.tree_util.keystr(path)] = {
            "shape": list(x.shape), "logical": list(names), "spec": str(logical_to_spec(names, layout.rules)),
            "bytes_per_device": math.prod(shard) * x.dtype.itemsize}
    report["parameters"] = params
    report["active_params"] = active_params(cfg, layout.num_params, params)
    total = sum(report["collectives"].values())
    theory = collective_theory(params, sizes, layout.rules)
    report["collective_bytes_total"] = total
    report["collective_bytes_theory"] = theory
    report["collective_bytes_ratio"] = total / theory if theory else None
    # Context parallelism: the ring's collective-permute bytes as compiled beside their theory
    # (jaxtrain.parallel.context.ring_bytes_theory), and the temporaries (activations, their
    # gradients and attention blocks), which fall ~1/context with the sequence split.
    report["context"] = context.describe(cfg, sizes)
    if report["context"] is not None:
        from jaxtrain.train.precision import compute_dtype
        ring = context.ring_bytes_theory(cfg, sizes, jnp.dtype(compute_dtype(cfg)).itemsize)
        permute = report["collectives_as_compiled"].get("collective-permute", 0)
        report["context"].update({"ring_permute_bytes": permute, "ring_permute_bytes_theory": ring,
                                  "ring_permute_ratio": permute / ring if ring else None})
    if mem is not None:
        report["activation_bytes_per_device"] = mem.temp_size_in_bytes
    if cfg.model.num_experts > 0:
        report["moe"] = moe_report(cfg, sizes, params, report["collectives"].get("all-to-all", 0.0))
    report["flops_per_step_per_device"] = report["flops_per_step"] / len(devices)
    report["attention_scores_bytes_per_device"] = (attention_scores_bytes(cfg, sizes) if attention == "xla"
                                                   else None)
    report["notes"] = report_notes(cfg, report, devices[0].platform)
    return report


def _ways(name: str, rules: dict, mesh_sizes: dict[str, int]) -> int:
    """Over how many devices the rules table splits logical axis `name`."""
    entry = logical_to_spec((name,), rules)[0]
    entries = entry if isinstance(entry, tuple) else (entry,) if entry else ()
    return math.prod(mesh_sizes[a] for a in entries)


def attention_scores_bytes(cfg: Config, mesh_sizes: dict[str, int]) -> int:
    """Bytes per device of one layer's attention scores [B, N, L, L] in fp32, as XLA's attention
    (`model.attention=xla`, the CPU's `auto`) materialises them; the fused kernels never do.

    B: the sequences one device holds per model call (per grad-accumulation microbatch, per pipeline
    microbatch when there are stages); N: its query heads. The backward pass holds a few such buffers
    (probabilities, their gradient), so this is a lower bound on what attention adds to the peak.
    """
    d, rules = cfg.data, cfg.mesh.rules
    rows = d.global_batch_size // cfg.train.grad_accum
    if mesh_sizes["stage"] > 1:  # inside the pipeline a microbatch is split over the batch axes but `stage`
        batch = logical_to_spec(("batch",), rules)[0]
        inner = [a for a in (batch if isinstance(batch, tuple) else (batch,) if batch else ()) if a != "stage"]
        rows = rows // cfg.pipeline.microbatches // math.prod(mesh_sizes[a] for a in inner)
    else:
        rows //= _ways("batch", rules, mesh_sizes)
    heads = cfg.model.num_heads // _ways("heads", rules, mesh_sizes)
    return max(rows, 1) * heads * d.seq_len ** 2 * 4


def _size(nbytes: float) -> str:
    """`nbytes` in GiB, or MiB below one GiB (a note should not read '0.000977 GiB')."""
    return f"{nbytes / 2**30:.3g} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.3g} MiB"


def report_notes(cfg: Config, report: dict, platform: str) -> list[str]:
    """Caveats that keep the figures from misleading, in words (text and --json carry the same).

    - XLA's attention builds the [L, L] scores: on the CPU they dominate the peak at long sequences,
      where a GPU/TPU runs a fused kernel that never holds them.
    - XLA's cost analysis counts a loop body once (the layer scan, gradient accumulation, the pipeline
      loop), so its FLOPs barely move with depth; the model FLOPs are the figure to use.
    """
    notes = []
    scores = report.get("attention_scores_bytes_per_device")
    if scores is not None:
        which, fused = (("the CPU's model.attention=auto", "on a GPU or TPU `auto` runs a fused kernel that never "
                         "holds them") if platform == "cpu" else
                        ("model.attention=xla", "a fused kernel (model.attention=auto) never holds them"))
        notes.append(f"XLA's attention ({which}) materialises the [L, L] scores: ~{_size(scores)} per layer per "
                     f"device (fp32 [B, N, L, L]; the backward holds a few such buffers), which weigh on the peak "
                     f"above; {fused}")
    m = cfg.model
    loops = [f"{m.num_layers} scanned layers"] if m.scan_layers and m.num_layers > 1 else []
    if cfg.train.grad_accum > 1:
        loops.append(f"{cfg.train.grad_accum} gradient-accumulation microbatches")
    if report["mesh"]["stage"] > 1:
        loops.append("the pipeline iterations")
    if loops and report.get("xla_flops_per_device") is not None:
        notes.append(f"XLA's FLOPs count each loop body once, not once per trip ({', '.join(loops)}), so they fall "
                     f"far below the work done: use the model FLOPs per step per device, "
                     f"{report['flops_per_step_per_device']:.4g}")
    return notes


def active_params(cfg: Config, total: int, parameters: dict) -> int:
    """Parameters one token uses: all but the routed experts it is not sent to (of each parameter
    stacked over `experts`, the fraction experts_per_token / num_experts is active)."""
    m = cfg.model
    if m.num_experts <= 0:
        return total
    expert_weights = sum(math.prod(p["shape"]) for p in parameters.values() if "experts" in p["logical"])
    return total - round(expert_weights * (1 - m.experts_per_token / m.num_experts))


def moe_report(cfg: Config, mesh_sizes: dict[str, int], parameters: dict, all_to_all_bytes: float) -> dict:
    """Mixture of experts: the dispatch, expert weights per device, all-to-all bytes vs theory.

    Theory (dense all-to-all of the capacity buffer, jaxtrain/parallel/experts.py): each MoE layer
    sends a group's [E, C, D] buffer out and back in the forward pass and twice again in the
    backward pass (twice more when `model.remat` recomputes the forward), each time
    buffer x (ep-1)/ep wire bytes per device, per grad-accumulation microbatch.
    """
    import jax.numpy as jnp

    from jaxtrain.parallel.experts import capacity, dispatch_kind
    from jaxtrain.train.precision import compute_dtype

    m, d = cfg.model, cfg.data
    rules = cfg.mesh.rules

    ep = _ways("experts", rules, mesh_sizes)
    tokens = d.global_batch_size // cfg.train.grad_accum // _ways("batch", rules, mesh_sizes) * d.seq_len  # one group's
    C = capacity(tokens, m.experts_per_token, m.num_experts, m.capacity_factor)
    buffer = m.num_experts * C * m.d_model * jnp.dtype(compute_dtype(cfg)).itemsize
    passes = 4 + (2 if m.remat != "none" else 0)
    layers = m.num_moe_layers
    theory = (passes * layers * cfg.train.grad_accum * buffer * (ep - 1) / ep) if ep > 1 else 0.0
    expert_bytes = sum(p["bytes_per_device"] for p in parameters.values() if "experts" in p["logical"])
    return {"dispatch": dispatch_kind(m.capacity_factor, ep, jax.default_backend()), "expert_ways": ep,
            "group_tokens": tokens,
            "capacity_per_expert": C if (m.capacity_factor > 0 or ep > 1) else None,
            "expert_weight_bytes_per_device": expert_bytes, "all_to_all_bytes": all_to_all_bytes,
            "all_to_all_bytes_theory": theory,
            "all_to_all_ratio": all_to_all_bytes / theory if theory else None}


def collective_theory(parameters: dict, mesh_sizes: dict[str, int], rules: dict) -> float:
    """Wire bytes per device per step that the layout needs for parameters and gradients.

    Per parameter (bytes per device b, sharded f ways over fsdp, its gradient summed over the
    d batch-axis devices that do not shard it):
      fsdp (f > 1): all-gather for the forward and again for the backward, reduce-scatter of the
        gradient: 3 x (b f) x (f-1)/f, the usual FSDP/ZeRO-3 count;
      data (d > 1): all-reduce of the (fsdp-sharded) gradient, 2 x b x (d-1)/d.
    So pure FSDP over n devices ~ 3 x parameter bytes x (n-1)/n and pure data parallelism
    2 x parameter bytes x (n-1)/n. Not counted: activation traffic of tensor and pipeline
    parallelism, and the loss and metric scalars.
    """
    batch = logical_to_spec(("batch",), rules)[0]
    batch_axes = set(batch if isinstance(batch, tuple) else (batch,) if batch else ())
    total = 0.0
    for p in parameters.values():
        spec = p["spec"]
        used = {a for a in mesh_sizes if re.search(rf"'{a}'", spec)}
        f = mesh_sizes.get("fsdp", 1) if "fsdp" in used else 1
        d = math.prod(mesh_sizes[a] for a in batch_axes - used)
        b = p["bytes_per_device"]
        if f > 1:
            total += 3 * b * f * (f - 1) / f
        if d > 1:
            total += 2 * b * (d - 1) / d
    return total


def format_report(report: dict, per_parameter: bool = False) -> str:
    """The text form of `inspect_report`."""
    lines = [f"devices: {report['devices']} ({report['device_kind']})   mesh: {report['mesh']}   "
             f"attention: {report['attention']}",
             describe_crossings(report["mesh_crossings"]),
             _pipeline_line(report["pipeline"]),
             f"parameters: {report['params']:,}" + (f" ({report['active_params']:,} active per token)"
                                                     if report.get("active_params", report["params"]) != report["params"]
                                                     else ""),
             f"model FLOPs per step: {report['flops_per_step']:.4g}   compile: {report['compile_s']:.1f} s"]
    if report.get("xla_flops_per_device") is not None:
        per_device = report.get("flops_per_step_per_device", report["flops_per_step"] / report["devices"])
        lines.append(f"XLA FLOPs per step per device: {report['xla_flops_per_device']:.4g}   model FLOPs per step "
                     f"per device: {per_device:.4g}")
    mem = report.get("memory_bytes_per_device")
    if mem is not None:
        gib = 1 / 2**30
        lines.append(f"memory per device: arguments {mem['arguments'] * gib:.3f} GiB, temporaries "
                     f"{mem['temporaries'] * gib:.3f} GiB, outputs {mem['outputs'] * gib:.3f} GiB (aliased "
                     f"{mem['aliased'] * gib:.3f} GiB); peak ~ {report['peak_memory_bytes_per_device'] * gib:.3f} GiB")
    lines.append("collectives per step (wire bytes per device):")
    for kind, nbytes in report["collectives"].items():
        lines.append(f"  {kind:<20} {int(report['collective_ops'][kind]):>6} ops  {nbytes / 2**20:>10.2f} MiB")
    ratio = report.get("collective_bytes_ratio")
    lines.append(f"  {'total':<20} {'':>6}      {report['collective_bytes_total'] / 2**20:>10.2f} MiB   theory for the "
                 f"layout (parameters + gradients) {report['collective_bytes_theory'] / 2**20:.2f} MiB"
                 + (f", ratio {ratio:.2f}" if ratio is not None else ""))
    moe = report.get("moe")
    if moe is not None:
        lines.append(f"moe: dispatch {moe['dispatch']}, expert parallelism {moe['expert_ways']}, "
                     f"{moe['group_tokens']} tokens per group, capacity {moe['capacity_per_expert']}; expert weights "
                     f"{moe['expert_weight_bytes_per_device'] / 2**30:.3f} GiB per device; all-to-all "
                     f"{moe['all_to_all_bytes'] / 2**20:.2f} MiB, theory {moe['all_to_all_bytes_theory'] / 2**20:.2f} MiB")
    lines += [f"note: {note}" for note in report.get("notes", [])]
    if per_parameter:
        lines.append("parameters (logical axes -> PartitionSpec, bytes per device):")
        for name, p in report["parameters"].items():
            lines.append(f"  {name:<36} {str(tuple(p['shape'])):<22} {str(tuple(p['logical'])):<44} "
                         f"{p['spec']:<36} {p['bytes_per_device']:,}")
    return "\n".join(lines)


def _pipeline_line(p: dict) -> str:
    """One line for `pipeline.describe`'s dict, e.g. 'pipeline: gpipe, S=4 stages x 2 layers,
    M=4 microbatches, R=1; 7 iterations, bubble (S-1)/(R*M+S-1) = 42.9%'."""
    if p["schedule"] == "none":
        return "pipeline: none (one stage)"
    return (f"pipeline: {p['schedule']}, S={p['stages']} stages x {p['layers_per_stage']} layers, "
            f"M={p['microbatches']} microbatches, R={p['repeats']}; {p['iterations']} iterations, "
            f"bubble (S-1)/(R*M+S-1) = {100 * p['bubble']:.1f}%")


def inspect_config(cfg: Config, per_parameter: bool = False) -> str:
    """`inspect_report` as text (the `jaxtrain inspect` output)."""
    return format_report(inspect_report(cfg), per_parameter)


def _at(tree, path):
    for k in path:
        tree = tree[k.key]
    return tree

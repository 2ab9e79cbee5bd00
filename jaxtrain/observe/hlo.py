"""The one reader of XLA's HLO text: computations, instructions, collectives and their bytes.

`jaxtrain inspect` (`inspection.collective_bytes`: collective traffic per step, loops multiplied
by their trip counts) and `jaxtrain profile-summary` (`profiling.parse_hlo`: each traced op's
category and wire bytes) both read a compiled module's text through this module, so the two
count every collective the same way:

- shapes: `shape_bytes` sums every array of a type string (a tuple counts all its elements),
  at each dtype's own width (bf16 2 bytes, f32 4, ...);
- an async pair (`-start` / `-done`) counts once, on its start. An `all-reduce-start` has the
  all-reduce's own result type (a tuple when XLA combined several all-reduces into one); an
  `all-gather-start` returns (operands, results) and a `collective-permute-start`
  (operand, result, u32[] contexts): their result is the tuple's second element;
- wire bytes per device over a replica group of n devices: `wire_bytes`.

Nothing here imports JAX.
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import NamedTuple

COLLECTIVE_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")

DTYPE_BYTES = {"f64": 8, "s64": 8, "u64": 8, "c64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2,
               "s16": 2, "u16": 2, "s8": 1, "u8": 1, "pred": 1, "f8e4m3fn": 1, "f8e5m2": 1}
_SHAPE = re.compile(r"\b([a-z]+\d*[a-z0-9]*)\[([\d,]*)\]")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")


def shape_bytes(text: str) -> int:
    """Bytes of all array shapes in an HLO type string (a tuple counts all its elements)."""
    total = 0
    for dtype, dims in _SHAPE.findall(text):
        if dtype in DTYPE_BYTES:
            n = 1
            for d in dims.split(","):
                if d:
                    n *= int(d)
            total += DTYPE_BYTES[dtype] * n
    return total


def split_tuple(t: str) -> list[str]:
    """'(a, (b, c), d)' -> ['a', '(b, c)', 'd']."""
    inner, parts, depth, start = t.strip()[1:-1], [], 0, 0
    for i, c in enumerate(inner):
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c == "," and depth == 0:
            parts.append(inner[start:i].strip())
            start = i + 1
    parts.append(inner[start:].strip())
    return parts


def replica_group_size(attributes: str, num_devices: int) -> int:
    """Devices in each replica group of a collective, from any of XLA's spellings.

    `replica_groups={{0,1},{2,3}}` (explicit), `replica_groups=[4,2]<=[8]` (iota: 4 groups of 2),
    `replica_groups=mesh['a'=4,'b'=2] {'b'}` (mesh axes: the product of the named axes; also with
    `, device_ids=(...)` before the names), and
    `replica_groups={}` (one group of all devices).
    """
    m = re.search(r"replica_groups=\{\{([\d,\s]*)\}", attributes)
    if m:
        return max(len([x for x in m.group(1).split(",") if x.strip()]), 1)
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", attributes)
    if m:
        return int(m.group(2))
    # The mesh spelling may carry a device order between the axes and the group's axis names:
    # `mesh[...], device_ids=([2,4]T(1,0)) {'axis_0'}` (no braces in between).
    m = re.search(r"replica_groups=mesh\[([^\]]*)\][^{}]*\{([^}]*)\}", attributes)
    if m:
        sizes = {k.strip("'\" "): int(v) for k, v in re.findall(r"([^,=]+)=(\d+)", m.group(1))}
        names = [x.strip("'\" ") for x in m.group(2).split(",") if x.strip()]
        size = 1
        for n in names:
            size *= sizes.get(n, 1)
        return size
    return num_devices


def collective_kind(opcode: str) -> str | None:
    """'all-gather-start' -> 'all-gather'; None for anything that is not a collective."""
    base = opcode[:-len("-start")] if opcode.endswith("-start") else opcode[:-len("-done")] if opcode.endswith("-done") else opcode
    return base if base in COLLECTIVE_KINDS else None


def wire_bytes(kind: str, result_bytes: int, group: int, operand_bytes: int | None = None) -> float:
    """Bytes one device sends for one collective over a replica group of `group` devices.

    all-gather: result x (n-1)/n; reduce-scatter: input x (n-1)/n (= result x (n-1));
    all-reduce: 2 x size x (n-1)/n (ring: reduce-scatter then all-gather); all-to-all:
    size x (n-1)/n; collective-permute: its whole buffer. A group of one moves nothing.
    """
    if group <= 1:
        return 0.0
    f = (group - 1) / group
    if kind == "all-gather":
        return result_bytes * f
    if kind == "reduce-scatter":
        return (operand_bytes if operand_bytes is not None else result_bytes * group) * f
    if kind == "all-reduce":
        return 2.0 * result_bytes * f
    if kind == "all-to-all":
        return result_bytes * f
    return float(result_bytes)  # collective-permute


class Instruction(NamedTuple):
    """One HLO instruction: `name = result_type opcode(operands), attributes` (rhs: all after '=')."""
    name: str
    result_type: str
    opcode: str
    rhs: str

    @property
    def operands(self) -> str | None:
        """The text between the opcode's parentheses (operand types and names), None without any."""
        m = re.search(r"\(([^)]*)\)", self.rhs[len(self.result_type):])
        return m.group(1) if m else None


def split_rhs(rhs: str) -> tuple[str, str]:
    """'<type> <opcode>(operands), attributes' -> (type, opcode); the type may be a tuple with spaces."""
    depth, i = 0, 0
    while i < len(rhs):
        c = rhs[i]
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c == " " and depth == 0:
            break
        i += 1
    result_type, rest = rhs[:i], rhs[i + 1:]
    m = re.match(r"([\w\-]+)\(", rest)
    return result_type, (m.group(1) if m else rest.split("(")[0])


def read_module(text: str) -> tuple[dict[str, list[Instruction]], str | None]:
    """(computation name -> its instructions in order, the ENTRY computation's name) of a module's text."""
    computations: dict[str, list[Instruction]] = defaultdict(list)
    current, entry = None, None
    for line in text.splitlines():
        m = _COMPUTATION.match(line)
        if m and " = " not in line.split("{")[0]:
            current = m.group(1)
            if line.startswith("ENTRY"):
                entry = current
            continue
        m = _INSTRUCTION.match(line)
        if m and current is not None:
            computations[current].append(Instruction(m.group(1), *split_rhs(m.group(2)), m.group(2)))
    return computations, entry


class Collective(NamedTuple):
    """One collective as it moves data: its kind, the bytes of its result and of its operands, the
    replica group's size and the wire bytes one device sends."""
    kind: str
    result_bytes: int
    operand_bytes: int
    group: int
    wire_bytes: float


def collective(instruction: Instruction, num_devices: int) -> Collective | None:
    """The collective `instruction` runs; None when it runs none, and for an async pair's `-done`
    (the pair counts once, on its start)."""
    kind = collective_kind(instruction.opcode)
    if kind is None or instruction.opcode.endswith("-done"):
        return None
    operands = instruction.operands
    operand_bytes = shape_bytes(operands) if operands else 0
    result = instruction.result_type
    if (instruction.opcode.endswith("-start") and kind != "all-reduce"
            and result.startswith("(")):  # (operands, results, contexts...): the results are the second part
        parts = split_tuple(result)
        result = parts[1] if len(parts) > 1 else result
    result_bytes = shape_bytes(result)
    group = replica_group_size(instruction.rhs, num_devices)
    return Collective(kind, result_bytes, operand_bytes, group,
                      wire_bytes(kind, result_bytes, group, operand_bytes or None))

"""`jaxtrain.observe.hlo`, the one HLO reader: `jaxtrain inspect` (inspection.collective_bytes) and
`profile-summary` (profiling.parse_hlo) count the same bytes for every collective kind."""

from __future__ import annotations

from collections import defaultdict

import pytest

from jaxtrain.observe.hlo import COLLECTIVE_KINDS, collective, read_module, shape_bytes
from jaxtrain.observe.inspection import collective_bytes
from jaxtrain.observe.profiling import parse_hlo

# Async pairs as GPU backends write them, mixed f32 and bf16, over 4 devices:
# - a combined all-reduce-start has the all-reduce's own (tuple) type, not (operands, results);
# - all-gather-start returns (operand, result); collective-permute-start (operand, result, u32[], u32[]).
HLO = """HloModule m, num_partitions=4

ENTRY %main (a: f32[8], b: bf16[16]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  %b = bf16[16]{0} parameter(1)
  %ars = (f32[8]{0}, bf16[16]{0}) all-reduce-start(f32[8]{0} %a, bf16[16]{0} %b), replica_groups={{0,1,2,3}}, to_apply=%add
  %ard = (f32[8]{0}, bf16[16]{0}) all-reduce-done((f32[8]{0}, bf16[16]{0}) %ars)
  %ags = (bf16[16]{0}, bf16[32]{0}) all-gather-start(bf16[16]{0} %b), replica_groups=[2,2]<=[4], dimensions={0}
  %agd = bf16[32]{0} all-gather-done((bf16[16]{0}, bf16[32]{0}) %ags)
  %cps = (f32[8]{0}, f32[8]{0}, u32[], u32[]) collective-permute-start(f32[8]{0} %a), source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
  %cpd = f32[8]{0} collective-permute-done((f32[8]{0}, f32[8]{0}, u32[], u32[]) %cps)
  %rs = bf16[4]{0} reduce-scatter(bf16[16]{0} %b), replica_groups={{0,1,2,3}}, dimensions={0}, to_apply=%add
  %ar = (f32[8]{0}, bf16[16]{0}) all-reduce(f32[8]{0} %a, bf16[16]{0} %b), replica_groups={{0,1},{2,3}}, to_apply=%add
  %a2a = bf16[16]{0} all-to-all(bf16[16]{0} %b), replica_groups={{0,1,2,3}}, dimensions={0}
  ROOT %r = f32[8]{0} add(%a, %cpd)
}
"""

# By hand: f32[8] = 32 bytes, bf16[16] = 32 bytes.
WANT = {
    # async over 4: 2 x (32 + 32) x 3/4 = 96 (the whole tuple, not its second element);
    # sync over pairs: 2 x 64 x 1/2 = 64
    "all-reduce": 96 + 64,
    "all-gather": 64 * 1 / 2,  # result bf16[32] = 64 bytes over 2
    "collective-permute": 32,  # its f32[8] buffer, not the u32[] contexts of the start's tuple
    "reduce-scatter": 32 * 3 / 4,  # input bf16[16] over 4
    "all-to-all": 32 * 3 / 4,
}


def test_shape_bytes_at_each_dtypes_width():
    assert shape_bytes("bf16[16]{0}") == 32 and shape_bytes("f32[16]{0}") == 64
    assert shape_bytes("(f32[8]{0}, bf16[16]{0}, u32[], pred[3])") == 32 + 32 + 4 + 3


def test_inspect_and_profile_summary_count_the_same_bytes_per_kind():
    inspected = collective_bytes(HLO)
    assert {k: v["bytes"] for k, v in inspected.items()} == pytest.approx(WANT)
    assert {k: v["count"] for k, v in inspected.items()} == {k: 2 if k == "all-reduce" else 1 for k in COLLECTIVE_KINDS}
    profiled: dict[str, float] = defaultdict(float)
    for op in parse_hlo(HLO, 4).values():
        if op.category in COLLECTIVE_KINDS:
            profiled[op.category] += op.wire_bytes
    assert dict(profiled) == pytest.approx(WANT)
    ops = parse_hlo(HLO, 4)
    assert ops["ard"].wire_bytes == ops["agd"].wire_bytes == ops["cpd"].wire_bytes == 0  # a pair counts once


def test_async_starts_result_bytes():
    computations, entry = read_module(HLO)
    by_name = {i.name: i for i in computations[entry]}
    assert collective(by_name["ars"], 4).result_bytes == 64
    assert collective(by_name["ags"], 4).result_bytes == 64
    assert collective(by_name["cps"], 4).result_bytes == 32
    assert collective(by_name["ard"], 4) is None and collective(by_name["a"], 4) is None

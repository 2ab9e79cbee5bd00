"""The preflight's pair exchanges on devices, in one process: the 8 simulated CPU devices stand for
4 processes of 2 devices (rails) each. One compiled program per round, every rail exchanged with
the same rail of the partner, and the chaos.slow_link delay lands on the listed pairs only."""

from __future__ import annotations


import jax
import pytest
import jax.numpy as jnp
import numpy as np
from helpers import TINY
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxtrain.config import ConfigError, load_config
from jaxtrain.fault import preflight
from jaxtrain.fault.preflight_plan import round_robin
from jaxtrain.parallel.mesh import validate_against_devices


PROCESSES, RAILS = 4, 2


def four_by_two() -> Mesh:
    return Mesh(np.array(jax.devices()[:PROCESSES * RAILS]).reshape(PROCESSES, RAILS), ("process", "rail"))


class CompileCounter:
    """Counts XLA backend compiles while active (jax.monitoring's compile-duration event)."""

    def __init__(self):
        self.count, self.active = 0, False
        jax.monitoring.register_event_duration_secs_listener(self._on)

    def _on(self, event, duration, **kwargs):
        if self.active and event == "/jax/core/compile/backend_compile_duration":
            self.count += 1


COUNTER = CompileCounter()


def test_a_round_swaps_every_rail_of_each_matched_pair_and_zeroes_the_rest():
    mesh = four_by_two()
    values = np.array([[[10.0 * p + r] * 3 for r in range(RAILS)] for p in range(PROCESSES)], np.float32)
    x = jax.device_put(jnp.asarray(values), NamedSharding(mesh, P("process", "rail")))
    out = np.asarray(preflight.exchange_program(mesh, [(0, 3)])(x))  # 1 and 2 sit this round out
    for p, partner in {0: 3, 3: 0}.items():
        for r in range(RAILS):
            assert (out[p, r] == 10.0 * partner + r).all()  # rail r met rail r of the partner
    assert (out[1] == 0).all() and (out[2] == 0).all()


def test_one_compiled_program_per_round_not_per_pair():
    mesh = four_by_two()
    rounds = round_robin(range(PROCESSES))  # 3 rounds of 2 pairs: 6 pairs
    preflight.exchange_buffer(mesh, 0.01)  # its constant's compile is not the exchanges'
    COUNTER.count, COUNTER.active = 0, True
    try:
        seen = preflight.round_bandwidths(rounds, 0.01, 1, mesh=mesh, process_index=0)
    finally:
        COUNTER.active = False
    assert COUNTER.count == len(rounds) == 3, COUNTER.count
    assert np.isfinite(seen).all() and (seen > 0).all()  # process 0 is in a pair of every round


def test_a_slow_link_slows_only_the_rounds_of_its_pairs_at_its_ends():
    mesh = four_by_two()
    rounds = round_robin(range(PROCESSES))
    slow = {(0, 2)}
    at_0 = preflight.round_bandwidths(rounds, 0.01, 2, slow, 0.05, mesh=mesh, process_index=0)
    at_1 = preflight.round_bandwidths(rounds, 0.01, 2, slow, 0.05, mesh=mesh, process_index=1)
    k = next(k for k, m in enumerate(rounds) if (0, 2) in m)
    assert all(at_0[k] < 0.2 * at_0[q] for q in range(len(rounds)) if q != k), at_0
    assert at_1[k] > 5 * at_0[k], (at_1, at_0)  # process 1's pair in that round is fine


@pytest.mark.parametrize("value, pairs", [("[]", []), ("[2, 0]", [(2, 0)]), ("[[1, 0], [1, 2]]", [(1, 0), (1, 2)])])
def test_chaos_slow_link_is_one_pair_or_a_list_of_pairs(value, pairs):
    cfg = load_config(TINY, [f"chaos.slow_link={value}"])
    assert cfg.chaos.slow_link_pairs() == pairs
    ends = cfg.chaos.slow_link_ends()
    assert sorted(ends.values()) == sorted(p for pair in pairs for p in pair)
    if len(pairs) == 2:
        assert ends["chaos.slow_link[1][1]"] == 2


@pytest.mark.parametrize("value", ["[1, 1]", "[[0, 1], [2]]", "[[0, 1], 2]", "[0, 1, 2]", "[[0, -1]]", "[[true, 1]]"])
def test_a_bad_chaos_slow_link_is_refused_with_one_line(value):
    with pytest.raises(ConfigError, match="'chaos.slow_link' must be two different process indices"):
        load_config(TINY, [f"chaos.slow_link={value}"])


def test_a_slow_link_pair_naming_no_process_is_refused_once_the_job_is_known():
    cfg = load_config(TINY, ["chaos.slow_link=[[0, 1], [1, 3]]"])
    with pytest.raises(ConfigError, match=r"chaos.slow_link\[1\]\[1\]=3 names no process"):
        validate_against_devices(cfg, 8, 3)


def test_the_exchange_mesh_has_a_row_of_devices_per_process():
    mesh = preflight.exchange_mesh()
    assert mesh.devices.shape == (1, len(jax.devices())) and mesh.axis_names == ("process", "rail")

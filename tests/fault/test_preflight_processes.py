"""The preflight verdict on real multi-process jobs: `jaxtrain preflight` as 3 or 4 local processes
(gloo on the CPU, 2 simulated devices each, so every rail of a process is exchanged).

A bad network card is `chaos.slow_link` on every pair touching one process. Nodes are simulated
with JAXTRAIN_HOST (the host name a process reports in the job's host table); the slower
inter-node network with `chaos.slow_link` on every inter-node pair.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys

import pytest
from helpers import TINY, free_port

from jaxtrain.runtime import env as jaxtrain_env

DEVICES = 2  # per process
SLOW_S = 0.05  # a bad link's extra time per exchange (an exchange of 1 MiB takes a few ms here)
# Healthy pairs of one class spread 1.1-1.7 GB/s here as the load of 2 shared cores goes (CI and a
# quiet run each named a healthy process once at the default 0.7); a drilled link or the slower
# class is over 10x slower, so 0.3 still separates them, and mixing the classes would still flag
# every network pair.
FACTOR = 0.3


def preflight_job(hosts: list[str], *overrides: str, timeout: int = 240, devices: int = DEVICES) -> dict:
    """Run `jaxtrain preflight --json` as len(hosts) processes, process p reporting host hosts[p];
    return process 0's report."""
    count, port = len(hosts), free_port()
    base = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS" and not k.startswith("JAXTRAIN_")}
    base.update({"JAX_PLATFORMS": "cpu", "JAX_DISABLE_MOST_OPTIMIZATIONS": "1",
                 "PYTHONPATH": os.pathsep.join(sys.path)})
    procs = []
    for p, host in enumerate(hosts):
        e = {**base, jaxtrain_env.COORDINATOR: f"127.0.0.1:{port}", jaxtrain_env.NUM_PROCESSES: str(count),
             jaxtrain_env.PROCESS_ID: str(p), jaxtrain_env.HOST: host}
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "jaxtrain", "preflight", "--config", TINY, "--cpu-devices", str(devices),
             "--json", f"data.global_batch_size={2 * count * devices}", "fault.startup_timeout_s=120",
             f"fault.preflight_factor={FACTOR}", *overrides],
            env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=timeout))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for proc, (_, err) in zip(procs, outputs):
        assert proc.returncode == 0, err[-3000:]
    return json.loads(outputs[0][0].strip().splitlines()[-1])


def touching(process: int, count: int) -> str:
    return json.dumps([sorted([process, q]) for q in range(count) if q != process])


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("count, bad", [(3, 1), (4, 2)])
def test_a_bad_network_card_is_named(count, bad):
    """Every pair touching `bad` is slow: among 3 processes that is 2 of the 3 pairs, so the median
    pair is a slow one (what the former rule compared with, naming nothing)."""
    hosts = [f"node{p}" for p in range(count)]
    r = preflight_job(hosts, f"chaos.slow_link={touching(bad, count)}", f"chaos.slow_link_seconds={SLOW_S}")
    # `named` also holds the matmul verdict, which the load of a shared 2-core machine can trip
    assert r["named_for_links"] == [bad] and bad in r["named"], r
    bad_pairs = [sorted([bad, q]) for q in range(count) if q != bad]
    assert all(p in r["slow_pairs"] for p in bad_pairs), r
    # The healthy pairs are far from the bad ones. Which of them fall under the factor x the others
    # is the machine's load here (healthy pairs measured 1.1 to 1.7 GB/s): exact slow_pairs are
    # asserted on synthetic timings (test_preflight_plan.py).
    gbps = {tuple(map(int, k.split("-"))): v for k, v in r["pairs_gbps"].items()}
    assert min(v for (i, j), v in gbps.items() if bad not in (i, j)) > 5 * max(
        v for (i, j), v in gbps.items() if bad in (i, j)), gbps
    assert set(r["pairs_gbps"]) == {f"{i}-{j}" for i, j in itertools.combinations(range(count), 2)}
    assert r["rails"] == DEVICES and r["rounds"] == 3  # 3 rounds of disjoint pairs, one program each


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("hosts", [["nodeA", "nodeA", "nodeB", "nodeB"], ["nodeA", "nodeA", "nodeA", "nodeB"]],
                         ids=["2+2", "3+1"])
def test_healthy_nodes_with_a_slower_network_name_nobody(hosts):
    """2 nodes, 4 processes; the inter-node pairs 10x slower than the intra-node ones (as a
    network is next to NVLink). With 3 + 1 the former rule (every pair against the median of all
    6) flagged the 3 network pairs and named process 3. Now each class is compared with itself:
    no inter-node pair is slow and no process is named for its links. (`named` also holds the
    matmul verdict; and an intra-node pair judged against one or two others can dip under the factor
    of them with the load of this shared 2-core machine, so those are not asserted here.)"""
    inter = [[i, j] for i, j in itertools.combinations(range(4), 2) if hosts[i] != hosts[j]]
    r = preflight_job(hosts, f"chaos.slow_link={json.dumps(inter)}", f"chaos.slow_link_seconds={SLOW_S}")
    assert r["hosts"] == hosts
    assert r["named_for_links"] == [], r
    assert not [p for p in r["slow_pairs"] if hosts[p[0]] != hosts[p[1]]], r  # no network pair is flagged
    ref = r["reference_gbps"]
    assert ref["intra_node"] > 3 * ref["inter_node"], ref  # the two classes really differ


@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_nodes_of_four_processes_with_a_slower_network_name_nobody():
    """2 nodes x 4 processes (8 processes, one device each here, to fit 2 cores): every pair is
    measured (7 rounds), 12 intra-node pairs and 16 inter-node ones 10x slower. Judged by class,
    nobody is named for links and no network pair is flagged. (Where the former rule broke, more
    than 16 processes whose ring is mostly intra-node pairs, is covered by the plan and verdict
    tests on synthetic timings up to P = 1,000.)"""
    hosts = ["nodeA"] * 4 + ["nodeB"] * 4
    inter = [[i, j] for i, j in itertools.combinations(range(8), 2) if hosts[i] != hosts[j]]
    r = preflight_job(hosts, f"chaos.slow_link={json.dumps(inter)}", f"chaos.slow_link_seconds={SLOW_S}",
                      devices=1, timeout=400)
    assert r["hosts"] == hosts
    assert r["named_for_links"] == [], r
    assert not [p for p in r["slow_pairs"] if hosts[p[0]] != hosts[p[1]]], r
    assert len(r["pairs_gbps"]) == 28 and r["rounds"] == 7, r
    ref = r["reference_gbps"]
    assert ref["intra_node"] > 3 * ref["inter_node"], ref

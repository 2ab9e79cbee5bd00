"""Which process pairs the preflight link check exchanges, in which rounds, and what their timings say.

Pure Python, no JAX: `jaxtrain/fault/preflight.py` runs the plan on the devices, the
simulated-scale harness (`tests/coordination_stand_in.py`) counts it at P = 1,000, and the tests feed the verdict
synthetic timings.

The plan: rounds of disjoint pairs (each a matching of the processes), one compiled program each.
- Up to ALL_PAIRS_UP_TO processes, every pair: a round-robin tournament, P - 1 rounds for even P
  (P for odd P, where one process sits out each round).
- Beyond, O(1) rounds whatever P: a ring over the processes ordered so that neighbours sit on
  different hosts (`spread`: host 0's first process, host 1's first, ..., host 0's second, ...):
  the inter-node links, 2 partners per process; and a ring inside each host (all hosts' rings in the
  same rounds): the intra-node links. At most 3 + 3 rounds (a ring of odd length needs 3).

The verdict, separately for intra-node and inter-node pairs (an NVLink pair and a network pair
are not comparable; on a healthy node the first is many times faster):
- a process is named when the median of its own pairs (the higher middle value, so half of them
  slow is not enough with an even count) is below `factor` x the median of the class's pairs that
  do not touch it. A process with only one partner in a class is not judged in it: one slow pair
  does not say which end is bad. With one bad network card among 3 processes, 2 of the 3 pairs are
  slow; judged against the pair that does not touch it, the bad process stands out, the others
  (one slow and one fast pair each) do not;
- a pair is slow when below `factor` x the median of the class's other pairs that touch no named
  process (a named process's pairs would drag the reference down; all other pairs where every
  pair touches one). With 2 processes, or one pair in a class, there is nothing to compare with.
"""

from __future__ import annotations

import bisect
import heapq
import statistics
from typing import Mapping, Sequence

Pair = tuple[int, int]  # (i, j) with i < j
ALL_PAIRS_UP_TO = 8  # every pair up to this many processes (at most 7 rounds); a few rings beyond
INTRA, INTER = "intra_node", "inter_node"


def _pair(a: int, b: int) -> Pair:
    return (a, b) if a < b else (b, a)


def round_robin(members: Sequence[int]) -> list[list[Pair]]:
    """Every pair of `members`, as len - 1 matchings (len for an odd count): the circle method."""
    people: list[int | None] = list(members)
    if len(people) < 2:
        return []
    if len(people) % 2:
        people.append(None)  # a bye: whoever meets it sits the round out
    n, rounds = len(people), []
    for _ in range(n - 1):
        matching = [_pair(a, b) for a, b in zip(people[:n // 2], reversed(people[n // 2:]))
                    if a is not None and b is not None]
        rounds.append(sorted(matching))
        people = [people[0], people[-1], *people[1:-1]]  # keep the first, rotate the rest
    return rounds


def ring(order: Sequence[int]) -> list[list[Pair]]:
    """The ring order[0] - order[1] - ... - order[-1] - order[0] as matchings: 2 for an even
    length, 3 for an odd one (the closing edge alone), 1 for two members, none for fewer."""
    n = len(order)
    if n < 2:
        return []
    if n == 2:
        return [[_pair(order[0], order[1])]]
    edges = [_pair(order[k], order[(k + 1) % n]) for k in range(n)]
    if n % 2 == 0:
        return [sorted(edges[0::2]), sorted(edges[1::2])]
    return [sorted(edges[0:n - 1:2]), sorted(edges[1:n - 1:2]), [edges[n - 1]]]


def by_host(hosts: Sequence[str]) -> list[list[int]]:
    """The processes of each host, hosts in order of their first process."""
    groups: dict[str, list[int]] = {}
    for p, h in enumerate(hosts):
        groups.setdefault(h, []).append(p)
    return list(groups.values())


def spread(groups: list[list[int]]) -> list[int]:
    """Every process of `groups` (one list per host) in an order where neighbours are on different
    hosts wherever the counts allow it (no host has more than half): each step takes the host with
    the most processes left other than the last one's, the earlier host on a tie. Equal hosts
    come out in turn (host 0's first, host 1's first, ..., host 0's second, ...), so a process's
    two ring neighbours sit on two different hosts."""
    heap = [(-len(g), h) for h, g in enumerate(groups) if g]
    heapq.heapify(heap)
    taken = [0] * len(groups)
    order: list[int] = []
    last = None
    while heap:
        left, h = heapq.heappop(heap)
        if h == last and heap:  # the same host twice in a row only when nothing else is left
            left, h, held = *heapq.heappop(heap), (left, h)
            heapq.heappush(heap, held)
        order.append(groups[h][taken[h]])
        taken[h] += 1
        if left + 1 < 0:
            heapq.heappush(heap, (left + 1, h))
        last = h
    return order


def plan_rounds(hosts: Sequence[str]) -> list[list[Pair]]:
    """The rounds of pair exchanges for a job whose process p runs on `hosts[p]`: each round a
    matching (no process in two of its pairs), no pair in two rounds. See the module docstring."""
    count = len(hosts)
    if count <= ALL_PAIRS_UP_TO:
        return round_robin(range(count))
    groups = by_host(hosts)
    rounds = ring(spread(groups)) if len(groups) > 1 else []
    intra_rings = [ring(g) for g in groups]
    for k in range(max(len(r) for r in intra_rings)):  # round k of every host's ring together
        rounds.append(sorted(p for r in intra_rings if k < len(r) for p in r[k]))
    seen: set[Pair] = set()
    out = []
    for matching in rounds:  # an unbalanced layout can put a same-host pair in the interleaved ring too
        fresh = [p for p in matching if p not in seen]
        seen.update(fresh)
        if fresh:
            out.append(fresh)
    return out


def pair_class(pair: Pair, hosts: Sequence[str]) -> str:
    """INTRA when both ends run on one host, else INTER."""
    return INTRA if hosts[pair[0]] == hosts[pair[1]] else INTER


def _median_without(ordered: list[float], drop: Sequence[float]) -> float | None:
    """The median of the sorted list `ordered` less one occurrence of each value in `drop`
    (None when nothing is left): O(len) per call, where re-sorting would be O(len log len)."""
    rest = list(ordered)
    for v in drop:
        del rest[bisect.bisect_left(rest, v)]
    return statistics.median(rest) if rest else None


def verdict(gbps: Mapping[Pair, float], hosts: Sequence[str], factor: float) -> dict:
    """Named processes and slow pairs from per-pair bandwidths (the rules: module docstring).

    Args:
      gbps: bandwidth of each measured pair (i < j), as the slower of its two ends saw it.
      hosts: the host of each process.
      factor: `fault.preflight_factor`.
    Returns:
      {"named": sorted processes, "slow_pairs": sorted [i, j] lists, "reference_gbps": {class:
      the median of the class's pairs that touch no named process}}.
    """
    named: set[int] = set()
    slow: list[Pair] = []
    reference: dict[str, float] = {}
    for cls in (INTRA, INTER):
        pairs = {p: v for p, v in gbps.items() if pair_class(p, hosts) == cls and v == v}  # NaN: not measured
        if not pairs:
            continue
        ordered = sorted(pairs.values())
        mine: dict[int, list[float]] = {}
        for (i, j), v in pairs.items():
            mine.setdefault(i, []).append(v)
            mine.setdefault(j, []).append(v)
        candidates = set()
        for p, own in mine.items():
            others = _median_without(ordered, own)  # the class's pairs that do not touch p
            if len(own) >= 2 and others is not None and statistics.median_high(own) < factor * others:
                candidates.add(p)
        named |= candidates
        clean = {q: v for q, v in pairs.items() if q[0] not in candidates and q[1] not in candidates}
        reference[cls] = statistics.median(clean.values()) if clean else statistics.median(ordered)
        # Each pair against the others touching no named process (all of them when every pair
        # touches one): with few pairs, a pair counted in its own reference would hide itself.
        basis = sorted(clean.values()) if clean else ordered
        for q, v in pairs.items():
            ref = _median_without(basis, [v]) if (q in clean or not clean) else statistics.median(basis)
            if ref is not None and v < factor * ref:
                slow.append(q)
    return {"named": sorted(named), "slow_pairs": [list(p) for p in sorted(slow)], "reference_gbps": reference}


def rounds_to_confirm(rounds: Sequence[Sequence[Pair]], judged: Mapping) -> list[int]:
    """The rounds holding a pair the first `verdict` flagged: a slow pair or a pair of a named
    process. Measured again, they tell a bad link (slow every time) from a moment's load on a shared
    machine or network (which a second look misses); every process reaches the same list."""
    named = set(judged["named"])
    slow = {tuple(p) for p in judged["slow_pairs"]}
    return [k for k, matching in enumerate(rounds)
            if any((i, j) in slow or i in named or j in named for i, j in matching)]


def better_of(first: Mapping[Pair, float], second: Mapping[Pair, float]) -> dict[Pair, float]:
    """Each pair's faster figure of two looks (`second` may hold only the pairs measured again)."""
    return {p: max(v, second.get(p, v)) for p, v in first.items()}

"""Built-in flat topologies: ``complete`` and ``ring``."""

from __future__ import annotations

from decent_optim_wrapper.topo.base import Topology
from decent_optim_wrapper.topo.factory import TopologyFactory

__all__ = ["CompleteTopology", "RingTopology"]


@TopologyFactory.register("complete")
class CompleteTopology(Topology):
    """Every rank averages with every other rank at every step: one exact all-average per step.

    .. math::
        x_i \\leftarrow \\frac{1}{n} \\sum_{j=0}^{n-1} x_j.
    """

    def assign_groups(self) -> list[list[list[int]]]:
        everyone = list(range(self._world_size))
        return [[everyone] for _ in range(self._world_size)]

    def exact_consensus_steps(self) -> int | None:
        return 0 if self._world_size == 1 else 1


@TopologyFactory.register("ring")
class RingTopology(Topology):
    """One-peer ring: each rank averages with its right neighbour, then with its left one, alternately.

    Even ``n`` (decent-dp's schedule): phase 0 pairs ``(0, 1), (2, 3), ..., (n-2, n-1)``; phase 1 pairs
    ``(1, 2), (3, 4), ..., (n-1, 0)``, each with weight 1/2. Each rank sends one model per step.

    Odd ``n >= 5``: an odd cycle has no perfect matching, so in each phase one group of three (uniform
    weight 1/3) takes the place of a pair and every rank still averages at every step; the matching
    turns one rank round the ring each phase, over ``n`` phases: phase ``s`` groups
    ``(s, s+1), (s+2, s+3), ..., (s+n-5, s+n-4), (s+n-3, s+n-2, s+n-1)`` (mod ``n``). Consecutive phases
    are the two matchings of the ring's edges, as for even ``n``, and the triple moves on by one, so no
    two ranks are grouped in every phase. (With the triple kept in one place, ranks ``n-2`` and ``n-1``
    would average together at every step, mixing more slowly with the rest, and each one's always-near
    partner would set its clipping radius (:mod:`~decent_optim_wrapper.engine.exchange.clipping`) low
    enough to halve its other neighbours' differences every round.) The three ranks of a triple send
    4/3 models each (ring all-reduce).
    ``n = 3`` is the complete graph, one phase.

    Exact consensus only for ``n <= 4`` (``n = 4`` is the 2-dimensional hypercube); beyond that it is
    asymptotic, at the rate :meth:`consensus_rate` reports, which decays like ``1/n^2``.
    """

    def assign_groups(self) -> list[list[list[int]]]:
        n = self._world_size
        if n == 1:
            return [[[0]]]
        if n % 2 == 0:
            schedule: list[list[list[int]]] = [[] for _ in range(n)]
            for rank in range(n):
                right = rank + 1 if rank % 2 == 0 else rank - 1
                left = (rank - 1) % n if rank % 2 == 0 else (rank + 1) % n
                schedule[rank] = [sorted({rank, right}), sorted({rank, left})]
            return schedule
        if n == 3:
            return [[[0, 1, 2]] for _ in range(n)]
        phases = []
        for start in range(n):  # the matching turned by one rank a phase: its triple goes round the ring
            at = [(start + offset) % n for offset in range(n)]
            phases.append([[at[2 * i], at[2 * i + 1]] for i in range((n - 3) // 2)] + [at[n - 3 :]])
        schedule = [[] for _ in range(n)]
        for phase in phases:
            for group in phase:
                for rank in group:
                    schedule[rank].append(sorted(group))
        return schedule

    def exact_consensus_steps(self) -> int | None:
        return {1: 0, 2: 1, 3: 1, 4: 2}.get(self._world_size)

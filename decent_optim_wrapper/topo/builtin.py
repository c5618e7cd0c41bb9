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

    Odd ``n >= 3``: an odd cycle has no perfect matching, so in each phase the last pair becomes a group
    of three (uniform weight 1/3) and every rank still averages at every step: phase 0 is
    ``(0, 1), (2, 3), ..., (n-5, n-4), (n-3, n-2, n-1)`` and phase 1 is
    ``(1, 2), (3, 4), ..., (n-4, n-3), (n-2, n-1, 0)``. Together they cover every ring edge, plus the
    two chords ``(n-3, n-1)`` and ``(n-2, 0)``; the three ranks of a triple send 4/3 models each
    (ring all-reduce). For ``n = 3`` both phases are the complete graph.

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
        phases = [
            [[2 * i, 2 * i + 1] for i in range((n - 3) // 2)] + [[n - 3, n - 2, n - 1]],
            [[2 * i + 1, 2 * i + 2] for i in range((n - 3) // 2)] + [[0, n - 2, n - 1]],
        ]
        schedule = [[] for _ in range(n)]
        for phase in phases:
            for group in phase:
                for rank in group:
                    schedule[rank].append(sorted(group))
        return schedule

    def exact_consensus_steps(self) -> int | None:
        return {1: 0, 2: 1, 3: 1, 4: 2}.get(self._world_size)

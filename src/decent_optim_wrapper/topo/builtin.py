"""Built-in topologies."""

from __future__ import annotations

from decent_optim_wrapper.topo.base import Topology
from decent_optim_wrapper.topo.factory import TopologyFactory

__all__ = ["CompleteTopology", "RingTopology"]


@TopologyFactory.register("complete")
class CompleteTopology(Topology):
    """Every rank averages with every other rank at every step: one exact all-average per step."""

    def assign_groups(self) -> list[list[list[int]]]:
        everyone = list(range(self._world_size))
        return [[everyone] for _ in range(self._world_size)]


@TopologyFactory.register("ring")
class RingTopology(Topology):
    """One-peer ring: each rank averages with its right neighbour, then with its left one, alternately.

    Phase 0 pairs ``(0, 1), (2, 3), ...``; phase 1 pairs ``(1, 2), (3, 4), ..., (n-1, 0)``. Each rank
    sends one model per step. Needs an even world size (or 1).
    """

    def assign_groups(self) -> list[list[list[int]]]:
        n = self._world_size
        if n == 1:
            return [[[0]]]
        if n % 2 != 0:
            raise ValueError(
                f"topology 'ring' needs an even world size, got world_size={n}. Use 'complete' for now; "
                "a later version lifts this restriction."
            )
        schedule: list[list[list[int]]] = [[] for _ in range(n)]
        for rank in range(n):
            right = rank + 1 if rank % 2 == 0 else rank - 1
            left = (rank - 1) % n if rank % 2 == 0 else (rank + 1) % n
            schedule[rank] = [sorted({rank, right}), sorted({rank, left})]
        return schedule

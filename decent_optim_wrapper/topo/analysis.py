"""Figures of merit of a schedule: communication volume, consensus rate, connectivity.

Cost model: one gossip group is one all-reduce. A ring all-reduce among ``k`` ranks (reduce-scatter then
all-gather) makes every member send ``2 (k - 1) / k`` models, which is 1 for a pair (the two ranks
swap their models) and 0 for a rank that rests. Volumes are in units of the model size.

Consensus rate over one period: with :math:`P = W_{p-1} \\cdots W_1 W_0` the product of the mixing matrices
of one period and :math:`J = \\mathbf{1}\\mathbf{1}^\\top / n`,

.. math::
    \\rho = 1 - \\lVert P - J \\rVert_2,

so that :math:`\\lVert x_{t+p} - \\bar{x} \\rVert \\le (1 - \\rho) \\lVert x_t - \\bar{x} \\rVert` for every
vector of parameters started at a period boundary (:math:`\\bar{x}` is the mean, which every doubly
stochastic :math:`W` preserves). :math:`\\rho = 1` means exact consensus within one period, :math:`\\rho = 0`
means some disagreement never shrinks; a norm below ``1e-12`` (float64 rounding) counts as exact. The
per-step rate :math:`1 - (1 - \\rho)^{1/p}` compares schedules of different periods.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from decent_optim_wrapper.topo.group import Group

if TYPE_CHECKING:
    from decent_optim_wrapper.topo.base import Topology

__all__ = [
    "TopologyStats",
    "allreduce_models_sent",
    "connected_components",
    "consensus_rate",
    "format_ranks",
    "models_sent_per_rank",
    "period_product",
    "stats",
]


#: Below this spectral norm ``P - J`` is rounding noise of float64 products (entries of ``P`` are sums of
#: at most a few hundred products of weights in [0, 1], each off by ~1e-16), so consensus counts as exact.
_EXACT = 1e-12


def allreduce_models_sent(group_size: int) -> float:
    """Models each member of a ring all-reduce among ``group_size`` ranks sends: ``2 (k - 1) / k``."""
    return 2.0 * (group_size - 1) / group_size


def models_sent_per_rank(topology: Topology) -> list[float]:
    """For every rank, the models it sends per step, averaged over one period."""
    sent = [0.0] * topology.world_size
    for phase in topology.schedule:
        for group in phase:
            for rank in group.ranks:
                sent[rank] += allreduce_models_sent(group.size)
    return [s / topology.period for s in sent]


def period_product(topology: Topology, steps: int | None = None) -> torch.Tensor:
    """``W_{s-1} ... W_0`` in float64 for the first ``steps`` steps (one period by default)."""
    steps = topology.period if steps is None else steps
    product = torch.eye(topology.world_size, dtype=torch.float64)
    for step in range(steps):
        product = topology.mixing_matrix(step) @ product
    return product


def consensus_rate(topology: Topology, *, per_step: bool = False) -> float:
    """:math:`1 - \\lVert P - J \\rVert_2` over one period (see the module docstring), or per step."""
    n = topology.world_size
    deviation = period_product(topology) - torch.full((n, n), 1.0 / n, dtype=torch.float64)
    contraction = min(1.0, float(torch.linalg.matrix_norm(deviation, ord=2)))
    if contraction <= _EXACT:
        return 1.0
    if per_step:
        contraction = contraction ** (1.0 / topology.period)
    return 1.0 - contraction


def connected_components(world_size: int, phases: Iterable[Sequence[Group]]) -> list[list[int]]:
    """Rank sets that the union over all phases of the communication graph splits into, by first rank.

    Two ranks are linked when they share a group whose off-diagonal weight is positive.
    """
    parent = list(range(world_size))

    def find(r: int) -> int:
        while parent[r] != r:
            parent[r] = parent[parent[r]]
            r = parent[r]
        return r

    for phase in phases:
        for group in phase:
            if group.size > 1 and group.peer_weight > 0.0:
                root = find(group.ranks[0])
                for member in group.ranks[1:]:
                    parent[find(member)] = root
    components: dict[int, list[int]] = {}
    for rank in range(world_size):
        components.setdefault(find(rank), []).append(rank)
    return sorted(components.values())


def format_ranks(ranks: Sequence[int]) -> str:
    """``[0, 1, 2, 3, 8]`` as ``"0-3, 8"``: short enough for error messages about 1000 ranks."""
    parts: list[str] = []
    start = prev = None
    for r in sorted(ranks):
        if prev is not None and r == prev + 1:
            prev = r
            continue
        if start is not None:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = r
    if start is not None:
        parts.append(str(start) if start == prev else f"{start}-{prev}")
    return ", ".join(parts)


@dataclass(frozen=True)
class TopologyStats:
    """The figures :func:`stats` reports for one topology."""

    name: str
    world_size: int
    local_world_size: int
    period: int
    process_groups: int
    max_group_size: int
    models_sent_mean: float
    models_sent_max: float
    rate_per_period: float
    rate_per_step: float
    exact_consensus_steps: int | None


def stats(topology: Topology) -> TopologyStats:
    """Collect every figure of ``topology`` (validates it first)."""
    sent = models_sent_per_rank(topology)
    return TopologyStats(
        name=topology.name,
        world_size=topology.world_size,
        local_world_size=topology.local_world_size,
        period=topology.period,
        process_groups=topology.num_process_groups(),
        max_group_size=max(g.size for phase in topology.schedule for g in phase),
        models_sent_mean=sum(sent) / len(sent),
        models_sent_max=max(sent),
        rate_per_period=consensus_rate(topology),
        rate_per_step=consensus_rate(topology, per_step=True),
        exact_consensus_steps=topology.exact_consensus_steps(),
    )

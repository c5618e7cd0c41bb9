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

The per-topology figures are defined in :mod:`~decent_optim_wrapper.topo.mixing` and the connectivity
check in :mod:`~decent_optim_wrapper.topo.validation`, below :mod:`~decent_optim_wrapper.topo.base`
whose methods use them; this module gathers them, with :func:`stats`, for reports and the command line.
"""

from __future__ import annotations

from dataclasses import dataclass

from decent_optim_wrapper.topo.base import Topology
from decent_optim_wrapper.topo.mixing import (
    allreduce_models_sent,
    consensus_rate,
    models_sent_per_rank,
    period_product,
)
from decent_optim_wrapper.topo.validation import connected_components, format_ranks

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

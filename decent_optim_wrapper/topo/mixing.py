"""What one period of a schedule costs and achieves: models sent per rank, period product, consensus rate.

These are the figures behind :meth:`~decent_optim_wrapper.topo.Topology.models_sent_per_step` and
:meth:`~decent_optim_wrapper.topo.Topology.consensus_rate`;
:mod:`decent_optim_wrapper.topo.analysis` re-exports them with the cost model and the consensus rate
explained. They sit below :mod:`~decent_optim_wrapper.topo.base` and take any object with a schedule
(:class:`SupportsSchedule`), so that ``base`` can use them without importing the figures module, which
itself builds on ``base``.
"""

from __future__ import annotations

from typing import Protocol

import torch

from decent_optim_wrapper.topo.group import Phase

__all__ = [
    "SupportsSchedule",
    "allreduce_models_sent",
    "consensus_rate",
    "models_sent_per_rank",
    "period_product",
]


#: Below this spectral norm ``P - J`` is rounding noise of float64 products (entries of ``P`` are sums of
#: at most a few hundred products of weights in [0, 1], each off by ~1e-16), so consensus counts as exact.
_EXACT = 1e-12


class SupportsSchedule(Protocol):
    """What the figures read from a topology: a :class:`~decent_optim_wrapper.topo.base.Topology` fits."""

    @property
    def world_size(self) -> int: ...

    @property
    def schedule(self) -> tuple[Phase, ...]: ...

    @property
    def period(self) -> int: ...

    def mixing_matrix(self, step: int) -> torch.Tensor: ...


def allreduce_models_sent(group_size: int) -> float:
    """Models each member of a ring all-reduce among ``group_size`` ranks sends: ``2 (k - 1) / k``."""
    return 2.0 * (group_size - 1) / group_size


def models_sent_per_rank(topology: SupportsSchedule) -> list[float]:
    """For every rank, the models it sends per step, averaged over one period."""
    sent = [0.0] * topology.world_size
    for phase in topology.schedule:
        for group in phase:
            for rank in group.ranks:
                sent[rank] += allreduce_models_sent(group.size)
    return [s / topology.period for s in sent]


def period_product(topology: SupportsSchedule, steps: int | None = None) -> torch.Tensor:
    """``W_{s-1} ... W_0`` in float64 for the first ``steps`` steps (one period by default)."""
    steps = topology.period if steps is None else steps
    product = torch.eye(topology.world_size, dtype=torch.float64)
    for step in range(steps):
        product = topology.mixing_matrix(step) @ product
    return product


def consensus_rate(topology: SupportsSchedule, *, per_step: bool = False) -> float:
    """:math:`1 - \\lVert P - J \\rVert_2` over one period (explained in :mod:`.analysis`), or per step."""
    n = topology.world_size
    deviation = period_product(topology) - torch.full((n, n), 1.0 / n, dtype=torch.float64)
    contraction = min(1.0, float(torch.linalg.matrix_norm(deviation, ord=2)))
    if contraction <= _EXACT:
        return 1.0
    if per_step:
        contraction = contraction ** (1.0 / topology.period)
    return 1.0 - contraction

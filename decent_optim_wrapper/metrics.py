"""Measurements over the replicas: how far apart they are."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = ["consensus_distance", "tensors_consensus_distance"]


@torch.no_grad()
def tensors_consensus_distance(
    tensors: Sequence[torch.Tensor], group: dist.ProcessGroup | None, world_size: int
) -> float:
    r"""Root-mean-square distance of the replicas of ``tensors`` to their average.

    .. math::
        d = \sqrt{\frac{1}{n} \sum_{i=0}^{n-1} \lVert x_i - \bar{x} \rVert_2^2},
        \qquad \bar{x} = \frac{1}{n} \sum_i x_i,

    where ``x_i`` is rank ``i``'s concatenation of ``tensors``. It is 0 exactly when all replicas
    agree, and is what gossip shrinks. Computed in float64 (one temporary per tensor at a time);
    every rank returns the same value.

    .. warning:: This is a collective: all ranks must call it with the same tensor layout.
    """
    if world_size == 1:
        return 0.0
    squared = torch.zeros((), dtype=torch.float64, device=tensors[0].device if tensors else "cpu")
    for tensor in tensors:
        mean = tensor.to(torch.float64)
        dist.all_reduce(mean, group=group)
        mean.div_(world_size)
        squared += (tensor.to(torch.float64) - mean).square().sum()
    dist.all_reduce(squared, group=group)
    return math.sqrt(squared.item() / world_size)


def consensus_distance(optimizer: object) -> float:
    """Consensus distance of a :class:`~decent_optim_wrapper.DecentOptimWrapper`'s parameters.

    See :func:`tensors_consensus_distance` for the definition. Gossip still in flight is not
    included: this measures the parameters as they are now.

    .. warning:: This is a collective: all ranks must call it.
    """
    from decent_optim_wrapper.wrapper import DecentOptimWrapper

    if not isinstance(optimizer, DecentOptimWrapper):
        raise TypeError(
            f"consensus_distance() needs a DecentOptimWrapper, got {type(optimizer).__name__}; for other "
            "tensors use tensors_consensus_distance(tensors, group, world_size)."
        )
    return optimizer.consensus_distance()

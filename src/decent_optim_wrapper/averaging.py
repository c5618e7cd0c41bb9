"""Exact world averaging of flat tensors (for evaluation), and the snapshot that undoes it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["Snapshot", "average_across_world_"]

# Summing n low-precision values in their own dtype rounds up to n times; summing in fp32 and
# rounding once at the end gives the average within one rounding of the exact value.
_ACCUMULATE_IN_FP32 = (torch.float16, torch.bfloat16)


@torch.no_grad()
def average_across_world_(
    tensors: Sequence[torch.Tensor], group: dist.ProcessGroup | None, world_size: int
) -> None:
    """Replace every tensor by its average over all ranks, in place, identically on every rank.

    ``x <- (sum_i x_i) / n``: the all-reduce hands every rank the same sum, and the division is
    the same on every rank, so all replicas end bit-for-bit equal.

    .. warning:: This is a collective: all ranks must call it with the same tensor layout.
    """
    if world_size == 1:
        return
    for tensor in tensors:
        if tensor.dtype in _ACCUMULATE_IN_FP32:
            wide = tensor.float()
            dist.all_reduce(wide, op=dist.ReduceOp.SUM, group=group)
            tensor.copy_(wide.div_(world_size))
        else:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
            tensor.div_(world_size)


@dataclass
class Snapshot:
    """What :meth:`DecentOptimWrapper.revert_global_avg` restores: the replica before averaging."""

    params: list[torch.Tensor]
    gossip: dict[str, Any] | None

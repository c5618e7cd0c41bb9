r"""Exact world averaging of tensors (for evaluation), the snapshot that undoes it, and the
consensus distance of the replicas.

Global average: ``x <- (sum_i x_i) / n``. The all-reduce hands every rank the same sum and the
division is the same on every rank, so all replicas end bit-for-bit equal. fp16/bf16 tensors are
summed in fp32 and rounded once (:func:`~.comm.reduction_dtype`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from decent_optim_wrapper.engine.comm import reduction_dtype, wait_all
from decent_optim_wrapper.engine.errors import GlobalAverageError

__all__ = ["Snapshot", "average_across_world_", "floating_buffers", "tensors_consensus_distance"]


@torch.no_grad()
def average_across_world_(
    tensors: Sequence[torch.Tensor],
    group: dist.ProcessGroup | None,
    world_size: int,
    timeout: timedelta | None = None,
    *,
    rank: int | None = None,
    step: int | None = None,
    waiter: Callable[..., None] = wait_all,
    in_place: bool = True,
) -> None:
    """Replace every tensor by its average over all ranks, in place, identically on every rank.

    All all-reduces are launched first and then waited for, so they pipeline instead of each
    paying a full round trip.

    Args:
        tensors: the tensors to average, the same layout on every rank.
        group: the process group spanning the world (None: the default group).
        world_size: number of ranks.
        timeout: longest CPU-side wait (see :func:`~.comm.wait_all`).
        rank, step: named in the :class:`GlobalAverageError` raised when a peer does not answer.
        waiter: how the all-reduces are waited for (a membership's failure-aware wait, or
            :func:`~.comm.wait_all`).
        in_place: reduce in the tensors themselves; with False, in copies written back only once
            every all-reduce has completed, so a failure leaves the tensors as they were (to retry).

    .. warning:: This is a collective: all ranks must call it with the same tensor layout.
    """
    if world_size == 1:
        return

    def failure(cause: BaseException | None) -> Exception:
        return GlobalAverageError(_failure_message(rank, step, world_size, timeout, cause))

    launched: list[tuple[torch.Tensor, torch.Tensor, dist.Work]] = []
    for tensor in tensors:
        wide = tensor if reduction_dtype(tensor.dtype) == tensor.dtype else tensor.to(torch.float32)
        if wide is tensor and not in_place:
            wide = tensor.clone()
        launched.append(
            (tensor, wide, dist.all_reduce(wide, op=dist.ReduceOp.SUM, group=group, async_op=True))
        )
    if not in_place:
        device = launched[0][0].device if launched else torch.device("cpu")
        waiter([work for _, _, work in launched], device, timeout, failure)
    for tensor, wide, work in launched:
        if in_place:
            waiter([work], tensor.device, timeout, failure)
        if wide is tensor:
            tensor.div_(world_size)
        else:
            tensor.copy_(wide.div_(world_size))


def _failure_message(
    rank: int | None,
    step: int | None,
    world_size: int,
    timeout: timedelta | None,
    cause: BaseException | None,
) -> str:
    limit = f"within {timeout}" if timeout is not None else "in time"
    at = "" if step is None else f" at step {step}"
    return (
        ("" if rank is None else f"rank {rank}: ")
        + f"global_avg(){at}: the all-reduce over all {world_size} ranks did not complete: a peer died, did "
        f"not call global_avg() at the same point, or did not answer {limit}. Every rank must call "
        f"global_avg() at the same point; restart from the last checkpoint. Cause: {cause}"
    )


def floating_buffers(module: object) -> list[torch.Tensor]:
    """The module's floating-point buffers (BatchNorm running statistics, ...), in a fixed order."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(
            f"buffers must be an nn.Module whose floating buffers to average (e.g. the model), got "
            f"{type(module).__name__}."
        )
    return [b for b in module.buffers() if b.is_floating_point()]


@dataclass
class Snapshot:
    """What a revert of the global average restores: the replica and gossip before averaging."""

    params: list[torch.Tensor]
    gossip: dict[str, Any] | None
    buffers: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (live, saved)
    local: dict[str, Any] | None = None  # low-communication gossip: anchors and rounds to fold in

    def add_buffers(self, buffers: Sequence[torch.Tensor]) -> None:
        """Save buffers not saved yet (a second ``global_avg`` keeps the first values)."""
        saved = {id(live) for live, _ in self.buffers}
        self.buffers.extend((b, b.detach().clone()) for b in buffers if id(b) not in saved)

    @torch.no_grad()
    def restore_buffers(self) -> None:
        for live, saved in self.buffers:
            live.copy_(saved)


@torch.no_grad()
def tensors_consensus_distance(
    tensors: Sequence[torch.Tensor],
    group: dist.ProcessGroup | None,
    world_size: int,
    wait: Callable[[dist.Work, torch.Tensor], None] | None = None,
) -> float:
    r"""Root-mean-square distance of the replicas of ``tensors`` to their average.

    .. math::
        d = \sqrt{\frac{1}{n} \sum_{i=0}^{n-1} \lVert x_i - \bar{x} \rVert_2^2},
        \qquad \bar{x} = \frac{1}{n} \sum_i x_i,

    where ``x_i`` is rank ``i``'s concatenation of ``tensors``. It is 0 exactly when all replicas
    agree, and is what gossip shrinks. Computed in float64 (one temporary per tensor at a time);
    every rank returns the same value.

    ``wait(work, tensor)`` waits for each all-reduce (default: ``work.wait()``).

    .. warning:: This is a collective: all ranks must call it with the same tensor layout.
    """
    if world_size == 1:
        return 0.0

    def reduce(tensor: torch.Tensor) -> None:
        work = dist.all_reduce(tensor, group=group, async_op=True)
        if wait is None:
            work.wait()
        else:
            wait(work, tensor)

    squared = torch.zeros((), dtype=torch.float64, device=tensors[0].device if tensors else "cpu")
    for tensor in tensors:
        mean = tensor.to(torch.float64, copy=True)  # a float64 tensor must not be reduced in place
        reduce(mean)
        mean.div_(world_size)
        squared += (tensor.to(torch.float64) - mean).square().sum()
    reduce(squared)
    return math.sqrt(squared.item() / world_size)

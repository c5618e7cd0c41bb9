"""Exact world averaging of tensors (for evaluation), and the snapshot that undoes it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["Snapshot", "average_across_world_", "floating_buffers"]

# Summing n low-precision values in their own dtype rounds up to n times; summing in fp32 and
# rounding once at the end gives the average within one rounding of the exact value.
_ACCUMULATE_IN_FP32 = (torch.float16, torch.bfloat16)


class GlobalAverageError(RuntimeError):
    """The world average could not complete: a peer died or did not answer in time."""


@torch.no_grad()
def average_across_world_(
    tensors: Sequence[torch.Tensor],
    group: dist.ProcessGroup | None,
    world_size: int,
    timeout: timedelta | None = None,
) -> None:
    """Replace every tensor by its average over all ranks, in place, identically on every rank.

    ``x <- (sum_i x_i) / n``: the all-reduce hands every rank the same sum, and the division is
    the same on every rank, so all replicas end bit-for-bit equal.

    .. warning:: This is a collective: all ranks must call it with the same tensor layout.
    """
    if world_size == 1:
        return
    for tensor in tensors:
        wide = tensor.float() if tensor.dtype in _ACCUMULATE_IN_FP32 else tensor
        work = dist.all_reduce(wide, op=dist.ReduceOp.SUM, group=group, async_op=True)
        try:
            done = work.wait() if timeout is None else work.wait(timeout)
        except RuntimeError as err:
            raise GlobalAverageError(_message(timeout, err)) from err
        if done is False:
            raise GlobalAverageError(_message(timeout, None))
        if wide is tensor:
            tensor.div_(world_size)
        else:
            tensor.copy_(wide.div_(world_size))


def _message(timeout: timedelta | None, cause: BaseException | None) -> str:
    limit = f"within {timeout}" if timeout is not None else "in time"
    return (
        f"global_avg(): the all-reduce over all ranks did not complete: a peer died, did not call "
        f"global_avg(), or did not answer {limit}. Every rank must call global_avg() at the same point. "
        f"Cause: {cause}"
    )


def floating_buffers(module: torch.nn.Module) -> list[torch.Tensor]:
    """The module's floating-point buffers (BatchNorm running statistics, ...), in a fixed order."""
    return [b for b in module.buffers() if b.is_floating_point()]


@dataclass
class Snapshot:
    """What :meth:`DecentOptimWrapper.revert_global_avg` restores: the replica before averaging."""

    params: list[torch.Tensor]
    gossip: dict[str, Any] | None
    buffers: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (live, saved)

    def add_buffers(self, buffers: Sequence[torch.Tensor]) -> None:
        """Save buffers not saved yet (a second ``global_avg`` keeps the first values)."""
        saved = {id(live) for live, _ in self.buffers}
        self.buffers.extend((b, b.detach().clone()) for b in buffers if id(b) not in saved)

    @torch.no_grad()
    def restore_buffers(self) -> None:
        for live, saved in self.buffers:
            live.copy_(saved)

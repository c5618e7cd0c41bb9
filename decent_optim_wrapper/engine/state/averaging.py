r"""Exact world averaging of the replicas (for evaluation), the snapshot that undoes it, and the
consensus distance of the replicas: :class:`GlobalAverage`, and the collectives under it.

Global average: ``x <- (sum_i x_i) / n`` over the gossip world. The all-reduce hands every rank the
same sum and the division is the same on every rank, so all replicas end bit-for-bit equal. fp16/bf16
tensors are summed in fp32 and rounded once (:func:`~.comm.reduction_dtype`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from decent_optim_wrapper.engine.errors import GlobalAverageError
from decent_optim_wrapper.engine.exchange.buckets import Bucket
from decent_optim_wrapper.engine.exchange.gossip import Gossip
from decent_optim_wrapper.engine.exchange.shards import ShardLayout
from decent_optim_wrapper.engine.fleet.comm import reduction_dtype, wait_all
from decent_optim_wrapper.engine.fleet.membership import PeerLost
from decent_optim_wrapper.engine.rules.local_steps import LocalSteps

__all__ = [
    "GlobalAverage",
    "Snapshot",
    "WorldReduce",
    "average_across_world_",
    "floating_buffers",
    "tensors_consensus_distance",
]


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
    *,
    square_sum: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
    across: Callable[[torch.Tensor], None] | None = None,
) -> float:
    r"""Root-mean-square distance of the replicas of ``tensors`` to their average.

    .. math::
        d = \sqrt{\frac{1}{n} \sum_{i=0}^{n-1} \lVert x_i - \bar{x} \rVert_2^2},
        \qquad \bar{x} = \frac{1}{n} \sum_i x_i,

    where ``x_i`` is rank ``i``'s concatenation of ``tensors``. It is 0 exactly when all replicas
    agree, and is what gossip shrinks. Computed in float64 (one temporary per tensor at a time);
    every rank returns the same value.

    ``wait(work, tensor)`` waits for each all-reduce (default: ``work.wait()``). For sharded replicas,
    ``square_sum(index, squares)`` sums tensor ``index``'s elementwise squared distances (counting each
    element once over the shards; default ``squares.sum()``) and ``across(total)`` sums the total over
    the other shards, in place.

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
    for index, tensor in enumerate(tensors):
        mean = tensor.to(torch.float64, copy=True)  # a float64 tensor must not be reduced in place
        reduce(mean)
        mean.div_(world_size)
        squares = (tensor.to(torch.float64) - mean).square()
        squared += squares.sum() if square_sum is None else square_sum(index, squares)
    reduce(squared)
    if across is not None:
        across(squared)
    return math.sqrt(squared.item() / world_size)


@dataclass(frozen=True)
class WorldReduce:
    """How to reduce over the gossip world: its group, size, this rank, and the wait.

    ``waiter`` is survival's failure-aware wait (``on_peer_failure="continue"``), else None.
    """

    group: dist.ProcessGroup | None
    world_size: int
    rank: int
    timeout: timedelta
    waiter: Callable[..., None] | None = None


class GlobalAverage:
    """``global_avg``/``revert_global_avg`` of one engine's buckets, and their consensus distance.

    Holds the snapshot between a global average and its revert. Sharded replicas (:mod:`~.shards`) are
    averaged shard by shard along the gossip world, and their distances summed over the shards.

    Args:
        buckets: the engine's buckets (the live list: it grows with ``add_parameters``).
        shards: where the sharded parameters live.
    """

    def __init__(self, buckets: list[Bucket], shards: ShardLayout) -> None:
        self._buckets = buckets
        self._shards = shards
        self.snapshot: Snapshot | None = None
        #: Whether a collective of the whole gossip world runs (no joiner is admitted during one, since
        #: it would not call it).
        self.busy = False

    @contextlib.contextmanager
    def whole_world(self) -> Iterator[None]:
        """Mark a collective every rank of the world must call (global average, consensus distance)."""
        self.busy = True
        try:
            yield
        finally:
            self.busy = False

    @torch.no_grad()
    def average(
        self,
        wiring: Callable[[], tuple[WorldReduce, Gossip]],
        local: LocalSteps | None,
        *,
        step: int,
        may_revert: bool,
        extra: list[torch.Tensor],
        return_distance: bool,
        survive: Callable[[Callable[[], None]], object],
    ) -> float | None:
        """Set every replica to the average of the gossip world's (see the engine's ``global_avg``).

        ``wiring()`` gives the current gossip world and gossip (new ones after a lost peer);
        ``survive(action)`` runs ``action`` and, after a lost peer, recovers and runs it again.
        """
        if local is not None:
            local.check_round_boundary(step, "global_avg()")
        before = [b.data.clone() for b in self._buckets] if return_distance else []
        if may_revert:
            if self.snapshot is None:
                # References stay as they are until the revert: the snapshot need not copy them.
                self.snapshot = Snapshot(
                    params=[b.data.clone() for b in self._buckets],
                    gossip=wiring()[1].state_dict(references=False),
                    local=None if local is None else local.snapshot(),
                )
            self.snapshot.add_buffers(extra)

        def average() -> None:
            world, gossip = wiring()
            # Every rank settles its groups' references before the rounds are dropped, so ranks that
            # revert and ranks that do not keep identical references.
            gossip.settle_references()
            gossip.discard_all()
            # With low-communication gossip both the parameters and the anchors are averaged.
            anchors = [] if local is None else local.prepare_global_avg()
            # With survival, reduced in copies written back once complete: a failure midway leaves
            # the replicas as they were, and the survivors average them again.
            waits: dict[str, Any] = {}
            if world.waiter is not None:
                waits = {"waiter": world.waiter, "in_place": False}
            average_across_world_(
                [b.data for b in self._buckets] + anchors + extra,
                world.group,
                world.world_size,
                world.timeout,
                rank=world.rank,
                step=step,
                **waits,
            )

        survive(average)
        if not return_distance:
            return None
        squared = torch.zeros((), dtype=torch.float64, device=self._buckets[0].data.device)
        for index, (old, bucket) in enumerate(zip(before, self._buckets, strict=True)):
            squared += self._square_sum(index, (old.double() - bucket.data.double()).square())
        self._shards.sum_over_mesh_(squared)
        return math.sqrt(float(squared))

    @torch.no_grad()
    def revert(self, gossip: Gossip, local: LocalSteps | None) -> None:
        """Restore the replica saved by :meth:`average` bit for bit (RuntimeError if none)."""
        if self.snapshot is None:
            raise RuntimeError(
                "revert_global_avg() has nothing to revert: call global_avg(may_revert=True) first (a "
                "step() or revert_global_avg() since then drops the snapshot). Parameters are unchanged."
            )
        snapshot, self.snapshot = self.snapshot, None
        restore_buckets(self._buckets, snapshot.params)
        snapshot.restore_buffers()
        gossip.load_state_dict(snapshot.gossip, references=False)
        if local is not None and snapshot.local is not None:
            local.restore(snapshot.local)

    def forget_rounds(self) -> None:
        """After a lost peer: a snapshot keeps the replica but no round of the old groups."""
        if self.snapshot is not None:
            self.snapshot.gossip = None
            if self.snapshot.local is not None:
                self.snapshot.local = {**self.snapshot.local, "gossip": None}

    def distance(
        self, wiring: Callable[[], WorldReduce], survive: Callable[[Callable[[], float]], float | None]
    ) -> float:
        """Root-mean-square distance of the replicas to their average (see the engine's)."""

        def distance() -> float:
            world = wiring()
            wait = None
            if world.waiter is not None:
                waiter = world.waiter

                def wait(work: dist.Work, tensor: torch.Tensor) -> None:
                    waiter([work], tensor.device, world.timeout, lambda c: PeerLost(str(c)))

            return tensors_consensus_distance(
                [b.data for b in self._buckets],
                world.group,
                world.world_size,
                wait,
                square_sum=self._square_sum if self._shards.sharded else None,
                across=self._shards.sum_over_mesh_ if self._shards.sharded else None,
            )

        result = survive(distance)
        assert result is not None
        return result

    def _square_sum(self, index: int, squares: torch.Tensor) -> torch.Tensor:
        """Bucket ``index``'s squared distances summed, each element of the model counted once."""
        if not self._shards.sharded:
            return squares.sum()
        bucket = self._buckets[index]
        total = torch.zeros((), dtype=torch.float64, device=squares.device)
        for param, part in zip(bucket.params, bucket.slices(squares), strict=True):
            total += part.sum() / self._shards.replication(param)
        return total


@torch.no_grad()
def restore_buckets(buckets: Sequence[Bucket], saved: Sequence[torch.Tensor]) -> None:
    """Copy ``saved`` into the buckets (a snapshot taken before ``add_parameters`` covers a prefix)."""
    for bucket, values in zip(buckets, saved, strict=False):
        bucket.data.copy_(values)

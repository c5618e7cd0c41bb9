r"""Asynchronous gossip averaging of flat buckets along a topology's schedule, bucket by bucket.

Every bucket has at most one round in flight. For bucket ``b`` launched at step ``t``:

* :meth:`Gossip.launch` stages ``c * x_b`` into the bucket's communication buffer and starts a
  non-blocking all-reduce (sum) in the rank's group ``G_t``;
* :meth:`Gossip.wait` waits until the sum ``S = sum_{j in G_t} c * x_{j,b}`` has arrived;
* :meth:`Gossip.mix` applies ``x_b <- (w - c) * x_b + S``, i.e. ``x_{i,b} <- sum_j W_ij x_{j,b}``
  with the weights of the phase the round was launched in (``w`` self-weight, ``c`` peer weight;
  uniform groups give ``x_b <- S``).

A front-end launches a bucket as soon as its values are final and mixes it just before it next
changes the bucket, so the optimizer front-end runs whole rounds (all buckets) once per step, and a
module front-end can launch each bucket as its gradients become ready. Between launch and mix the
bucket may change (a local optimizer step does): the received sum is of the values at launch,
mixed into the values at mix, which is the overlap this library is for.

fp16 and bf16 buckets travel and accumulate in fp32 buffers (:func:`~.comm.reduction_dtype`), so a
group average of low-precision parameters is within one rounding of the exact average. A peer that
died or stopped responding makes :meth:`Gossip.wait` raise a :class:`~.errors.GossipError` naming
the step and the group instead of hanging (on CPU after ``timeout``; on CUDA through the process
group's timeout, see :func:`~.comm.wait_all`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from decent_optim_wrapper.engine.buckets import misfit
from decent_optim_wrapper.engine.comm import ProcessGroups, reduction_dtype, wait_all
from decent_optim_wrapper.engine.errors import GossipError
from decent_optim_wrapper.topo import Group, Topology

__all__ = ["Gossip"]


@dataclass
class _Round:
    """A bucket's round that has been launched (or restored) and not mixed yet."""

    step: int
    group: Group
    work: dist.Work | None  # None once waited for (or when restored from a checkpoint)


class Gossip:
    """Per-bucket gossip over ``tensors`` (flat buckets) for one rank of ``topology``.

    Memory: one communication buffer per bucket, allocated at the bucket's first launch that
    communicates.

    Args:
        tensors: the flat tensors to average; bucket ``b`` is read at ``launch(b)`` and written at
            ``mix(b)``.
        topology: the schedule; step ``t`` uses phase ``t % period``.
        rank: this process's rank.
        process_groups: the topology's process groups.
        timeout: longest CPU-side wait for a round before :class:`GossipError`; None waits for the
            process groups' own timeout.
    """

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        topology: Topology,
        rank: int,
        process_groups: ProcessGroups,
        timeout: timedelta | None = None,
    ) -> None:
        self._tensors = list(tensors)
        self._topology = topology
        self._rank = rank
        self._process_groups = process_groups
        self._timeout = timeout
        self._buffers: list[torch.Tensor | None] = [None] * len(self._tensors)
        self._rounds: list[_Round | None] = [None] * len(self._tensors)

    @property
    def num_buckets(self) -> int:
        return len(self._tensors)

    def add_tensors(self, tensors: Sequence[torch.Tensor]) -> None:
        """Gossip these tensors too, as new buckets at the end (nothing is in flight for them)."""
        self._tensors.extend(tensors)
        self._buffers.extend([None] * len(tensors))
        self._rounds.extend([None] * len(tensors))

    def pending(self, bucket: int) -> int | None:
        """The step bucket ``bucket``'s unmixed round was launched at, or None."""
        round_ = self._rounds[bucket]
        return None if round_ is None else round_.step

    # -- one bucket ------------------------------------------------------------------------------
    def stage(self, bucket: int, step: int) -> Group:
        """Write what bucket ``bucket`` sends at ``step`` into its buffer (no communication).

        Returns the rank's group at ``step``; a group of one sends nothing and stages nothing.
        """
        group = self._topology.group(self._rank, step)
        if group.size == 1:
            return group
        tensor, buffer = self._tensors[bucket], self._buffers[bucket]
        if buffer is None:
            buffer = self._buffers[bucket] = _new_buffer(tensor)
        # Division by k is correctly rounded (exact for k a power of two); x * fl(1/k) would round
        # twice. Low-precision tensors are widened into their fp32 buffer here.
        if group.self_weight is None:
            torch.div(tensor, group.size, out=buffer)
        else:
            torch.mul(tensor, group.peer_weight, out=buffer)
        return group

    def launch(self, bucket: int, step: int) -> None:
        """Stage bucket ``bucket`` and start its all-reduce in the rank's group at ``step`` (non-blocking)."""
        pending = self._rounds[bucket]
        if pending is not None:
            raise RuntimeError(
                f"bucket {bucket}: the gossip round launched at step {pending.step} has not been mixed yet; "
                "call mix() or discard() before launching it again."
            )
        group = self.stage(bucket, step)
        if group.size == 1:
            return  # nothing to exchange: W_ii = 1
        buffer = self._buffers[bucket]
        assert buffer is not None  # staged above
        work = dist.all_reduce(
            buffer, op=dist.ReduceOp.SUM, group=self._process_groups[group.ranks], async_op=True
        )
        self._rounds[bucket] = _Round(step, group, work)

    def wait(self, bucket: int) -> None:
        """Wait until bucket ``bucket``'s round has arrived; its buffer then holds the group sum."""
        round_ = self._rounds[bucket]
        if round_ is None or round_.work is None:
            return
        work, round_.work = round_.work, None
        wait_all([work], self._tensors[bucket].device, self._timeout, lambda c: self._failure(round_, c))

    def mix(self, bucket: int, factor: float = 1.0) -> None:
        """Finish bucket ``bucket``'s round (if any) and mix it in: ``x_i <- sum_j W_ij x_j``.

        With ``factor`` ``a`` below 1, only part of the way: ``x_i <- (1 - a) x_i + a sum_j W_ij x_j``,
        i.e. the doubly stochastic ``(1 - a) I + a W``.
        """
        round_ = self._rounds[bucket]
        if round_ is None:
            return
        self.wait(bucket)
        self._rounds[bucket] = None
        group, tensor, buffer = round_.group, self._tensors[bucket], self._buffers[bucket]
        assert buffer is not None  # a pending round has a buffer
        own = group.own_weight - group.peer_weight
        if factor != 1.0:
            # (1 - a) x + a ((w - c) x + S) = (1 - a + a (w - c)) x + a S
            tensor.mul_(1.0 - factor + factor * (0.0 if group.self_weight is None else own))
            tensor.add_(buffer, alpha=factor)
        elif group.self_weight is None or own == 0.0:
            tensor.copy_(buffer)
        else:
            torch.add(buffer, tensor, alpha=own, out=tensor)

    def discard(self, bucket: int) -> None:
        """Finish and drop bucket ``bucket``'s round without mixing it (its values are stale)."""
        self.wait(bucket)
        self._rounds[bucket] = None

    # -- every bucket ------------------------------------------------------------------------------
    def wait_all(self) -> None:
        for bucket in range(self.num_buckets):
            self.wait(bucket)

    def discard_all(self) -> None:
        for bucket in range(self.num_buckets):
            self.discard(bucket)

    def _failure(self, round_: _Round, cause: BaseException | None) -> GossipError:
        limit = f"within {self._timeout}" if self._timeout is not None else "within the process group timeout"
        return GossipError(
            f"rank {self._rank}: the gossip round launched at step {round_.step} in group "
            f"{list(round_.group.ranks)} did not complete: a peer died or did not answer {limit}. Check "
            f"the other ranks' logs; restart from the last checkpoint. Cause: {cause}"
        )

    # -- checkpoints ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any] | None:
        """The rounds still to be mixed (waiting for them first), or None if there are none.

        Format: ``{"step": t, "buffers": [tensor or None per bucket]}``; ``None`` marks a bucket with
        nothing pending. Every pending round must have been launched at the same step ``t`` (true
        between two steps of either front-end).
        """
        steps = {r.step for r in self._rounds if r is not None}
        if not steps:
            return None
        if len(steps) > 1:
            raise RuntimeError(
                f"buckets have gossip in flight from different steps {sorted(steps)}: save between two "
                "steps (after step() / after backward), not in the middle of one."
            )
        self.wait_all()
        buffers: list[torch.Tensor | None] = []
        for round_, buffer in zip(self._rounds, self._buffers, strict=True):
            buffers.append(None if round_ is None or buffer is None else buffer.clone())
        while buffers and buffers[-1] is None:
            buffers.pop()  # the layout checkpoints of version 1 used: a prefix of the buckets
        return {"step": steps.pop(), "buffers": buffers}

    def check_state_dict(self, state: dict[str, Any] | None) -> None:
        """Raise ``ValueError`` if ``state`` (from :meth:`state_dict`) does not fit these buckets."""
        if state is None:
            return
        if not isinstance(state, dict) or "step" not in state or "buffers" not in state:
            raise ValueError(f"gossip state must be None or a dict with 'step' and 'buffers', got {state!r}.")
        buffers = state["buffers"]
        if len(buffers) > len(self._tensors):
            raise ValueError(
                f"gossip state has {len(buffers)} buffers but there are {len(self._tensors)} buckets; "
                "it comes from a different parameter layout."
            )
        for bucket, (saved, tensor) in enumerate(zip(buffers, self._tensors, strict=False)):
            if saved is None:
                continue
            dtype = reduction_dtype(tensor.dtype)
            got = misfit(saved, tensor.shape, dtype)
            if got is not None:
                raise ValueError(
                    f"gossip buffer {bucket} of {got} does not fit a bucket of shape {tuple(tensor.shape)} "
                    f"and dtype {dtype}; the checkpoint comes from a different parameter layout."
                )

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Restore rounds from :meth:`state_dict` as received-but-not-mixed (drops any pending round)."""
        self.check_state_dict(state)
        self.discard_all()
        if state is None:
            return
        step = int(state["step"])
        group = self._topology.group(self._rank, step)
        for bucket, saved in enumerate(state["buffers"]):
            if saved is None:
                continue
            buffer = self._buffers[bucket]
            if buffer is None:
                buffer = self._buffers[bucket] = _new_buffer(self._tensors[bucket])
            buffer.copy_(saved)
            self._rounds[bucket] = _Round(step, group, None)


def _new_buffer(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty(tensor.shape, dtype=reduction_dtype(tensor.dtype), device=tensor.device)

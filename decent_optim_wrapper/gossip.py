"""Asynchronous gossip averaging of flat tensors along a topology's schedule.

This is the engine any front-end drives (today the optimizer wrapper; a module front-end that
steps buckets inside backward would call the same three operations per bucket):

* :meth:`Gossip.launch` at step ``t`` stages ``c * x`` into a communication buffer and starts a
  non-blocking all-reduce (sum) in the rank's group ``G_t``;
* :meth:`Gossip.wait` blocks until the sum ``S = sum_{j in G_t} c * x_j`` has arrived;
* :meth:`Gossip.mix` applies ``x_i <- (w - c) * x_i + S``, i.e. ``x_i <- sum_j W_ij x_j`` with the
  group's mixing weights (``w`` self-weight, ``c`` peer weight; uniform groups give ``x_i <- S``).

Between launch and mix the tensors may change (a local optimizer step does): the received sum is
of the values at launch, mixed into the values at mix, which is the overlap this library is for.

fp16 and bf16 tensors travel and accumulate in fp32 buffers, so a group average of low-precision
parameters is within one rounding of the exact average (summing in bf16 would round per term).
A peer that died or stopped responding makes :meth:`Gossip.wait` raise a :class:`GossipError`
naming the step and the group, after the process groups' timeout, instead of hanging.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from decent_optim_wrapper.comm import ProcessGroups
from decent_optim_wrapper.topo import Group, Topology

__all__ = ["Gossip", "GossipError", "buffer_dtype"]

_WIDEN = {torch.float16: torch.float32, torch.bfloat16: torch.float32}


def buffer_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a tensor of ``dtype`` is communicated and summed in."""
    return _WIDEN.get(dtype, dtype)


class GossipError(RuntimeError):
    """A gossip round could not complete: a peer died, or did not answer within the timeout."""


class Gossip:
    """Gossip over ``tensors`` (flat buckets) for one rank of ``topology``.

    Memory: one communication buffer per tensor, allocated at the first launch that communicates.

    Args:
        tensors: the flat tensors to average; they are read at :meth:`launch` and written at :meth:`mix`.
        topology: the schedule; step ``t`` uses phase ``t % period``.
        rank: this process's rank.
        process_groups: the topology's process groups.
        timeout: longest wait for a round before :class:`GossipError`; None waits for the process
            groups' own timeout.
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
        self._buffers: list[torch.Tensor] = []
        self._works: list[dist.Work] = []
        # (launch step, group, number of tensors launched) of the round not yet mixed
        self._pending: tuple[int, Group, int] | None = None

    def add_tensors(self, tensors: Sequence[torch.Tensor]) -> None:
        """Gossip these tensors too from the next launch on (a pending round does not include them)."""
        self._tensors.extend(tensors)
        if self._buffers:
            self._buffers.extend(_new_buffer(t) for t in tensors)

    def launch(self, step: int) -> None:
        """Stage the tensors and start this step's all-reduce in the rank's group (non-blocking)."""
        if self._pending is not None:
            raise RuntimeError(
                f"gossip of step {self._pending[0]} has not been mixed yet; call mix() or discard() first"
            )
        group = self._topology.group(self._rank, step)
        if group.size == 1:
            return  # nothing to exchange: W_ii = 1
        if not self._buffers:
            self._buffers = [_new_buffer(t) for t in self._tensors]
        handle = self._process_groups[group.ranks]
        for tensor, buffer in zip(self._tensors, self._buffers, strict=True):
            # Division by k is correctly rounded (exact for k a power of two); x * fl(1/k) would
            # round twice. Low-precision tensors are widened into their fp32 buffer here.
            if group.self_weight is None:
                torch.div(tensor, group.size, out=buffer)
            else:
                torch.mul(tensor, group.peer_weight, out=buffer)
            self._works.append(dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=handle, async_op=True))
        self._pending = (step, group, len(self._tensors))

    def wait(self) -> None:
        """Block until the launched round has arrived; afterwards the buffers hold the group sums."""
        works, self._works = self._works, []
        for work in works:
            try:
                ok = work.wait() if self._timeout is None else work.wait(self._timeout)
            except RuntimeError as err:
                raise self._failure(err) from err
            if ok is False:
                raise self._failure(None)

    def _failure(self, cause: BaseException | None) -> GossipError:
        step, group, _ = self._pending if self._pending is not None else (None, None, 0)
        ranks = list(group.ranks) if group is not None else "?"
        limit = f"within {self._timeout}" if self._timeout is not None else "within the process group timeout"
        return GossipError(
            f"rank {self._rank}: the gossip round launched at step {step} in group {ranks} did not "
            f"complete: a peer died or did not answer {limit}. Check the other ranks' logs; restart "
            f"from the last checkpoint. Cause: {cause}"
        )

    def mix(self) -> None:
        """Finish the pending round (if any) and mix it in: ``x_i <- sum_j W_ij x_j``."""
        if self._pending is None:
            return
        self.wait()
        _, group, launched = self._pending
        self._pending = None
        own = group.own_weight - group.peer_weight
        for tensor, buffer in zip(self._tensors[:launched], self._buffers[:launched], strict=True):
            if group.self_weight is None or own == 0.0:
                tensor.copy_(buffer)
            else:
                torch.add(buffer, tensor, alpha=own, out=tensor)

    def discard(self) -> None:
        """Finish and drop the pending round without mixing it (its values are stale)."""
        self.wait()
        self._pending = None

    def state_dict(self) -> dict[str, Any] | None:
        """The round still to be mixed (waiting for it first), as ``{"step", "buffers"}``, or None."""
        if self._pending is None:
            return None
        self.wait()
        step, _, launched = self._pending
        return {"step": step, "buffers": [b.clone() for b in self._buffers[:launched]]}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Restore a round from :meth:`state_dict` as received-but-not-mixed (drops any pending round)."""
        self.discard()
        if state is None:
            return
        step, buffers = state["step"], state["buffers"]
        if len(buffers) > len(self._tensors):
            raise ValueError(
                f"gossip state has {len(buffers)} buffers but there are {len(self._tensors)} buckets; "
                "it comes from a different parameter layout."
            )
        if not self._buffers:
            self._buffers = [_new_buffer(t) for t in self._tensors]
        for buffer, saved in zip(self._buffers, buffers, strict=False):
            if saved.shape != buffer.shape or saved.dtype != buffer.dtype:
                raise ValueError(
                    f"gossip buffer of shape {tuple(saved.shape)} and dtype {saved.dtype} does not fit a "
                    f"bucket of shape {tuple(buffer.shape)} and dtype {buffer.dtype}."
                )
            buffer.copy_(saved)
        self._pending = (step, self._topology.group(self._rank, step), len(buffers))


def _new_buffer(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty(tensor.shape, dtype=buffer_dtype(tensor.dtype), device=tensor.device)

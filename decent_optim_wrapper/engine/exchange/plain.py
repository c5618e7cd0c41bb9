r"""A plain round: an all-reduce of the members' weighted values, ``x_i <- (w - c) x_i + S``.

At launch a member stages ``c x_i`` (``c`` the peer weight; ``x_i / k`` for a uniform group, correctly
rounded) in the bucket's fp32 buffer, with one withheld flag per member after the values (guarded
mixing, :mod:`~.guard`), and all-reduces the buffer. At the mix it applies ``x_i <- (w - c) x_i + S``
with ``S`` the sum: the weights of the topology's phase the round was launched in. A member's
withheld values leave their weight with the receiver (``(w - c + m c) x_i + S``), a member that
withheld heals to ``S / ((k - m) c)``, and entries of ``S`` that are not finite are not mixed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from decent_optim_wrapper.engine.exchange.guard import (
    GuardEvent,
    GuardLog,
    all_finite,
    heal_from_peers,
    withhold_if_nonfinite,
)
from decent_optim_wrapper.engine.exchange.rounds import Channel, Round
from decent_optim_wrapper.engine.exchange.transport import Transport
from decent_optim_wrapper.engine.fleet.comm import reduction_dtype
from decent_optim_wrapper.topo import Group
from decent_optim_wrapper.topo.mixing import allreduce_models_sent

__all__ = ["PlainRounds"]


class PlainRounds:
    """Stages, starts and mixes the plain rounds of one :class:`~.gossip.Gossip`.

    Args:
        rank: this process's rank.
        transport: how the all-reduce runs (:mod:`~.transport`).
        guard: where guarded mixing's events go.
        label: what the buckets are, for the events.
    """

    def __init__(self, rank: int, transport: Transport, guard: GuardLog, label: str) -> None:
        self._rank = rank
        self._transport = transport
        self._guard = guard
        self._label = label

    def bytes_sent(self, group: Group, numel: int, dtype: torch.dtype) -> float:
        """A ring all-reduce: each member sends ``2 (k - 1) / k`` buckets (fp32 for 16-bit ones)."""
        return allreduce_models_sent(group.size) * numel * reduction_dtype(dtype).itemsize

    def stage(self, channel: Channel, group: Group) -> bool | None:
        """Write ``c x_i`` and this member's flag into the buffer; whether it withheld (None: the flags
        will tell, see :mod:`~.guard`)."""
        tensor, buffer = channel.tensor, channel.sum_buffer()
        # Division by k is correctly rounded (exact for k a power of two); x * fl(1/k) would round
        # twice. Low-precision tensors are widened into their fp32 buffer here.
        if group.self_weight is None:
            torch.div(tensor, group.size, out=buffer)
        else:
            torch.mul(tensor, group.peer_weight, out=buffer)
        flags = channel.flags(group.size)
        flags.zero_()
        if not self._guard.enabled:
            return False
        return withhold_if_nonfinite(buffer, flags[group.ranks.index(self._rank)])

    def start(
        self,
        channel: Channel,
        bucket: int,
        group: Group,
        handle: dist.ProcessGroup,
        step: int,
        withheld: bool | None,
    ) -> Round:
        """Start the all-reduce of the staged buffer."""
        work = self._transport.all_reduce(bucket, channel.round_buffer(group.size), handle)
        return Round(step, group, work, withheld=withheld, staged=self._transport.staged)

    def mix(self, channel: Channel, bucket: int, round_: Round, factor: float) -> bool:
        """``x_i <- x_i + a ((w - c) x_i + S - x_i)``, guarded; whether this rank healed."""
        group, tensor, buffer = round_.group, channel.tensor, channel.sum_buffer()
        k, numel = group.size, tensor.numel()
        # Staged: the sums and flags are read from the host copy (no device sync).
        received = channel.round_buffer(k)
        if round_.staged:
            received = self._transport.sums(bucket, received)
        raised = [j for j, flag in enumerate(received[numel : numel + k].tolist()) if flag != 0.0]
        sent_with = 1.0 / k if group.self_weight is None else group.peer_weight  # each member's weight c
        if group.ranks.index(self._rank) in raised:
            return heal_from_peers(
                self._guard,
                self._label,
                bucket,
                round_.step,
                group.ranks,
                round_.withheld,
                raised,
                lambda: tensor.copy_(buffer).div_((k - len(raised)) * sent_with),
            )
        if raised:
            senders = tuple(group.ranks[j] for j in raised)
            self._guard.record(
                GuardEvent("peer_withheld", round_.step, bucket, self._label, group.ranks, senders)
            )
        # The withheld members' weight stays here: (w - c) + m c.
        own = group.own_weight - group.peer_weight + len(raised) * sent_with
        if self._guard.enabled and not all_finite(received[:numel]):
            # Altered after its sender's check: every member sees the same sum, so all keep their own
            # values at those entries (and the mean).
            bad = torch.isfinite(buffer).logical_not_()
            mixed = (
                torch.add(buffer, tensor, alpha=own)
                if factor == 1.0
                else tensor.mul(1.0 - factor + factor * own).add_(buffer, alpha=factor)
            )
            tensor.copy_(torch.where(bad, tensor, mixed))
            self._guard.record(
                GuardEvent(
                    "not_finite", round_.step, bucket, self._label, group.ranks, entries=int(bad.sum())
                )
            )
            return False
        if factor != 1.0:
            # (1 - a) x + a ((w - c) x + S) = (1 - a + a (w - c)) x + a S
            tensor.mul_(1.0 - factor + factor * own)
            tensor.add_(buffer, alpha=factor)
        elif own == 0.0:
            tensor.copy_(buffer)
        else:
            torch.add(buffer, tensor, alpha=own, out=tensor)
        return False

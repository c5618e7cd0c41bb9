r"""A gathered round: every member's payload, compressed differences from the group's reference.

A group the :class:`~decent_optim_wrapper.engine.wire.compression.CompressionPlan` compresses keeps
a reference ``r`` that every member holds bit for bit. At launch a member encodes ``q_i = Q(x_i - r)``
(``Q`` the codec, seeded by the step and the bucket) into its slot and the members all-gather the
slots; at the mix each decodes ``s = sum_j q_j`` in rank order (identical on every member) and applies

.. math::
    x_i \leftarrow x_i + a\, c\, (s - k\, q_i), \qquad r \leftarrow r + s / k

(see the compressed gossip page of the docs). A group's first round without a common starting point
sends the values themselves, exactly, and its mean becomes the reference. Clipped gossip
(:mod:`~.clipping`) gathers every round, compressed or not, and mixes each neighbour's difference
clipped instead. Guarded mixing (:mod:`~.guard`): a member whose difference is not finite sends zero
(it counts as holding the reference) and heals to ``r + c s``; a payload that decodes to values that
are not finite is read as zero by every member alike.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from decent_optim_wrapper.engine.exchange.audit import Audit
from decent_optim_wrapper.engine.exchange.guard import GuardEvent, GuardLog, all_finite, heal_from_peers
from decent_optim_wrapper.engine.exchange.rounds import Channel, Round
from decent_optim_wrapper.engine.exchange.transport import Transport
from decent_optim_wrapper.engine.fleet.comm import reduction_dtype
from decent_optim_wrapper.engine.wire.compression import CompressionPlan, codec, round_seed
from decent_optim_wrapper.topo import Group, Topology

__all__ = ["DifferenceMix", "GatheredMix", "GatheredRounds", "MixRule", "gathered_sum"]


class GatheredMix(Protocol):
    """How a member that sent finite values (in slot ``slot``) mixes a gathered round in, given the
    sum ``total`` of the good payloads, a bucket-sized ``scratch`` and the slots ``bad`` left out; with
    whether it needs every round gathered (not only compressed ones), and what of it a checkpoint keeps.
    One is made per :class:`~.gossip.Gossip` by a :class:`MixRule`."""

    #: Whether every round is gathered (an uncompressed one then keeps no reference), or only the
    #: rounds the compression plan compresses (the others are all-reduced).
    gathers_every_round: bool

    def state(self, buckets: int) -> dict[str, Any]:
        """What a gossip checkpoint keeps of this mix for ``buckets`` buckets (entries of its own)."""
        ...

    def load_state(self, buckets: int, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state` from a gossip checkpoint (one that lacks its entries: keep as is)."""
        ...

    def across_change(self, buckets: int) -> dict[str, Any]:
        """The part of :meth:`state` that stays true over new members (ranks renumbered), for the mix of
        the gossip re-formed over them (:meth:`load_state`)."""
        ...

    def __call__(
        self,
        channel: Channel,
        bucket: int,
        round_: Round,
        slot: int,
        factor: float,
        total: torch.Tensor,
        scratch: torch.Tensor,
        bad: Sequence[int],
    ) -> None: ...


class MixRule(Protocol):
    """A rule for mixing gathered rounds in, as the job's options give it (e.g. clipped gossip's
    :class:`~.clipping.ClippedGossip`): it makes each :class:`~.gossip.Gossip` its own mix. A new rule is a
    new kind of this, handed to the engine by its config part (:class:`~decent_optim_wrapper.Robustness`)."""

    def mixer(self, guard: GuardLog, label: str, audit: Audit | None = None) -> GatheredMix:
        """The mix of one :class:`~.gossip.Gossip`'s rounds; its events go to ``guard``, named ``label``;
        it leaves out the ranks ``audit`` quarantined (:mod:`~.audit`), if given."""
        ...


class DifferenceMix:
    """``x_i <- x_i + a c (s - k q_i)``: the weighted mean of the members' decoded values (plain gossip's
    mix of a compressed round; it keeps nothing between rounds)."""

    gathers_every_round = False

    def state(self, buckets: int) -> dict[str, Any]:
        return {}

    def load_state(self, buckets: int, state: Mapping[str, Any]) -> None:
        return None

    def across_change(self, buckets: int) -> dict[str, Any]:
        return {}

    def __call__(
        self,
        channel: Channel,
        bucket: int,
        round_: Round,
        slot: int,
        factor: float,
        total: torch.Tensor,
        scratch: torch.Tensor,
        bad: Sequence[int],
    ) -> None:
        assert round_.codec is not None
        group = round_.group
        seed = round_seed(round_.step, channel.index)
        codec(round_.codec).decode_into(channel.payloads(group.size)[slot], scratch, seed)
        # x <- x + a c (s - k q_i): one pass for s - k q_i, one for the update
        channel.tensor.add_(
            torch.add(total, scratch, alpha=-group.size, out=scratch), alpha=factor * group.peer_weight
        )


class GatheredRounds:
    """Stages, starts and mixes the gathered rounds of one :class:`~.gossip.Gossip`, and keeps each
    compressed group's reference.

    Args:
        rank: this process's rank.
        topology: the schedule (which groups this rank meets).
        plan: which groups compress; None: none do (every gathered round is clipped gossip's, exact).
        transport: how the all-gather runs (:mod:`~.transport`).
        guard: where guarded mixing's events go.
        label: what the buckets are, for the events.
        mix: how a member that sent mixes the round in (:class:`DifferenceMix`, or clipped gossip's
            :class:`~.clipping.ClippedMix`).
    """

    def __init__(
        self,
        rank: int,
        topology: Topology,
        plan: CompressionPlan | None,
        transport: Transport,
        guard: GuardLog,
        label: str,
        mix: GatheredMix,
    ) -> None:
        self._rank = rank
        self._topology = topology
        self._plan = plan
        self._transport = transport
        self._guard = guard
        self._label = label
        self._mix = mix

    def compresses(self, group: Group, dtype: torch.dtype) -> bool:
        """Whether ``group``'s rounds send compressed differences (and so track a reference)."""
        return self._plan is not None and self._plan.compresses(group, dtype)

    def bytes_sent(self, group: Group, numel: int, dtype: torch.dtype) -> float:
        """A gather: each member sends its payload ``k - 1`` times."""
        if self._plan is not None and self.compresses(group, dtype):
            return self._plan.bytes_sent(group, numel, dtype, reduction_dtype(dtype).itemsize)
        return (group.size - 1) * codec("exact").payload_bytes(numel, dtype) if group.size > 1 else 0

    # -- references ----------------------------------------------------------------------------------
    def reference(self, channel: Channel, group: Group) -> torch.Tensor | None:
        """The reference ``group``'s members share: their own, or before they first met the common
        starting point; None if neither (the next round is exact) or if the group does not compress
        (clipped gossip's uncompressed rounds send the values)."""
        if not self.compresses(group, channel.tensor.dtype):
            return None
        return channel.references.get(group.ranks, channel.start)

    def release_start(self, channel: Channel) -> None:
        """Drop the common point once every compressed group of this rank holds its own reference.

        Consistent across a group: its members gain its reference at the same round."""
        if channel.start is None:
            return
        dtype = channel.tensor.dtype
        groups = (self._topology.group(self._rank, step) for step in range(self._topology.period))
        if all(g.ranks in channel.references for g in groups if self.compresses(g, dtype)):
            channel.start = None

    def settle(self, channel: Channel, round_: Round) -> None:
        """Apply ``round_``'s update of its group's reference now, if it has one still to apply."""
        if round_.codec is None or round_.reference_applied or not round_.tracks_reference:
            return
        _update_reference(channel, round_, gathered_sum(channel, round_)[0])
        self.release_start(channel)

    # -- a round -------------------------------------------------------------------------------------
    def stage(self, channel: Channel, group: Group, step: int) -> tuple[str, bool]:
        """Encode this member's part into its slot of the gathered payload: the codec's name and
        whether this rank withheld."""
        tensor = channel.tensor
        reference = self.reference(channel, group)
        # A group's first round without a common starting point, and every uncompressed clipped round,
        # sends the values themselves, exactly.
        name = "exact" if reference is None or self._plan is None else self._plan.codec.name
        coder = codec(name)
        size = coder.payload_bytes(tensor.numel(), tensor.dtype)
        if channel.gathered is None or channel.gathered.numel() != group.size * size:
            channel.gathered = torch.empty(group.size * size, dtype=torch.uint8, device=tensor.device)
        slot = group.ranks.index(self._rank)
        own = channel.gathered[slot * size : (slot + 1) * size]
        if reference is None:
            # A first round's values that are not finite are found by every member at the mix.
            coder.encode(tensor, own)
            return name, False
        scratch = channel.sum_buffer()  # free until the round arrives
        torch.sub(tensor, reference, out=scratch)  # small: what changed since the group last met
        # Withheld: a zero difference (this rank counts as holding the reference). Checked before
        # encoding: a sparse codec might not pick the bad entries, and then nobody would see them.
        withheld = self._guard.enabled and not all_finite(scratch)
        if withheld:
            scratch.zero_()
        coder.encode(scratch, own, round_seed(step, channel.index))
        return name, withheld

    def start(
        self,
        channel: Channel,
        bucket: int,
        group: Group,
        handle: dist.ProcessGroup,
        step: int,
        name: str,
        withheld: bool,
    ) -> Round:
        """Start gathering the members' staged payloads (a pair over gloo: by XOR, see
        :func:`~.transport.gather_payloads`)."""
        assert channel.gathered is not None  # staged
        slot = group.ranks.index(self._rank)
        pair = group.size == 2 and handle.name() == "gloo"
        work = self._transport.gather(bucket, channel.gathered, slot, group.size, handle, pair)
        tracks = self.compresses(group, channel.tensor.dtype)
        return Round(
            step, group, work, name, 1 - slot if pair else None, withheld=withheld, tracks_reference=tracks
        )

    @staticmethod
    def arrived(channel: Channel, round_: Round) -> None:
        """After the wait: a pair gathered by XOR holds ``own ^ peer`` in the peer's slot; XOR ``own``
        out again."""
        if round_.xor_slot is None:
            return
        assert channel.gathered is not None
        size = channel.gathered.numel() // 2
        own = channel.gathered[(1 - round_.xor_slot) * size : (2 - round_.xor_slot) * size]
        peer = channel.gathered[round_.xor_slot * size : (round_.xor_slot + 1) * size]
        peer.bitwise_xor_(own)  # (own ^ peer) ^ own = peer
        round_.xor_slot = None

    def mix(self, channel: Channel, bucket: int, round_: Round, factor: float) -> bool:
        """``x_i <- x_i + a c (s - k q_i)`` (or clipped gossip's mix) and ``r <- r + s / k``, guarded;
        whether this rank healed."""
        assert round_.codec is not None
        group = round_.group
        reference = self.reference(channel, group)
        total, scratch, bad = gathered_sum(channel, round_)
        slot = group.ranks.index(self._rank)
        others_bad = tuple(group.ranks[j] for j in bad if j != slot)
        if others_bad:
            self._guard.record(
                GuardEvent("not_finite", round_.step, bucket, self._label, group.ranks, others_bad)
            )
        if round_.withheld or slot in bad:
            # Read as holding the reference (exact rounds: the good members' mean): x <- r + c s.
            def heal() -> None:
                if round_.codec == "exact" or reference is None:
                    channel.tensor.copy_(total).div_(group.size)
                    return
                channel.tensor.copy_(reference).add_(total, alpha=group.peer_weight)
                if round_.reference_applied:  # r already moved on by s / k
                    channel.tensor.sub_(total, alpha=1.0 / group.size)

            raised = [slot, *bad] if slot not in bad else list(bad)
            healed = heal_from_peers(
                self._guard, self._label, bucket, round_.step, group.ranks, round_.withheld, raised, heal
            )
        else:
            self._mix(channel, bucket, round_, slot, factor, total, scratch, bad)
            healed = False
        if round_.tracks_reference and not round_.reference_applied:
            _update_reference(channel, round_, total)
            self.release_start(channel)
        return healed


def gathered_sum(channel: Channel, round_: Round) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """``s = sum_j q_j`` in rank order (identical on every member), a scratch buffer, and the slots
    whose payload did not decode to finite values: read as zero (the member holds the reference),
    or in a group's first, exact round as the mean of the others.

    Both live in buffers kept per bucket: fresh bucket-sized tensors every step would cost more
    (page faults) than the arithmetic.
    """
    assert round_.codec is not None
    coder, slots = codec(round_.codec), channel.payloads(round_.group.size)
    total = channel.sum_buffer()
    if channel.decoded is None:
        channel.decoded = torch.empty_like(total)
    scratch = channel.decoded
    seed = round_seed(round_.step, channel.index)
    coder.decode_into(slots[0], total, seed)
    for j in range(1, round_.group.size):
        coder.add_into(slots[j], total, scratch, seed)
    # Checked whatever nonfinite_guard says: every member must read a bad payload alike, or the
    # group's references would differ.
    if all_finite(total):
        return total, scratch, []
    bad: list[int] = []  # rare: find the slots, one decode each, and sum the good ones again
    total.zero_()
    for j in range(round_.group.size):
        coder.decode_into(slots[j], scratch, seed)
        if all_finite(scratch):
            total.add_(scratch)
        else:
            bad.append(j)
    good = round_.group.size - len(bad)
    if round_.codec == "exact" and good > 0:
        total.mul_(round_.group.size / good)  # the missing members count as the good ones' mean
    return total, scratch, bad


def _update_reference(channel: Channel, round_: Round, total: torch.Tensor) -> None:
    """``r <- r + s / k`` (a first, exact round: ``r <- s / k``; a first compressed round from the
    common starting point: ``r <- x_0 + s / k``), the same on every member."""
    k, ranks = round_.group.size, round_.group.ranks
    if round_.codec == "exact":
        channel.references[ranks] = total.div(k)  # the members' average: the group's first reference
    elif ranks in channel.references:
        channel.references[ranks].add_(total.div_(k))
    elif channel.start is not None:
        channel.references[ranks] = channel.start.add(total.div_(k))
    # else: dropped by a checkpoint without references while in flight; the next round is exact
    round_.reference_applied = True

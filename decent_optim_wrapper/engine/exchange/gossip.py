r"""Asynchronous gossip of flat buckets along a topology's schedule, one round in flight per bucket.

For bucket ``b`` launched at step ``t``, :meth:`Gossip.launch` stages ``c x_b`` (``c`` the peer
weight) and starts a non-blocking all-reduce in the rank's group ``G_t``; :meth:`Gossip.mix` waits
for the sum ``S`` and applies ``x_b <- (w - c) x_b + S``, i.e. ``x_i <- sum_j W_ij x_j`` with the
weights of the phase the round was launched in (``w`` the self-weight). Between launch and mix the
bucket may change (the local step does): the values sent are those at launch, mixed into those at
mix — the overlap this library is for. fp16/bf16 buckets travel and accumulate in fp32. A round
that does not arrive raises :class:`~.errors.GossipError` naming the step and the group, and is
dropped. Groups a :class:`~.compression.CompressionPlan` names gather compressed differences
instead (see the compressed gossip page of the docs). With host staging
(:mod:`~decent_optim_wrapper.engine.exchange.staging`) the collective runs on pinned host copies of
the buffers, launched in order from a thread of its own, and the sums are copied back before the mix.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from decent_optim_wrapper.engine.errors import GossipError
from decent_optim_wrapper.engine.exchange.buckets import check_saved_tensors, misfit
from decent_optim_wrapper.engine.exchange.clipping import ClippedGossip, RadiusWindow
from decent_optim_wrapper.engine.exchange.guard import (
    GuardEvent,
    GuardLog,
    NonFiniteReplicaError,
    all_finite,
    withhold_if_nonfinite,
)
from decent_optim_wrapper.engine.exchange.staging import HostStaging, host_buffer
from decent_optim_wrapper.engine.fleet.comm import ProcessGroups, reduction_dtype, wait_all
from decent_optim_wrapper.engine.fleet.membership import ChannelReport, PeerLost, RoundState
from decent_optim_wrapper.engine.wire.compression import CompressionPlan, codec, is_codec_name, round_seed
from decent_optim_wrapper.topo import Group, Topology
from decent_optim_wrapper.topo.mixing import allreduce_models_sent

__all__ = ["Gossip", "Waiter"]

#: How a round is waited for (``comm.wait_all``, or a membership's failure-aware wait).
Waiter = Callable[
    [Sequence[dist.Work], torch.device, timedelta | None, Callable[[BaseException | None], Exception]], None
]


@dataclass
class _Round:
    """A bucket's round that has been launched (or restored) and not mixed yet."""

    step: int
    group: Group
    work: dist.Work | None  # None once waited for (or when restored from a checkpoint)
    codec: str | None = None  # a gathered round's codec; None: an all-reduce of the weighted values
    xor_slot: int | None = None  # a pair gathered by XOR: this slot holds peer ^ own until waited for
    reference_applied: bool = False  # its update of the group's reference is done (see settle_references)
    withheld: bool | None = False  # this rank's values were not finite and not sent (None: told by the flags)
    staged: bool = False  # its sums arrived in the host copy (a round restored from a state did not)
    tracks_reference: bool = True  # a compressed round (clipped gossip's uncompressed rounds have none)


@dataclass
class _Channel:
    """One bucket's gossip: the tensor it averages and everything its rounds need."""

    tensor: torch.Tensor  # read at launch, written at mix
    index: int  # the bucket's number, not its position (with the round's step, it seeds random-k's draws)
    flag_slots: int = 0  # the largest group's size: one withheld-flag slot per member after the values
    buffer: torch.Tensor | None = (
        None  # staged values and flags, then the group sums (allocated at first use)
    )
    round: _Round | None = None  # launched (or restored) and not mixed yet
    gathered: torch.Tensor | None = None  # compressed rounds: every member's payload, rank order
    decoded: torch.Tensor | None = None  # compressed rounds: decoding scratch
    # group ranks -> the reference every member of that group holds bit for bit
    references: dict[tuple[int, ...], torch.Tensor] = field(default_factory=dict)
    # the point every rank held when the buckets were broadcast: the reference of a group that has not
    # met yet (dropped once all this rank's groups have references; None: such a group meets exactly)
    start: torch.Tensor | None = None
    launched: int | None = None  # the step of the latest round launched (recovery compares them)
    discarded: int | None = None  # the step of the latest round dropped unmixed
    host: torch.Tensor | None = None  # host staging: the buffer's host copy (allocated at first use)
    host_gathered: torch.Tensor | None = None  # host staging: the gathered payloads' host copy
    radius: RadiusWindow | None = None  # clipped gossip: the recent difference norms
    clip_buffers: tuple[torch.Tensor, torch.Tensor] | None = None  # clipped gossip: a difference, the update

    def _storage(self) -> torch.Tensor:
        if self.buffer is None:
            numel = self.tensor.numel() + self.flag_slots
            self.buffer = torch.empty(
                numel, dtype=reduction_dtype(self.tensor.dtype), device=self.tensor.device
            )
        return self.buffer

    def sum_buffer(self) -> torch.Tensor:
        """The values part of the buffer: the staged values, then the group sum."""
        return self._storage()[: self.tensor.numel()].view(self.tensor.shape)

    def round_buffer(self, size: int) -> torch.Tensor:
        """What a plain round of ``size`` members all-reduces: the values, then one flag per member."""
        return self._storage()[: self.tensor.numel() + size]

    def flags(self, size: int) -> torch.Tensor:
        """The members' withheld flags of a plain round (in group order), after the values."""
        numel = self.tensor.numel()
        return self._storage()[numel : numel + size]


class Gossip:
    """Per-bucket gossip over ``tensors`` (flat buckets) for one rank of ``topology``.

    Memory: one communication buffer per bucket, allocated at the bucket's first launch that
    communicates; with compression also the gathered payloads and the references (see
    :mod:`~decent_optim_wrapper.engine.wire.compression`).

    Args:
        tensors: the flat tensors to average; bucket ``b`` is read at ``launch(b)`` and written at
            ``mix(b)``.
        topology: the schedule; step ``t`` uses phase ``t % period``.
        rank: this process's rank.
        process_groups: the topology's process groups.
        timeout: longest CPU-side wait for a round before :class:`GossipError`; None waits for the
            process groups' own timeout.
        plan: which groups gossip compressed; None: none do.
        waiter: how rounds are waited for (default :func:`~.comm.wait_all`).
        staging: stage every round through host buffers (:mod:`~.staging`); None: collectives run on
            the buckets' own buffers.
        guard: where guarded mixing's events go (:mod:`~.guard`); None: a log of this rank's own.
        label: what these tensors are, for the guard's events (``"parameters"``, ``"anchors"``, ...).
        clipped: clipped gossip's options (:mod:`~.clipping`): every round gathers the members' values
            (or compressed differences) and mixes each neighbour's difference clipped; None: plain.
    """

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        topology: Topology,
        rank: int,
        process_groups: ProcessGroups,
        timeout: timedelta | None = None,
        plan: CompressionPlan | None = None,
        waiter: Waiter | None = None,
        staging: HostStaging | None = None,
        guard: GuardLog | None = None,
        label: str = "parameters",
        clipped: ClippedGossip | None = None,
    ) -> None:
        self._clipped = clipped
        self._guard = GuardLog(rank) if guard is None else guard
        self._label = label
        self._flag_slots = max((g.size for g in topology.distinct_groups()), default=1)
        self._waiter: Waiter = wait_all if waiter is None else waiter
        self._staging = staging
        self._topology = topology
        self._rank = rank
        self._process_groups = process_groups
        self._timeout = timeout
        self._plan = plan
        self._channels: list[_Channel] = []
        self.add_tensors(tensors)

    @property
    def plan(self) -> CompressionPlan | None:
        return self._plan

    @property
    def num_buckets(self) -> int:
        return len(self._channels)

    def add_tensors(self, tensors: Sequence[torch.Tensor]) -> None:
        """Gossip these tensors too, as new buckets at the end (nothing is in flight for them)."""
        for position, tensor in enumerate(tensors, start=len(self._channels)):
            number = position if self._plan is None else self._plan.bucket_number(position)
            channel = _Channel(tensor, number, flag_slots=self._flag_slots)
            if self._clipped is not None:
                channel.radius = RadiusWindow(self._clipped)
            self._channels.append(channel)

    def bytes_sent_per_step(self) -> float:
        """Bytes this rank sends per step for these buckets, averaged over one period of the schedule.

        Cost model: an all-reduce in a group of ``k`` is a ring, in which each member sends
        ``2 (k - 1) / k`` buckets (in fp32 for 16-bit buckets); a compressed round is a gather, in
        which each member sends its payload ``k - 1`` times. The exact first round of a group that
        has no common starting point (after a membership change or a checkpoint without references) is
        left out: it happens once per group.
        """
        total = 0.0
        for step in range(self._topology.period):
            group = self._topology.group(self._rank, step)
            for channel in self._channels:
                numel, dtype = channel.tensor.numel(), channel.tensor.dtype
                reduced = reduction_dtype(dtype).itemsize
                if self._gathers_exact(group, dtype):
                    total += (
                        (group.size - 1) * codec("exact").payload_bytes(numel, dtype) if group.size > 1 else 0
                    )
                elif self._plan is not None:
                    total += self._plan.bytes_sent(group, numel, dtype, reduced)
                else:
                    total += allreduce_models_sent(group.size) * numel * reduced
        return total / self._topology.period

    def start_from_common_point(self, buckets: Sequence[int] | None = None) -> None:
        """Declare ``buckets`` (default: all) bit-identical on every rank right now (they were just
        broadcast): each compressed group's first round then sends differences from this point,
        compressed like every later round, instead of the values themselves exactly.

        The common point ``x_0`` is every group's reference until it first meets (``r_G = x_0``); an
        exact first round would cost one uncompressed bucket per group, which on a slow link can
        exceed hundreds of compressed rounds. A collective promise: every rank must call it for the
        same buckets at the same point. Without compression there are no references, and nothing is
        kept.
        """
        if self._plan is None:
            return
        for bucket in range(self.num_buckets) if buckets is None else buckets:
            channel = self._channels[bucket]
            channel.start = channel.tensor.to(reduction_dtype(channel.tensor.dtype), copy=True)
            self._release_start(channel)

    def _reference(self, channel: _Channel, group: Group) -> torch.Tensor | None:
        """The reference ``group``'s members share: their own, or before they first met the common
        starting point; None if neither (the next round is exact) or if the group does not compress
        (clipped gossip's uncompressed rounds send the values)."""
        if self._plan is None or not self._plan.compresses(group, channel.tensor.dtype):
            return None
        return channel.references.get(group.ranks, channel.start)

    def _release_start(self, channel: _Channel) -> None:
        """Drop the common point once every compressed group of this rank holds its own reference.

        Consistent across a group: its members gain its reference at the same round."""
        if channel.start is None:
            return
        plan, dtype = self._plan, channel.tensor.dtype
        groups = (self._topology.group(self._rank, step) for step in range(self._topology.period))
        compressed = [g for g in groups if plan is not None and plan.compresses(g, dtype)]
        if all(g.ranks in channel.references for g in compressed):
            channel.start = None

    def pending(self, bucket: int) -> int | None:
        """The step bucket ``bucket``'s unmixed round was launched at, or None."""
        round_ = self._channels[bucket].round
        return None if round_ is None else round_.step

    # -- one bucket ------------------------------------------------------------------------------
    def stage(self, bucket: int, step: int) -> Group:
        """Write what bucket ``bucket`` sends at ``step`` into its buffer (no communication).

        Returns the rank's group at ``step``; a group of one sends nothing and stages nothing.
        """
        return self._stage(self._channels[bucket], step)[0]

    def _stage(self, channel: _Channel, step: int) -> tuple[Group, str | None, bool | None]:
        """Stage ``channel`` for ``step``: its group, the codec of a gathered round (or None), and
        whether this rank withheld its values (None: the flags will tell, see :mod:`~.guard`)."""
        group = self._topology.group(self._rank, step)
        if group.size == 1:
            return group, None, False
        tensor, buffer = channel.tensor, channel.sum_buffer()
        if self._gathers_exact(group, tensor.dtype) or (
            self._plan is not None and self._plan.compresses(group, tensor.dtype)
        ):
            name, gathered_withheld = self._stage_gathered(channel, group, step)
            return group, name, gathered_withheld
        # Division by k is correctly rounded (exact for k a power of two); x * fl(1/k) would round
        # twice. Low-precision tensors are widened into their fp32 buffer here.
        if group.self_weight is None:
            torch.div(tensor, group.size, out=buffer)
        else:
            torch.mul(tensor, group.peer_weight, out=buffer)
        flags = channel.flags(group.size)
        flags.zero_()
        if not self._guard.enabled:
            return group, None, False
        withheld = withhold_if_nonfinite(buffer, flags[group.ranks.index(self._rank)])
        return group, None, withheld

    def _gathers_exact(self, group: Group, dtype: torch.dtype) -> bool:
        """Whether ``group``'s rounds gather every member's values exactly: clipped gossip's rounds that
        are not compressed (they need each member's part, not the sum)."""
        compressed = self._plan is not None and self._plan.compresses(group, dtype)
        return self._clipped is not None and not compressed

    def _stage_gathered(self, channel: _Channel, group: Group, step: int) -> tuple[str, bool]:
        """Encode this member's part of a compressed (or clipped) round into its slot of the gathered
        payload."""
        tensor = channel.tensor
        reference = self._reference(channel, group)
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

    def launch(self, bucket: int, step: int) -> None:
        """Stage bucket ``bucket`` and start its all-reduce in the rank's group at ``step`` (non-blocking).

        A compressed round starts an all-gather of the members' payloads instead.
        """
        channel = self._channels[bucket]
        if channel.round is not None:
            raise RuntimeError(
                f"bucket {bucket}: the gossip round launched at step {channel.round.step} has not been mixed "
                "yet; call mix() or discard() before launching it again."
            )
        group, name, withheld = self._stage(channel, step)
        if group.size == 1:
            return  # nothing to exchange: W_ii = 1
        handle = self._process_groups[group.ranks]
        channel.launched = step
        if withheld:
            self._guard.record(GuardEvent("withheld", step, bucket, self._label, group.ranks))
        if name is not None:
            work, xor_slot = self._start_gather(channel, group, handle)
            tracks = not self._gathers_exact(group, channel.tensor.dtype)
            channel.round = _Round(
                step, group, work, name, xor_slot, withheld=withheld, tracks_reference=tracks
            )
            return
        buffer = channel.round_buffer(group.size)
        if self._staging is None:
            work = dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=handle, async_op=True)
        else:
            if channel.host is None or channel.host.numel() != buffer.numel():
                channel.host = host_buffer(buffer)
            host = channel.host
            work = self._staging.start(
                [(host, buffer)],
                lambda: dist.all_reduce(host, op=dist.ReduceOp.SUM, group=handle, async_op=True),
                copy_back=(buffer, host),
            )
        channel.round = _Round(step, group, work, withheld=withheld, staged=self._staging is not None)

    def _start_gather(
        self, channel: _Channel, group: Group, handle: dist.ProcessGroup
    ) -> tuple[dist.Work | None, int | None]:
        """Start gathering the members' staged payloads; returns the work and the XOR slot, if any."""
        gathered = channel.gathered
        assert gathered is not None  # staged
        slot, size = group.ranks.index(self._rank), gathered.numel() // group.size
        pair = group.size == 2 and handle.name() == "gloo"
        if self._staging is None:
            return _gather(gathered, slot, size, handle, pair), 1 - slot if pair else None
        if channel.host_gathered is None or channel.host_gathered.numel() != gathered.numel():
            channel.host_gathered = host_buffer(gathered)
        host = channel.host_gathered
        work = self._staging.start(
            [(host[slot * size : (slot + 1) * size], gathered[slot * size : (slot + 1) * size])],
            lambda: _gather(host, slot, size, handle, pair),
            copy_back=(gathered, host),
        )
        return work, 1 - slot if pair else None

    def wait(self, bucket: int) -> None:
        """Wait until bucket ``bucket``'s round has arrived; its buffer then holds the group sum."""
        channel = self._channels[bucket]
        round_ = channel.round
        if round_ is None or round_.work is None:
            return
        work, round_.work = round_.work, None
        # A staged round is a host-side wait (timed, like gloo's on CPU), whatever the bucket's device.
        device = channel.tensor.device if self._staging is None else torch.device("cpu")
        try:
            self._waiter([work], device, self._timeout, lambda c: self._failure(round_, c))
        except PeerLost:
            round_.work = work  # recovery decides from every member's report whether it is mixed
            raise
        except BaseException:
            channel.round = None  # never mix or save a round that did not arrive
            if self._staging is not None:
                # Its collective may still write the host buffers: the next round gets fresh ones.
                channel.host = channel.host_gathered = None
            raise
        if round_.xor_slot is not None:
            assert channel.gathered is not None
            size = channel.gathered.numel() // 2
            own = channel.gathered[(1 - round_.xor_slot) * size : (2 - round_.xor_slot) * size]
            peer = channel.gathered[round_.xor_slot * size : (round_.xor_slot + 1) * size]
            peer.bitwise_xor_(own)  # (own ^ peer) ^ own = peer
            round_.xor_slot = None

    def mix(self, bucket: int, factor: float = 1.0) -> bool:
        """Finish bucket ``bucket``'s round (if any) and mix it in: ``x_i <- sum_j W_ij x_j``.

        With ``factor`` ``a`` below 1, only part of the way: ``x_i <- (1 - a) x_i + a sum_j W_ij x_j``,
        i.e. the doubly stochastic ``(1 - a) I + a W``. Guarded (:mod:`~.guard`): what a member
        withheld or what is not finite is left out. Returns whether this rank *healed*: its own
        values were not finite and it took its peers' instead (its caller resets what stepped them).
        """
        channel = self._channels[bucket]
        round_ = channel.round
        if round_ is None:
            return False
        self.wait(bucket)
        channel.round = None
        if round_.codec is not None:
            return self._mix_gathered(channel, round_, factor, bucket)
        group, tensor, buffer = round_.group, channel.tensor, channel.sum_buffer()
        k, numel = group.size, tensor.numel()
        # Staged: the sums and flags are read from the host copy (no device sync).
        received = channel.host if round_.staged and channel.host is not None else channel.round_buffer(k)
        raised = [j for j, flag in enumerate(received[numel : numel + k].tolist()) if flag != 0.0]
        sent_with = 1.0 / k if group.self_weight is None else group.peer_weight  # each member's weight c
        if group.ranks.index(self._rank) in raised:
            return self._heal(
                bucket, round_, raised, lambda: tensor.copy_(buffer).div_((k - len(raised)) * sent_with)
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

    def _heal(self, bucket: int, round_: _Round, raised: Sequence[int], heal: Callable[[], object]) -> bool:
        """This rank withheld: take its peers' values (``heal``), or raise if every member withheld."""
        group = round_.group
        # Recorded at launch when decided there on the host; decided on the device (None), or found at
        # the mix (a gathered round: its own slot not finite, left out by every member), recorded now.
        if not round_.withheld:
            self._guard.record(GuardEvent("withheld", round_.step, bucket, self._label, group.ranks))
        if len(raised) == group.size:
            raise NonFiniteReplicaError(
                f"rank {self._rank}: the {self._label} of bucket {bucket} are not finite (inf/NaN) and every "
                f"member of the round launched at step {round_.step} in group {list(group.ranks)} withheld "
                "its values, so there is nothing finite to heal from. Look for the step that overflowed "
                "(a loss or gradient that became inf/NaN: lower the learning rate, clip gradients, or use "
                "GradScaler), then restart from the last checkpoint."
            )
        heal()
        self._guard.record(GuardEvent("healed", round_.step, bucket, self._label, group.ranks))
        return True

    def _mix_gathered(self, channel: _Channel, round_: _Round, factor: float, bucket: int) -> bool:
        """``x_i <- x_i + a c (s - k q_i)`` and ``r <- r + s / k`` with ``s = sum_j q_j`` in rank order."""
        assert round_.codec is not None
        group = round_.group
        reference = self._reference(channel, group)
        total, scratch, bad = self._gathered_sum(channel, round_)
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
            healed = self._heal(bucket, round_, raised, heal)
        elif self._clipped is not None:
            self._mix_clipped(channel, round_, factor, bad, bucket)
            healed = False
        else:
            seed = round_seed(round_.step, channel.index)
            codec(round_.codec).decode_into(_slots(channel, round_)[slot], scratch, seed)
            # x <- x + a c (s - k q_i): one pass for s - k q_i, one for the update
            channel.tensor.add_(
                torch.add(total, scratch, alpha=-group.size, out=scratch), alpha=factor * group.peer_weight
            )
            healed = False
        if round_.tracks_reference and not round_.reference_applied:
            _update_reference(channel, round_, total)
            self._release_start(channel)
        return healed

    def _mix_clipped(
        self, channel: _Channel, round_: _Round, factor: float, bad: Sequence[int], bucket: int
    ) -> None:
        """``x_i <- x_i + a sum_j c clip(x^_j - x^_i, tau)`` over the members that sent finite values
        (:mod:`~.clipping`; compressed: ``x^_j - x^_i = q_j - q_i``), then the radius learns the norms.
        Neighbours left out beyond ``drop_beyond`` radii are a ``"dropped"`` guard event."""
        assert round_.codec is not None and channel.radius is not None and channel.decoded is not None
        group = round_.group
        coder, slots, seed = (
            codec(round_.codec),
            _slots(channel, round_),
            round_seed(round_.step, channel.index),
        )
        if channel.clip_buffers is None:
            channel.clip_buffers = (torch.empty_like(channel.decoded), torch.empty_like(channel.decoded))
        other, update = channel.clip_buffers
        own = channel.decoded
        slot = group.ranks.index(self._rank)
        coder.decode_into(slots[slot], own, seed)
        update.zero_()
        assert self._clipped is not None
        radius, norms = channel.radius.radius(), []
        own_norm = float(torch.linalg.vector_norm(channel.tensor))  # the warm-up's cut-off (clipping)
        sent_with = 1.0 / group.size if group.self_weight is None else group.peer_weight
        dropped = []
        for j in range(group.size):
            if j == slot or j in bad:
                continue
            coder.decode_into(slots[j], other, seed)
            other.sub_(own)
            norm = float(torch.linalg.vector_norm(other))
            norms.append(norm)
            scale = channel.radius.judge(group.ranks[j], norm, radius, own_norm)
            if scale > 0.0:
                update.add_(other, alpha=factor * sent_with * scale)
            elif radius > 0.0:  # a radius of 0 (nothing learnt yet) mixes nobody: not a verdict on j
                dropped.append(group.ranks[j])
        channel.tensor.add_(update)
        channel.radius.add(norms)
        if dropped:
            self._guard.record(
                GuardEvent("dropped", round_.step, bucket, self._label, group.ranks, tuple(dropped))
            )

    @staticmethod
    def _gathered_sum(channel: _Channel, round_: _Round) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """``s = sum_j q_j`` in rank order (identical on every member), a scratch buffer, and the slots
        whose payload did not decode to finite values: read as zero (the member holds the reference),
        or in a group's first, exact round as the mean of the others.

        Both live in buffers kept per bucket: fresh bucket-sized tensors every step would cost more
        (page faults) than the arithmetic.
        """
        assert round_.codec is not None
        coder, slots = codec(round_.codec), _slots(channel, round_)
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

    def settle_references(self) -> None:
        """Apply every pending compressed round's reference update now, without mixing it.

        Global averaging calls this on every rank before it drops the rounds: a rank that later
        reverts (and mixes the restored rounds) and one that does not then hold the same references.
        """
        for bucket, channel in enumerate(self._channels):
            round_ = channel.round
            if (
                round_ is None
                or round_.codec is None
                or round_.reference_applied
                or not round_.tracks_reference
            ):
                continue
            self.wait(bucket)
            if channel.round is round_:
                _update_reference(channel, round_, self._gathered_sum(channel, round_)[0])
                self._release_start(channel)

    def discard(self, bucket: int) -> None:
        """Finish and drop bucket ``bucket``'s round without mixing it (its values are stale)."""
        self.wait(bucket)
        channel = self._channels[bucket]
        if channel.round is not None:
            channel.discarded = channel.round.step
        channel.round = None

    # -- recovery from a lost peer -----------------------------------------------------------------
    def reports(self, kind: str) -> list[ChannelReport]:
        """Each bucket's round in flight and launch history, for the survivors' decision."""
        reports = []
        for bucket, channel in enumerate(self._channels):
            round_ = channel.round
            reports.append(
                ChannelReport(
                    kind,
                    bucket,
                    None if round_ is None else round_.step,
                    None if round_ is None else round_.group.ranks,
                    None if round_ is None else _round_state(round_.work),
                    channel.launched,
                    channel.discarded,
                )
            )
        return reports

    def resolve(self, bucket: int, finish: bool, factor: float) -> bool:
        """Mix bucket ``bucket``'s round in flight (``finish``) or drop it; False if mixing failed.

        A round to finish has every member's part in flight, so it completes; should a second
        failure stop it, it is dropped.
        """
        channel = self._channels[bucket]
        if channel.round is None:
            return True
        if finish:
            try:
                self.mix(bucket, factor)
                return True
            except PeerLost:
                pass
        channel.round = None
        return not finish

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
    def state_dict(self, references: bool = True) -> dict[str, Any] | None:
        """The rounds still to be mixed (waiting for them first) and the references; None if neither.

        Format::

            {
                "step": t,  # the step every pending round was launched at (None if none is)
                "buffers": [tensor or None per bucket],  # all-reduced sums, not mixed yet
                "gathered": [uint8 tensor or None per bucket],  # compressed rounds' payloads
                "codecs": [str or None per bucket],  # their codecs
                "references": [{"ranks": [...], "tensors": [tensor or None per bucket]}, ...],
                "start": [tensor or None per bucket],  # the common starting point, while a group has not met
            }

        ``None`` marks a bucket with nothing pending. Every pending round must have been launched at
        the same step ``t`` (true between two steps of either front-end). With ``references=False``
        the references are left out (a global average's snapshot: they do not change until its
        revert).
        """
        steps = {c.round.step for c in self._channels if c.round is not None}
        if len(steps) > 1:
            raise RuntimeError(
                f"buckets have gossip in flight from different steps {sorted(steps)}: save between two "
                "steps (after step() / after backward), not in the middle of one."
            )
        saved_references = self._references_state() if references else []
        starts = [_cloned(c.start) for c in self._channels] if references else []
        saved_start = starts if any(t is not None for t in starts) else []
        clipping = references and self._clipped is not None  # a checkpoint keeps the radii's norms
        if not steps and not saved_references and not saved_start and not clipping:
            return None
        self.wait_all()
        buffers: list[torch.Tensor | None] = []
        flags: list[torch.Tensor | None] = []  # a plain round's withheld flags
        gathered: list[torch.Tensor | None] = []
        codecs: list[str | None] = []
        for channel in self._channels:
            round_ = channel.round
            plain = round_ is not None and round_.codec is None and channel.buffer is not None
            buffers.append(channel.sum_buffer().clone() if plain else None)
            flags.append(channel.flags(round_.group.size).clone() if plain and round_ is not None else None)
            compressed = round_ is not None and round_.codec is not None and channel.gathered is not None
            gathered.append(channel.gathered.clone() if compressed and channel.gathered is not None else None)
            codecs.append(None if round_ is None else round_.codec)
        while buffers and buffers[-1] is None:
            buffers.pop()  # the layout checkpoints of version 1 used: a prefix of the buckets
        state: dict[str, Any] = {"step": steps.pop() if steps else None, "buffers": buffers}
        if any(f is not None and bool(f.any()) for f in flags):  # only where a member withheld
            state["flags"] = flags
        if clipping:
            state["clip_norms"] = [[] if c.radius is None else c.radius.state() for c in self._channels]
            state["clip_probation"] = [
                {} if c.radius is None else c.radius.on_probation() for c in self._channels
            ]
        if any(c is not None for c in codecs) or saved_references:
            state.update(gathered=gathered, codecs=codecs, references=saved_references)
        if saved_start:
            state["start"] = saved_start
        return state

    def _references_state(self) -> list[dict[str, Any]]:
        groups = dict.fromkeys(ranks for c in self._channels for ranks in c.references)  # first seen first
        return [
            {"ranks": list(ranks), "tensors": [_cloned(c.references.get(ranks)) for c in self._channels]}
            for ranks in groups
        ]

    def check_state_dict(self, state: dict[str, Any] | None) -> None:
        """Raise ``ValueError`` if ``state`` (from :meth:`state_dict`) does not fit these buckets."""
        if state is None:
            return
        if not isinstance(state, dict) or "step" not in state or "buffers" not in state:
            raise ValueError(f"gossip state must be None or a dict with 'step' and 'buffers', got {state!r}.")
        tensors = [c.tensor for c in self._channels]
        summed = [(t.shape, reduction_dtype(t.dtype)) for t in tensors]
        check_saved_tensors("gossip buffers", state["buffers"], summed, optional=True)
        self._check_compressed_state(state)

    def _check_compressed_state(self, state: dict[str, Any]) -> None:
        gathered, codecs = state.get("gathered", []), state.get("codecs", [])
        if len(gathered) != len(codecs) or len(gathered) > self.num_buckets:
            raise ValueError(
                f"gossip state has {len(gathered)} gathered payloads and {len(codecs)} codecs for "
                f"{self.num_buckets} buckets; the checkpoint is corrupt or from a different layout."
            )
        step = state["step"]
        for bucket, (payload, name) in enumerate(zip(gathered, codecs, strict=True)):
            if payload is None and name is None:
                continue
            if not is_codec_name(name) or payload is None or step is None:
                raise ValueError(
                    f"gossip state of bucket {bucket} has codec {name!r}, payload "
                    f"{'missing' if payload is None else 'present'} and step {step!r}: a pending compressed "
                    "round needs a known codec, its payload and the step it was launched at."
                )
            tensor = self._channels[bucket].tensor
            group = self._topology.group(self._rank, int(step))
            size = group.size * codec(name).payload_bytes(tensor.numel(), tensor.dtype)
            got = misfit(payload, torch.Size([size]), torch.uint8)
            if got is not None:
                raise ValueError(
                    f"compressed gossip payload {bucket} of {got} does not fit its round ({size} bytes of "
                    f"uint8); the checkpoint comes from a different parameter layout or topology."
                )
        groups = {g.ranks for g in self._topology.distinct_groups()}
        layout = [(c.tensor.shape, c.tensor.dtype) for c in self._channels]
        for entry in state.get("references", []):
            ranks = tuple(entry["ranks"])
            if ranks not in groups or self._rank not in ranks:
                raise ValueError(
                    f"the checkpoint has a compression reference for group {list(ranks)}, which is not one "
                    f"of rank {self._rank}'s groups in this topology; resume with the same topology."
                )
            check_saved_tensors(f"references of group {list(ranks)}", entry["tensors"], layout, optional=True)
        if "start" in state:
            check_saved_tensors("gossip start", state["start"], layout, optional=True)

    def load_state_dict(self, state: dict[str, Any] | None, references: bool = True) -> None:
        """Restore rounds from :meth:`state_dict` as received-but-not-mixed (drops any pending round).

        With ``references`` (a checkpoint), the references and the common starting point are
        replaced by the state's (none if it has none, so that every member of a group starts it again
        with an exact round); without (a global average's snapshot), the current ones are kept.
        """
        self.check_state_dict(state)
        self.discard_all()
        if references:
            for channel in self._channels:
                channel.references.clear()
                channel.start = None
        if state is None:
            return
        step = state["step"]
        if references and self._plan is not None:  # without compression, references are of no use
            for entry in state.get("references", []):
                for channel, saved in zip(self._channels, entry["tensors"], strict=False):
                    if saved is not None:
                        channel.references[tuple(entry["ranks"])] = saved.to(channel.tensor.device).clone()
            for channel, saved in zip(self._channels, state.get("start", []), strict=False):
                if saved is not None:
                    channel.start = saved.to(channel.tensor.device).clone()
        norms = state.get("clip_norms")
        if references and norms is not None and self._clipped is not None:
            probation = state.get("clip_probation") or [{} for _ in norms]
            for channel, saved_norms, held in zip(self._channels, norms, probation, strict=False):
                channel.radius = RadiusWindow(
                    self._clipped, [float(n) for n in saved_norms], {int(r): int(n) for r, n in held.items()}
                )
        if step is None:
            return
        group = self._topology.group(self._rank, int(step))
        saved_flags = state.get("flags", [])
        for bucket, (channel, saved) in enumerate(zip(self._channels, state["buffers"], strict=False)):
            if saved is not None:
                channel.sum_buffer().copy_(saved)
                flags = saved_flags[bucket] if bucket < len(saved_flags) else None
                channel.flags(group.size).copy_(flags) if flags is not None else channel.flags(
                    group.size
                ).zero_()
                own = flags is not None and bool(flags[group.ranks.index(self._rank)])
                channel.round = _Round(int(step), group, None, withheld=own)
        for channel, payload, name in zip(
            self._channels, state.get("gathered", []), state.get("codecs", []), strict=False
        ):
            if name is None:
                continue
            channel.gathered = payload.to(channel.tensor.device).clone()
            # A global average's snapshot is restored after its references were settled.
            channel.round = _Round(
                int(step),
                group,
                None,
                name,
                reference_applied=not references,
                tracks_reference=not self._gathers_exact(group, channel.tensor.dtype),
            )


def _gather(
    gathered: torch.Tensor, slot: int, size: int, handle: dist.ProcessGroup, pair: bool
) -> dist.Work | None:
    """Start gathering every member's ``size``-byte payload into ``gathered``, whose slot ``slot`` holds
    this member's (in place: its input is its own slot of the output)."""
    own = gathered[slot * size : (slot + 1) * size]
    if not pair:
        return dist.all_gather_into_tensor(gathered, own, group=handle, async_op=True)
    # gloo sends an all-gather's two directions one after the other but pipelines an all-reduce
    # (3.2 MB at 200 Mbit/s: 197 ms vs 132 ms), so a pair gathers with a bitwise-XOR all-reduce of
    # the other slot, seeded with its own payload: it ends as own ^ peer, and wait() XORs its own
    # payload out again. Exact, same bytes.
    other = gathered[(1 - slot) * size : (2 - slot) * size]
    other.copy_(own)
    return dist.all_reduce(_as_words(other), op=dist.ReduceOp.BXOR, group=handle, async_op=True)


def _slots(channel: _Channel, round_: _Round) -> torch.Tensor:
    assert channel.gathered is not None  # a pending gathered round has its payloads
    return channel.gathered.view(round_.group.size, -1)


def _update_reference(channel: _Channel, round_: _Round, total: torch.Tensor) -> None:
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


def _cloned(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else tensor.clone()


def _as_words(payload: torch.Tensor) -> torch.Tensor:
    """A uint8 payload as int32 words where its size allows (a quarter of the elements to reduce)."""
    if payload.numel() % 4 == 0 and payload.storage_offset() % 4 == 0:
        return payload.view(torch.int32)
    return payload


def _round_state(work: dist.Work | None) -> RoundState:
    """Whether a round's collective has completed on this rank (None: already waited for)."""
    if work is None:
        return "done"
    if not work.is_completed():
        return "running"
    try:
        work.wait()
    except RuntimeError:
        return "failed"
    return "done"

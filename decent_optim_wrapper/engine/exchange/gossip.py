r"""Asynchronous gossip of flat buckets along a topology's schedule, one round in flight per bucket.

For bucket ``b`` launched at step ``t``, :meth:`Gossip.launch` stages what the bucket sends in the
rank's group ``G_t`` and starts the collective; :meth:`Gossip.mix` waits for it and applies
``x_i <- sum_j W_ij x_j`` with the weights of the phase the round was launched in. Between launch and
mix the bucket may change (the local step does): the values sent are those at launch, mixed into
those at mix — the overlap this library is for. A round that does not arrive raises
:class:`~.errors.GossipError` naming the step and the group, and is dropped.

A :class:`Gossip` is made of parts chosen once, when the groups are wired:

* the round kinds: :class:`~.plain.PlainRounds` (an all-reduce of the weighted values) and
  :class:`~.gathered.GatheredRounds` (every member's payload gathered: the groups a
  :class:`~.compression.CompressionPlan` compresses, and every group under clipped gossip); a group's
  kind follows from the plan and the options, a restored round's from its codec;
* how a gathered round is mixed: :class:`~.gathered.DifferenceMix`, or the mix of the job's
  :class:`~.gathered.MixRule` (clipped gossip's :class:`~.clipping.ClippedMix`), which also says whether
  every round is gathered and keeps its own part of the checkpoint;
* the transport (:mod:`~.transport`): collectives on the buckets' buffers, or through pinned host
  copies (:mod:`~.staging`);
* guarded mixing's log (:mod:`~.guard`), which every kind reports to.

:class:`Gossip` owns the channels (one per bucket) and the checkpoint format over all the parts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from decent_optim_wrapper.engine.errors import GossipError
from decent_optim_wrapper.engine.exchange.audit import Audit
from decent_optim_wrapper.engine.exchange.buckets import check_saved_tensors, misfit
from decent_optim_wrapper.engine.exchange.gathered import DifferenceMix, GatheredMix, GatheredRounds, MixRule
from decent_optim_wrapper.engine.exchange.guard import GuardEvent, GuardLog
from decent_optim_wrapper.engine.exchange.plain import PlainRounds
from decent_optim_wrapper.engine.exchange.rounds import Channel, Round
from decent_optim_wrapper.engine.exchange.staging import HostStaging
from decent_optim_wrapper.engine.exchange.transport import transport_for
from decent_optim_wrapper.engine.fleet.comm import ProcessGroups, reduction_dtype, wait_all
from decent_optim_wrapper.engine.fleet.membership import ChannelReport, PeerLost, RoundState
from decent_optim_wrapper.engine.wire.compression import CompressionPlan, codec, is_codec_name
from decent_optim_wrapper.topo import Group, Topology

__all__ = ["Gossip", "GossipWiring", "RoundRules", "Waiter"]

#: How a round is waited for (``comm.wait_all``, or a membership's failure-aware wait).
Waiter = Callable[
    [Sequence[dist.Work], torch.device, timedelta | None, Callable[[BaseException | None], Exception]], None
]


@dataclass(frozen=True)
class RoundRules:
    """How every round of a job is mixed in beyond plain gossip, the same for every :class:`Gossip` of
    it (parameters, trackers, anchors): guarded mixing's log (:mod:`~.guard`) and the rule that mixes
    gathered rounds (:class:`~.gathered.MixRule`, e.g. clipped gossip's :mod:`~.clipping`; None: plain
    differences). The engine takes the rule from its config's robustness part
    (:meth:`~decent_optim_wrapper.Robustness.mix_rule`), so a new one reaches every round unforwarded."""

    guard: GuardLog
    mix: MixRule | None = None
    audit: Audit | None = None  # clipped gossip's audit: the parameters' rounds leave out whom it quarantined


@dataclass(frozen=True)
class GossipWiring:
    """What every :class:`Gossip` over one wiring of the job is built from: the schedule, this rank,
    the process groups, the waits, the compression plan, the transport and the round rules. The
    engine's :class:`~.wiring.Wiring` makes one each time it wires the current members and hands it
    to the parameters', the trackers' and the anchors' gossip alike."""

    topology: Topology
    rank: int
    process_groups: ProcessGroups
    timeout: timedelta | None
    plan: CompressionPlan | None
    waiter: Waiter | None
    staging: HostStaging | None
    rules: RoundRules

    def gossip(self, tensors: Sequence[torch.Tensor], label: str = "parameters") -> Gossip:
        """A :class:`Gossip` of ``tensors`` over this wiring (``label`` names them in guard events)."""
        return Gossip(
            tensors,
            self.topology,
            self.rank,
            self.process_groups,
            self.timeout,
            self.plan,
            self.waiter,
            self.staging,
            self.rules.guard,
            label,
            self.rules.mix,
            self.rules.audit if label == "parameters" else None,
        )


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
        mix: the rule that mixes gathered rounds in (:class:`~.gathered.MixRule`; e.g. clipped gossip's
            options, under which every round gathers the members' values, or compressed differences,
            and mixes each neighbour's difference clipped); None: plain differences.
        audit: clipped gossip's audit (:mod:`~.audit`), whose quarantined ranks ``mix`` leaves out.
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
        mix: MixRule | None = None,
        audit: Audit | None = None,
    ) -> None:
        guard = GuardLog(rank) if guard is None else guard
        self._transport = transport_for(staging)
        self._mix: GatheredMix = DifferenceMix() if mix is None else mix.mixer(guard, label, audit)
        self._plain = PlainRounds(rank, self._transport, guard, label)
        self._gathered = GatheredRounds(
            rank,
            topology,
            plan,
            self._transport,
            guard,
            label,
            self._mix,
        )
        self._guard = guard
        self._label = label
        self._flag_slots = max((g.size for g in topology.distinct_groups()), default=1)
        self._waiter: Waiter = wait_all if waiter is None else waiter
        self._topology = topology
        self._rank = rank
        self._process_groups = process_groups
        self._timeout = timeout
        self._plan = plan
        self._channels: list[Channel] = []
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
            self._channels.append(Channel(tensor, number, flag_slots=self._flag_slots))

    def _gathers(self, group: Group, dtype: torch.dtype) -> bool:
        """Whether ``group``'s rounds of ``dtype`` buckets are gathered (compressed, or every round of a
        mix that needs them all, such as clipped gossip's) rather than all-reduced."""
        return self._mix.gathers_every_round or self._gathered.compresses(group, dtype)

    def bytes_sent_per_step(self) -> float:
        """Bytes this rank sends per step for these buckets, averaged over one period of the schedule.

        Cost model: an all-reduce in a group of ``k`` is a ring, in which each member sends
        ``2 (k - 1) / k`` buckets (in fp32 for 16-bit buckets); a gathered round, in which each member
        sends its payload ``k - 1`` times. The exact first round of a group that has no common
        starting point (after a membership change or a checkpoint without references) is left out:
        it happens once per group.
        """
        total = 0.0
        for step in range(self._topology.period):
            group = self._topology.group(self._rank, step)
            for channel in self._channels:
                numel, dtype = channel.tensor.numel(), channel.tensor.dtype
                kind = self._gathered if self._gathers(group, dtype) else self._plain
                total += kind.bytes_sent(group, numel, dtype)
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
            self._gathered.release_start(channel)

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

    def _stage(self, channel: Channel, step: int) -> tuple[Group, str | None, bool | None]:
        """Stage ``channel`` for ``step``: its group, the codec of a gathered round (or None), and
        whether this rank withheld its values (None: the flags will tell, see :mod:`~.guard`)."""
        group = self._topology.group(self._rank, step)
        if group.size == 1:
            return group, None, False
        if self._gathers(group, channel.tensor.dtype):
            name, withheld = self._gathered.stage(channel, group, step)
            return group, name, withheld
        return group, None, self._plain.stage(channel, group)

    def launch(self, bucket: int, step: int) -> None:
        """Stage bucket ``bucket`` and start its round in the rank's group at ``step`` (non-blocking):
        an all-reduce of the weighted values, or a gather of the members' payloads."""
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
            channel.round = self._gathered.start(channel, bucket, group, handle, step, name, bool(withheld))
        else:
            channel.round = self._plain.start(channel, bucket, group, handle, step, withheld)

    def wait(self, bucket: int) -> None:
        """Wait until bucket ``bucket``'s round has arrived; its buffer then holds the group sum."""
        channel = self._channels[bucket]
        round_ = channel.round
        if round_ is None or round_.work is None:
            return
        work, round_.work = round_.work, None
        device = self._transport.wait_device(channel.tensor.device)
        try:
            self._waiter([work], device, self._timeout, lambda c: self._failure(round_, c))
        except PeerLost:
            round_.work = work  # recovery decides from every member's report whether it is mixed
            raise
        except BaseException:
            channel.round = None  # never mix or save a round that did not arrive
            # Its collective may still write the host copies: the next round gets fresh ones.
            self._transport.forget(bucket)
            raise
        GatheredRounds.arrived(channel, round_)

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
        kind = self._plain if round_.codec is None else self._gathered
        return kind.mix(channel, bucket, round_, factor)

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
                self._gathered.settle(channel, round_)

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

    def _failure(self, round_: Round, cause: BaseException | None) -> GossipError:
        limit = f"within {self._timeout}" if self._timeout is not None else "within the process group timeout"
        return GossipError(
            f"rank {self._rank}: the gossip round launched at step {round_.step} in group "
            f"{list(round_.group.ranks)} did not complete: a peer died or did not answer {limit}. Check "
            f"the other ranks' logs; restart from the last checkpoint. Cause: {cause}"
        )

    # -- checkpoints ---------------------------------------------------------------------------------
    def mix_state_across_change(self) -> dict[str, Any]:
        """What the mix learnt that stays true over new members (e.g. clipped gossip's recent norms: the
        spread of the replicas), for :meth:`load_mix_state` on the gossip that replaces this one."""
        return self._mix.across_change(self.num_buckets)

    def load_mix_state(self, state: dict[str, Any]) -> None:
        """Take over :meth:`mix_state_across_change` of the gossip this one replaces."""
        self._mix.load_state(self.num_buckets, state)

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
        mixing = self._mix.state(self.num_buckets) if references else {}  # e.g. clipped gossip's radii
        if not steps and not saved_references and not saved_start and not mixing:
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
        state.update(mixing)
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
        if references:
            self._mix.load_state(self.num_buckets, state)
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
                channel.round = Round(int(step), group, None, withheld=own)
        for channel, payload, name in zip(
            self._channels, state.get("gathered", []), state.get("codecs", []), strict=False
        ):
            if name is None:
                continue
            channel.gathered = payload.to(channel.tensor.device).clone()
            # A global average's snapshot is restored after its references were settled.
            channel.round = Round(
                int(step),
                group,
                None,
                name,
                reference_applied=not references,
                # an uncompressed round of a mix that gathers every round keeps no reference
                tracks_reference=not self._mix.gathers_every_round
                or self._gathered.compresses(group, channel.tensor.dtype),
            )


def _cloned(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else tensor.clone()


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

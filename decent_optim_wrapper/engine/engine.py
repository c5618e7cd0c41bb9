r"""The engine both front-ends drive: :class:`GossipEngine`.

It owns everything decentralized training needs besides the local update: cross-rank agreement, the
flat buckets, the process groups, the step protocol (:meth:`GossipEngine.step` for a whole model,
:meth:`GossipEngine.step_bucket` for one bucket inside backward), exact global averaging with its
snapshot (:mod:`~decent_optim_wrapper.engine.state.averaging`). It holds its parts: the step counters
(:mod:`~decent_optim_wrapper.engine.progress`), the communication over the current members
(:mod:`~decent_optim_wrapper.engine.wiring`), what a change of members does
(:mod:`~decent_optim_wrapper.engine.member_changes`) and its part of a checkpoint
(:mod:`~decent_optim_wrapper.engine.checkpointing`). The architecture page of the docs shows a step's
data flow.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar, Unpack

import torch
from loguru import logger
from torch.utils.hooks import RemovableHandle

from decent_optim_wrapper.engine.checkpointing import EngineCheckpoint
from decent_optim_wrapper.engine.config import GossipConfig, GossipOptions
from decent_optim_wrapper.engine.counters import CounterTotals, GossipMetrics, WaitClock
from decent_optim_wrapper.engine.exchange.buckets import Bucket, build_buckets, check_named_params, current
from decent_optim_wrapper.engine.exchange.gossip import RoundRules
from decent_optim_wrapper.engine.exchange.guard import GuardEvent, GuardLog
from decent_optim_wrapper.engine.exchange.staging import HostStaging
from decent_optim_wrapper.engine.fleet.comm import agree
from decent_optim_wrapper.engine.fleet.growth import Growth
from decent_optim_wrapper.engine.fleet.jobs import current_job
from decent_optim_wrapper.engine.fleet.refusals import REFUSALS
from decent_optim_wrapper.engine.fleet.status import StatusBoard, default_job
from decent_optim_wrapper.engine.layout import NamedParams, agree_on_parts, join_signature, signatures
from decent_optim_wrapper.engine.member_changes import MemberChanges
from decent_optim_wrapper.engine.option_docs import document_options
from decent_optim_wrapper.engine.options import (
    DEFAULT_TIMEOUT,
    TopologySpec,
    check_buckets_agree,
    check_mixing_factor,
)
from decent_optim_wrapper.engine.progress import StepProgress
from decent_optim_wrapper.engine.quarantine import Quarantine
from decent_optim_wrapper.engine.rules.pacing import PaceReport, Pacing
from decent_optim_wrapper.engine.state.averaging import GlobalAverage, floating_buffers
from decent_optim_wrapper.engine.state.checkpoint import STATE_VERSION
from decent_optim_wrapper.engine.stepping import BucketHealing, StepProtocol
from decent_optim_wrapper.engine.survival import PeerFailureHook, Survival
from decent_optim_wrapper.engine.wire.compression import GossipCompression
from decent_optim_wrapper.engine.wiring import Wiring
from decent_optim_wrapper.topo import Topology

__all__ = ["DEFAULT_TIMEOUT", "STATE_VERSION", "GossipEngine", "PeerFailureHook", "TopologySpec"]

_T = TypeVar("_T")


@document_options
class GossipEngine:
    r"""Buckets, topology schedule, process groups and gossip of one rank.

    Built from ``(name, parameter)`` pairs in a given order (the optimizer front-end passes its
    param_groups order, the module front-end the model's and ``reverse_buckets``): the parameters move
    into flat buckets in that order (``param.data`` becomes a view into a bucket, one bucket per
    dtype and device run, at most ``bucket_cap_mb`` each; a sharded parameter's local shard is
    copied in and out, :mod:`~decent_optim_wrapper.engine.exchange.shards`) and rank 0's values are
    broadcast, so all replicas start equal. Ranks are those of the gossip world: the whole job, or
    the group ``device_mesh``/``process_group`` names (:mod:`~decent_optim_wrapper.engine.fleet.world`).
    Gossip of bucket ``b`` at step ``t`` computes, on every rank ``i``,

    .. math::
        x_{i,b} \leftarrow \sum_{j \in G_t(i)} W^{(t)}_{ij}\, x_{j,b}

    with the topology's doubly stochastic mixing matrix ``W^{(t)}`` of the phase the round was
    launched in; the values sent are those after step ``t``'s local update, mixed in at step
    ``t + 1`` before its local update (:meth:`step`, :meth:`step_bucket`).

    .. warning:: Construction, :meth:`step`/:meth:`step_bucket` (through the gossip rounds),
        :meth:`global_avg`, :meth:`consensus_distance` and :meth:`add_parameters` involve
        collectives: all ranks must call them in the same order, the same number of times.
        Construction and :meth:`add_parameters` agree over the whole job, even with a
        ``device_mesh``: every rank of the job builds its engine at the same point.

    Args:
        named_params: ``(name, parameter)`` pairs; names appear in error messages.
        config: the options as one :class:`~decent_optim_wrapper.GossipConfig`; the keywords below build
            it (or change it, if they agree with it: a keyword that contradicts ``config`` is an error).
        params_as_views: make ``param.data`` a view into its bucket. With False the parameters keep
            their own storage and are copied in before a bucket is read and back after it is written.
        context: what the user is building, for error messages (e.g. ``"DecentOptimWrapper"``).
        reverse_buckets: list the buckets last first (a module front-end steps them as backward
            produces gradients); each is laid out, and compressed, as it is without.
        {gossip_options}
    """

    def __init__(
        self,
        named_params: NamedParams,
        *,
        config: GossipConfig | None = None,
        params_as_views: bool = True,
        context: str = "GossipEngine",
        reverse_buckets: bool = False,
        **options: Unpack[GossipOptions],
    ) -> None:
        agreed = agree_on_parts(
            named_params,
            config,
            options,
            context=context,
            params_as_views=params_as_views,
            reverse_buckets=reverse_buckets,
        )
        config, world, reports, built = agreed.config, agreed.world, agreed.reports, agreed.parts
        self._config = config
        transport, elasticity = config.transport, config.elasticity
        timeout = transport.timeout
        self._as_views = params_as_views
        self._bucket_cap_bytes = transport.bucket_cap_bytes
        self._buckets, self._shards, self._local = built.buckets, built.shards, built.local
        self._compression, self._second_moment = built.compression, built.second_moment
        self._averaging = GlobalAverage(self._buckets, self._shards)
        self._progress = StepProgress()
        # guarded mixing's switch and events, kept across changes of the world
        self._guard = GuardLog(world.rank, enabled=config.robustness.nonfinite_guard)
        self._healing = BucketHealing(self._buckets)
        # Clipped gossip's audit compares the ranks at one step: not with paced rounds (ranks stand at
        # different steps) nor over shards (a node's ranks would judge their shards apart).
        paced = self._local is not None and self._local.spec.pacing is not None
        audit = None if paced or self._shards.sharded else config.robustness.audit()
        self._wait_clock = WaitClock()  # host seconds in the rounds' waits, for metrics()
        self._wiring = Wiring(
            world,
            list(dict.fromkeys(r.groups for r in reports)),  # every gossip world's groups
            built.topology,
            config.topology,
            buckets=self._buckets,
            local=self._local,
            timeout=timeout,
            compression=self._compression,
            staging=HostStaging(timeout) if built.layout.host_staging else None,
            rules=RoundRules(self._guard, config.robustness.mix_rule(), audit),
            tracking=config.rounds.gradient_tracking,
            on_healed=self._healing,
            wait_clock=self._wait_clock,
        )
        job = current_job()
        # This rank's status record (:mod:`~.fleet.status`), published by its heartbeat once it is a
        # member of the job (a joiner's, once admitted); named as torchrun names the job when
        # init_elastic did not start it, so that a monitor finds it there too.
        self._status = StatusBoard(default_job() if job is None else job.job)
        self._status.attach(self.status_fields)
        #: (step, distance) of the latest consensus_distance() (a collective: the records only report it)
        self._consensus: tuple[int, float] | None = None
        survives = elasticity.survives
        survival = Survival.of_job(elasticity.store, world, timeout, self._status) if survives else None
        self._members = MemberChanges(
            self._wiring,
            self._progress,
            buckets=self._buckets,
            local=self._local,
            averaging=self._averaging,
            survival=survival,
            growth=Growth(enabled=elasticity.survives),
            join_signature=join_signature(built.layout),
            save=self.state_dict,
            load=self.load_state_dict,
            status=self._status,
        )
        self._checkpoint = EngineCheckpoint(
            self._wiring,
            self._progress,
            buckets=self._buckets,
            local=self._local,
            averaging=self._averaging,
            compression=self._compression,
            wait_all=self.wait_all,
        )
        self._quarantine = (
            None
            if audit is None
            else Quarantine(
                audit, self._wiring, self._members, self._averaging, self._guard, lambda: len(self._buckets)
            )
        )
        self._steps = StepProtocol(
            self._buckets,
            self._wiring,
            self._progress,
            self._members,
            self._averaging,
            local=self._local,
            quarantine=self._quarantine,
            healing=self._healing,
        )
        self._wiring.connect(self._members.membership, broadcast=True)
        self._metrics = GossipMetrics(self._counter_totals)
        logger.debug("rank {}/{}: {}", world.rank, world.world_size, self._wiring.topology)

    # -- facts -----------------------------------------------------------------------------------
    @property
    def config(self) -> GossipConfig:
        """The options this engine was built with (frozen)."""
        return self._config

    @property
    def rank(self) -> int:
        """This process's rank in the gossip world."""
        return self._wiring.world.rank

    @property
    def world_size(self) -> int:
        """How many ranks gossip together (the job's size, or that of ``device_mesh``/``process_group``)."""
        return self._wiring.world.world_size

    @property
    def local_world_size(self) -> int:
        """Ranks per node along the gossip world."""
        return self._wiring.world.local_world_size

    @property
    def gossip_ranks(self) -> tuple[int, ...]:
        """The global ranks of the gossip world, in its rank order."""
        return self._wiring.world.ranks

    @property
    def topology(self) -> Topology:
        return self._wiring.topology

    @property
    def host_staging(self) -> bool:
        """Whether gossip rounds travel through host buffers (:mod:`~.exchange.staging`)."""
        return self._wiring.staging is not None

    @property
    def compression(self) -> GossipCompression | None:
        """The gossip compression, or None if gossip sends the parameters exactly."""
        return self._compression

    def bytes_sent_per_step(self) -> float:
        """Bytes this rank sends per step
        (:meth:`~decent_optim_wrapper.engine.exchange.gossip.Gossip.bytes_sent_per_step`; twice with
        tracking; with low-communication gossip, one anchor round's bytes over ``sync_every`` steps)."""
        if self._local is not None:
            return self._local.bytes_sent_per_step()
        rounds = 2 if self._wiring.tracker is not None else 1  # the trackers travel like the parameters
        return rounds * self._wiring.gossip.bytes_sent_per_step()

    def second_moment_step(
        self, optimizer: torch.optim.Optimizer
    ) -> Callable[[torch.Tensor | None], None] | None:
        """``step(grad_scale)`` to take in place of ``optimizer.step()``, or None where the step stays
        the optimizer's own; see
        :meth:`~decent_optim_wrapper.engine.rules.second_moment.SecondMomentRule.step`.
        Local."""
        rule, world_size = self._second_moment, self.world_size
        if not rule.applies(optimizer, world_size):
            return None
        return lambda grad_scale: rule.step(optimizer, world_size, grad_scale)

    @property
    def gradient_tracking_requested(self) -> bool:
        """Whether ``gradient_tracking=True`` was passed (checked for misuse at any world size)."""
        return self._config.rounds.gradient_tracking

    @property
    def buckets(self) -> list[Bucket]:
        """The buckets, in order (a new list; the buckets themselves are live)."""
        return list(self._buckets)

    @property
    def step_count(self) -> int:
        """Completed steps; step ``t`` gossips in phase ``t % period``."""
        return self._progress.step

    @property
    def mixing_factor(self) -> float:
        """``a`` in ``x <- (1 - a) x + a sum_j W_ij x_j``; 1 (full mixing) unless set."""
        return self._progress.mixing_factor

    @mixing_factor.setter
    def mixing_factor(self, factor: float) -> None:
        self._progress.mixing_factor = check_mixing_factor(factor)

    # -- low-communication gossip ----------------------------------------------------------------
    @property
    def sync_every(self) -> int:
        """How many inner steps a round has (1 for per-step gossip; with pacing, the nominal count)."""
        return 1 if self._local is None else self._local.spec.sync_every

    @property
    def sync_delay(self) -> int | None:
        """Inner steps a round's exchange may run behind; None for per-step gossip."""
        return None if self._local is None else self._local.spec.sync_delay

    @property
    def outer_optimizer(self) -> torch.optim.Optimizer | None:
        """The outer optimizer over the anchors (e.g. for an LR scheduler of its own), or None."""
        return None if self._local is None else self._local.outer_optimizer

    @property
    def anchors(self) -> list[torch.Tensor]:
        """The flat anchors of low-communication gossip, one per bucket (live); empty without it."""
        return [] if self._local is None else self._local.anchors

    @property
    def pacing(self) -> Pacing | None:
        """The options of paced rounds (:mod:`~.rules.pacing`), or None."""
        return None if self._local is None else self._local.spec.pacing

    @property
    def round_count(self) -> int:
        """Rounds launched so far (every completed step is a round with per-step gossip). With paced
        rounds ranks stand at different steps but launch the same rounds: loops count these."""
        step = self._progress.step
        return step if self._local is None else self._local.rounds_launched(step)

    def rounds_launched_before_last_step(self) -> int:
        """Rounds launched before the last completed step (:attr:`round_count` one step earlier)."""
        before = max(self._progress.step - 1, 0)
        return before if self._local is None else self._local.rounds_launched(before)

    def pace_report(self) -> PaceReport | None:
        """Where paced rounds stand on this rank (:class:`~.rules.pacing.PaceReport`), or None without
        pacing."""
        return None if self._local is None else self._local.pace_report()

    # -- one step (:mod:`~.stepping`) -------------------------------------------------------------
    def step(self, local_update: Callable[[], _T], *, found_inf: torch.Tensor | None = None) -> _T:
        """One step of the whole model: :meth:`begin_step`, every bucket's update, :meth:`end_step`.

        Mixes every bucket, tracks every bucket's gradients (with gradient tracking, unless
        ``found_inf`` holds a nonzero value: GradScaler found inf/NaN), runs ``local_update()``
        once (it decides itself whether to skip on ``found_inf``), and launches every bucket.
        ``found_inf`` is read on the host only with gradient tracking. Returns what
        ``local_update`` returns.
        """
        return self._steps.step(local_update, found_inf)

    def step_bucket(
        self, bucket: int, local_update: Callable[[], object], *, skip_local_update: bool = False
    ) -> None:
        """One bucket's update inside a step: mix its round, track, ``local_update()``, launch.

        With ``skip_local_update`` (inf/NaN gradients on this rank) only the gossip happens. A
        module front-end calls this per bucket between :meth:`begin_step` and :meth:`end_step`, in
        the same bucket order on every rank.
        """
        self._steps.step_bucket(bucket, local_update, skip_local_update)

    def begin_step(self) -> None:
        """Start a step: check the buckets, drop a global average's snapshot, admit waiting joiners;
        with low-communication gossip the first step sets the anchors to the parameters."""
        self._steps.begin_step()

    def end_step(self) -> None:
        """Finish a step: the next one gossips in the next phase."""
        self._steps.end_step()

    def wait_all(self) -> None:
        """Wait for every round in flight without mixing it (GossipError if a peer does not answer)."""
        self._steps.wait_all()

    def check_buckets(self) -> None:
        """Raise if a parameter no longer lives in its bucket (e.g. ``model.to()`` after wrapping)."""
        self._steps.check_buckets()

    # -- guarded mixing ----------------------------------------------------------------------------
    def register_guard_hook(self, hook: Callable[[GuardEvent], None]) -> RemovableHandle:
        """Call ``hook(event)`` whenever guarded mixing leaves a value that is not finite out of a round
        (a :class:`~.guard.GuardEvent`: withheld, healed, a peer withheld, entries not finite).
        Returns a handle whose ``remove()`` unregisters it."""
        return self._guard.register_hook(hook)

    @property
    def guard_counts(self) -> dict[str, int]:
        """How many times each kind of guard event happened on this rank (see :mod:`~.guard`), and each
        kind of forged store entry this process refused (``forged_<kind>``:
        :mod:`~decent_optim_wrapper.engine.fleet.refusals`)."""
        return {**self._guard.counts, **REFUSALS.counts}

    # -- what a monitor and a logger read ----------------------------------------------------------
    def status_fields(self) -> dict[str, Any]:
        """What this rank's status record says of its engine (:mod:`~.fleet.status`): plain numbers
        and names, read by the heartbeat thread every 2 s from attributes (no collective, nothing the
        step waits for): the consensus distance is the latest the training loop computed, if any."""
        members, survival = self._members, self._members.survival
        membership = members.membership
        pace = self.pace_report()
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "step": self._progress.step,
            "round": self.round_count,
            "topology": self.topology.name,
            "bytes_per_step": self.bytes_sent_per_step(),
            "compression": None if self._compression is None else self._compression.name,
            "wait_s": 0.0 if membership is None else membership.wait_seconds,
            "losses": 0 if survival is None else len(survival.failures),
            "joins": len(self.growth.joins),
            "guard": self.guard_counts,
            "pace_round_s": None if pace is None else pace.round_seconds,
            "pace_step_s": None if pace is None else pace.step_seconds,
            "consensus": None if self._consensus is None else self._consensus[1],
            "consensus_step": None if self._consensus is None else self._consensus[0],
        }

    def metrics(self) -> dict[str, float | int]:
        """What this rank did since the previous call (the first: since construction), as plain numbers.

        Names and units are those of :data:`~.counters.METRIC_NAMES`: ``gossip/steps``,
        ``gossip/rounds``, ``gossip/bytes_sent`` (bytes), ``gossip/bytes_per_step``, ``gossip/wait_s``
        (host seconds the rounds' waits took), ``guard/<kind>`` for each guard event kind and
        ``guard/forged_entries``, ``fleet/world_size``, ``fleet/losses``, ``fleet/joins``. Each call
        resets the counts (:class:`~.counters.GossipMetrics`). Local: no collective, no device sync,
        so a logger may call it on any rank at any step.
        """
        return self._metrics.read()

    def _counter_totals(self) -> CounterTotals:
        """The running totals :meth:`metrics` differences: the sources of :meth:`status_fields`."""
        survival = self._members.survival
        return CounterTotals(
            steps=self._progress.step,
            rounds=self.round_count,
            wait_s=self._wait_clock.seconds,
            bytes_per_step=self.bytes_sent_per_step(),
            world_size=self.world_size,
            guard=self.guard_counts,
            losses=0 if survival is None else len(survival.failures),
            joins=len(self.growth.joins),
        )

    def on_bucket_healed(self, reset: Callable[[list[torch.Tensor]], None]) -> None:
        """For front-ends: ``reset(params)`` is called with a bucket's parameters when the bucket healed
        from its peers, to drop the optimizer state that stepped them (:func:`~.guard.drop_state`)."""
        self._healing.register(reset)

    # -- growing -----------------------------------------------------------------------------------
    @torch.no_grad()
    def add_parameters(
        self,
        new_named_params: Callable[[], Sequence[tuple[str, torch.Tensor]]],
        context: str = "add_parameters",
    ) -> list[Bucket]:
        """Move new parameters into new buckets, sync them from rank 0 and gossip them from now on.

        ``new_named_params`` runs inside the cross-rank agreement, so an error it raises on one rank
        (bad input) is an error on every rank instead of a hang. A round already in flight does not
        include the new parameters. Returns the new buckets.

        .. warning:: This is a collective: all ranks must call it, with the same shapes and dtypes.
        """
        known = {id(p) for bucket in self._buckets for p in bucket.params}
        built: list[Bucket] = []

        def local_layout() -> tuple[object, ...]:
            params, names = check_named_params(new_named_params())
            for param, name in zip(params, names, strict=True):
                if id(param) in known:
                    raise ValueError(f"{name} is already gossiped; add each parameter only once.")
            self._shards.add(params, names)
            first = len(self._buckets)
            built.extend(build_buckets(params, names, self._bucket_cap_bytes, self._as_views, first=first))
            return signatures(built)

        with self._members.unbroken():
            check_buckets_agree(agree(context, local_layout))
            self._wiring.bind_and_broadcast(built)
        known_buckets = len(self._buckets)
        self._buckets.extend(built)
        gossip, tracker = self._wiring.gossip, self._wiring.tracker
        gossip.add_tensors([b.data for b in built])
        gossip.start_from_common_point(range(known_buckets, len(self._buckets)))  # just broadcast
        if self._local is not None:
            self._local.add_buckets(built)
        if tracker is not None:
            tracker.add_buckets(built)
        return built

    # -- global averaging ----------------------------------------------------------------------------
    @torch.no_grad()
    def global_avg(
        self, may_revert: bool = True, buffers: torch.nn.Module | None = None, return_distance: bool = False
    ) -> float | None:
        """Set every replica to the exact average of the gossip world's (the front-ends' ``global_avg``).

        With ``may_revert`` a snapshot is kept for :meth:`revert_global_avg`; floating buffers of
        ``buffers`` are averaged too; with ``return_distance`` returns this replica's float64 L2
        distance to the average (the whole model's, summed over the shards; else None).

        .. warning:: This is a collective: all ranks must call it, with the same ``buffers`` layout.
        """
        extra = floating_buffers(buffers) if buffers is not None else []
        self.check_buckets()
        with self._averaging.whole_world():
            if may_revert and self._averaging.snapshot is None:
                # The snapshot saves the rounds in flight, waiting for them: a peer lost there is
                # survived first, so that the snapshot holds the replica and rounds as recovery left them.
                self.wait_all()
            with current(self._buckets, write=True):
                distance = self._averaging.average(
                    lambda: (self._wiring.world_reduce, self._wiring.gossip),  # new ones after a change
                    self._local,
                    step=self._progress.step,
                    may_revert=may_revert,
                    extra=extra,
                    return_distance=return_distance,
                    survive=self._members.survive,
                )
        self._members.collective_done()
        return distance

    def revert_global_avg(self) -> None:
        """Restore the replica saved by :meth:`global_avg` bit for bit (local; RuntimeError if none)."""
        with current(self._buckets, write=True):
            self._averaging.revert(self._wiring.gossip, self._local)

    def consensus_distance(self) -> float:
        """Root-mean-square distance of the replicas to their average, gossip in flight left out.

        .. warning:: This is a collective: all ranks must call it.
        """
        self.check_buckets()
        with self._averaging.whole_world(), current(self._buckets, write=False):
            distance = self._averaging.distance(lambda: self._wiring.world_reduce, self._members.survive)
        self._members.collective_done()
        self._consensus = (self._progress.step, float(distance))
        return distance

    @torch.no_grad()
    def broadcast_(self, tensors: Sequence[torch.Tensor]) -> None:
        """Overwrite ``tensors`` with the gossip world's rank 0's, in place (e.g. a model's buffers).

        .. warning:: This is a collective over the gossip world: all its ranks must call it.
        """
        self._wiring.broadcast_(tensors)

    # -- a change of members (on_peer_failure="continue", init_elastic) --------------------------------
    @property
    def on_peer_failure(self) -> str:
        """``"raise"`` or ``"continue"``."""
        return self._members.on_peer_failure

    @property
    def survival(self) -> Survival | None:
        """The lost peers survived and their hooks (:mod:`~.survival`); None with ``"raise"``."""
        return self._members.survival

    @property
    def growth(self) -> Growth:
        """Joins seen by this rank, their hooks, and what joiners receive (:mod:`~.fleet.growth`)."""
        return self._members.growth

    def open_to_joiners(
        self,
        save: Callable[[], dict[str, Any]],
        load: Callable[[dict[str, Any]], None],
        signature: tuple[tuple[str, object], ...] = (),
    ) -> None:
        """Let workers join (in a job of :func:`~decent_optim_wrapper.init_elastic`); on a joiner, join.

        Front-ends call this last in their constructor: ``save()``/``load(state)`` give and take their
        part of a replica, ``signature`` what a joiner must share besides the engine's layout
        (:meth:`~.member_changes.MemberChanges.open_to_joiners`).
        """
        self._members.open_to_joiners(save, load, signature)

    # -- the engine's part of a checkpoint -----------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This replica's engine state: the ``"decent"`` entry of a front-end's checkpoint
        (:meth:`~.checkpointing.EngineCheckpoint.state_dict`). Waits for gossip in flight (no
        collective), so a run resumed from it continues bit for bit."""
        with current(self._buckets, write=False):
            return self._checkpoint.state_dict()

    def check_state_dict(self, state: Any) -> None:
        """Raise ``ValueError`` naming the mismatch if ``state`` cannot be loaded into this engine."""
        self._checkpoint.check_state_dict(state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` of the same rank, world size, topology and layout (checked
        before anything changes). Local."""
        with current(self._buckets, write=True):
            self._checkpoint.load_state_dict(state)

    def resume_state(self, states: Sequence[Any]) -> dict[str, Any] | None:
        """What this rank loads from a checkpoint's engine entries (every saved rank's, in order): None
        at the saved world size and topology, else the average every rank starts from
        (:meth:`~.checkpointing.EngineCheckpoint.resume_state`). Local."""
        return self._checkpoint.resume_state(states)

    def __repr__(self) -> str:
        return (
            f"GossipEngine(topology={self.topology.name!r}, rank={self.rank}, "
            f"world_size={self.world_size}, buckets={len(self._buckets)}, step={self.step_count})"
        )

r"""The engine both front-ends drive: :class:`GossipEngine`.

It owns everything decentralized training needs besides the local update: cross-rank agreement, the
flat buckets, the process groups, the step protocol (:meth:`GossipEngine.step` for a whole model,
:meth:`GossipEngine.step_bucket` for one bucket inside backward), exact global averaging with its
snapshot (:mod:`~decent_optim_wrapper.engine.state.averaging`), and its part of a checkpoint
(:mod:`~decent_optim_wrapper.engine.checkpointing`). The architecture page of the docs shows a step's
data flow.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import fields
from typing import TypeVar, Unpack

import torch
import torch.distributed as dist
from loguru import logger
from torch.utils.hooks import RemovableHandle

from decent_optim_wrapper.engine.checkpointing import EngineCheckpoint
from decent_optim_wrapper.engine.config import GossipConfig, GossipOptions, Placement
from decent_optim_wrapper.engine.exchange.buckets import Bucket, build_buckets, check_named_params, current
from decent_optim_wrapper.engine.exchange.guard import GuardEvent, GuardLog
from decent_optim_wrapper.engine.exchange.staging import HostStaging
from decent_optim_wrapper.engine.fleet.admission import current_job
from decent_optim_wrapper.engine.fleet.comm import agree, run_token
from decent_optim_wrapper.engine.fleet.growth import Growth
from decent_optim_wrapper.engine.fleet.membership import Membership, connect_store
from decent_optim_wrapper.engine.fleet.refusals import REFUSALS
from decent_optim_wrapper.engine.fleet.world import resolve_gossip_world
from decent_optim_wrapper.engine.layout import (
    EngineParts,
    NamedParams,
    build_parts,
    join_signature,
    signatures,
)
from decent_optim_wrapper.engine.option_docs import document_options
from decent_optim_wrapper.engine.options import (
    DEFAULT_TIMEOUT,
    LocalLayout,
    TopologySpec,
    check_buckets_agree,
    check_layouts_agree,
    check_mixing_factor,
)
from decent_optim_wrapper.engine.recovery import MemberChanges
from decent_optim_wrapper.engine.rules.local_steps import LowCommunicationFacts
from decent_optim_wrapper.engine.state.averaging import GlobalAverage, floating_buffers
from decent_optim_wrapper.engine.state.checkpoint import STATE_VERSION
from decent_optim_wrapper.engine.survival import PeerFailureHook, Survival
from decent_optim_wrapper.engine.wire.compression import GossipCompression
from decent_optim_wrapper.topo import Topology

__all__ = ["DEFAULT_TIMEOUT", "STATE_VERSION", "GossipEngine", "PeerFailureHook", "TopologySpec"]

_T = TypeVar("_T")


@document_options
class GossipEngine(MemberChanges, EngineCheckpoint, LowCommunicationFacts):
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
        given = config
        try:
            config = GossipConfig.merge(given, options)
            refused: BaseException | None = None
        except (TypeError, ValueError) as error:
            if not dist.is_initialized():
                raise
            # Refused on this rank only, perhaps: the agreement below raises it here and names it on the
            # others, rather than leaving them waiting. The world is the one the options name, if any.
            config, refused = None, error
        placement = _placement(config if config is not None else given, options)
        world = resolve_gossip_world(
            placement.rank,
            placement.world_size,
            placement.local_world_size,
            placement.device_mesh,
            placement.process_group,
        )
        parts: list[EngineParts] = []

        def local_layout() -> LocalLayout:
            if refused is not None:
                raise refused
            assert config is not None
            parts.append(
                build_parts(
                    named_params,
                    world,
                    config,
                    params_as_views=params_as_views,
                    reverse_buckets=reverse_buckets,
                )
            )
            return parts[0].layout

        # Every rank of the job reaches this gather even if its own input is bad (an error everywhere
        # rather than a hang); layouts are compared, per gossip world, before anything is broadcast.
        reports = agree(f"Building {context}", local_layout)
        check_layouts_agree(reports, world.ranks)
        assert config is not None
        self._config = config
        transport, elasticity = config.transport, config.elasticity
        timeout = transport.timeout
        self._topology_spec = config.topology
        self._as_views = params_as_views
        self._mixing_factor = 1.0
        self._world = world
        self._bucket_cap_bytes = transport.bucket_cap_bytes
        self._timeout = timeout
        built = parts[0]
        self._topology, self._buckets, self._shards = built.topology, built.buckets, built.shards
        self._local, self._compression, self._second_moment = (
            built.local,
            built.compression,
            built.second_moment,
        )
        self._join_signature = join_signature(built.layout)
        self._staging = HostStaging(timeout) if built.layout.host_staging else None
        self._clipped = built.layout.clipped_gossip
        self._layouts = list(dict.fromkeys(r.groups for r in reports))  # every gossip world's groups
        self._averaging = GlobalAverage(self._buckets, self._shards)

        self._survival: Survival | None = None
        self._growth = Growth(enabled=elasticity.survives)
        if elasticity.survives:
            # A token every rank shares names this run's keys in the store (reruns never collide).
            run = run_token()
            job = current_job()
            store = elasticity.store if elasticity.store is not None or job is None else job.store
            membership = Membership.of_world(connect_store(store, timeout), run, world, timeout)
            self._survival = Survival(membership, timeout)
        self._updated = False  # whether the current step has run a local update (it cannot donate then)
        self._tracking_requested = config.rounds.gradient_tracking
        self._step, self._in_step = 0, False
        self._launch_from = 0  # after a change of the world: the step whose rounds all launch first
        # guarded mixing's switch and events, kept across changes of the world
        self._guard = GuardLog(world.rank, enabled=config.robustness.nonfinite_guard)
        self._heal_hooks: list[Callable[[list[torch.Tensor]], None]] = []
        self._wire(broadcast=True)
        logger.debug("rank {}/{}: {}", world.rank, world.world_size, self._topology)

    # -- facts -----------------------------------------------------------------------------------
    @property
    def config(self) -> GossipConfig:
        """The options this engine was built with (frozen)."""
        return self._config

    @property
    def gossip_ranks(self) -> tuple[int, ...]:
        """The global ranks of the gossip world, in its rank order."""
        return self._world.ranks

    @property
    def topology(self) -> Topology:
        return self._topology

    @property
    def host_staging(self) -> bool:
        """Whether gossip rounds travel through host buffers (:mod:`~.exchange.staging`)."""
        return self._staging is not None

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
        rounds = 2 if self._tracker is not None else 1  # the trackers travel like the parameters
        return rounds * self._gossip.bytes_sent_per_step()

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
        return self._tracking_requested

    @property
    def gradient_tracking_active(self) -> bool:
        """Whether the local update steps with the tracked gradient (requested, and world size > 1)."""
        return self._tracker is not None

    @property
    def buckets(self) -> list[Bucket]:
        """The buckets, in order (a new list; the buckets themselves are live)."""
        return list(self._buckets)

    @property
    def step_count(self) -> int:
        """Completed steps; step ``t`` gossips in phase ``t % period``."""
        return self._step

    @property
    def mixing_factor(self) -> float:
        """``a`` in ``x <- (1 - a) x + a sum_j W_ij x_j``; 1 (full mixing) unless set."""
        return self._mixing_factor

    @mixing_factor.setter
    def mixing_factor(self, factor: float) -> None:
        self._mixing_factor = check_mixing_factor(factor)

    # -- one step --------------------------------------------------------------------------------
    # The protocol of a step, in one place for both front-ends: per bucket, mix the round launched at
    # the previous step, track the gradient (when on), run the caller's local update, launch this
    # step's round. A rank whose gradients hold inf/NaN skips its local update and leaves its
    # trackers alone, but still mixes and launches, so no peer waits for it. A round that fails
    # raises from mix (GossipError) and is dropped: it is never mixed or saved.
    def step(self, local_update: Callable[[], _T], *, found_inf: torch.Tensor | None = None) -> _T:
        """One step of the whole model: :meth:`begin_step`, every bucket's update, :meth:`end_step`.

        Mixes every bucket, tracks every bucket's gradients (with gradient tracking, unless
        ``found_inf`` holds a nonzero value: GradScaler found inf/NaN), runs ``local_update()``
        once (it decides itself whether to skip on ``found_inf``), and launches every bucket.
        ``found_inf`` is read on the host only with gradient tracking. Returns what
        ``local_update`` returns.
        """
        self.begin_step()
        buckets = range(len(self._buckets))
        for bucket in buckets:
            self._mix(bucket)
        if self._tracker is not None and (found_inf is None or not bool(found_inf.item())):
            for bucket in buckets:
                self._tracker.track(bucket)
        self._updated = True
        result = local_update()
        for bucket in buckets:
            self._launch(bucket)
        self.end_step()
        return result

    @torch.no_grad()
    def step_bucket(
        self, bucket: int, local_update: Callable[[], object], *, skip_local_update: bool = False
    ) -> None:
        """One bucket's update inside a step: mix its round, track, ``local_update()``, launch.

        With ``skip_local_update`` (inf/NaN gradients on this rank) only the gossip happens. A
        module front-end calls this per bucket between :meth:`begin_step` and :meth:`end_step`, in
        the same bucket order on every rank.
        """
        self._mix(bucket)
        self._updated = True  # the front-end's per-bucket state (schedulers) moves on even when skipping
        if not skip_local_update:
            if self._tracker is not None:
                self._tracker.track(bucket)
            local_update()
        self._launch(bucket)

    def begin_step(self) -> None:
        """Start a step: check the buckets, drop a global average's snapshot, admit waiting joiners;
        with low-communication gossip the first step sets the anchors to the parameters."""
        self.check_buckets()
        self._averaging.snapshot = None
        if self._survival is not None and self._survival.joins_checked_at(self._step):
            # Workers apply to join: admit them at this step boundary (the others follow from their waits).
            self._survive(self._survival.raise_if_joins_due, retry=False)
        self._in_step = True
        if self._local is not None and self._step == 0:
            self._local.reset_anchors()

    @torch.no_grad()
    def _mix(self, bucket: int) -> None:
        """Finish bucket ``bucket``'s round launched at the previous step and mix it in."""
        self._survive(lambda: self._mix_rounds(bucket))

    def _mix_rounds(self, bucket: int) -> None:
        if self._tracker is not None:  # its rounds outlive a global average: mixed on their own
            self._tracker.mix(bucket, self._mixing_factor)
        if self._gossip.pending(bucket) is not None:
            with current([self._buckets[bucket]], write=True):
                healed = self._gossip.mix(bucket, self._mixing_factor)
            if healed:
                self._bucket_healed(bucket)

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

    def on_bucket_healed(self, reset: Callable[[list[torch.Tensor]], None]) -> None:
        """For front-ends: ``reset(params)`` is called with a bucket's parameters when the bucket healed
        from its peers, to drop the optimizer state that stepped them (:func:`~.guard.drop_state`)."""
        self._heal_hooks.append(reset)

    def _bucket_healed(self, bucket: int) -> None:
        """A bucket took its peers' values (its own were not finite): this step's gradients of it were
        computed at those values, so they are dropped (the local update leaves the bucket alone), and
        the front-end drops the optimizer state that stepped it."""
        params = list(self._buckets[bucket].params)
        for param in params:
            param.grad = None
        for reset in self._heal_hooks:
            reset(params)

    @torch.no_grad()
    def _launch(self, bucket: int) -> None:
        """Start bucket ``bucket``'s gossip for the current step, non-blocking. With low-communication
        gossip: fold in a round that is due; at a round's end, the outer step and the anchors' round."""
        local = self._local
        if local is not None:
            self._survive(lambda: local.fold_due(bucket, self._step, self._mixing_factor))
            # A failure inside end_round comes from its last part (the fold without delay), so it is
            # not run again: recovery settles that round.
            self._survive(
                lambda: local.end_round(bucket, self._step, self._mixing_factor, self._launch_from),
                retry=False,
            )
            return
        if self._step < self._launch_from:  # after a lost peer, rounds restart in step
            return
        with current([self._buckets[bucket]], write=False):
            self._gossip.launch(bucket, self._step)
        if self._tracker is not None:
            self._tracker.launch(bucket, self._step)

    def wait_all(self) -> None:
        """Wait for every round in flight without mixing it (GossipError if a peer does not answer)."""

        def wait() -> None:
            for bucket in range(len(self._buckets)):
                self._gossip.wait(bucket)
                if self._tracker is not None:
                    self._tracker.wait(bucket)
            if self._local is not None:
                self._local.wait_all()

        self._survive(wait)

    def end_step(self) -> None:
        """Finish a step: the next one gossips in the next phase."""
        self._step += 1
        self._in_step = self._updated = False

    def check_buckets(self) -> None:
        """Raise if a parameter no longer lives in its bucket (e.g. ``model.to()`` after wrapping)."""
        for bucket in self._buckets:
            bucket.check_views()

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

        with self._unbroken():
            check_buckets_agree(agree(context, local_layout))
            self._bind_and_broadcast(built)
        known_buckets = len(self._buckets)
        self._buckets.extend(built)
        self._gossip.add_tensors([b.data for b in built])
        self._gossip.start_from_common_point(range(known_buckets, len(self._buckets)))  # just broadcast
        if self._local is not None:
            self._local.add_buckets(built)
        if self._tracker is not None:
            self._tracker.add_buckets(built)
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
            distance = self._averaging.average(
                lambda: (self._world_reduce, self._gossip),  # new ones after a change of members
                self._local,
                step=self._step,
                may_revert=may_revert,
                extra=extra,
                return_distance=return_distance,
                survive=self._survive,
            )
        self._collective_done()
        return distance

    def revert_global_avg(self) -> None:
        """Restore the replica saved by :meth:`global_avg` bit for bit (local; RuntimeError if none)."""
        self._averaging.revert(self._gossip, self._local)

    def consensus_distance(self) -> float:
        """Root-mean-square distance of the replicas to their average, gossip in flight left out.

        .. warning:: This is a collective: all ranks must call it.
        """
        self.check_buckets()
        with self._averaging.whole_world():
            distance = self._averaging.distance(lambda: self._world_reduce, self._survive)
        self._collective_done()
        return distance

    def _collective_done(self) -> None:
        """Count a completed collective of the whole world (members announce changes only once every
        member is out of it: :meth:`~.fleet.membership.Membership.try_announce`)."""
        if self._survival is not None:
            self._survival.membership.collective_done()

    def __repr__(self) -> str:
        return (
            f"GossipEngine(topology={self._topology.name!r}, rank={self.rank}, "
            f"world_size={self.world_size}, buckets={len(self._buckets)}, step={self._step})"
        )


def _placement(config: GossipConfig | None, options: GossipOptions) -> Placement:
    """Where this rank gossips: the config's, or (when the options were refused) what they name of it."""
    if config is not None:
        return config.placement
    names = {f.name for f in fields(Placement)}
    return Placement(**{name: value for name, value in options.items() if name in names})  # type: ignore[arg-type]

"""The engine's side of a change of members: wiring its communication over the current members, and
rewiring it when a peer is lost or a worker joins (``on_peer_failure="continue"``).

:class:`MemberChanges` is a mixin of :class:`~decent_optim_wrapper.engine.GossipEngine`: the engine
coordinates a step, this part coordinates what a change of the world does to it. On a lost peer the
survivors agree on the new world (:mod:`~.survival`, :mod:`~.fleet.membership`), settle the rounds in
flight, retire the old process groups and build new ones, gossip and trackers over the new topology;
a joiner (:mod:`~.fleet.growth`) is wired the same way once admitted, and loads its donor's replica.
Everything here runs inside a collective the engine started, so its callers are collectives too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from decent_optim_wrapper.engine.exchange.buckets import Bucket, current
from decent_optim_wrapper.engine.exchange.clipping import ClippedGossip
from decent_optim_wrapper.engine.exchange.gossip import Gossip
from decent_optim_wrapper.engine.exchange.guard import GuardLog
from decent_optim_wrapper.engine.exchange.staging import HostStaging
from decent_optim_wrapper.engine.fleet.admission import current_job
from decent_optim_wrapper.engine.fleet.comm import ProcessGroups, group_layout
from decent_optim_wrapper.engine.fleet.growth import Growth
from decent_optim_wrapper.engine.fleet.membership import ChannelReport, Decision, Membership, PeerLost, Phase
from decent_optim_wrapper.engine.fleet.world import GossipWorld
from decent_optim_wrapper.engine.options import TopologySpec
from decent_optim_wrapper.engine.rules.local_steps import LocalSteps
from decent_optim_wrapper.engine.rules.tracking import GradientTracker
from decent_optim_wrapper.engine.state.averaging import GlobalAverage, WorldReduce
from decent_optim_wrapper.engine.survival import Survival, settle_rounds, survivors_topology
from decent_optim_wrapper.engine.wire.compression import CompressionPlan, GossipCompression
from decent_optim_wrapper.topo import Topology

__all__ = ["MemberChanges"]

_T = TypeVar("_T")


class MemberChanges:
    """Wiring over the current members and what a change of members does to the engine (a mixin of the
    engine, which sets the attributes below)."""

    _world: GossipWorld
    _layouts: list[Any]
    _topology: Topology
    _topology_spec: TopologySpec
    _timeout: timedelta
    _compression: GossipCompression | None
    _buckets: list[Bucket]
    _local: LocalSteps | None
    _tracking_requested: bool
    _survival: Survival | None
    _growth: Growth
    _averaging: GlobalAverage
    _join_signature: tuple[tuple[str, object], ...]
    _mixing_factor: float
    _step: int
    _in_step: bool
    _updated: bool
    _launch_from: int
    _process_groups: ProcessGroups
    _world_reduce: WorldReduce
    _gossip: Gossip
    _tracker: GradientTracker | None
    _staging: HostStaging | None
    _guard: GuardLog
    _clipped: ClippedGossip | None
    _bucket_healed: Callable[[int], None]

    @property
    def rank(self) -> int:
        """This process's rank in the gossip world."""
        return self._world.rank

    @property
    def world_size(self) -> int:
        """How many ranks gossip together (the job's size, or that of ``device_mesh``/``process_group``)."""
        return self._world.world_size

    @property
    def local_world_size(self) -> int:
        """Ranks per node along the gossip world."""
        return self._world.local_world_size

    # the engine's own: a joiner loads its donor's replica, a donor saves its own
    state_dict: Callable[[], dict[str, Any]]
    load_state_dict: Callable[[dict[str, Any]], None]

    def _bind_and_broadcast(self, buckets: list[Bucket]) -> None:
        for bucket in buckets:
            bucket.bind()
        with current(buckets, write=True):
            self.broadcast_([bucket.data for bucket in buckets])

    @torch.no_grad()
    def broadcast_(self, tensors: Sequence[torch.Tensor]) -> None:
        """Overwrite ``tensors`` with the gossip world's rank 0's, in place (e.g. a model's buffers).

        .. warning:: This is a collective over the gossip world: all its ranks must call it.
        """
        if self.world_size > 1:
            for tensor in tensors:
                dist.broadcast(tensor, group=self._process_groups.world, group_src=0)

    def _wire(self, broadcast: bool = False) -> None:
        """Process groups, gossip and trackers for the current rank, world size and topology: built once,
        and again whenever the world changes (fresh rounds, references and trackers)."""
        waiter = None if self._survival is None else self._survival.membership.wait
        separate = self._staging is not None  # staged gossip launches from a thread of its own
        self._process_groups = ProcessGroups(self._world, self._layouts, self._group_timeout(), separate)
        world = WorldReduce(self._process_groups.world, self.world_size, self.rank, self._timeout, waiter)
        self._world_reduce = world
        if broadcast:
            self._bind_and_broadcast(self._buckets)
        numbers = [b.spec.number for b in self._buckets]  # random draws follow a bucket, not its position
        plan = (
            None if self._compression is None else CompressionPlan(self._topology, self._compression, numbers)
        )
        tensors = [b.data for b in self._buckets]
        wiring = (self._topology, self.rank, self._process_groups, self._timeout, plan)
        self._guard.rank = self.rank
        self._gossip = Gossip(tensors, *wiring, waiter, self._staging, self._guard, clipped=self._clipped)
        if broadcast:
            self._gossip.start_from_common_point()  # compressed groups meet first without an exact round
        if self._local is not None:
            self._local.connect(
                *wiring,
                waiter,
                reset=broadcast,
                staging=self._staging,
                guard=self._guard,
                on_healed=self._bucket_healed,
                clipped=self._clipped,
            )
        self._tracker: GradientTracker | None = None
        if self._tracking_requested and self.world_size > 1:
            self._tracker = GradientTracker(
                self._buckets, *wiring, waiter, self._staging, self._guard, clipped=self._clipped
            )

    def _group_timeout(self) -> timedelta:
        if self._survival is None:
            return self._timeout
        # The engine's own wait decides when a peer is lost; gloo must not time a round out first,
        # so that a round every member launched completes (see membership.Decision.finishes).
        return 3 * self._timeout

    # -- surviving a lost peer (on_peer_failure="continue") ------------------------------------------------
    @property
    def on_peer_failure(self) -> str:
        """``"raise"`` or ``"continue"``."""
        return "raise" if self._survival is None else "continue"

    @property
    def survival(self) -> Survival | None:
        """The lost peers survived and their hooks (:mod:`~.survival`); None with ``"raise"``."""
        return self._survival

    # -- growing the world (init_elastic, on_peer_failure="continue") -----------------------------------
    def open_to_joiners(
        self,
        save: Callable[[], dict[str, Any]],
        load: Callable[[dict[str, Any]], None],
        signature: tuple[tuple[str, object], ...] = (),
    ) -> None:
        """Let workers join (in a job of :func:`~decent_optim_wrapper.init_elastic`); on a joiner, join.

        Front-ends call this last in their constructor: ``save()``/``load(state)`` give and take their
        part of a replica, ``signature`` what a joiner must share besides the engine's layout. The
        protocol: :mod:`~.admission`; the transfer and the mean: :mod:`~.growth`.
        """
        job = current_job()
        if job is None:
            return

        def wire(membership: Membership) -> None:  # a joiner's world, once admitted
            self._survival = Survival(membership, self._timeout)
            self._rewire(None, [])

        def load_replica(state: dict[str, Any], resume_step: int) -> None:
            self.load_state_dict({**state, "rank": self.rank})
            self._restart_rounds(resume_step)

        membership = None if self._survival is None else self._survival.membership
        signature = (*self._join_signature, *signature)
        self._growth.open(job, membership, signature, self._timeout, (save, load), (wire, load_replica))

    @property
    def growth(self) -> Growth:
        """Joins seen by this rank, their hooks, and what joiners receive (:mod:`~.growth`)."""
        return self._growth

    def _survive(self, action: Callable[[], _T], retry: bool = True) -> _T | None:
        """Run ``action``; on a lost peer (``"continue"``) recover, and run it again if ``retry``."""
        while True:
            try:
                return action() if self._survival is None else self._survival.attempt(action)
            except PeerLost as lost:
                if self._survival is None:
                    raise
                self._recover(lost)
                if not retry:
                    return None

    @contextlib.contextmanager
    def _unbroken(self) -> Iterator[None]:
        """Run a collective of the whole world that cannot be redone over new groups (``add_param_group``):
        a change of members announced before this rank entered is followed first, and no member
        announces one while a member is inside (:meth:`~.fleet.membership.Membership.enter_unbroken`)."""
        if self._survival is None:
            yield
            return
        membership = self._survival.membership
        with self._averaging.whole_world():  # a change followed here defers its applicants
            self._survive(membership.enter_unbroken)
        try:
            yield
        finally:
            membership.leave_unbroken()

    @torch.no_grad()
    def _recover(self, cause: BaseException) -> None:
        """Agree with the others on the new world, settle the rounds in flight, and rewire over it."""
        assert self._survival is not None

        def reports() -> list[ChannelReport]:  # the rounds this rank has in flight
            return self._gossip.reports("params") + ([] if self._local is None else self._local.reports())

        phase: Phase = "collective" if self._averaging.busy else "updating" if self._updated else "idle"
        while True:
            try:
                self._survival.recover(
                    cause,
                    step=self._step,
                    position=self._position(),
                    rank=self.rank,
                    reports=reports,
                    settle=self._settle_rounds,
                    rewire=self._rewire,
                    phase=phase,
                    admitted=self._admitted,
                )
                return
            except PeerLost as again:  # a transfer to a joiner met a lost peer in turn
                cause = again

    def _position(self) -> int:
        """The first step whose rounds this rank can still launch (paced: the first round)."""
        step = self._step + 1 if self._in_step else self._step
        return step if self._local is None else self._local.position(step)

    def _restart_rounds(self, launch_from: int) -> None:
        self._launch_from = launch_from
        if self._local is not None:
            self._local.restart(launch_from)

    def _admitted(self, decision: Decision, previous_rank: int) -> None:
        assert self._survival is not None
        membership, step = self._survival.membership, self._step
        self._growth.admitted(decision, membership, previous_rank, step, self.state_dict, self._timeout)

    def _settle_rounds(self, decision: Decision) -> None:
        assert self._survival is not None
        member, factor = self._survival.membership.member, self._mixing_factor
        settle_rounds(decision, member, self._buckets, self._gossip, self._local, factor)
        # The trackers restart over the survivors (their mean would still hold the lost rank's share).
        self._averaging.forget_rounds()
        self._restart_rounds(decision.resume_step)
        if self._staging is not None:  # no staged launch may reach the groups about to be shut down
            self._staging.drain(self._timeout)

    def _rewire(self, decision: Decision | None, before: list[int]) -> None:
        """The topology, process groups and gossip over the new members (the new default group stands;
        ``decision`` None on a joiner)."""
        # Old groups may hold collectives stuck on the lost peer: let them go off this thread.
        self._process_groups.retire(self._group_timeout() + self._timeout)
        spec, name = self._topology_spec, self._topology.name
        self._topology, self._world = survivors_topology(spec, name, decision, before, self.local_world_size)
        self._layouts = [group_layout(self._topology, self._world)]
        self._wire()

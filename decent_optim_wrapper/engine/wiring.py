"""The engine's wiring: its communication over the current members, built once and rebuilt over new ones.

:class:`Wiring` holds what a rank's rounds travel over: the gossip world and its topology, the process
groups (one per group of the schedule and one spanning the world), the reduce of the whole world
(exact global averaging), the parameters' :class:`~.exchange.gossip.Gossip` with its compression plan
and transport (direct or host-staged), the trackers of gradient tracking and the anchors' rounds of
low-communication gossip. :meth:`Wiring.connect` builds all of it over the current world;
:meth:`Wiring.rewire` retires the groups and builds it again over the members a change of the world
left (:mod:`~.member_changes`). Building it is a collective of the whole job.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from decent_optim_wrapper.engine.counters import WaitClock
from decent_optim_wrapper.engine.exchange.buckets import Bucket, current
from decent_optim_wrapper.engine.exchange.gossip import Gossip, GossipWiring, RoundRules
from decent_optim_wrapper.engine.exchange.staging import HostStaging
from decent_optim_wrapper.engine.fleet.comm import ProcessGroups, group_layout, wait_all
from decent_optim_wrapper.engine.fleet.membership import Decision, Membership
from decent_optim_wrapper.engine.fleet.world import GossipWorld
from decent_optim_wrapper.engine.options import TopologySpec
from decent_optim_wrapper.engine.rules.local_steps import LocalSteps
from decent_optim_wrapper.engine.rules.tracking import GradientTracker
from decent_optim_wrapper.engine.state.averaging import WorldReduce
from decent_optim_wrapper.engine.survival import survivors_topology
from decent_optim_wrapper.engine.wire.compression import CompressionPlan, GossipCompression
from decent_optim_wrapper.topo import Topology

__all__ = ["Wiring"]


class Wiring:
    """One rank's communication over the current members (the engine holds one).

    Args:
        world: the gossip world at construction.
        layouts: every gossip world's groups (the same list on every rank of the job).
        topology: the topology over ``world``; ``spec`` rebuilds it over new members.
        buckets: the engine's buckets (the live list: buckets added later are wired at the next change).
        local: low-communication gossip's state, or None; its anchors' rounds are wired here too.
        timeout: the rounds' wait; the process groups' own is 3x longer with survival.
        compression: the gossip compression, or None (exact rounds).
        staging: host staging of the rounds, or None (direct).
        rules: how every round is mixed in (the guard's log, clipped gossip).
        tracking: whether gradient tracking was asked for (trackers exist at world size > 1).
        on_healed: told which bucket healed from its peers.
        wait_clock: times the waits of the rounds (gossip, trackers, anchors), not those of a global
            average.
    """

    def __init__(
        self,
        world: GossipWorld,
        layouts: list[Any],
        topology: Topology,
        spec: TopologySpec,
        *,
        buckets: list[Bucket],
        local: LocalSteps | None,
        timeout: timedelta,
        compression: GossipCompression | None,
        staging: HostStaging | None,
        rules: RoundRules,
        tracking: bool,
        on_healed: Callable[[int], None],
        wait_clock: WaitClock,
    ) -> None:
        self.world, self.topology = world, topology
        self.timeout, self.staging = timeout, staging
        self._layouts, self._spec = layouts, spec
        self._buckets, self._local = buckets, local
        self._compression, self._rules = compression, rules
        self._tracking, self._on_healed = tracking, on_healed
        self._wait_clock = wait_clock
        self._membership: Membership | None = None
        self.process_groups: ProcessGroups
        self.world_reduce: WorldReduce
        self.gossip: Gossip
        self.tracker: GradientTracker | None = None

    @property
    def rank(self) -> int:
        return self.world.rank

    @property
    def world_size(self) -> int:
        return self.world.world_size

    def connect(self, membership: Membership | None, broadcast: bool = False) -> None:
        """Process groups, gossip and trackers for the current rank, world size and topology: built once,
        and again whenever the world changes (fresh rounds, references and trackers). With
        ``broadcast`` the buckets take the world's rank 0's values first (construction).
        ``membership`` is survival's view of the job (its failure-aware wait), or None."""
        self._membership = membership
        waiter = None if membership is None else membership.wait
        separate = self.staging is not None  # staged gossip launches from a thread of its own
        self.process_groups = ProcessGroups(self.world, self._layouts, self.group_timeout, separate)
        self.world_reduce = WorldReduce(
            self.process_groups.world, self.world_size, self.rank, self.timeout, waiter
        )
        timed = self._wait_clock.timed(wait_all if waiter is None else waiter)  # the rounds' waits only
        if broadcast:
            self.bind_and_broadcast(self._buckets)
        numbers = [b.spec.number for b in self._buckets]  # random draws follow a bucket, not its position
        compression = self._compression
        plan = None if compression is None else CompressionPlan(self.topology, compression, numbers)
        tensors = [b.data for b in self._buckets]
        self._rules.guard.rank = self.rank
        wired = GossipWiring(
            self.topology,
            self.rank,
            self.process_groups,
            self.timeout,
            plan,
            timed,
            self.staging,
            self._rules,
        )
        self.gossip = wired.gossip(tensors)
        if broadcast:
            self.gossip.start_from_common_point()  # compressed groups meet first without an exact round
        if self._local is not None:
            self._local.connect(wired, reset=broadcast, on_healed=self._on_healed)
        self.tracker = None
        if self._tracking and self.world_size > 1:
            self.tracker = GradientTracker(self._buckets, wired)

    @property
    def group_timeout(self) -> timedelta:
        """How long the process groups wait, as long as the rounds or 3x with survival.

        With survival the engine's own wait decides when a peer is lost, and gloo must not time a round
        out first, so that a round every member launched completes
        (:meth:`~.fleet.membership.Decision.finishes`)."""
        return self.timeout if self._membership is None else 3 * self.timeout

    def rewire(self, decision: Decision | None, before: list[int], membership: Membership) -> None:
        """The topology, process groups and gossip over the new members, once the new default group
        stands (``decision`` None on a joiner; ``before``: the members before the change)."""
        # Old groups may hold collectives stuck on the lost peer: let them go off this thread. A joiner
        # gets its membership now, and its groups (built without one) wait as long as a member's.
        self._membership = membership
        self.process_groups.retire(self.group_timeout + self.timeout)
        if self._rules.audit is not None:
            self._rules.audit.forget()  # its samples and verdicts name the old world's ranks
        name, per_node = self.topology.name, self.world.local_world_size
        self.topology, self.world = survivors_topology(self._spec, name, decision, before, per_node)
        self._layouts = [group_layout(self.topology, self.world)]
        learnt = self.gossip.mix_state_across_change()
        self.connect(membership)
        self.gossip.load_mix_state(learnt)

    def bind_and_broadcast(self, buckets: list[Bucket]) -> None:
        """Bind ``buckets``' parameters as views and give them the world's rank 0's values."""
        for bucket in buckets:
            bucket.bind()
        with current(buckets, write=True):
            self.broadcast_([bucket.data for bucket in buckets])

    @torch.no_grad()
    def broadcast_(self, tensors: Sequence[torch.Tensor]) -> None:
        """Overwrite ``tensors`` with the gossip world's rank 0's, in place (a collective of the world)."""
        if self.world_size > 1:
            for tensor in tensors:
                dist.broadcast(tensor, group=self.process_groups.world, group_src=0)

"""Going on without a lost peer (``on_peer_failure="continue"``): the recovery loop of one rank, and
what the training loop sees of it.

:class:`Survival` runs the survivors' side of :mod:`~.membership`'s protocol for an engine: agree on
who is gone, have the engine settle its rounds in flight, re-form the process group, have the engine
rewire over it, and try again from the next generation if a survivor fails to join. Then it records
the :class:`~decent_optim_wrapper.PeerFailure`, logs the warning every survivor logs, and calls the hooks.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TypeVar, cast

import torch
import torch.distributed as dist
from loguru import logger
from torch.distributed import Store  # type: ignore[attr-defined]
from torch.utils.hooks import RemovableHandle

from decent_optim_wrapper.engine.errors import PeerFailureError
from decent_optim_wrapper.engine.exchange.buckets import Bucket
from decent_optim_wrapper.engine.exchange.gossip import Gossip
from decent_optim_wrapper.engine.fleet.comm import run_token
from decent_optim_wrapper.engine.fleet.jobs import current_job
from decent_optim_wrapper.engine.fleet.membership import (
    ChannelReport,
    Decision,
    Membership,
    MembershipChange,
    PeerFailure,
    PeerLost,
    Phase,
    Report,
    connect_store,
    nodes_of,
)
from decent_optim_wrapper.engine.fleet.status import StatusBoard
from decent_optim_wrapper.engine.fleet.world import GossipWorld
from decent_optim_wrapper.engine.options import TopologySpec, resolve_topology
from decent_optim_wrapper.engine.rules.local_steps import LocalSteps
from decent_optim_wrapper.topo import Topology

_T = TypeVar("_T")

__all__ = ["PeerFailureHook", "Survival", "settle_rounds", "surviving_local_world_size", "survivors_topology"]

#: Called on every survivor after a lost peer, with what happened.
PeerFailureHook = Callable[[PeerFailure], None]

#: In a job of nodes, the step boundaries at which a node looks for applicants (every this many steps):
#: its ranks must decide together, which costs an exchange over the node (see :meth:`Survival.attempt`).
NODE_JOIN_CHECK_EVERY = 8


def surviving_local_world_size(kept: set[int], world_size: int, local_world_size: int) -> int:
    """Ranks per node after a loss: unchanged if only whole nodes were lost (``kept``: the old ranks
    that survive), else 1, since renumbered ranks no longer share nodes."""
    whole_nodes = all(
        len({r for r in kept if r // local_world_size == node}) in (0, local_world_size)
        for node in range(world_size // local_world_size)
    )
    return local_world_size if whole_nodes and len(kept) % local_world_size == 0 else 1


def settle_rounds(
    decision: Decision,
    member: int,
    buckets: Sequence[Bucket],
    gossip: Gossip,
    local: LocalSteps | None,
    mixing_factor: float,
) -> None:
    """Mix or drop every round in flight as ``decision`` says, the same on every member of its group.

    ``member`` is this rank's identity in the membership (its reports list its rounds in flight).
    """
    mine = decision.reports[decision.members.index(member)]
    finish = {(c.kind, c.bucket): decision.finishes(c, mine.shard) for c in mine.channels}
    for bucket in range(len(buckets)):
        gossip.resolve(bucket, finish.get(("params", bucket), False), mixing_factor)
        if local is not None:
            local.resolve(bucket, finish.get(("anchors", bucket), False), mixing_factor)


def survivors_topology(
    spec: TopologySpec, name: str, decision: Decision | None, before: list[int], local_world_size: int
) -> tuple[Topology, GossipWorld]:
    """The topology and gossip world over the new members, once the new default group stands.

    ``before`` lists the members before the change; ``name`` is the topology's, for the error raised
    when it does not exist at the new world size. With joiners (or on a joiner: ``decision`` None)
    every rank counts as a node of its own. In a job of nodes the world is this rank's shard world
    over the surviving nodes (re-formed by the membership), one member per node.
    """
    job = current_job()
    replicas = None if job is None else job.replicas
    if replicas is not None:
        rank, world_size = replicas.node, replicas.nodes
    else:
        rank, world_size = dist.get_rank(), dist.get_world_size()
    if decision is None or decision.admission.joiners or replicas is not None:
        per_node = 1
    else:
        kept = {before.index(m) for m in decision.members}
        per_node = surviving_local_world_size(kept, len(before), local_world_size)
    try:
        topology = resolve_topology(spec, world_size, per_node)
    except (ValueError, TypeError) as err:
        raise PeerFailureError(
            f"rank {rank}: the topology {name!r} cannot be rebuilt for the {world_size} survivors ({err}); "
            "use a topology that exists at every world size."
        ) from err
    return topology, GossipWorld(tuple(range(world_size)), rank, per_node, replicas is not None, replicas)


class Survival:
    """The recovery loop of one rank, its record of failures and its hooks.

    Args:
        membership: this rank's view of the job (heartbeat, failure-aware wait, the agreement).
        timeout: the default process group's timeout after a re-form.
    """

    def __init__(self, membership: Membership, timeout: timedelta) -> None:
        self.membership = membership
        self._timeout = timeout
        self._failures: list[PeerFailure] = []
        self._node_checks = 0  # flags exchanged with the node's other ranks (a job of nodes)
        #: Seconds this rank spent in each recovery or admission (agreement, re-form, transfers).
        self.pauses: list[float] = []
        self._hooks: OrderedDict[int, PeerFailureHook] = OrderedDict()

    @classmethod
    def of_job(
        cls, store: Store | None, world: GossipWorld, timeout: timedelta, status: StatusBoard
    ) -> Survival:
        """This rank's survival in the job: its membership on ``store`` (the job's of
        :func:`~decent_optim_wrapper.init_elastic` when None), named by a token every rank shares so
        that reruns never collide; a joiner publishes ``status`` only once admitted."""
        job = current_job()
        store = store if store is not None or job is None else job.store
        published = None if job is not None and job.joining else status
        membership = Membership.of_world(
            connect_store(store, timeout), run_token(), world, timeout, published
        )
        return cls(membership, timeout)

    @property
    def failures(self) -> list[PeerFailure]:
        return list(self._failures)

    def joins_checked_at(self, step: int) -> bool:
        """Whether the step boundary of ``step`` looks for applicants (:meth:`raise_if_joins_due`): when
        one waits (attributes only), or in a job of nodes every :data:`NODE_JOIN_CHECK_EVERY` steps,
        where the ranks of a node must all look, so that they go into the admission together; and at
        the first boundary after a collective of the whole world that deferred applicants, on every
        rank of every node alike (:meth:`~.membership.Membership.admission_due`)."""
        if self.membership.admission_due():
            return True
        if self.membership.shards == 1:
            return self.membership.watch.due()
        return step % NODE_JOIN_CHECK_EVERY == 0

    def raise_if_joins_due(self) -> None:
        """Announce the applicants waiting for a decision, if any and if no member may still be inside a
        collective of the whole world (:meth:`~.membership.Membership.try_announce`), and raise
        :class:`~.membership.MembershipChange` (run it under :meth:`attempt`, so that a node's ranks
        follow each other). Applicants deferred by a collective are due at the first boundary after
        one, on every member: each announces or follows there
        (:meth:`~.membership.Membership.announce_deferred`)."""
        membership = self.membership
        if membership.admission_due():
            if membership.announce_deferred():
                raise MembershipChange("workers deferred by a collective of the whole world apply to join")
            return
        if membership.watch.due() and membership.try_announce():
            raise MembershipChange("workers apply to join")

    def attempt(self, action: Callable[[], _T]) -> _T:
        """``action()``, raising :class:`~.membership.PeerLost` if it met a lost peer; in a job of
        nodes also if another rank of this node did.

        The ranks of a node wait for each other inside FSDP2's collectives, so they must go into a
        recovery together: a rank whose node-mate recovers while it runs on into the next forward
        would wait there for it, and never report. So after each action the node's ranks exchange
        a flag over the node (the default group), with how many such exchanges each has made, so
        that a node-mate's loss is everyone's at the same point of the step, and ranks that got out
        of step (bucket layouts that differ between the shards) are an error, not a hang. A
        node-mate that does not answer within ``timeout`` is lost with its node
        (:class:`~.errors.PeerFailureError` here: a node goes on whole or not at all).
        """
        if self.membership.shards == 1:
            return action()
        lost: PeerLost | None = None
        result: _T | None = None
        try:
            result = action()
        except PeerLost as err:
            lost = err
        self._node_checks += 1
        # 0: nothing met; 1: a lost peer; 2: applicants only.
        flag = 0 if lost is None else 2 if isinstance(lost, MembershipChange) else 1
        mine = torch.tensor([flag, self._node_checks], dtype=torch.int64)
        gathered = torch.empty(2 * self.membership.shards, dtype=torch.int64)
        cause: BaseException | None = None
        try:
            node = self.membership.replicas
            group = None if node is None else node.node_group  # the node's own gloo group
            work = dist.all_gather_into_tensor(gathered, mine, group=group, async_op=True)
            done = work is None or work.wait(self._timeout)
        except (RuntimeError, dist.DistError) as err:
            done, cause = False, err
        if not done:
            raise PeerFailureError(
                f"rank {self.membership.shard} of its node: another rank of this node did not answer "
                f"within {self._timeout} ({cause}); a node goes on whole or not at all, so this one stops. "
                "Restart the node's processes from a checkpoint."
            ) from cause
        flags, counts = gathered[0::2].tolist(), gathered[1::2].tolist()
        if len(set(counts)) > 1:
            raise PeerFailureError(
                f"the ranks of this node are out of step (gossip waits so far: {counts}): their shards "
                "were cut into different numbers of buckets. Pass a bucket_cap_mb that holds each "
                "rank's shards in the same number of buckets (e.g. a larger one)."
            )
        if lost is not None:
            raise lost
        if 1 in flags:
            raise PeerLost("another rank of this node met a lost peer")
        if 2 in flags:
            raise MembershipChange("workers apply to join (seen by another rank of this node)")
        return cast(_T, result)

    def register_hook(self, hook: PeerFailureHook) -> RemovableHandle:
        handle = RemovableHandle(self._hooks)
        self._hooks[handle.id] = hook
        return handle

    def recover(
        self,
        cause: BaseException,
        *,
        step: int,
        position: int,
        rank: int,
        reports: Callable[[], Sequence[ChannelReport]],
        settle: Callable[[Decision], None],
        rewire: Callable[[Decision, list[int]], None],
        phase: Phase = "updating",
        admitted: Callable[[Decision, int], None] | None = None,
    ) -> PeerFailure | None:
        """Agree, ``settle(decision)`` once, re-form the default group and ``rewire(decision, before)``;
        then, if the decision admits joiners, ``admitted(decision, previous_rank)`` (the transfers).

        ``position`` is the first step at which this rank can launch on new groups, ``reports()`` its
        rounds in flight, ``phase`` where it stands (whether it can donate). Returns the failure, or
        None if nobody was lost (a false alarm: a collective outlasted the timeout; or an admission).
        Raises :class:`~.errors.PeerFailureError` if this rank cannot go on.
        """
        started = time.perf_counter()
        membership = self.membership
        before = membership.members
        # Ranks, losses and world sizes count nodes in a job of nodes (each node is a replica).
        nodes_before = nodes_of(before, membership.shards)
        world_before, rank_before = len(nodes_before), rank
        settled = False
        unformed: set[tuple[int, ...]] = set()
        while True:
            report = Report(membership.member, rank, position, tuple(reports()), phase, membership.shard)
            decision = membership.agree(report, cause)
            if not settled:
                settle(decision)
                settled = True
            rank = decision.nodes().index(membership.member // membership.shards)
            try:
                # 3 * timeout, as the joiner's and the gossip groups' (the engine's own waits decide a
                # loss): forming the group on a loaded machine must not be what drops a live worker.
                membership.reform(decision, "gloo", 3 * self._timeout)
                rewire(decision, before)
                break
            except (RuntimeError, dist.DistError) as err:  # a survivor did not join: recover again
                if decision.members in unformed:
                    # The same survivors twice: they reach the store but not each other (a partition).
                    raise PeerFailureError(
                        f"rank {rank}: the survivors {list(decision.members)} (ranks at launch) reach the "
                        f"store but cannot form a process group ({err}); stopping rather than training "
                        "as separate jobs."
                    ) from err
                unformed.add(decision.members)
                membership.failed_to_reform(err)
                cause = err
        if decision.admission.joiners and admitted is not None:
            admitted(decision, rank_before)
        self.pauses.append(time.perf_counter() - started)
        nodes_after = decision.nodes()
        lost = tuple(nodes_before.index(n) for n in nodes_before if n not in nodes_after)
        admission = decision.admission
        if not lost and (admission.joiners or admission.deferred or admission.rejected):
            return None  # an admission (or joiners deferred or refused): nobody is lost
        if not lost:
            logger.warning(
                "rank {}: a collective outlasted the timeout at step {}, but all {} ranks rejoined: nobody "
                "is lost; the process group was re-formed over the same ranks. If this recurs, raise "
                "timeout above the longest stretch a rank spends between optimizer steps.",
                rank,
                step,
                world_before,
            )
            return None
        failure = PeerFailure(
            step=step,
            lost=lost,
            survivors=tuple(nodes_before.index(n) for n in nodes_after if n in nodes_before),
            previous_world_size=world_before,
            world_size=len(nodes_after),
            previous_rank=rank_before,
            rank=rank,
        )
        self._failures.append(failure)
        if membership.status is not None:
            membership.status.event(
                "lost",
                step=step,
                generation=decision.generation + 1,
                members=[m for m in before if m not in decision.members],
                world_size=failure.world_size,
            )
        # Unlike the library's other logs this one is on by default: a lost worker changes the run
        # (the world size, the data seen, what the learning rate means).
        # A worker that applied while the survivors agreed on the loss is admitted in the same change.
        joining = f" and {len(admission.joiners)} joining" if admission.joiners else ""
        logger.warning(
            "lost rank(s) {} of {} at step {}; this rank ({} before) goes on as rank {} of {} "
            "({} survivors{}), gossiping again from position {} (a step; with paced rounds, a round)",
            list(failure.lost),
            world_before,
            step,
            rank_before,
            rank,
            failure.world_size,
            len(failure.survivors),
            joining,
            decision.resume_step,
        )
        for hook in list(self._hooks.values()):
            hook(failure)
        return failure

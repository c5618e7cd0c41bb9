r"""Surviving a dead or silent peer (``on_peer_failure="continue"``): who is still here, agreed through
the job's store, and a fresh process group over the survivors.

The store is the one ``torch.distributed`` already rendezvoused through (torchrun's agent hosts it,
or a launcher does): it outlives any worker, so it is the single place where survivors meet. No
central service of our own and no vote between workers: the first proposal written to the store
is the decision, so every survivor reaches the same set, or raises.

Protocol for generation ``g`` (the current membership), under the key prefix of this run:

1. *Detect.* A rank whose collective fails (a peer closed its connection) or does not complete
   within ``timeout`` marks ``g/lost``. Every rank waiting for a collective polls that mark, so a
   rank blocked on a peer that has gone into recovery follows within ~50 ms instead of timing out,
   and checks it once more when its collectives complete: a rank that gave up on a round its peers
   then completed (it was starved of CPU) pulls them into recovery rather than recovering alone.
   Deadlines count only the time a rank was running: seconds it spent descheduled (an overloaded
   machine) are added back, so a starved rank does not mistake its own absence for a silent peer.
2. *Report.* Each rank in recovery writes its report: its position in the step protocol and, per
   gossip channel, the round it has in flight (launched at which step, in which group, completed
   or not) and the last round it launched.
3. *Decide.* A rank waits until every member has reported, or is dead (its heartbeat, a counter a
   thread of each rank bumps in the store every 0.2 s, stopped), or ``timeout`` has passed; then
   it proposes the reporters with ``compare_set``. The first proposal wins; every rank reads it. A
   rank left out (it reported too late) raises :class:`~.errors.PeerFailureError`. A decision
   that keeps every member was a false alarm (a collective outlasted ``timeout``): the group is
   re-formed all the same, but nothing is recorded as lost.
4. *Reform.* The survivors destroy the default process group and build a new one over the store
   (prefix ``g+1``), ranks renumbered in their old order. A member that fails to join makes
   this a failure of generation ``g+1``: back to 1 with the others.

What happens to the rounds in flight is decided from the reports (:meth:`Decision.finishes`) so
that the members of a group all mix a round or all drop it, and the survivors' mean moves by
nothing but the lost replica's share.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from loguru import logger
from torch.distributed import PrefixStore, Store, TCPStore  # type: ignore[attr-defined]

from decent_optim_wrapper.engine.errors import DecentError, PeerFailureError
from decent_optim_wrapper.engine.fleet.admission import (
    Admission,
    JoinerWatch,
    admit,
    joiner_verdicts,
    ready_key,
    settle_fates,
    write_verdicts,
)
from decent_optim_wrapper.engine.fleet.heartbeats import POLL_S, STALE_AFTER_S, start_heartbeat
from decent_optim_wrapper.engine.fleet.jobs import current_job, process_seal, run_prefix
from decent_optim_wrapper.engine.fleet.refusals import REFUSALS
from decent_optim_wrapper.engine.fleet.replicas import ReplicaWorld
from decent_optim_wrapper.engine.fleet.sealing import ForgedEntryError, Seal
from decent_optim_wrapper.engine.fleet.status import StatusBoard
from decent_optim_wrapper.engine.fleet.world import GossipWorld

__all__ = [
    "ChannelReport",
    "Decision",
    "Membership",
    "PeerFailure",
    "MembershipChange",
    "PeerJoin",
    "PeerLost",
    "Report",
    "connect_store",
]

# Each rank's heartbeat thread bumps its counter every HEARTBEAT_S; a counter standing still for
# STALE_AFTER_S means its rank is dead. A live rank's beat stalls only if its process stops (SIGSTOP, a
# frozen VM) or the machine is starved for seconds; a hung main thread keeps beating, and is instead
# dropped when ``timeout`` passes without its report.
#: A pause between two polls longer than this means the polling process itself was descheduled.
_STARVED_S = 0.5

RoundState = Literal["done", "failed", "running"]
#: Where a rank stands when it reports. "idle" between steps or inside one before its local update
#: (its replica, optimizer state and step count agree: it can donate to a joiner), "updating" past
#: its first local update of the step, "collective" inside a collective of the whole world.
Phase = Literal["idle", "updating", "collective"]


class PeerLost(DecentError):
    """A collective failed or went silent with ``on_peer_failure="continue"``: the engine recovers."""


class MembershipChange(PeerLost):
    """Workers apply to join: the members agree on a new world as after a loss, though nobody failed.

    Announced under its own key (``g/join``) and followed from every wait, a collective of the whole
    world (``global_avg``, ``consensus_distance``) included: its ranks report phase "collective", the
    decision defers the applicants (they would not take part in it), and the collective is redone over
    the re-formed groups of the same members (:meth:`Membership.try_announce` keeps a member from announcing
    while another may still be finishing one it already completed).
    """


@dataclass(frozen=True)
class PeerFailure:
    """One recovery, as the training loop sees it (``front_end.peer_failures``, the hooks).

    Ranks are numbered as before the failure, except ``rank``/``world_size`` (after it).
    """

    step: int  # the step count when the failure was detected
    lost: tuple[int, ...]  # ranks gone
    survivors: tuple[int, ...]  # ranks that continue, in their new order
    previous_world_size: int
    world_size: int
    previous_rank: int
    rank: int


@dataclass(frozen=True)
class PeerJoin:
    """One admission of new workers, as the training loop sees it (``front_end.peer_joins``, the hooks).

    Ranks are numbered in the new world; ``previous_rank`` is -1 on a joiner.
    """

    step: int  # the step count at the admission (a joiner starts there)
    joined: tuple[int, ...]  # the joiners' ranks (the last ranks of the new world)
    donors: tuple[int, ...]  # the rank whose replica each joiner received
    previous_world_size: int
    world_size: int
    previous_rank: int
    rank: int


@dataclass(frozen=True)
class ChannelReport:
    """One gossip channel of a rank at recovery: its round in flight and what it launched."""

    kind: str  # "params", "tracker" or "anchors"
    bucket: int
    pending: int | None  # the step (or anchor round) of the round in flight, if any
    group: tuple[int, ...] | None  # that round's group, ranks before the failure
    state: RoundState | None  # whether that round's collective has completed on this rank
    launched: int | None  # the latest step (or round) this channel launched
    discarded: int | None  # the latest round dropped unmixed (by a global average)


@dataclass(frozen=True)
class Report:
    """What a rank tells the others when it goes into recovery."""

    member: int  # rank at launch: stable across recoveries
    rank: int  # rank in the failed generation
    position: int  # the first step at which it can launch on the new groups (paced rounds: the round)
    channels: tuple[ChannelReport, ...]
    phase: Phase = "updating"
    shard: int = 0  # in a job of nodes (``shards=k``): this rank's index in its node; ``rank`` is the node's


@dataclass(frozen=True)
class Decision:
    """The survivors (their reports, in rank order) and the step from which new rounds start."""

    generation: int
    reports: tuple[Report, ...]
    admission: Admission = field(default_factory=Admission)
    shards: int = 1  # ranks per node in a job of nodes: members then come in whole nodes, node by node

    @property
    def members(self) -> tuple[int, ...]:
        """The new world's members in rank order, those that reported first and admitted joiners last."""
        joiners = tuple(m for j in self.admission.joiners for m in j.members)  # a node's ranks, in order
        return tuple(r.member for r in self.reports) + joiners

    @property
    def ranks(self) -> tuple[int, ...]:
        """The ranks (in the failed generation) of the members that go on."""
        return tuple(r.rank for r in self.reports)

    @property
    def resume_step(self) -> int:
        """Rounds on the new groups start at the furthest position any survivor has reached, so that
        every survivor launches a round of the same step in the same new group (with paced rounds,
        positions and this are round indices: ranks stand at different steps of one round)."""
        return max(r.position for r in self.reports)

    def nodes(self) -> list[int]:
        """The new world's nodes in rank order, by their launch index (its members without ``shards``)."""
        return nodes_of(self.members, self.shards)

    def finishes(self, channel: ChannelReport, shard: int = 0) -> bool:
        """Whether the round ``channel`` has in flight is mixed (else dropped), the same on every member.

        A round whose group is all survivors is mixed if every member launched it and none dropped
        it (it then completes: every member's part is in flight). A round with a lost member is mixed
        only where it has already completed: a pair's survivor received the lost peer's values
        before it died. In groups of three or more, a peer dying inside the all-reduce can leave
        the round completed on some members and not others; that is the one case where members
        differ. In a job of nodes a round belongs to one shard world (``shard``): its group's ranks
        are nodes, and only the reports of that shard speak for them.
        """
        if channel.pending is None or channel.group is None:
            return False
        alive = {r.rank: r for r in self.reports if r.shard == shard}
        if not set(channel.group) <= set(alive):
            return channel.state == "done"
        for rank in channel.group:
            peer = next(
                (c for c in alive[rank].channels if (c.kind, c.bucket) == (channel.kind, channel.bucket)),
                None,
            )
            if peer is None or peer.launched is None or peer.launched < channel.pending:
                return False
            if peer.discarded is not None and peer.discarded >= channel.pending:
                return False
        return True


def nodes_of(members: Sequence[int], shards: int) -> list[int]:
    """The nodes of ``members`` (ranks at launch, node by node), in order: ``member // shards``."""
    return list(dict.fromkeys(m // shards for m in members))


def whole_nodes(reports: Sequence[Report], shards: int) -> tuple[Report, ...]:
    """``reports`` of the nodes all of whose ``shards`` ranks reported, node by node in rank order
    (the others' nodes are lost: a replica goes on whole or not at all)."""
    ordered = sorted(reports, key=lambda r: (r.rank, r.shard))
    count: dict[int, int] = {}
    for report in ordered:
        count[report.member // shards] = count.get(report.member // shards, 0) + 1
    return tuple(r for r in ordered if count[r.member // shards] == shards)


def connect_store(store: Store | None, timeout: timedelta) -> Store:
    """The store survivors meet in: ``store``, or a client of ``MASTER_ADDR:MASTER_PORT``."""
    if store is not None:
        if not isinstance(store, Store):
            raise TypeError(
                f"store must be a torch.distributed.Store (e.g. a TCPStore client) or None, got {store!r}."
            )
        return store
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if host is None or port is None:
        raise ValueError(
            'on_peer_failure="continue" needs the store the job rendezvoused through, but store=None and '
            "MASTER_ADDR/MASTER_PORT are not set; pass store=torch.distributed.TCPStore(host, port, "
            "is_master=False) (hosted by the launcher, outside the workers)."
        )
    return TCPStore(host, int(port), is_master=False, timeout=timeout)


class Membership:
    """This rank's view of who is in the job, the heartbeat, and the failure-aware wait.

    Args:
        store: the store every rank can reach (see the module docstring).
        run: a token all ranks share, unique to this run (keys of other runs never collide).
        rank: this rank at launch.
        world_size: ranks at launch.
        timeout: how long a collective, or a report, may take before its peer counts as lost.
        replicas: in a job of nodes (``init_elastic(..., shards=k)``), this rank's shard world: the
            members are then every rank of the job, kept or lost a node at a time, and a re-form
            builds the shard world's group anew instead of the default group (:mod:`~.replicas`).
        status: the status record its heartbeat publishes (:mod:`~.status`), or None (none: a
            worker that has not joined its job yet).
    """

    def __init__(
        self,
        store: Store,
        run: str,
        rank: int,
        world_size: int,
        timeout: timedelta,
        *,
        members: Sequence[int] | None = None,
        generation: int = 0,
        replicas: ReplicaWorld | None = None,
        seal: Seal | None = None,
        status: StatusBoard | None = None,
    ) -> None:
        self._seal = process_seal() if seal is None else seal  # the job secret's (:mod:`~.sealing`)
        self._replicas = replicas
        self.shards = 1 if replicas is None else replicas.shards
        self._store = store
        self._prefix = run_prefix(run)
        self._run = run
        self._me = rank
        self._members = list(range(world_size)) if members is None else list(members)
        self._generation = generation
        self._timeout = timeout.total_seconds()
        self._recovering = False
        self._stopped = threading.Event()
        #: The members' signature for applicants to match; None until the job opens to joiners.
        self.signature: tuple[tuple[str, object], ...] | None = None
        self.watch = JoinerWatch(self._seal)
        #: Collectives of the whole world this rank completed in the current generation (counted in the
        #: store too, so that an announcer knows when every member is out of its latest one).
        self._collectives = 0
        #: Seconds spent waiting for peers' rounds to complete (their share of a step), all waits.
        self.wait_seconds = 0.0
        self.status = status
        self._place_status()
        beat_key = f"{self._prefix}/beat/{rank}"
        self._store.add(beat_key, 1)
        # The thread holds the store, the watch and the record, not this object, so that it stops once
        # the engine is gone.
        start_heartbeat(store, beat_key, self._prefix, self._stopped, self.watch, status)

    @classmethod
    def of_world(
        cls, store: Store, run: str, world: GossipWorld, timeout: timedelta, status: StatusBoard | None = None
    ) -> Membership:
        """The membership of the job ``world`` belongs to: its ranks, or in a job of nodes every rank
        of every node (rank ``node * shards + shard`` at launch)."""
        replicas = world.replicas
        if replicas is None:
            return cls(store, run, world.rank, world.world_size, timeout, status=status)
        me, size = replicas.node * replicas.shards + replicas.shard, replicas.nodes * replicas.shards
        return cls(store, run, me, size, timeout, replicas=replicas, status=status)

    def _place_status(self) -> None:
        if self.status is not None:
            self.status.placed(self._prefix, self._me, self._generation, self._members, self._seal)

    @property
    def seal(self) -> Seal:
        """Seals this job's store entries and replica digests (:mod:`~.sealing`)."""
        return self._seal

    @property
    def run(self) -> str:
        """The token naming this run's keys in the store."""
        return self._run

    @property
    def shard(self) -> int:
        """This rank's index in its node (0 outside a job of nodes)."""
        return 0 if self._replicas is None else self._replicas.shard

    @property
    def store(self) -> Store:
        return self._store

    @property
    def replicas(self) -> ReplicaWorld | None:
        """This rank's shard world in a job of nodes, as re-formed by the latest change."""
        return self._replicas

    @property
    def member(self) -> int:
        """This rank's rank at launch."""
        return self._me

    @property
    def members(self) -> list[int]:
        """The current members' ranks at launch, in their current rank order (a new list)."""
        return list(self._members)

    @property
    def generation(self) -> int:
        return self._generation

    def close(self) -> None:
        """Stop the heartbeat thread."""
        self._stopped.set()

    def __del__(self) -> None:
        self._stopped.set()

    def _key(self, name: str, generation: int | None = None) -> str:
        return f"{self._prefix}/g{self._generation if generation is None else generation}/{name}"

    # -- detection ----------------------------------------------------------------------------------
    def wait(
        self,
        works: Sequence[dist.Work],
        device: torch.device,
        timeout: timedelta | None,
        failure: Callable[[BaseException | None], Exception],
    ) -> None:
        """Wait for ``works`` like :func:`~.comm.wait_all`, but raise :class:`PeerLost` as soon as a peer
        fails, ``timeout`` passes, or another rank has announced a failure (outside recovery)."""
        del device  # gloo only: a host-side wait
        limit = self._timeout if timeout is None else timeout.total_seconds()
        waited_from: float | None = None  # timed only when a peer keeps this rank waiting
        clock = _AwakeClock(limit)
        next_check = time.monotonic() + POLL_S
        announced = RuntimeError("another rank reported a lost peer")
        for work in works:
            pause = 1e-4
            while not work.is_completed():
                if waited_from is None:
                    waited_from = time.perf_counter()
                now = clock.tick()
                if clock.expired():
                    raise PeerLost(str(failure(None)))
                if not self._recovering and now >= next_check:
                    next_check = now + POLL_S
                    if self.failure_announced():
                        raise PeerLost(str(failure(announced)))
                    if self.joins_announced():
                        raise MembershipChange("workers apply to join (announced by another member)")
                time.sleep(pause)
                pause = min(2 * pause, 2e-3)
            try:
                work.wait()
            except RuntimeError as err:
                raise PeerLost(str(failure(err))) from err
        if waited_from is not None:
            self.wait_seconds += time.perf_counter() - waited_from
        # Completed here, but a peer may have given up on it (it was starved past its deadline) and
        # be waiting in recovery: follow it now, not at a next collective that may never come.
        if works and not self._recovering and self.failure_announced():
            raise PeerLost(str(failure(announced)))

    def failure_announced(self) -> bool:
        try:
            return bool(self._store.check([self._key("lost")]))
        except Exception as err:
            raise self._store_gone(err) from err

    def joins_announced(self) -> bool:
        """Whether a member announced applicants (followed inside a collective of the whole world too)."""
        if not self.watch.open:
            return False
        try:
            return bool(self._store.check([self._key("join")]))
        except Exception as err:
            raise self._store_gone(err) from err

    # -- collectives of the whole world and announcements ---------------------------------------------
    def collective_done(self) -> None:
        """Count a collective of the whole world this rank completed (``global_avg``, ``consensus_distance``).

        The count is per generation: every member calls the same collectives in the same order, and a
        collective redone after a change of members counts once, in the generation that completed it.
        """
        self._collectives += 1
        self._store.add(self._key(f"collective/{self._collectives}"), 1)

    def try_announce(self) -> bool:
        """Announce applicants, unless a member may still be inside a collective of the whole world that
        an announcement would break; returns whether it announced.

        Two cases wait for a later step boundary:

        * A member has not completed the latest collective of the whole world this rank completed. An
          all-reduce completes on one rank once every rank sent its part, while another may still be
          receiving its last bytes; were that one to follow the announcement, it would redo the average
          over the new groups, waiting for this rank, which is past it for good, and ``timeout`` would
          drop one of them. (A member *behind* such a collective may announce: nobody completed it, and
          the members inside it follow and redo it.)
        * A member is inside a collective that cannot be redone (:meth:`enter_unbroken`). This rank
          marks its intent before it looks and announces before it unmarks, and the entering rank marks
          itself before it looks for intents: the store orders both, so at least one of them sees the
          other.
        """
        store = self._store
        try:
            if self._collectives and int(store.add(self._key(f"collective/{self._collectives}"), 0)) < len(
                self._members
            ):
                return False
            intent = self._intent_key(self._me)
            store.set(intent, "1")
            try:
                if any(store.check([self._unbroken_key(m)]) for m in self._members if m != self._me):
                    return False
                self.announce()
                return True
            finally:
                store.delete_key(intent)
        except PeerFailureError:
            raise
        except Exception as err:
            raise self._store_gone(err) from err

    def admission_due(self) -> bool:
        """Whether applicants deferred by a collective of the whole world are due at this step boundary:
        this rank has completed a collective since (the redone one; counts restart with each
        generation) and no admitted joiner is still without its replica. Attributes only."""
        watch = self.watch
        return watch.after_collective and self._collectives > 0 and not watch.transfers

    def announce_deferred(self) -> bool:
        """At the first step boundary after a collective of the whole world that deferred applicants:
        follow the announcement another member made, or make it once every member completed the
        latest collective this rank completed (they are all inside it or past it: a bounded wait).
        Returns whether this rank goes into the agreement (False only if a member stays inside a
        collective past ``timeout``, or inside one that cannot be redone: the next boundary tries again).
        """
        if self.joins_announced():
            return True
        counter = self._key(f"collective/{self._collectives}")
        clock = _AwakeClock(self._timeout)
        try:
            while int(self._store.add(counter, 0)) < len(self._members):
                clock.tick()
                if clock.expired() or self.joins_announced():
                    break
                time.sleep(POLL_S / 5)
        except PeerFailureError:
            raise
        except Exception as err:
            raise self._store_gone(err) from err
        return self.joins_announced() or self.try_announce()

    def enter_unbroken(self) -> None:
        """Enter a collective of the whole world that cannot be redone over new groups (``add_param_group``).

        Marks this rank inside it, waits while a member is deciding to announce a change
        (:meth:`try_announce`), and raises :class:`PeerLost` (:class:`MembershipChange` for applicants),
        unmarked, if a change was announced: the caller follows it and enters again. Call
        :meth:`leave_unbroken` once out of the collective.
        """
        store, mark = self._store, self._unbroken_key(self._me)
        store.set(mark, "1")
        # An intent is held for a few store calls; one held past ``timeout`` is a dead announcer's.
        clock = _AwakeClock(self._timeout)
        while True:
            change: PeerLost | None = None
            if self.failure_announced():
                change = PeerLost("another rank reported a lost peer before this rank entered a collective")
            elif self.joins_announced():
                change = MembershipChange("workers apply to join (announced before this rank entered)")
            if change is not None:
                store.delete_key(mark)
                raise change
            others = [m for m in self._members if m != self._me]
            if clock.expired() or not any(store.check([self._intent_key(m)]) for m in others):
                return
            time.sleep(POLL_S)
            clock.tick()

    def leave_unbroken(self) -> None:
        """This rank is out of the collective entered with :meth:`enter_unbroken`."""
        self._store.delete_key(self._unbroken_key(self._me))

    def _unbroken_key(self, member: int) -> str:
        return f"{self._prefix}/unbroken/{member}"

    def _intent_key(self, member: int) -> str:
        return f"{self._prefix}/announcing/{member}"

    def _store_gone(self, err: BaseException) -> PeerFailureError:
        return PeerFailureError(
            f"rank {self._me} (at launch): the store the survivors meet in cannot be reached ({err}). With "
            "plain init_process_group, rank 0 hosts it and its death ends the job; host the store outside "
            "the workers (torchrun's agent, or a launcher) to survive any rank."
        )

    # -- recovery -----------------------------------------------------------------------------------
    def agree(self, report: Report, cause: BaseException) -> Decision:
        """Announce the failure, report, and return the decision of this generation (see module doc)."""
        self._recovering = True
        try:
            return self._agree(report, cause)
        except PeerFailureError:
            raise
        except Exception as err:  # the store failed us
            raise self._store_gone(err) from err

    def _agree(self, report: Report, cause: BaseException) -> Decision:
        store = self._store
        store.set(self._key("join" if isinstance(cause, MembershipChange) else "lost"), str(report.member))
        own_report = self._key(f"report/{report.member}")
        store.set(own_report, self._seal.seal(report, own_report))
        logger.debug("rank {} (launch rank {}): recovering from: {}", report.rank, report.member, cause)
        decision_key = self._key("decision")
        clock = _AwakeClock(self._timeout)
        reported: dict[int, Report] = {}
        beats: dict[int, tuple[int, float]] = {}
        while True:
            while not self._decided(decision_key):
                now = clock.tick()
                if (
                    clock.starved
                ):  # heartbeats that stood still while this rank was not watching prove nothing
                    beats.clear()
                dead: set[int] = set()
                for member in self._members:
                    if member in reported:
                        continue
                    key = self._key(f"report/{member}")
                    if store.check([key]):
                        found = self._open(key)
                        if found is not None:
                            reported[member] = found
                            continue
                    if store.check([self._key(f"left/{member}")]):  # it said so: no need to wait for its beat
                        dead.add(member)
                        continue
                    beat = int(store.add(f"{self._prefix}/beat/{member}", 0))
                    last = beats.get(member)
                    if last is None or last[0] != beat:
                        beats[member] = (beat, now)
                    elif now - last[1] > STALE_AFTER_S:
                        dead.add(member)
                if len(reported) + len(dead) == len(self._members) or clock.expired():
                    ordered = whole_nodes(list(reported.values()), self.shards)
                    admission = self._admission(ordered)
                    proposal = self._seal.seal(
                        Decision(self._generation, ordered, admission, self.shards), decision_key
                    )
                    store.compare_set(decision_key, "", proposal)
                    break
                time.sleep(POLL_S)
            raw = store.get(decision_key)
            if not raw:
                continue  # a forged decision another member cleared: propose again
            decision: Decision | None = self._open(decision_key, raw)
            if decision is not None:
                break
            # Written without the job's secret: cleared (only those bits, atomically), then decided again.
            store.compare_set(decision_key, raw.decode(errors="replace"), "")
        # Joiners that gave up before the members claimed them are out, on every member alike.
        decision = replace(
            decision, admission=settle_fates(store, self._prefix, decision.admission, self._seal)
        )
        self._record_verdicts(decision)
        if report.member not in decision.members and self.shards > 1:
            raise PeerFailureError(
                f"rank {report.shard} of node {report.rank}: this node is not among the nodes that go on "
                f"after recovery {self._generation} (nodes {decision.nodes()} at launch): one of its ranks "
                "was lost or reported too late, and a node goes on whole or not at all. This replica is no "
                "longer part of the job; restart the node's processes from a checkpoint."
            )
        if report.member not in decision.members:
            raise PeerFailureError(
                f"rank {report.rank} (rank {report.member} at launch) reported too late to recovery "
                f"{self._generation}: the survivors went on without it (ranks {list(decision.ranks)}). This "
                "replica is no longer part of the job; restart it from a checkpoint."
            )
        return decision

    def _decided(self, decision_key: str) -> bool:
        """Whether a decision is in the store (an entry cleared after a forgery is empty: not yet)."""
        return bool(self._store.check([decision_key])) and bool(self._store.get(decision_key))

    def _open(self, key: str, raw: bytes | None = None) -> Any:
        """The sealed value at ``key`` (read now unless ``raw`` is given), or None if its seal does not
        verify: written by a process without the job's secret, it is ignored and logged once."""
        raw = self._store.get(key) if raw is None else raw
        try:
            return self._seal.open(raw, key)
        except ForgedEntryError as err:
            REFUSALS.forged("decision" if key.endswith("/decision") else "report", key, err)
            return None

    def _admission(self, reports: tuple[Report, ...]) -> Admission:
        """The joiners part of this rank's proposal (:func:`~.admission.admit`)."""
        if self.signature is None:
            return Admission(handled=self.watch.handled)
        # A donor node is idle on every rank: each of them sends its own shard of the replica.
        busy = {r.member // self.shards for r in reports if r.phase != "idle"}
        donors = [
            r.member for r in reports if r.member % self.shards == 0 and r.member // self.shards not in busy
        ]
        blocked = any(r.phase == "collective" for r in reports)
        return admit(
            self._store, self._prefix, self.watch.handled, self.signature, donors, blocked, self._seal
        )

    def _record_verdicts(self, decision: Decision) -> None:
        """Write the verdicts of the decision's applications; defer the next announcement if some wait."""
        admission = decision.admission
        verdicts = joiner_verdicts(admission, decision.generation, decision.members, decision.resume_step)
        write_verdicts(self._store, self._prefix, verdicts, self._seal)
        self.watch.decided(self._store, self._prefix, admission)

    def leave(self) -> None:
        """Leave the job for good (a joiner whose join failed): the others recover without this rank
        at once, without waiting for its heartbeat to stand still."""
        try:
            self._store.set(self._key(f"left/{self._me}"), "1")
            self._store.set(self._key("lost"), f"{self._me} left")
        finally:
            self.close()

    def announce(self) -> None:
        """Announce applicants: the members follow into an agreement from their next wait."""
        self._store.set(self._key("join"), str(self._me))

    def ready(self) -> None:
        """This joiner holds its replica: members may announce the next change."""
        self._store.set(ready_key(self._prefix, self._me), "1")

    def reform(self, decision: Decision, backend: str, timeout: timedelta) -> None:
        """Replace the default process group by one over ``decision``'s survivors (ranks renumbered);
        in a job of nodes, replace this rank's shard world instead (the default group is the node).

        Raises ``RuntimeError`` if a survivor does not join; the caller recovers again from there.
        """
        rank, size = decision.members.index(self._me), len(decision.members)
        if dist.is_initialized() and self._replicas is None:
            dist.destroy_process_group()
        self._generation = decision.generation + 1
        self._members = list(decision.members)
        self._place_status()
        self._collectives = 0  # counted afresh under the new generation's keys
        store = PrefixStore(group_prefix(self._prefix, decision.generation), self._store)
        try:
            if self._replicas is None:
                dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)
            else:  # the same shard of every surviving node, numbered by node
                node = decision.nodes().index(self._me // self.shards)
                self._replicas = self._replicas.reformed(store, node, size // self.shards)
                job = current_job()
                if job is not None:
                    job.replicas = self._replicas
        finally:
            self._recovering = False

    def failed_to_reform(self, cause: BaseException) -> None:
        """The new group did not form: a failure of the new generation, announced like any other."""
        logger.warning("rank {} (at launch): the survivors' new group did not form: {}", self._me, cause)
        self._recovering = True


class _AwakeClock:
    """A deadline ``limit`` seconds away that counts only the time this process was running.

    :meth:`tick` is called every few milliseconds by a polling loop; a gap between ticks longer
    than :data:`_STARVED_S` means the process was descheduled (an overloaded machine, a stopped
    VM), and the gap is added to the deadline: peers cannot be judged silent while this rank
    was not watching. A process starved for good never expires, but then it is the one a live
    peer's own deadline drops.
    """

    def __init__(self, limit: float) -> None:
        self._last = time.monotonic()
        self._deadline = self._last + limit
        self.starved = False

    def tick(self) -> float:
        """The time now; sets :attr:`starved` if this process was descheduled since the last tick."""
        now = time.monotonic()
        self.starved = now - self._last > _STARVED_S
        if self.starved:
            self._deadline += now - self._last
        self._last = now
        return now

    def expired(self) -> bool:
        return self._last >= self._deadline


def group_prefix(prefix: str, generation: int) -> str:
    """Where the default group of the generation after ``generation``'s decision forms in the store."""
    return f"{prefix}/g{generation}/group"

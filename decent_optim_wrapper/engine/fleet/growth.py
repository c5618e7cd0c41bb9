r"""Growing the world: members donate their replicas to admitted joiners, and a joiner takes one.

:mod:`~.admission` decides who joins and from whom; :mod:`~.membership` re-forms the default group
with the joiners appended; this module moves the state and tells the training loop.

**What a join does to the replicas.** Each joiner starts as a bit-for-bit copy of its donor's replica
(parameters, optimizer state, step count, anchors and outer optimizer state of low-communication
gossip), so over the new world of ``n + k`` replicas

.. math::
    \sum_{i \in \text{new}} x_i = \sum_{i \in \text{old}} x_i + \sum_{j\ \text{joiner}} x_{d(j)},
    \qquad
    \bar x_{\text{new}} = \bar x_{\text{old}} + \frac{1}{n+k} \sum_j \big(x_{d(j)} - \bar x_{\text{old}}\big),

where ``d(j)`` is joiner ``j``'s donor: the mean moves towards the donors' replicas, by at most
``k / (n + k)`` times the largest distance of a replica from the old mean, and no member's replica
changes. From the first round on the new
groups, mixing is the topology's over ``n + k`` ranks: doubly stochastic, so it keeps the new mean.
Like after a lost peer, compression references restart with an exact round in each new group,
gradient trackers restart from the next gradient, and rounds in flight are settled before the
transfer (mixed by every member of their group or dropped by all).

In a job of nodes the same holds shard world by shard world: a joining node's rank ``s`` is rank
``s`` of its donor node, bit for bit, and its node's ranks start together or leave together
(:func:`node_agrees`).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist
from loguru import logger
from torch.distributed import PrefixStore  # type: ignore[attr-defined]
from torch.utils.hooks import RemovableHandle

from decent_optim_wrapper.engine.errors import PeerFailureError
from decent_optim_wrapper.engine.fleet.admission import Applicant, ApplyAgainError, Verdict
from decent_optim_wrapper.engine.fleet.comm import all_gather_pickled
from decent_optim_wrapper.engine.fleet.jobs import ElasticJob, JobInfo, publish_job, run_prefix
from decent_optim_wrapper.engine.fleet.membership import (
    Decision,
    Membership,
    PeerJoin,
    PeerLost,
    group_prefix,
    nodes_of,
)
from decent_optim_wrapper.engine.fleet.replicas import ReplicaWorld
from decent_optim_wrapper.engine.fleet.status import StatusBoard
from decent_optim_wrapper.engine.fleet.transfer import (
    TransferCorruptedError,
    pack,
    receive_header,
    receive_payload,
    send_replica,
    unpack,
)

__all__ = ["Growth", "JoinHook", "Stateful"]

#: Called on every member after an admission, once the joiners hold their replicas.
JoinHook = Callable[[PeerJoin], None]

#: How many times a joiner applies again after an aborted join (a donor lost, a corrupted transfer).
JOIN_ATTEMPTS = 3


class Stateful(Protocol):
    """What a joiner can receive from its donor: anything with ``state_dict``/``load_state_dict``."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any], /) -> Any: ...


class Growth:
    """A rank's side of joins: what it donates, what it received, the record of joins and their hooks."""

    def __init__(self, enabled: bool) -> None:
        self._enabled = enabled
        self._save: Callable[[], dict[str, Any]] | None = None
        self._states: dict[str, Stateful] = {}
        self._received: dict[str, Any] = {}
        self._joins: list[PeerJoin] = []
        self._hooks: OrderedDict[int, JoinHook] = OrderedDict()
        self.joined: PeerJoin | None = None
        #: Where a joiner's join spent its seconds ("admission", "group", "donor" while the donor packs
        #: its replica, "transfer" for the payload on the wire, "verify") and the replica's size in
        #: "bytes"; empty on a worker that started the job.
        self.join_seconds: dict[str, float] = {}

    @property
    def joins(self) -> list[PeerJoin]:
        """Every admission this rank took part in as a member, oldest first (a new list)."""
        return list(self._joins)

    def register_hook(self, hook: JoinHook) -> RemovableHandle:
        """Call ``hook(join)`` on every member after an admission, once the joiners hold their replicas."""
        self._check_enabled("register_join_hook()")
        handle = RemovableHandle(self._hooks)
        self._hooks[handle.id] = hook
        return handle

    def register_state(self, name: str, obj: Stateful) -> None:
        """Send ``obj``'s state to joiners under ``name``; on a joiner, load what the donor sent now."""
        self._check_enabled("register_join_state()")
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty string, got {name!r}.")
        for method in ("state_dict", "load_state_dict"):
            if not callable(getattr(obj, method, None)):
                raise TypeError(
                    f"register_join_state({name!r}, ...) needs an object with state_dict() and "
                    f"load_state_dict() (an LR scheduler, a sampler), got {type(obj).__name__}."
                )
        if name in self._states:
            raise ValueError(f"a join state named {name!r} is registered already; pick another name.")
        self._states[name] = obj
        if name in self._received:
            obj.load_state_dict(self._received.pop(name))

    def _check_enabled(self, what: str) -> None:
        if not self._enabled:
            raise RuntimeError(
                f'{what} needs on_peer_failure="continue": with "raise" (the default) the world never '
                "changes, and no hook would ever run."
            )

    # -- members ----------------------------------------------------------------------------------
    def donate(
        self,
        decision: Decision,
        membership: Membership,
        engine_state: Callable[[], dict[str, Any]],
        timeout: timedelta,
    ) -> None:
        """Send this rank's replica to the joiners it donates to (nothing if it donates to none)."""
        admission, shards = decision.admission, membership.shards
        # In a job of nodes each rank of the donor node sends its shard to the same rank of the joining
        # node, over their shard world (whose ranks are nodes).
        nodes = decision.nodes()
        mine = [
            nodes.index(j.member // shards)
            for j, d in zip(admission.joiners, admission.donors, strict=True)
            if d // shards == membership.member // shards
        ]
        if not mine:
            return
        data, digest = pack(self._payload(engine_state()), membership.seal)
        logger.debug("donating {} bytes to ranks {}", len(data), mine)
        group = None if membership.replicas is None else membership.replicas.group
        send_replica(data, digest, mine, _waiter("sending a replica to a joiner", timeout), group)

    def admitted(
        self,
        decision: Decision,
        membership: Membership,
        previous_rank: int,
        step: int,
        engine_state: Callable[[], dict[str, Any]],
        timeout: timedelta,
    ) -> None:
        """After an admission: donate where this rank was chosen, then record it and call the hooks
        (also if the transfer failed: the admission happened, and the recovery that follows is
        recorded as a lost peer)."""
        try:
            self.donate(decision, membership, engine_state, timeout)
        finally:
            join = join_record(decision, step, previous_rank, membership.member)
            if membership.status is not None:
                admission = decision.admission
                membership.status.event(
                    "joined",
                    step=step,
                    generation=decision.generation + 1,
                    members=[j.member for j in admission.joiners],
                    donors=list(admission.donors),
                    world_size=join.world_size,
                )
            self.record(join)

    def record(self, join: PeerJoin) -> None:
        """Log an admission and call the hooks (every member, after the transfers)."""
        self._joins.append(join)
        logger.info(
            "admitted {} worker(s) at step {}: the world grows from {} to {} ranks (joiners {}, donors {})",
            len(join.joined),
            join.step,
            join.previous_world_size,
            join.world_size,
            list(join.joined),
            list(join.donors),
        )
        for hook in list(self._hooks.values()):
            hook(join)

    def _payload(self, engine_state: dict[str, Any]) -> dict[str, Any]:
        return {
            "engine": engine_state,
            "front_end": None if self._save is None else self._save(),
            "user": {name: obj.state_dict() for name, obj in self._states.items()},
        }

    def open(
        self,
        job: ElasticJob,
        membership: Membership | None,
        signature: tuple[tuple[str, object], ...],
        timeout: timedelta,
        front_end: tuple[Callable[[], dict[str, Any]], Callable[[dict[str, Any]], None]],
        engine: tuple[Callable[[Membership], None], Callable[[dict[str, Any], int], None]],
        status: StatusBoard | None = None,
    ) -> None:
        """Open the job to joiners; on a worker started to join, join now (the engine's
        ``open_to_joiners``).

        ``front_end`` is the front-end's (save, load) of its part of a replica; ``engine`` the
        engine's (wire over an admitted joiner's world, load a replica's engine part at a resume step);
        ``status`` the record a joiner publishes once it is a member (:mod:`~.status`).
        """
        save, load = front_end
        wire, load_replica = engine
        self._save = save
        shards = 1 if job.replicas is None else job.replicas.shards
        if membership is None:  # on_peer_failure="raise": the world never changes
            if job.joining:
                raise ValueError(
                    f"this worker was started to join the running job {job.job!r} (init_elastic found "
                    'it running), but its front-end has on_peer_failure="raise"; pass '
                    'on_peer_failure="continue", as the job\'s members do.'
                )
            return
        signature = node_signature(signature, job.replicas)
        if job.found is None:  # this process started the job: open it to joiners
            membership.signature = signature
            membership.watch.open = True
            if membership.member == 0:
                info = JobInfo(membership.run, len(membership.members), signature, shards)
                publish_job(job.store, job.job, info, job.seal)
            return
        found, job.found = job.found, None  # one engine per process joins
        membership.close()
        joined, verdict, payload = self.join(job, found, signature, timeout, wire, status)
        joined.signature = signature
        error: Exception | None = None
        try:
            load_replica(payload["engine"], verdict.resume_step)
            if payload["front_end"] is not None:
                load(payload["front_end"])
        except Exception as err:
            error = err
        if not node_agrees(error is None, job.replicas, timeout):
            joined.leave()  # the members go on without it (without its node) at once
            if error is not None:
                raise error
            raise PeerFailureError(
                "another rank of this node could not load its shard of the replica it received; a node "
                "joins whole, so this rank leaves the job too. Start the node's processes again."
            )
        joined.ready()
        step = payload["engine"]["step"]
        self.joined_at(verdict, joined.member, step, shards)
        if status is not None:
            status.event(
                "joined",
                step=step,
                generation=verdict.generation + 1,
                members=list(verdict.joiners),
                donors=list(verdict.donors),
                world_size=len(nodes_of(verdict.members, shards)),
            )

    # -- a joiner ---------------------------------------------------------------------------------
    def join(
        self,
        job: ElasticJob,
        info: JobInfo,
        signature: tuple[tuple[str, object], ...],
        timeout: timedelta,
        wire: Callable[[Membership], None],
        status: StatusBoard | None = None,
    ) -> tuple[Membership, Verdict, dict[str, Any]]:
        """Apply to the running job ``info`` (found by ``init_elastic``), form its new group,
        ``wire(membership)`` over it, receive a replica.

        Returns the new membership, the verdict and the donor's payload (its ``"user"`` part is kept
        here for :meth:`register_state`). Retries an aborted join (the donor lost, a corrupted
        transfer) or an application no member admitted before its deadline (withdrawn, logged) up to
        :data:`JOIN_ATTEMPTS` times in all; raises
        :class:`~.jobs.JoinRejectedError` if the job refuses this worker.
        """
        # init_elastic saw the members alive moments ago; if they are gone since, the applicant sees
        # their heartbeat stand still and says so.
        shards = 1 if job.replicas is None else job.replicas.shards
        for attempt in range(1, JOIN_ATTEMPTS + 1):
            clock = [time.perf_counter()]
            applicant = _applicant(job, info, signature, timeout, attempt)
            try:
                verdict = applicant.apply()
            except ApplyAgainError as err:
                # Withdrawn before any member claimed it (the fate), or overwritten by an outsider:
                # nobody waits for this application, so a new one starts clean.
                if attempt == JOIN_ATTEMPTS:
                    raise
                logger.warning("{}; applying again (attempt {} of {})", err, attempt + 1, JOIN_ATTEMPTS)
                continue
            clock.append(time.perf_counter())
            membership = None
            failure: BaseException | None = None
            try:
                membership = _enter(job, info, applicant, verdict, timeout, status)
                wire(membership)
                clock.append(time.perf_counter())
                group = None if membership.replicas is None else membership.replicas.group
                donor = nodes_of(verdict.members, shards).index(verdict.donor // shards)
                wait = _waiter("receiving a replica", timeout)
                length, digest = receive_header(donor, wait, group)  # the donor has packed its replica
                clock.append(time.perf_counter())
                data = receive_payload(donor, length, wait, group)
                clock.append(time.perf_counter())
                payload = unpack(data, digest, job.seal)
                clock.append(time.perf_counter())
            except (PeerLost, TransferCorruptedError, RuntimeError, dist.DistError) as err:
                failure = err
            # A node joins whole: each of its ranks tries again, or none does.
            if not node_agrees(failure is None, job.replicas, timeout) and failure is None:
                failure = PeerLost("another rank of this node did not receive its shard of the replica")
            if failure is not None:
                # Leaving makes this rank a lost peer of the new world; the members go on without it.
                applicant.withdraw()
                if membership is not None:
                    membership.leave()
                if dist.is_initialized() and shards == 1:  # a node's own group stays: it is the node
                    dist.destroy_process_group()
                if attempt == JOIN_ATTEMPTS:
                    raise PeerFailureError(
                        f"joining the running job failed {attempt} times; last: {failure}"
                    ) from failure
                logger.warning("joining the running job failed ({}); applying again", failure)
                continue
            applicant.withdraw()  # the membership beats for this rank now
            self._received = dict(payload.get("user") or {})
            phases = ("admission", "group", "donor", "transfer", "verify")
            self.join_seconds = dict(zip(phases, (b - a for a, b in itertools.pairwise(clock)), strict=True))
            self.join_seconds["bytes"] = float(len(data))
            assert membership is not None
            return membership, verdict, payload
        raise AssertionError("unreachable")

    def joined_at(self, verdict: Verdict, member: int, step: int, shards: int = 1) -> None:
        """Record this joiner's own admission (its ``joined`` record)."""
        pairs = tuple(zip(verdict.joiners, verdict.donors, strict=True))
        self.joined = _join_record(verdict.members, pairs, step, -1, member, shards)


def join_record(decision: Decision, step: int, previous_rank: int, member: int) -> PeerJoin:
    """The record every member keeps of ``decision``'s admission (ranks count nodes in a job of nodes)."""
    pairs = tuple(
        (j.member, d) for j, d in zip(decision.admission.joiners, decision.admission.donors, strict=True)
    )
    return _join_record(decision.members, pairs, step, previous_rank, member, decision.shards)


def _join_record(
    members: Sequence[int],
    pairs: Sequence[tuple[int, int]],
    step: int,
    previous_rank: int,
    member: int,
    shards: int,
) -> PeerJoin:
    nodes = nodes_of(members, shards)
    return PeerJoin(
        step=step,
        joined=tuple(nodes.index(j // shards) for j, _ in pairs),
        donors=tuple(nodes.index(d // shards) for _, d in pairs),
        previous_world_size=len(nodes) - len(pairs),
        world_size=len(nodes),
        previous_rank=previous_rank,
        rank=nodes.index(member // shards),
    )


def node_signature(
    signature: tuple[tuple[str, object], ...], replicas: ReplicaWorld | None
) -> tuple[tuple[str, object], ...]:
    """What a replica must match: this rank's ``signature``, or in a job of nodes every shard's, gathered
    over the node (its ranks hold different slices of the model). A collective of the node."""
    if replicas is None or replicas.shards == 1:
        return signature
    gathered = all_gather_pickled(signature, replicas.node_group)
    return tuple((f"shard {s}", mine) for s, mine in enumerate(gathered))


def node_agrees(ok: bool, replicas: ReplicaWorld | None, timeout: timedelta) -> bool:
    """Whether ``ok`` holds on every rank of this node (a collective of the node's own gloo group; just
    ``ok`` outside a job of nodes). A node-mate that is gone or silent for ``timeout`` counts as not ok."""
    if replicas is None or replicas.shards == 1:
        return ok
    flags = torch.empty(replicas.shards, dtype=torch.int64)
    try:
        mine = torch.tensor([int(ok)], dtype=torch.int64)
        work = dist.all_gather_into_tensor(flags, mine, group=replicas.node_group, async_op=True)
        if work is not None and not work.wait(timeout):
            return False
    except (RuntimeError, dist.DistError):
        return False
    return bool(flags.all())


def _applicant(
    job: ElasticJob,
    info: JobInfo,
    signature: tuple[tuple[str, object], ...],
    timeout: timedelta,
    attempt: int,
) -> Applicant:
    """This worker's application; a node's ranks apply as one, under a node identity its rank 0 draws
    (a collective of the node: the identities of a node are consecutive, ``node * shards + s``)."""
    seconds = timeout.total_seconds()
    replicas = job.replicas
    if replicas is None:
        return Applicant(job.store, info, signature, seconds, seal=job.seal)
    shards, shard = replicas.shards, replicas.shard
    drawn = torch.zeros(1, dtype=torch.int64)
    if shard == 0:  # each attempt is a new node: a replica that left is never mistaken for a live one
        count = int(job.store.add(f"{run_prefix(info.run)}/joining-nodes", 1))
        drawn[0] = info.launch_world_size // shards + count - 1
    dist.broadcast(drawn, group=replicas.node_group, group_src=0)
    member = int(drawn[0]) * shards + shard
    node = (f"{job.node_key}/attempt/{attempt}/slot", shard == 0)
    return Applicant(
        job.store, info, signature, seconds, member=member, shards=shards, node=node, seal=job.seal
    )


def _enter(
    job: ElasticJob,
    info: JobInfo,
    applicant: Applicant,
    verdict: Verdict,
    timeout: timedelta,
    status: StatusBoard | None,
) -> Membership:
    """Leave this worker's world of its own and form the new default group with the members; in a job
    of nodes, form this rank's shard world with them instead (the default group is the node)."""
    members = verdict.members
    store = PrefixStore(group_prefix(run_prefix(info.run), verdict.generation), job.store)
    replicas = job.replicas
    if replicas is None:
        if dist.is_initialized():
            dist.destroy_process_group()
        rank = members.index(applicant.member)
        # The members' groups time out after 3 * timeout (the engine's own wait decides a loss first).
        dist.init_process_group("gloo", store=store, rank=rank, world_size=len(members), timeout=3 * timeout)
    else:
        nodes = nodes_of(members, replicas.shards)
        node = nodes.index(applicant.member // replicas.shards)
        replicas = dataclasses.replace(replicas.reformed(store, node, len(nodes)), token=info.run)
        job.replicas = replicas
    membership = Membership(
        job.store,
        info.run,
        applicant.member,
        len(members),
        timeout,
        members=members,
        generation=verdict.generation + 1,
        replicas=replicas,
        seal=job.seal,
        status=status,
    )
    membership.watch.handled = verdict.handled
    membership.watch.open = True
    return membership


def _waiter(what: str, timeout: timedelta) -> Callable[[Sequence[dist.Work | None]], None]:
    """Wait for point-to-point works, each within ``timeout`` (gloo reports their completion only to
    ``wait``); a failure is a lost peer."""

    def wait(works: Sequence[dist.Work | None]) -> None:
        # Announcements are not followed here: a transfer in progress finishes (or fails) first.
        for work in works:
            try:
                if work is not None:
                    work.wait(timeout)
            except (RuntimeError, dist.DistError) as err:
                raise PeerLost(f"{what}: {err}") from err

    return wait

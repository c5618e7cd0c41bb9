r"""Growing a running job: a worker that starts while the job runs applies through the store and is
admitted at a step boundary.

A job opens to joiners when its workers start with :func:`~decent_optim_wrapper.launch.init_elastic`
(or ``initialize_dist(elastic=True)``) and build a front-end with ``on_peer_failure="continue"``: rank 0
then publishes the job under its name in the store. A worker that starts later (a replacement for a
lost one, a restarted one, or an extra one) runs the same command;
:func:`~decent_optim_wrapper.engine.fleet.jobs.job_running` finds the job live, the worker builds its
model and front-end in a world of its own, and the engine applies:

1. *Apply.* The joiner compares the signature of its model and options with the one the job
   published (a mismatch raises :class:`~.jobs.JoinRejectedError` there, and the members never hear of it),
   then claims the first free application slot with its :class:`JoinRequest` in one
   ``compare_set`` (so a slot is either free or holds a whole request) and starts its heartbeat.
   Each request carries a nonce of its own, so that a slot reads back as this applicant's only if
   this applicant wrote it (two workers applying at once would otherwise write the same bytes).
2. *Notice.* Each member's heartbeat thread sees the slot after the last decided one taken and
   raises a flag; the next member to reach a step boundary reads the flag (attributes: nothing per
   step) and announces the applicants under ``g/join``. The others follow into the agreement of
   :mod:`~.membership` from their next wait, inside a collective of the whole world (``global_avg``)
   too: they then report phase "collective", the applicants are deferred (they would not take part
   in it) and the collective is redone over the same members. No change is announced while the
   latest admission's joiners do not hold their replicas yet, nor while a member may still be inside
   a collective of the whole world (:meth:`~.membership.Membership.try_announce`).

   *Deferred by a collective.* Such a deferral is recorded in the decision
   (:attr:`Admission.after_collective`), so every member knows it, and it is decided once: nobody
   announces the applicants again until they have completed a collective of the whole world (the
   redone one); then every member goes into the agreement at its first step boundary after it, the
   first there announcing (once every member is out of that collective), the others following.
   At a boundary nobody is inside a collective, and the announcer has not updated yet, so it can
   donate: the applicants are admitted there. Whatever the members' speeds and evaluation rhythm,
   an applicant announced inside a collective is admitted at the first boundary after it, one
   deferral and one redone collective later (a loop that runs two collectives of the whole world
   back to back, with no step between them, defers once per collective).
3. *Decide.* The member whose proposal wins the agreement also decides the applicants
   (:func:`admit`): one whose signature differs from the members' is rejected with the entry that
   differs; one whose heartbeat does not move is dropped; the others are admitted if some member
   can donate (it has not yet updated in its current step, so its replica, optimizer state and step
   count agree) and no member is inside a collective of the whole world. Otherwise they wait for a
   later boundary. Donors are spread over the members that can donate, one joiner each in turn, so
   no member carries every transfer.
4. *Fate.* Before anyone acts on a decision that admits an applicant, the members claim its fate,
   "admitted", with one ``compare_set`` on the application's fate key; an applicant whose deadline
   passes claims it "withdrawn" the same way. Whoever comes first wins, and everyone reads the same
   value: an applicant that gave up is never admitted (every member takes it out of the decision
   before it re-forms its groups), and an admitted applicant never gives up (it waits for its
   verdict while the members are alive). An applicant that withdrew applies again, with a new
   application, up to :data:`~.growth.JOIN_ATTEMPTS` times.
5. *Verdict.* Every member writes each applicant's :class:`Verdict` from the decision (the same bits
   whoever writes); an admitted joiner forms the new default group with the members under the
   decision's generation and receives its donor's state (:mod:`~.transfer`).

In a job of nodes (``init_elastic(..., shards=k)``) a replica is a node of ``k`` ranks and joins whole:
one request stands for the node's ``k`` identities (``node * k + s``, :attr:`JoinRequest.members`),
claimed by its rank 0 while every rank beats; it is admitted only if all of them beat, from a donor
node idle on every rank, and rank ``s`` receives shard ``s`` over shard world ``s``
(:mod:`~.growth`). A node looks for applicants every few steps rather than at every boundary, so that
its ranks decide together (:meth:`~.survival.Survival.joins_checked_at`).

Keys live beside the membership's, under ``decent-optim-wrapper/<run>``; the job's name maps to its run
under ``decent-optim-wrapper/jobs/<job>``.
"""

from __future__ import annotations

import itertools
import secrets
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from loguru import logger
from torch.distributed import Store  # type: ignore[attr-defined]

from decent_optim_wrapper.engine.errors import PeerFailureError
from decent_optim_wrapper.engine.fleet.heartbeats import HEARTBEAT_S, POLL_S, STALE_AFTER_S, start_heartbeat
from decent_optim_wrapper.engine.fleet.jobs import JobInfo, JoinRejectedError, run_prefix
from decent_optim_wrapper.engine.fleet.refusals import REFUSALS
from decent_optim_wrapper.engine.fleet.sealing import ForgedEntryError, Seal
from decent_optim_wrapper.engine.fleet.signatures import mismatch

__all__ = [
    "ADMITTED",
    "WITHDRAWN",
    "Admission",
    "Applicant",
    "ApplyAgainError",
    "JoinRequest",
    "JoinerWatch",
    "Verdict",
    "admit",
    "claim_fate",
    "settle_fates",
    "write_verdicts",
]

#: After joiners were deferred because no member could donate, members wait this long before
#: announcing them again. (Joiners deferred by a collective of the whole world are announced at the
#: first step boundary after it instead: see "Deferred by a collective" above.)
RETRY_AFTER_S = 1.0
#: An application's fate, claimed once by whoever comes first (see "Fate" above).
ADMITTED, WITHDRAWN = "admitted", "withdrawn"


@dataclass(frozen=True)
class JoinRequest:
    """An applicant, as the members read it from the store."""

    number: int  # its place in the order of applications, from 1
    member: int  # its identity in the membership, stable across generations (a node's: its first rank's)
    signature: tuple[tuple[str, object], ...]  # (field, value) pairs that must equal the members'
    shards: int = 1  # in a job of nodes, one request stands for a whole node of ``shards`` ranks
    # Drawn afresh by each applicant: two workers that apply at once with the same code write the same
    # request otherwise, byte for byte (sealing is deterministic), and a slot's ``compare_set`` could not
    # tell the one who claimed it from the one who found it claimed: both would join as one member.
    nonce: str = ""

    @property
    def members(self) -> tuple[int, ...]:
        """The identities this request brings in (one rank, or every rank of a node)."""
        return tuple(range(self.member, self.member + self.shards))


@dataclass(frozen=True)
class Verdict:
    """What the members decided about one applicant."""

    admitted: bool
    reason: str = ""  # why not, for a rejected applicant
    generation: int = -1  # the decision's generation: the new group forms under it
    members: tuple[int, ...] = ()  # the new world's members in rank order (joiners last)
    donor: int = -1  # the member whose replica the joiner receives
    resume_step: int = 0  # the step from which rounds start on the new groups
    handled: int = 0  # applications decided up to this number (the joiner's watch starts there)
    joiners: tuple[int, ...] = ()  # every joiner admitted with it (member ids), and their donors
    donors: tuple[int, ...] = ()


@dataclass(frozen=True)
class Admission:
    """The joiners part of a decision: who is admitted and from whom, who is refused."""

    joiners: tuple[JoinRequest, ...] = ()
    donors: tuple[int, ...] = ()  # member id of each joiner's donor
    rejected: tuple[tuple[int, str], ...] = ()  # (application number, reason)
    handled: int = 0  # applications up to this number have a verdict
    deferred: int = 0  # applicants left for a later boundary (nobody could donate, or a collective ran)
    #: Whether the applicants were deferred because a member was inside a collective of the whole
    #: world; they are then announced again at the first step boundary after the members complete
    #: one, not after a wait of RETRY_AFTER_S.
    after_collective: bool = False


def slot_key(prefix: str, number: int) -> str:
    """Where application ``number`` lives: claimed whole, with its request, by one ``compare_set``."""
    return f"{prefix}/joiner/{number}"


def ready_key(prefix: str, member: int) -> str:
    """Set by a joiner once it holds its replica (members announce no other change before)."""
    return f"{prefix}/joined/{member}"


class JoinerWatch:
    """What a member's heartbeat thread knows about applicants: the flag the step boundary reads.

    The thread (``refresh``) and the decisions (``decided``) update it under a lock, so a
    refresh made with the previous decision's count never overwrites a newer decision's.
    """

    def __init__(self, seal: Seal | None = None) -> None:
        self._lock = threading.Lock()
        self._seal = Seal() if seal is None else seal
        self._screened: dict[int, bool] = {}  # application number -> whether its seal verified
        self.open = False  # the job takes joiners: set once the front-end is built
        self.handled = 0  # applications with a verdict, from the latest decision
        self.transfers: tuple[str, ...] = ()  # ready keys of the latest admission's joiners still missing
        self.not_before = 0.0  # monotonic time before which deferred applicants are not announced
        self.waiting = False
        #: Whether applicants were deferred by a collective of the whole world; they are announced
        #: again only at the first step boundary after one completes
        #: (:meth:`~.membership.Membership.admission_due`).
        self.after_collective = False

    def due(self) -> bool:
        """Whether an application waits for a decision (read at every step boundary: attributes only)."""
        return (
            self.waiting
            and not self.after_collective
            and not self.transfers
            and time.monotonic() >= self.not_before
        )

    def refresh(self, store: Store, prefix: str) -> None:
        with self._lock:
            if self.transfers:
                self.transfers = tuple(key for key in self.transfers if not store.check([key]))
            self.waiting = self._genuine_waits(store, prefix)

    def _genuine_waits(self, store: Store, prefix: str) -> bool:
        """Whether a genuine application follows the decided ones. Each slot's seal is checked once, here
        (on the heartbeat thread, off the step): a forged application is logged and passed over, so
        that it costs the members no agreement (the decision that admits a later genuine one refuses
        it as well)."""
        number = self.handled + 1
        while store.check([key := slot_key(prefix, number)]):
            genuine = self._screened.get(number)
            if genuine is None:
                try:
                    self._seal.open(store.get(key), key)
                    genuine = True
                except ForgedEntryError as err:
                    REFUSALS.forged("application", key, err)
                    genuine = False
                self._screened[number] = genuine
            if genuine:
                return True
            number += 1
        return False

    def decided(self, store: Store, prefix: str, admission: Admission) -> None:
        """After a decision: applications up to ``admission.handled`` have their verdicts."""
        with self._lock:
            self.handled = admission.handled
            self.transfers = tuple(ready_key(prefix, m) for j in admission.joiners for m in j.members)
            self.waiting = self._genuine_waits(store, prefix)
            self.after_collective = bool(admission.deferred and admission.after_collective)
            if admission.deferred and not admission.after_collective:
                self.not_before = time.monotonic() + RETRY_AFTER_S


def admit(
    store: Store,
    prefix: str,
    handled: int,
    signature: tuple[tuple[str, object], ...],
    donors: Sequence[int],
    blocked: bool,
    seal: Seal,
) -> Admission:
    """Decide the applications after number ``handled`` (the winning proposer calls this).

    ``signature`` is the members' own; ``donors`` the members that can donate, in rank order;
    ``blocked`` says a member is inside a collective of the whole world. Applications whose request
    is not written yet are left for a later decision, as are all of them when nobody can donate. An
    application whose seal does not verify (written without the job's secret) is rejected and logged.
    """
    requests: list[JoinRequest] = []
    forged: list[tuple[int, str]] = []
    number = handled + 1
    while store.check([slot_key(prefix, number)]):  # slots are claimed in order, without gaps
        key = slot_key(prefix, number)
        try:
            requests.append(seal.open(store.get(key), key))
        except ForgedEntryError as err:
            REFUSALS.forged("application", key, err)
            forged.append((number, FORGED_APPLICATION))
        number += 1
    rejected = forged + [(r.number, reason) for r in requests if (reason := mismatch(signature, r.signature))]
    applicants = [r for r in requests if r.number not in dict(rejected)]
    applicants, dead = _alive(store, prefix, applicants)
    rejected += [(r.number, "its heartbeat stopped before it was admitted") for r in dead]
    if applicants and (blocked or not donors):
        # Deferred: handled stops below the first deferred application, so it is decided again.
        first = applicants[0].number
        early = tuple((n, w) for n, w in rejected if n < first)
        return Admission(
            rejected=early, handled=first - 1, deferred=len(applicants), after_collective=blocked
        )
    cycle = itertools.cycle(donors)
    return Admission(
        joiners=tuple(applicants),
        donors=tuple(next(cycle) for _ in applicants),
        rejected=tuple(rejected),
        handled=handled + len(requests) + len(forged),
    )


def _alive(
    store: Store, prefix: str, requests: list[JoinRequest]
) -> tuple[list[JoinRequest], list[JoinRequest]]:
    """Split ``requests`` into applicants whose heartbeats move (within two beats; a node's: all of its
    ranks') and the rest."""
    if not requests:
        return [], []
    keys = {(r.number, m): f"{prefix}/beat/{m}" for r in requests for m in r.members}
    first = {n: int(store.add(k, 0)) for n, k in keys.items()}
    moved: set[tuple[int, int]] = set()
    deadline = time.monotonic() + 3 * HEARTBEAT_S
    while len(moved) < len(keys) and time.monotonic() < deadline:
        time.sleep(POLL_S)
        moved |= {n for n, k in keys.items() if n not in moved and int(store.add(k, 0)) != first[n]}
    live = [r for r in requests if all((r.number, m) in moved for m in r.members)]
    return live, [r for r in requests if r not in live]


def verdict_key(prefix: str, number: int, seal: Seal) -> str:
    """Where application ``number``'s verdict is written: a key an outsider cannot compute
    (:meth:`~.sealing.Seal.private`)."""
    return seal.private(f"{slot_key(prefix, number)}/verdict")


def write_verdicts(store: Store, prefix: str, verdicts: dict[int, Verdict], seal: Seal) -> None:
    """Record each application's verdict (idempotent: every member writes the same bits)."""
    for number, verdict in verdicts.items():
        key = verdict_key(prefix, number, seal)
        store.set(key, seal.seal(verdict, key))


def fate_key(prefix: str, number: int, seal: Seal) -> str:
    """Where application ``number``'s fate is claimed: a key an outsider cannot compute
    (:meth:`~.sealing.Seal.private`)."""
    return seal.private(f"{slot_key(prefix, number)}/fate")


def claim_fate(store: Store, prefix: str, number: int, fate: str, seal: Seal) -> str:
    """Claim application ``number``'s fate (:data:`ADMITTED` by the members, :data:`WITHDRAWN` by its
    applicant at its deadline) unless it is claimed already; returns the fate that holds.

    One ``compare_set``: the first claim stands and everyone reads it. A fate that does not verify
    (written without the job's secret) counts as withdrawn for members and applicant alike, so that
    nobody waits for the other.
    """
    key = fate_key(prefix, number, seal)
    sealed = seal.seal(fate, key)
    held = store.compare_set(key, "", sealed)
    if held == sealed.encode():
        return fate
    try:
        value = seal.open(held, key)
    except ForgedEntryError as err:
        REFUSALS.forged("fate", key, err)  # counts as withdrawn: see above
        return WITHDRAWN
    return value if value in (ADMITTED, WITHDRAWN) else WITHDRAWN


def settle_fates(store: Store, prefix: str, admission: Admission, seal: Seal) -> Admission:
    """``admission`` without the joiners that withdrew before the members claimed them (every member
    calls it on the same decision and reads the same fates, so all drop the same joiners)."""
    kept, donors, withdrawn = [], [], []
    for joiner, donor in zip(admission.joiners, admission.donors, strict=True):
        if claim_fate(store, prefix, joiner.number, ADMITTED, seal) == ADMITTED:
            kept.append(joiner)
            donors.append(donor)
        else:
            withdrawn.append((joiner.number, "it gave up waiting before it was admitted"))
    if not withdrawn:
        return admission
    logger.warning("applications {} withdrew before they were admitted", [n for n, _ in withdrawn])
    return replace(
        admission,
        joiners=tuple(kept),
        donors=tuple(donors),
        rejected=admission.rejected + tuple(withdrawn),
    )


class ApplyAgainError(PeerFailureError):
    """This application ended without admitting the worker, through no fault of its own: no member
    admitted it before its deadline (it withdrew), or a process without the job's secret overwrote it
    in the store (the members refused what they read there). The worker may apply again:
    :meth:`~.growth.Growth.join` does, a bounded number of times."""


#: The reason the members give for an application whose seal does not verify.
FORGED_APPLICATION = "its application does not carry the job's secret"


class Applicant:
    """A worker applying to join a running job: its request, its heartbeat, its wait for a verdict.

    A node joining a job of nodes applies once for its ``shards`` ranks: each rank beats under its
    own identity (``member``, given), the node's rank 0 (``node=(key, True)``) claims the slot and
    writes its number under ``key``, and the node's other ranks (``node=(key, False)``) read it there
    and wait for the same verdict.

    Args:
        store: the job's store.
        info: the running job (:func:`~decent_optim_wrapper.engine.fleet.jobs.job_running`).
        signature: what the members compare with theirs (model layout and options).
        timeout: how long to wait for a verdict before giving up.
        member: this rank's identity, for a node's ranks (else drawn from the slot's number).
        shards: ranks the request stands for (a node's).
        node: where a node's rank 0 shares its slot's number, and whether this rank is rank 0.
        seal: seals the request and opens the verdict with the job's secret (:mod:`~.sealing`).
    """

    def __init__(
        self,
        store: Store,
        info: JobInfo,
        signature: tuple[tuple[str, object], ...],
        timeout: float,
        *,
        member: int | None = None,
        shards: int = 1,
        node: tuple[str, bool] | None = None,
        seal: Seal | None = None,
    ) -> None:
        self._seal = Seal() if seal is None else seal
        self._store = store
        self._prefix = run_prefix(info.run)
        self._info = info
        self._signature = signature
        self._timeout = timeout
        self._stopped = threading.Event()
        self._shards = shards
        self._node = node
        self.member = -1 if member is None else member

    def apply(self) -> Verdict:
        """Apply and wait for the verdict; raises if refused, if the job is gone, or after a deadline."""
        store, prefix = self._store, self._prefix
        reason = mismatch(self._info.signature, self._signature)
        if self._info.signature and reason:  # refused here: the members never hear of it
            raise JoinRejectedError(f"the running job refuses this worker: {reason}.")
        # Members admit at their next step boundary, after recovering from a lost peer if one is
        # being recovered (up to ``timeout`` to notice it, a few seconds to agree).
        deadline = time.monotonic() + 2 * self._timeout + 2 * STALE_AFTER_S
        if self.member >= 0:  # a node's rank: beat before the slot is claimed, so all of them count alive
            self._beat()
        if self._node is None or self._node[1]:
            number = self._claim()
            if self._node is not None:
                store.set(self._node[0], str(number))
        else:
            lead = self.member - self.member % self._shards
            self._await(self._node[0], deadline, lead)
            number = int(store.get(self._node[0]))
        key = verdict_key(prefix, number, self._seal)
        stale: bytes | None = None
        while True:
            self._await(key, deadline, number=number, stale=stale)
            raw = store.get(key)
            try:
                verdict: Verdict = self._seal.open(raw, key)
                break
            except ForgedEntryError as err:  # not the members': wait for theirs, written over it
                REFUSALS.forged("verdict", key, err)
                stale = raw
        if not verdict.admitted:
            self.withdraw()
            if verdict.reason == FORGED_APPLICATION and self._seal.enabled:  # this worker sealed it
                raise ApplyAgainError(
                    f"application {number} was overwritten in the store by a process without the job's "
                    "secret (the members refused what they read there)"
                )
            raise JoinRejectedError(f"the running job refused this worker: {verdict.reason}.")
        return verdict

    def _claim(self) -> int:
        """Claim the first free slot, request included, with one ``compare_set``: an applicant that dies
        at any point leaves either no slot or a whole request (whose heartbeat then never moves)."""
        store, prefix = self._store, self._prefix
        number = int(store.add(f"{prefix}/joiners/count", 0)) + 1
        given = self.member >= 0
        while True:
            member = self.member if given else self._info.launch_world_size + number - 1
            entry = JoinRequest(
                number, member - member % self._shards, self._signature, self._shards, secrets.token_hex(16)
            )
            request = self._seal.seal(entry, slot_key(prefix, number))
            if store.compare_set(slot_key(prefix, number), "", request) == request.encode():
                break
            number += 1
        store.add(f"{prefix}/joiners/count", 1)  # a hint for the next applicant's first try
        if not given:
            self.member = member
            self._beat()
        return number

    def _beat(self) -> None:
        key = f"{self._prefix}/beat/{self.member}"
        self._store.add(key, 1)
        start_heartbeat(self._store, key, self._prefix, self._stopped)

    def _await(
        self,
        key: str,
        deadline: float,
        lead: int | None = None,
        number: int | None = None,
        stale: bytes | None = None,
    ) -> None:
        """Wait until ``key`` is in the store while the job's members (and the node's rank ``lead``,
        whose slot this rank follows) are alive; past ``deadline``, raise, unless this is the wait for
        application ``number``'s verdict and the members claimed it admitted first (:func:`claim_fate`):
        then wait on, while they are alive. With ``stale``, wait until ``key`` holds another value."""
        store = self._store
        watched = {"alive": f"{self._prefix}/alive"}
        if lead is not None:
            watched["lead"] = f"{self._prefix}/beat/{lead}"
        last = {name: (-1, time.monotonic()) for name in watched}
        while not store.check([key]) or (stale is not None and store.get(key) == stale):
            now = time.monotonic()
            for name, counter in watched.items():
                count = int(store.add(counter, 0))
                if count != last[name][0]:
                    last[name] = (count, now)
                elif now - last[name][1] > STALE_AFTER_S:
                    self.withdraw()
                    if name == "lead":
                        raise PeerFailureError(
                            "rank 0 of this node stopped while the node applied to the running job; a "
                            "node joins whole, so this rank stops too. Start the node's processes again."
                        )
                    raise PeerFailureError(
                        f"the job {self._prefix!r} this worker applied to has no live member (no "
                        f"heartbeat for {STALE_AFTER_S:.0f} s); start the job afresh (it is over, or its "
                        "store is stale)."
                    )
            if now > deadline and (
                number is None or claim_fate(store, self._prefix, number, WITHDRAWN, self._seal) == WITHDRAWN
            ):
                self.withdraw()
                raise ApplyAgainError(
                    f"no member of the running job admitted this worker within "
                    f"{2 * self._timeout + 2 * STALE_AFTER_S:.0f} s "
                    "(members admit joiners at a step boundary); raise timeout, "
                    "or check that the members train with on_peer_failure='continue'."
                )
            if now > deadline:
                deadline = float("inf")  # admitted: the verdict follows while the members are alive
            time.sleep(POLL_S)

    def withdraw(self) -> None:
        """Stop the heartbeat: the members take this applicant for gone (after an aborted join)."""
        self._stopped.set()

    @property
    def stopped(self) -> threading.Event:
        """Set when the applicant withdraws; a joined worker's membership takes the heartbeat over."""
        return self._stopped


def joiner_verdicts(
    admission: Admission, generation: int, members: tuple[int, ...], resume: int
) -> dict[int, Verdict]:
    """The verdict of every application an admission decided."""
    verdicts = {n: Verdict(False, reason) for n, reason in admission.rejected}
    joiners = tuple(j.member for j in admission.joiners)
    for joiner, donor in zip(admission.joiners, admission.donors, strict=True):
        verdicts[joiner.number] = Verdict(
            True, "", generation, members, donor, resume, admission.handled, joiners, admission.donors
        )
    return verdicts

"""What a change of members does to one rank's engine: recovering from a lost peer and admitting joiners
(``on_peer_failure="continue"``, :func:`~decent_optim_wrapper.init_elastic`).

:class:`MemberChanges` is the elastic machinery the engine holds. On a lost peer the survivors agree
on the new world (:mod:`~.survival`, :mod:`~.fleet.membership`), settle the rounds in flight, and
rewire over the members left (:class:`~.wiring.Wiring`); a joiner (:mod:`~.fleet.growth`) is wired
the same way once admitted, and loads its donor's replica. Everything here runs inside a collective
the engine started, so its callers are collectives too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any, TypeVar

import torch

from decent_optim_wrapper.engine.exchange.buckets import Bucket, current
from decent_optim_wrapper.engine.fleet.growth import Growth
from decent_optim_wrapper.engine.fleet.jobs import current_job
from decent_optim_wrapper.engine.fleet.membership import ChannelReport, Decision, Membership, PeerLost, Phase
from decent_optim_wrapper.engine.fleet.status import StatusBoard
from decent_optim_wrapper.engine.progress import StepProgress
from decent_optim_wrapper.engine.rules.local_steps import LocalSteps
from decent_optim_wrapper.engine.state.averaging import GlobalAverage
from decent_optim_wrapper.engine.survival import Survival, settle_rounds
from decent_optim_wrapper.engine.wiring import Wiring

__all__ = ["MemberChanges"]

_T = TypeVar("_T")

#: A replica's engine state, saved by a donor and loaded by a joiner.
EngineState = dict[str, Any]


class MemberChanges:
    """The engine's side of a change of members.

    Args:
        wiring: the engine's communication, rewired over the new members.
        progress: the engine's step counters (rounds restart from the agreed step).
        buckets: the engine's buckets (live); ``local``: low-communication gossip's state, or None.
        averaging: the engine's global average (its rounds are forgotten on a change).
        survival: the recovery loop, or None with ``on_peer_failure="raise"``.
        growth: joins (enabled with survival).
        join_signature: what a joiner must share with the members (the engine's layout).
        save, load: the engine's state, saved by a donor and loaded by a joiner.
        status: the status record a joiner publishes once admitted (:mod:`~.fleet.status`).
    """

    def __init__(
        self,
        wiring: Wiring,
        progress: StepProgress,
        *,
        buckets: list[Bucket],
        local: LocalSteps | None,
        averaging: GlobalAverage,
        survival: Survival | None,
        growth: Growth,
        join_signature: tuple[tuple[str, object], ...],
        save: Callable[[], EngineState],
        load: Callable[[EngineState], None],
        status: StatusBoard | None = None,
    ) -> None:
        self._wiring, self._progress = wiring, progress
        self._buckets, self._local, self._averaging = buckets, local, averaging
        self._survival, self._growth = survival, growth
        self._join_signature = join_signature
        self._save, self._load = save, load
        self._status = status

    @property
    def timeout(self) -> timedelta:
        return self._wiring.timeout

    @property
    def on_peer_failure(self) -> str:
        """``"raise"`` or ``"continue"``."""
        return "raise" if self._survival is None else "continue"

    @property
    def survival(self) -> Survival | None:
        """The lost peers survived and their hooks (:mod:`~.survival`); None with ``"raise"``."""
        return self._survival

    @property
    def growth(self) -> Growth:
        """Joins seen by this rank, their hooks, and what joiners receive (:mod:`~.growth`)."""
        return self._growth

    @property
    def membership(self) -> Membership | None:
        """Survival's view of the job, or None with ``"raise"``."""
        return None if self._survival is None else self._survival.membership

    # -- growing the world (init_elastic, on_peer_failure="continue") -----------------------------------
    def open_to_joiners(
        self,
        save: Callable[[], dict[str, Any]],
        load: Callable[[dict[str, Any]], None],
        signature: tuple[tuple[str, object], ...] = (),
    ) -> None:
        """Let workers join (in a job of :func:`~decent_optim_wrapper.init_elastic`); on a joiner, join.

        ``save()``/``load(state)`` give and take the front-end's part of a replica, ``signature`` what a
        joiner must share besides the engine's layout. The protocol: :mod:`~.fleet.admission`; the
        transfer and the mean: :mod:`~.fleet.growth`.
        """
        job = current_job()
        if job is None:
            return

        def wire(membership: Membership) -> None:  # a joiner's world, once admitted
            self._survival = Survival(membership, self.timeout)
            self._wiring.rewire(None, [], membership)

        def load_replica(state: dict[str, Any], resume_step: int) -> None:
            self._load({**state, "rank": self._wiring.rank})
            self._restart_rounds(resume_step)

        signature = (*self._join_signature, *signature)
        self._growth.open(
            job, self.membership, signature, self.timeout, (save, load), (wire, load_replica), self._status
        )

    # -- surviving a lost peer -------------------------------------------------------------------------
    def survive(self, action: Callable[[], _T], retry: bool = True) -> _T | None:
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

    def leave(self) -> None:
        """Leave the job for good (a rank clipped gossip's audit quarantined): the others recover without
        it at once (:meth:`~.fleet.membership.Membership.leave`)."""
        if self._survival is not None:
            self._survival.membership.leave()

    def admit_due_joiners(self) -> None:
        """At a step boundary: admit the workers applying to join, if this boundary looks for them (the
        others follow from their waits)."""
        survival = self._survival
        if survival is not None and survival.joins_checked_at(self._progress.step):
            self.survive(survival.raise_if_joins_due, retry=False)

    @contextlib.contextmanager
    def unbroken(self) -> Iterator[None]:
        """Run a collective of the whole world that cannot be redone over new groups (``add_param_group``):
        a change of members announced before this rank entered is followed first, and no member
        announces one while a member is inside (:meth:`~.fleet.membership.Membership.enter_unbroken`)."""
        membership = self.membership
        if membership is None:
            yield
            return
        with self._averaging.whole_world():  # a change followed here defers its applicants
            self.survive(membership.enter_unbroken)
        try:
            yield
        finally:
            membership.leave_unbroken()

    def collective_done(self) -> None:
        """Count a completed collective of the whole world (members announce changes only once every
        member is out of it: :meth:`~.fleet.membership.Membership.try_announce`)."""
        if self._survival is not None:
            self._survival.membership.collective_done()

    @torch.no_grad()
    def _recover(self, cause: BaseException) -> None:
        """Agree with the others on the new world, settle the rounds in flight, and rewire over it."""
        assert self._survival is not None
        wiring, progress = self._wiring, self._progress

        def reports() -> list[ChannelReport]:  # the rounds this rank has in flight
            return wiring.gossip.reports("params") + ([] if self._local is None else self._local.reports())

        def rewire(decision: Decision | None, before: list[int]) -> None:
            assert self._survival is not None
            wiring.rewire(decision, before, self._survival.membership)

        phase: Phase = "collective" if self._averaging.busy else "updating" if progress.updated else "idle"
        while True:
            try:
                self._survival.recover(
                    cause,
                    step=progress.step,
                    position=self._position(),
                    rank=wiring.rank,
                    reports=reports,
                    settle=self._settle_rounds,
                    rewire=rewire,
                    phase=phase,
                    admitted=self._admitted,
                )
                return
            except PeerLost as again:  # a transfer to a joiner met a lost peer in turn
                cause = again

    def _position(self) -> int:
        """The first step whose rounds this rank can still launch (paced: the first round)."""
        progress = self._progress
        step = progress.step + 1 if progress.in_step else progress.step
        return step if self._local is None else self._local.position(step)

    def _restart_rounds(self, launch_from: int) -> None:
        self._progress.launch_from = launch_from
        if self._local is not None:
            self._local.restart(launch_from)

    def _admitted(self, decision: Decision, previous_rank: int) -> None:
        assert self._survival is not None
        membership, step = self._survival.membership, self._progress.step
        self._growth.admitted(decision, membership, previous_rank, step, self._save, self.timeout)

    def _settle_rounds(self, decision: Decision) -> None:
        assert self._survival is not None
        member, factor = self._survival.membership.member, self._progress.mixing_factor
        with current(self._buckets, write=True):  # the parts write the buckets as they would views
            settle_rounds(decision, member, self._buckets, self._wiring.gossip, self._local, factor)
        # The trackers restart over the survivors (their mean would still hold the lost rank's share).
        self._averaging.forget_rounds()
        self._restart_rounds(decision.resume_step)
        staging = self._wiring.staging
        if staging is not None:  # no staged launch may reach the groups about to be shut down
            staging.drain(self.timeout)

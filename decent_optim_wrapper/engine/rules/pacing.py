r"""Paced rounds for uneven fleets: each rank takes as many inner steps per round as its speed allows.

With low-communication gossip (:mod:`~.local_steps`) a round ends after ``H`` inner steps on every
rank, so a fast rank waits for a slow neighbour at every fold. Paced rounds end after a number of
inner steps planned per rank, ``n_i(r)``, so that every rank spends about the same time ``tau`` on a
round. Ranks still gossip round ``r`` with round ``r`` (rounds are matched by their index, never by
step), so no collective is ever unmatched, whatever the counts are.

**Planning.** Every rank measures its own step time ``t_i`` (host time between consecutive steps,
minus the time it waited for peers; an exponential average over rounds, which jumps to a round's
mean when that differs by more than a quarter: a change of speed). Every ``repace_every``
rounds the ranks exchange it (a non-blocking all-gather of integers, consumed one round later, so it
waits only for a peer a whole round behind). From the shared rates every rank computes the same
round length

.. math::
    \tau = \frac{N H}{\sum_j 1 / t_j},

the time in which the fleet takes ``N H`` steps, as many as a round of ``H`` steps on ``N`` equal
ranks, so an outer learning rate tuned for ``H`` carries over. Rank ``i`` then plans
``q_i = tau / t_i`` steps per round (with its latest ``t_i``, so it follows its own slowdowns at
once), rounded by error diffusion (the fractions carry over, so counts average ``q_i`` exactly) and
held in ``[1, max_share H]``. Round ``r`` is folded in ``ceil(D n_i(r+1) / H)`` inner steps after
its launch: the same fraction ``D / H`` of a round on every rank. The first three rounds take ``H``
steps (round 0, which compiles and warms up, is not measured).

**What the average does.** Mixing is unchanged, so the mean of the anchors is kept exactly as
without pacing. With equal batches per step, the mean pseudo-gradient is the sum of every sample's
contribution over ``N`` (to first order in the learning rate), as under DDP at batch ``N b`` over
the same samples: ``weighting="samples"`` (the default) leaves the pseudo-gradients as they are.
Weighting them by the samples each rank processed in the round would count a fast rank's samples
twice (once through its extra steps, once through the weight). ``weighting="workers"`` scales
rank ``i``'s pseudo-gradient by ``H / n_i(r)`` instead, so that every worker's data weighs the same
whatever its speed (FedNova's normalisation, Wang et al., "Tackling the Objective Inconsistency
Problem in Heterogeneous Federated Optimization", 2020): for fixed shards of data that differ.

A ``schedule`` (a function ``(rank, round) -> steps``) replaces the measurement: counts fixed in
advance, bitwise reproducible (the tests drive the exact rule this way).

**Changes of the world.** After a lost peer or a joiner, survivors resume by round, not by step
(:meth:`PacedClock.position`, :meth:`PacedClock.restart`): rounds launch again from the furthest
round any survivor can still launch, a joiner takes its donor's clock, and the pace messages restart
at that round on the new group. **Decentralized HSDP**: the shards of a replica plan with their
slowest shard's step time, a MAX over the shard mesh every round, so they take the same steps.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from decent_optim_wrapper.checks import is_int, is_real
from decent_optim_wrapper.engine.errors import GossipError
from decent_optim_wrapper.engine.fleet.comm import wait_all

__all__ = [
    "FixedClock",
    "PaceReport",
    "PacedClock",
    "Pacing",
    "PacingSpec",
    "UNPACED_ROUNDS",
    "planned_steps",
    "resolve_pacing",
    "round_seconds",
]

#: The weightings of a rank's pseudo-gradient (see the module docstring).
WEIGHTINGS = ("samples", "workers")

#: Rounds at the start that take ``sync_every`` steps: round 0 is not measured (compilation, warm-up),
#: round 1 is, and its measurement travels with the first pace message.
UNPACED_ROUNDS = 3

#: A round whose mean step differs from the estimate by more than this fraction is a change of speed
#: (a throttled or freed machine): the estimate jumps to it instead of averaging it in.
_CHANGE = 0.25

#: A step that takes longer than this many times the estimate (an evaluation, a checkpoint, a garbage
#: collection) counts as this many estimates: the rest is time the rank did not spend training.
_OUTLIER = 3.0


@dataclass(frozen=True)
class Pacing:
    """Options of paced rounds (``pacing=Pacing(...)``; ``pacing="measured"`` is ``Pacing()``).

    Args:
        weighting: ``"samples"`` (default): the average moves as DDP's over the samples processed.
            ``"workers"``: each worker's pseudo-gradient is scaled to ``H`` steps, so every worker's
            data weighs the same (for fixed, differing shards).
        repace_every: rounds between two exchanges of the ranks' step times.
        max_share: the most inner steps a rank takes in a round, in units of ``sync_every``; bounds
            how far a fast rank drifts from its neighbours between two mixings.
        schedule: ``schedule(rank, round)`` gives rank ``rank``'s inner steps in round ``round``
            (rounds count from 0; it returns an int >= 1), in place of the measured speeds, from the
            first round on: reproducible counts, or speeds known in advance.
        clock: where step times are read from: a function returning seconds that never go back
            (``time.perf_counter``, the default). Another clock paces by another measure of work,
            e.g. a simulation's model of each machine's speed: the plan is then reproducible
            whatever the host's load (the tests pace this way). Each rank may pass its own.
    """

    weighting: str = "samples"
    repace_every: int = 8
    max_share: float = 4.0
    schedule: Callable[[int, int], int] | None = None
    clock: Callable[[], float] = time.perf_counter

    def agreement(self) -> tuple[object, ...]:
        """What every rank must agree on (a schedule is a function: only its presence is compared)."""
        return (self.weighting, self.repace_every, self.max_share, self.schedule is not None)


#: What a ``pacing`` argument may be.
PacingSpec = Pacing | str | None


def resolve_pacing(pacing: object) -> Pacing | None:
    """Check a ``pacing`` argument: None (every round takes ``sync_every`` steps), ``"measured"``, or a
    :class:`Pacing`."""
    if pacing is None:
        return None
    if pacing == "measured":
        return Pacing()
    if not isinstance(pacing, Pacing):
        raise TypeError(
            f"pacing must be None, 'measured' or a Pacing(...), got {pacing!r}; e.g. pacing='measured' to "
            "let each rank take as many inner steps per round as its speed allows."
        )
    if pacing.weighting not in WEIGHTINGS:
        raise ValueError(
            f"Pacing(weighting={pacing.weighting!r}) is not one of {WEIGHTINGS}; 'samples' (the default) "
            "moves the average as DDP's over the samples processed."
        )
    every = pacing.repace_every
    if not is_int(every) or every < 1:
        raise ValueError(
            f"Pacing(repace_every={every!r}) must be an int >= 1 (rounds between pace messages)."
        )
    share = pacing.max_share
    if not is_real(share) or not 1 <= share < math.inf:
        raise ValueError(
            f"Pacing(max_share={share!r}) must be a finite number >= 1 (the most inner steps a rank takes "
            "per round, in units of sync_every)."
        )
    if pacing.schedule is not None and not callable(pacing.schedule):
        raise TypeError(
            f"Pacing(schedule={pacing.schedule!r}) must be a function (rank, round) -> inner steps, or None."
        )
    if not callable(pacing.clock):
        raise TypeError(
            f"Pacing(clock={pacing.clock!r}) must be a function returning seconds, e.g. time.perf_counter "
            "(the default)."
        )
    return pacing


def round_seconds(step_seconds: list[float], sync_every: int) -> float | None:
    """``tau``: the time in which ranks of these step times take ``N * sync_every`` steps together.

    A rank that has not measured itself yet (0: it joined or resumed within the last round) counts
    as the mean rate of the others; None when nobody has.
    """
    known = [t for t in step_seconds if t > 0]
    if not known:
        return None
    return len(known) * sync_every / sum(1.0 / t for t in known)


def planned_steps(
    tau: float, step_s: float, carry: float, sync_every: int, max_share: float
) -> tuple[int, float]:
    """A round's inner steps for a rank of step time ``step_s`` and the fraction carried to the next.

    ``carry`` (start: 0.5, i.e. rounding to nearest) holds what earlier roundings left over, so the
    counts average ``tau / step_s``; the count is held in ``[1, max_share * sync_every]``.
    """
    wanted = tau / step_s + carry
    steps = max(1, min(math.floor(max_share * sync_every), math.floor(wanted)))
    return steps, min(1.0, max(0.0, wanted - steps))


@dataclass(frozen=True)
class PaceReport:
    """Where a rank's pacing stands (``pace_report()`` on a front-end).

    ``rounds``: rounds launched; ``steps``: inner steps planned for the current round;
    ``step_seconds``: the rank's measured step time (None before it is measured);
    ``round_seconds``: the agreed round length (None before the first pace message);
    ``waited_seconds``: the time spent waiting for peers' rounds and pace messages so far.
    """

    rounds: int
    steps: int
    step_seconds: float | None
    round_seconds: float | None
    waited_seconds: float


class FixedClock:
    """Rounds of ``sync_every`` inner steps on every rank: round ``r`` ends after step ``(r + 1) H - 1``
    and is folded in ``sync_delay`` steps later."""

    def __init__(self, sync_every: int, sync_delay: int) -> None:
        self._every, self._delay = sync_every, sync_delay

    def round_ending_at(self, step: int) -> int | None:
        return (step + 1) // self._every - 1 if (step + 1) % self._every == 0 else None

    def fold_after(self, round_: int, step: int) -> int:
        return (round_ + 1) * self._every - 1 + self._delay

    def scale(self) -> float:
        return 1.0

    def rounds_launched(self, step: int) -> int:
        return step // self._every

    def position(self, step_position: int) -> int:
        """Where this rank stands for a recovery: the first step whose round it can still launch."""
        return step_position

    def launches(self, round_: int, step: int, launch_from: int) -> bool:
        """Whether the round ending at ``step`` is launched after a change of the world (rounds of
        steps before ``launch_from``, the survivors' furthest position, are not)."""
        return step >= launch_from

    def restart(self, launch_from: int) -> None:
        pass

    @contextmanager
    def waiting(self) -> Iterator[None]:
        yield

    def connect(self, group: dist.ProcessGroup | None, rank: int, world_size: int, **wiring: Any) -> None:
        pass

    def state_dict(self) -> dict[str, Any] | None:
        return None

    def load_state_dict(self, state: dict[str, Any] | None, step: int) -> None:
        pass


class PacedClock:
    """Rounds of a planned number of inner steps per rank (see the module docstring).

    The engine asks it, at every bucket's end of step, whether a round ends (:meth:`round_ending_at`)
    and when the round in flight is folded in (:meth:`fold_after`); the first question about a new
    step also times the step before and, past a round's end, plans the next round.
    """

    def __init__(self, pacing: Pacing, sync_every: int, sync_delay: int) -> None:
        self._pacing, self._every, self._delay = pacing, sync_every, sync_delay
        self._group: dist.ProcessGroup | None = None
        self._device = torch.device("cpu")
        self._rank, self._world_size = 0, 1
        # The current round: its index, first step and planned steps; the round before: when it folds.
        self._round, self._start, self._steps = 0, 0, sync_every
        self._fold_previous = -1
        self._carry = 0.5
        self._step_s: float | None = None
        self._tau: float | None = None
        self._pace: tuple[int, dist.Work | None, torch.Tensor] | None = None  # (due round, work, buffer)
        self._pace_result: tuple[int, list[int]] | None = None  # a received message not yet applied
        # Pace messages go out at rounds origin, origin + repace_every, ...: the same rounds on every
        # rank, moved to the survivors' resume round after a change of the world (see restart).
        self._pace_origin = UNPACED_ROUNDS - 1
        self._waiter: Callable[..., None] = wait_all
        self._timeout: timedelta | None = None
        self._replica_max: Callable[[float], float] | None = None
        # Timing: the last step seen and when it was first seen; the round's measured time and steps.
        self._seen, self._seen_at = -1, 0.0
        self._round_time, self._round_steps = 0.0, 0
        self._waited_since_tick = 0.0
        self.waited_seconds = 0.0

    def connect(
        self,
        group: dist.ProcessGroup | None,
        rank: int,
        world_size: int,
        device: torch.device | None = None,
        waiter: Callable[..., None] | None = None,
        timeout: timedelta | None = None,
        replica_max: Callable[[float], float] | None = None,
    ) -> None:
        """Wire the clock once the process groups exist (again after a change of the world).

        ``group``: where the pace messages travel (the gossip world's), on ``device`` (the buckets':
        NCCL takes CUDA tensors only), waited for with ``waiter`` within ``timeout`` (a membership's
        failure-aware wait with survival). ``replica_max`` (decentralized HSDP): the maximum of a
        value over the ranks that hold one replica's shards, which must take the same steps.
        """
        self._group, self._rank, self._world_size = group, rank, world_size
        self._device = torch.device("cpu") if device is None else device
        self._waiter = wait_all if waiter is None else waiter
        self._timeout, self._replica_max = timeout, replica_max
        if self._round == 0 and self._seen < 0:  # before the first step: round 0's count is this rank's
            self._steps = self._plan(0)

    # -- the engine's questions ------------------------------------------------------------------------
    def round_ending_at(self, step: int) -> int | None:
        """The round that ends after inner step ``step``, or None."""
        self._advance(step)
        return self._round if step == self._start + self._steps - 1 else None

    def fold_after(self, round_: int, step: int) -> int:
        """The inner step after which round ``round_`` (launched, not yet folded) is folded in."""
        self._advance(step)
        if round_ == self._round:  # launched at the end of this step: its fold is planned next step
            return step + 1 if self._delay > 0 else step
        return self._fold_previous

    def scale(self) -> float:
        """The factor of this rank's pseudo-gradient for the round that ends now."""
        if self._pacing.weighting == "workers":
            return self._every / self._steps
        return 1.0

    def rounds_launched(self, step: int) -> int:
        return self._round + 1 if step > self._start + self._steps - 1 else self._round

    def position(self, step_position: int) -> int:
        """Where this rank stands for a recovery: the first round it can still launch, given the first
        step whose rounds it can still launch. Survivors resume at the furthest rank's round: rounds
        are matched by index, and ranks stand at different steps of one round."""
        return self.rounds_launched(step_position)

    def launches(self, round_: int, step: int, launch_from: int) -> bool:
        """Whether round ``round_`` is launched after a change of the world (from ``launch_from`` on)."""
        return round_ >= launch_from

    def restart(self, launch_from: int) -> None:
        """After a change of the world (a lost peer, a joiner), with rounds launched from round
        ``launch_from``: drop the pace message in flight (its group is gone, and not every rank sent
        it) and any received but not applied (not every rank received it), and send the next ones
        from the round after it on, the first round no member has begun (a member may stand inside
        round ``launch_from``, past its message), so that every member sends them at the same rounds
        of the new group. The round length stands until the next message, which counts the new world."""
        self._pace = self._pace_result = None
        self._pace_origin = max(UNPACED_ROUNDS - 1, launch_from + 1)

    @contextmanager
    def waiting(self) -> Iterator[None]:
        """Time spent in here is waiting for peers, not training: left out of the step time."""
        clock = self._pacing.clock
        began = clock()
        try:
            yield
        finally:
            waited = clock() - began
            self._waited_since_tick += waited
            self.waited_seconds += waited

    def report(self) -> PaceReport:
        return PaceReport(self._round, self._steps, self._step_s, self._tau, self.waited_seconds)

    # -- timing and planning ---------------------------------------------------------------------------
    def _advance(self, step: int) -> None:
        if step != self._seen:
            self._tick(step)
        if step > self._start + self._steps - 1:
            self._plan_next()  # again after a recovery if a lost peer interrupted it

    def _tick(self, step: int) -> None:
        now = self._pacing.clock()
        if self._seen >= 0 and step == self._seen + 1 and self._round >= 1:
            spent = now - self._seen_at - self._waited_since_tick
            if self._step_s is not None:
                spent = min(spent, _OUTLIER * self._step_s)
            self._round_time += max(spent, 0.0)
            self._round_steps += 1
        self._seen, self._seen_at, self._waited_since_tick = step, now, 0.0

    def _plan_next(self) -> None:
        """Past the end of a round: update the speed estimate, exchange it when due, plan the next
        round. Nothing changes before the exchange, which may meet a lost peer (and run again after
        the recovery)."""
        step_s = self._estimate()
        with self.waiting():
            self._exchange(self._round + 1, step_s)
        self._step_s = step_s
        self._round_time, self._round_steps = 0.0, 0
        self._round, self._start = self._round + 1, self._start + self._steps
        self._steps = self._plan(self._round)
        # The round that just ended folds the same fraction D / H of the next round on every rank.
        self._fold_previous = self._start - 1 + math.ceil(self._delay * self._steps / self._every)

    def _estimate(self) -> float | None:
        """The step time after the round that just ended (the replica's slowest rank's under HSDP)."""
        measured = self._round_time / self._round_steps if self._round_steps > 0 else 0.0
        if self._replica_max is not None and self._pacing.schedule is None:
            with self.waiting():  # every rank of a replica, at every round: they take the same steps
                measured = self._replica_max(measured)
        known = self._step_s
        if measured <= 0.0:
            return known
        if known is None or abs(measured - known) > _CHANGE * known:
            return measured  # a new speed: planned with at once, so nobody waits for it
        return 0.5 * (known + measured)  # noise: smoothed over rounds

    def _plan(self, round_: int) -> int:
        schedule = self._pacing.schedule
        if schedule is not None:
            steps = schedule(self._rank, round_)
            if not is_int(steps) or steps < 1:
                raise ValueError(
                    f"Pacing(schedule=...) gave {steps!r} inner steps for rank {self._rank} in round "
                    f"{round_}; it must return an int >= 1."
                )
            return steps
        if self._tau is None or self._step_s is None:
            return self._every
        steps, self._carry = planned_steps(
            self._tau, self._step_s, self._carry, self._every, self._pacing.max_share
        )
        return steps

    def _exchange(self, round_: int, step_s: float | None) -> None:
        """Apply a pace message due at ``round_``; send ``step_s`` when one is due (0: not measured yet,
        sent all the same: every rank sends at the same rounds, or the all-gathers would mismatch)."""
        if self._pacing.schedule is not None:
            return
        if self._pace is not None and self._pace[0] <= round_:
            self._receive()
        if self._pace_result is not None:
            self._tau = round_seconds([ns / 1e9 for ns in self._pace_result[1]], self._every) or self._tau
            self._pace_result = None
        origin = self._pace_origin
        if round_ >= origin and (round_ - origin) % self._pacing.repace_every == 0:
            nanoseconds = 0 if step_s is None else max(1, round(step_s * 1e9))
            mine = torch.tensor([nanoseconds], dtype=torch.int64, device=self._device)
            if self._group is None or self._world_size == 1:
                self._pace = (round_ + 1, None, mine)
                return
            gathered = torch.empty(self._world_size, dtype=torch.int64, device=self._device)
            work = dist.all_gather_into_tensor(gathered, mine, group=self._group, async_op=True)
            self._pace = (round_ + 1, work, gathered)

    def _receive(self) -> None:
        """Wait for the pace message in flight (every rank sent it) and hold its values until applied."""
        assert self._pace is not None
        due, work, buffer = self._pace
        if work is not None:
            self._waiter([work], buffer.device, self._timeout, lambda cause: self._failure(due - 1, cause))
        self._pace, self._pace_result = None, (due, [int(v) for v in buffer.tolist()])

    def _failure(self, round_: int, cause: BaseException | None) -> GossipError:
        limit = f"within {self._timeout}" if self._timeout is not None else "within the process group timeout"
        return GossipError(
            f"rank {self._rank}: the pace message of round {round_} (every rank's step time, all-gathered "
            f"over the gossip world) did not complete: a peer died or did not answer {limit}. Check the "
            f"other ranks' logs; restart from the last checkpoint. Cause: {cause}"
        )

    # -- checkpoints -----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The round position and plan, the speed estimate and a pace message received or in flight
        (waited for: every rank sent it at the same round)."""
        pending = None
        if self._pace is not None:
            with self.waiting():
                self._receive()
        if self._pace_result is not None:
            pending = [self._pace_result[0], list(self._pace_result[1])]
        return {
            "round": self._round,
            "start": self._start,
            "steps": self._steps,
            "fold_previous": self._fold_previous,
            "carry": self._carry,
            "step_s": self._step_s,
            "tau": self._tau,
            "pace": pending,
            "pace_origin": self._pace_origin,
        }

    def load_state_dict(self, state: dict[str, Any] | None, step: int) -> None:
        """Restore a :meth:`state_dict`; None (a checkpoint without pacing, or resumed at another world
        size) starts a round of ``sync_every`` steps at ``step``, its index counted in such rounds."""
        if state is None:
            self._round, self._start, self._steps = step // self._every, step, self._every
            self._fold_previous, self._carry, self._step_s, self._tau = -1, 0.5, None, None
            self._pace = self._pace_result = None
            self._pace_origin = UNPACED_ROUNDS - 1
        else:
            self._round, self._start, self._steps = (
                int(state["round"]),
                int(state["start"]),
                int(state["steps"]),
            )
            self._fold_previous, self._carry = int(state["fold_previous"]), float(state["carry"])
            self._step_s, self._tau = state["step_s"], state["tau"]
            pace = state["pace"]
            self._pace_origin = int(state.get("pace_origin", UNPACED_ROUNDS - 1))
            self._pace = None
            self._pace_result = None if pace is None else (int(pace[0]), [int(v) for v in pace[1]])
        self._seen = -1
        self._round_time, self._round_steps = 0.0, 0

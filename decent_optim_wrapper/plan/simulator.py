r"""Simulate a training run's step dependency graph: when does every rank finish every step?

Each rank ``r`` repeats: compute (forward and backward, ``c[r, t]`` seconds from
:class:`~.compute.ComputeTimes`), then its step's own CPU work (``overhead_s``: the optimizer update,
plus staging and mixing for gossip). Communication decides when a step may end:

* **No communication**: ``end[r, t] = end[r, t-1] + c[r, t] + o``.
* **All-reduce** (DDP): bucket ``b`` is ready on rank ``r`` at ``end[r, t-1] + f_b c[r, t]``; its
  all-reduce starts when every rank has it ready and the previous bucket's all-reduce is over, and takes
  ``d_b`` seconds. ``end[r, t] = max(end[r, t-1] + c[r, t], last all-reduce's end) + o``: every step
  waits for the slowest rank.
* **Gossip** (the engine's step protocol): a rank mixes the round launched at its previous step, takes
  its local update and launches this step's round. The round of step ``t`` in group ``G`` starts when
  every member has launched it, at ``s_G = max_{m in G} end[m, t]``, and arrives ``d_G`` seconds
  later, overlapping the members' next compute:

  .. math::
      \mathrm{end}[r, t] = \max\bigl(\mathrm{end}[r, t-1] + c[r, t],\;
      s_{G(r, t-1)} + d_{G(r, t-1)}\bigr) + o.

  A rank therefore waits only for its group, and only when the exchange is slower than its compute.
  **Blocking** gossip (``blocking=True``: the engine's ``sync_every=1, sync_delay=0``) mixes the round
  in before the next forward, so the next compute starts only when it has arrived:

  .. math::
      \mathrm{end}[r, t] = s_{G(r, t-1)} + d_{G(r, t-1)} + c[r, t] + o,

  every exchange added to the step instead of hidden behind it.
* **Low-communication** gossip (``sync_every=H``, ``sync_delay=D``: the engine's anchors): round
  ``k`` is launched at the end of step ``t_k = (k + 1) H - 1`` in phase ``k`` of the topology and
  folded in at the end of step ``t_k + D``; the other steps end at their compute plus ``o``:

  .. math::
      \mathrm{end}[r, t] = \max\bigl(\mathrm{end}[r, t-1] + c[r, t],\;
      s_{G_k(r)} + d_{G_k(r)} \text{ if } t = t_k + D\bigr) + o
      + e\,[t = t_j] + f\,[t = t_k + D],

  where ``e`` and ``f`` are a round's own CPU seconds on a member (``encode_s``: staging and
  encoding at the launch; ``fold_s``: decoding the members' payloads and folding them in), which
  grow with the wire format (a top-k selection, a quantization) rather than with the link.
  A model on a GPU gossiping over gloo stages its rounds through host memory: the round starts
  ``stage_out_s`` after its last member launched it (the copy out, beside the compute), and
  ``stage_in_s`` (the copy back) is added to ``f``.
  ``D = 0`` blocks: the step after the launch starts ``f`` after the round has arrived.
  ``d_G`` is not fixed: a round is a :class:`~.sharing.Transfer`, and rounds in flight at the same
  time on the same link (two ranks of a node sending to other nodes, or a round of step ``t + 1``
  catching up with a neighbour's round of step ``t``) share it only while they overlap
  (:class:`~.sharing.LinkSharing`).

**Paced rounds** (``pacing=True``: the engine's ``pacing="measured"``,
:mod:`~decent_optim_wrapper.engine.rules.pacing`) end round ``k`` on rank ``i`` after ``n_i(k)`` steps
instead of ``H``. Rounds 0 to 2 take ``H`` steps; later ones follow the engine's own plan for every
rank's mean step time ``t_i`` (the mean of its compute draws plus ``o``: what the engine measures,
host time per step minus waits): the round length ``tau = N H / sum_j 1 / t_j`` and
``q_i = tau / t_i`` steps, rounded by error diffusion and held in ``[1, max_share H]``. Round ``k`` is
launched at the end of rank ``i``'s last step of it (in phase ``k``, matched with the members' round
``k`` whatever their steps) and folded in at the end of the step ``ceil(D n_i(k + 1) / H)`` steps
later (``D = 0``: before the next step starts). Every rank runs the same number of rounds, so the
ranks end with different step counts and their seconds per step no longer compare:
:meth:`Run.steps_per_second` (every rank's steps over the time it took them, summed) does. With
equal step times every ``n_i(k)`` is ``H`` and a paced run is the unpaced one, event for event. The
plan uses each rank's mean over the whole run, where the engine follows its latest rounds; a round's
own processor time (``e``, ``f``) is left out of ``t_i``, and the pace messages (a few bytes,
consumed a round after they are sent) are not simulated.

Every time is the earliest the graph allows (its longest path). No communication and DDP (one
all-reduce at a time, so nothing shares a link) are found step by step: the graph's edges only go
from step ``t - 1`` to step ``t``. Gossip is simulated event by event in time order (compute done,
step ended, round started, round's last byte sent, round arrived), since a round's duration depends
on what else is in flight. A ``barrier_at`` step starts on every rank when the last rank has ended the
step before (the benchmark's barrier before its timed window).
"""

from __future__ import annotations

import heapq
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from decent_optim_wrapper.checks import is_real
from decent_optim_wrapper.engine.rules.pacing import UNPACED_ROUNDS, planned_steps, round_seconds
from decent_optim_wrapper.plan.compute import ComputeTimes
from decent_optim_wrapper.plan.sharing import LinkSharing, SharingModel, Transfer
from decent_optim_wrapper.topo.group import Phase

__all__ = ["UNPACED_ROUNDS", "AllReduce", "Gossip", "NoComm", "Run", "Scheme", "paced_steps", "simulate"]


@dataclass(frozen=True)
class NoComm:
    """Every rank trains alone; ``overhead_s``: the update's own seconds per step."""

    world_size: int
    overhead_s: float = 0.0


@dataclass(frozen=True)
class AllReduce:
    """DDP: ``buckets`` are ``(seconds, ready_fraction)``, all-reduced in order (see the module docstring)."""

    world_size: int
    buckets: Sequence[tuple[float, float]]
    overhead_s: float = 0.0


@dataclass(frozen=True)
class Gossip:
    """Gossip: ``phase(k)`` groups the ranks for round ``k``, ``rounds(k)`` is each group's round.

    ``rounds(k)[i]`` is the :class:`~.sharing.Transfer` of group ``phase(k)[i]`` (``Transfer.fixed``
    for a round of a fixed length); ``sharing`` says how rounds that overlap on a link split it.
    Per-step gossip launches round ``k`` at step ``k``; with ``sync_every=H`` round ``k`` is launched
    at step ``(k + 1) H - 1`` and folded in ``sync_delay`` steps later (see the module docstring).
    ``pacing``: paced rounds, each rank taking as many steps per round as its speed allows, at most
    ``max_share * sync_every`` (the engine's ``pacing="measured"``; a run is then sized in rounds).
    Build one from a topology with :func:`~decent_optim_wrapper.plan.schemes.gossip_scheme`.
    """

    world_size: int
    phase: Callable[[int], Phase]
    rounds: Callable[[int], Sequence[Transfer]]
    overhead_s: float = 0.0
    sharing: SharingModel = field(default_factory=SharingModel)
    blocking: bool = False  # the next compute waits for the round (the same as sync_delay=0)
    sync_every: int = 1  # a round after every sync_every-th step (low-communication gossip)
    sync_delay: int = 1  # steps a round has to arrive before it is folded in (0 blocks)
    encode_s: float = 0.0  # a round's CPU seconds on each member at its launch
    fold_s: float = 0.0  # and when it is folded in (decoding, summing)
    stage_out_s: float = 0.0  # host staging: the copy out, after the launch, before the round starts
    stage_in_s: float = 0.0  # and the copy back in, on the compute stream, before the fold
    pacing: bool = False  # paced rounds: n_i(k) steps per round, planned from each rank's step time
    max_share: float = 4.0  # the most steps a paced round takes, in units of sync_every

    def __post_init__(self) -> None:
        if self.sync_every < 1 or not 0 <= self.sync_delay <= self.sync_every:
            raise ValueError(
                f"need sync_every >= 1 and 0 <= sync_delay <= sync_every, got sync_every="
                f"{self.sync_every}, sync_delay={self.sync_delay}"
            )
        if self.encode_s < 0 or self.fold_s < 0:
            raise ValueError(f"encode_s and fold_s must be >= 0, got {self.encode_s} and {self.fold_s}")
        if self.stage_out_s < 0 or self.stage_in_s < 0:
            raise ValueError(
                f"stage_out_s and stage_in_s must be >= 0, got {self.stage_out_s} and {self.stage_in_s}"
            )
        share = self.max_share
        if not is_real(share) or not 1 <= share < math.inf:
            raise ValueError(
                f"max_share={share!r} must be a finite number >= 1 (the most steps a paced round takes, in "
                "units of sync_every), as the engine's Pacing(max_share=...); the default is 4.0."
            )

    @property
    def delay(self) -> int:
        """How many steps pass between a round's launch and its fold; 0 blocks."""
        return 0 if self.blocking else self.sync_delay

    def round_of(self, step: int) -> int | None:
        """The round launched at the end of ``step``, or None (unpaced rounds)."""
        return step // self.sync_every if (step + 1) % self.sync_every == 0 else None


Scheme = NoComm | AllReduce | Gossip


@dataclass
class Run:
    """The simulated end of every step on every rank, seconds from the start.

    ``ends[t][r]``: step ``t`` on rank ``r``, when every rank took the same number of steps (always
    but in a paced run of uneven ranks, where it is empty); ``rank_ends[r][t]``: the same, rank by rank,
    for every run. ``round_steps[r][k]``: the steps rank ``r`` took in round ``k`` (a partial last
    round included; without rounds, no communication and DDP, every step counts as one).
    ``waited[r]``: seconds rank ``r`` spent waiting for peers (a round to fold in, a barrier, an
    all-reduce). ``barriers[t]`` is when the barrier before step ``t`` let every rank go.
    """

    ends: list[list[float]] = field(default_factory=list)
    barriers: dict[int, float] = field(default_factory=dict)
    rank_ends: list[list[float]] = field(default_factory=list)
    round_steps: list[list[int]] = field(default_factory=list)
    waited: list[float] = field(default_factory=list)

    def iteration_s(self, skip: int = 0) -> float:
        """Mean seconds per step over the ranks, steps ``skip ..`` (``skip`` steps of warm-up left out).

        Timed from the barrier before step ``skip`` if there is one (as the benchmark times).
        """
        if not self.ends and self.rank_ends:
            raise ValueError(
                "the ranks took different numbers of steps (paced rounds), so their seconds per step do not "
                "compare; use steps_per_second(skip_rounds) for the fleet's throughput."
            )
        if not 0 <= skip < len(self.ends):
            raise ValueError(f"skip must be in [0, {len(self.ends)}), got {skip}")
        n = len(self.ends[-1])
        if skip in self.barriers:
            first = [self.barriers[skip]] * n
        else:
            first = self.ends[skip - 1] if skip else [0.0] * n
        last = self.ends[-1]
        steps = len(self.ends) - skip
        return sum(b - a for a, b in zip(first, last, strict=True)) / (len(last) * steps)

    def steps_per_second(self, skip_rounds: int = 0) -> float:
        """The fleet's throughput: the sum over the ranks of each rank's steps after its first
        ``skip_rounds`` rounds over the time they took, from its end of round ``skip_rounds - 1`` (0 for
        none) to its last end.

        It compares runs whose ranks take different numbers of steps (paced rounds). A rank's steps
        lie in its own window, so a rank of step time ``t_r`` adds at most ``1 / t_r``: the sum is at
        most ``sum_r 1 / t_r``, reached when no rank waits, and in a periodic steady state timed over
        whole periods it is the steps of all ranks over the time of a period. (One window for all
        ranks, from the last rank's end of round ``skip_rounds - 1``, would credit a rank that got
        there earlier with steps it took before the window.)
        """
        rounds = min(len(counts) for counts in self.round_steps)
        if not 0 <= skip_rounds < rounds:
            raise ValueError(
                f"skip_rounds must be in [0, {rounds}) (the rounds every rank ran), got {skip_rounds}"
            )
        total = 0.0
        for ends, counts in zip(self.rank_ends, self.round_steps, strict=True):
            skipped = sum(counts[:skip_rounds])
            start = ends[skipped - 1] if skipped else 0.0
            total += (len(ends) - skipped) / (ends[-1] - start)
        return total


def simulate(scheme: Scheme, compute: ComputeTimes, steps: int, barrier_at: int | None = None) -> Run:
    """Run ``scheme`` for ``steps`` steps with compute times from ``compute``; all ranks start at 0.

    A paced :class:`Gossip` runs ``steps // sync_every`` rounds on every rank (``steps`` is the nominal
    count, ``H`` per round), each rank taking its planned steps.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    n = scheme.world_size
    if isinstance(scheme, Gossip) and scheme.pacing:
        return _simulate_paced(scheme, compute, steps, barrier_at)
    draws = [compute.draws(rank, steps) for rank in range(n)]
    if isinstance(scheme, Gossip):
        every = scheme.sync_every
        counts = [[every] * (steps // every) for _ in range(n)]
        return _GossipRun(scheme, draws, _Rounds(counts, [steps] * n, every, scheme.delay), barrier_at).go()
    run = Run(waited=[0.0] * n)
    previous = [0.0] * n
    for t in range(steps):
        if t == barrier_at:
            opened = max(previous)
            run.waited = [w + opened - p for w, p in zip(run.waited, previous, strict=True)]
            previous = [opened] * n
            run.barriers[t] = opened
        computed = [previous[r] + draws[r][t] for r in range(n)]
        if isinstance(scheme, NoComm):
            ends = [c + scheme.overhead_s for c in computed]
        else:
            done = 0.0
            for seconds, fraction in scheme.buckets:
                ready = max(previous[r] + fraction * draws[r][t] for r in range(n))
                done = max(done, ready) + seconds
            ends = [max(c, done) + scheme.overhead_s for c in computed]
            run.waited = [w + max(0.0, done - c) for w, c in zip(run.waited, computed, strict=True)]
        run.ends.append(ends)
        previous = ends
    run.rank_ends = [list(column) for column in zip(*run.ends, strict=True)]
    run.round_steps = [[1] * steps for _ in range(n)]
    return run


def paced_steps(scheme: Gossip, step_seconds: Sequence[float], rounds: int) -> list[list[int]]:
    """Every rank's steps in rounds ``0 .. rounds - 1`` as the engine plans them for these step times.

    Rounds 0 to 2 take ``H = sync_every`` steps; later ones ``q_i = tau / t_i`` rounded by error
    diffusion (carry from 0.5) and held in ``[1, max_share H]``, with
    ``tau = N H / sum_j 1 / t_j`` (:func:`~decent_optim_wrapper.engine.rules.pacing.round_seconds`,
    :func:`~decent_optim_wrapper.engine.rules.pacing.planned_steps`).
    """
    every = scheme.sync_every
    tau = round_seconds(list(step_seconds), every)
    assert tau is not None, "every rank's step time is known here"
    plans = []
    for seconds in step_seconds:
        counts, carry = [every] * min(rounds, UNPACED_ROUNDS), 0.5
        for _ in range(UNPACED_ROUNDS, rounds):
            steps, carry = planned_steps(tau, seconds, carry, every, scheme.max_share)
            counts.append(steps)
        plans.append(counts)
    return plans


def _simulate_paced(scheme: Gossip, compute: ComputeTimes, steps: int, barrier_at: int | None) -> Run:
    rounds = steps // scheme.sync_every
    if rounds < 1:
        raise ValueError(
            f"a paced run is sized in rounds of sync_every={scheme.sync_every} nominal steps, so steps "
            f"must be >= sync_every, got steps={steps}"
        )
    if barrier_at is not None:
        raise ValueError(
            f"barrier_at={barrier_at}: paced ranks stand at different steps, so a barrier before one step "
            "has no meaning; leave barrier_at out and time rounds with Run.steps_per_second(skip_rounds)."
        )
    n = scheme.world_size
    # The engine's t_i: host time per step minus waits, i.e. compute plus the step's own CPU time (a
    # round's, once per round, left out), averaged over the nominal steps; a rank's draws are one
    # stream, so drawing its planned steps afterwards extends the same draws.
    nominal = [compute.draws(rank, rounds * scheme.sync_every) for rank in range(n)]
    counts = paced_steps(scheme, [statistics.fmean(d) + scheme.overhead_s for d in nominal], rounds)
    totals = [sum(c) for c in counts]
    draws = [compute.draws(rank, totals[rank]) for rank in range(n)]
    return _GossipRun(scheme, draws, _Rounds(counts, totals, scheme.sync_every, scheme.delay), None).go()


class _Rounds:
    """Which round every step of every rank launches or folds in, from each rank's steps per round.

    Round ``k`` is launched at the end of the rank's last step of it and, with ``delay = D >= 1``,
    folded in at the end of the step ``ceil(D n(k + 1) / H)`` steps later (``n(k + 1)``: the next
    round's steps, ``H`` past the last round): ``D`` steps for rounds of ``H``, as the engine's
    :class:`~decent_optim_wrapper.engine.rules.pacing.PacedClock` and ``FixedClock`` rule.
    """

    def __init__(self, counts: list[list[int]], steps: list[int], every: int, delay: int) -> None:
        self.steps = steps  # per rank, at least the rounds' steps (an unpaced run's partial round)
        self.launches: list[list[int | None]] = [[None] * total for total in steps]
        self.folds: list[list[int | None]] = [[None] * total for total in steps]
        self.launch_step: list[list[int]] = [[] for _ in steps]
        self.fold_step: list[list[int]] = [[] for _ in steps]
        self.round_steps: list[list[int]] = []
        for rank, per_round in enumerate(counts):
            last = -1
            for k, count in enumerate(per_round):
                last += count
                self.launches[rank][last] = k
                self.launch_step[rank].append(last)
                following = per_round[k + 1] if k + 1 < len(per_round) else every
                fold = last + math.ceil(delay * following / every)
                self.fold_step[rank].append(fold)
                if delay and fold < steps[rank]:
                    self.folds[rank][fold] = k
            rest = steps[rank] - (last + 1)
            self.round_steps.append(list(per_round) + ([rest] if rest else []))


class _GossipRun:
    """The event loop of one gossip simulation (see the module docstring)."""

    def __init__(self, scheme: Gossip, draws: list[list[float]], rounds: _Rounds, barrier_at: int | None):
        self.scheme, self.draws, self.rounds, self.barrier_at = scheme, draws, rounds, barrier_at
        n = scheme.world_size
        self.run = Run(
            rank_ends=[[0.0] * total for total in rounds.steps],
            round_steps=rounds.round_steps,
            waited=[0.0] * n,
        )
        self.links: LinkSharing[tuple[int, int]] = LinkSharing(scheme.sharing)  # keyed by (round, group)
        self.events: list[tuple[float, int, str, int, int]] = []  # (time, order, kind, rank or group, step)
        self.order = 0
        self.step_of = [0] * n  # the step each rank is in
        self.computed: list[float | None] = [None] * n  # when the current step's compute is done
        self.arrivals: dict[tuple[int, int], float] = {}  # (round, rank) -> when it reached the rank
        self.launched: dict[tuple[int, int], list[float]] = {}  # (round, group) -> members' launches
        self.at_barrier: dict[int, float] = {}  # rank -> when it reached the barrier
        self.group_of: dict[int, dict[int, int]] = {}  # round -> rank -> index of its group

    def push(self, at: float, kind: str, who: int, step: int) -> None:
        heapq.heappush(self.events, (at, self.order, kind, who, step))
        self.order += 1

    def go(self) -> Run:
        for r in range(self.scheme.world_size):
            self.start_step(r, 0, 0.0)
        while self.events or self.links:
            ending = self.links.next_end()
            if ending is not None and (not self.events or ending[0] <= self.events[0][0]):
                at, key = ending
                transfer = self.links.end(key, at)
                round_index, group = key
                self.push(at + transfer.latency_s, "arrived", group, round_index)
                continue
            at, _, kind, who, index = heapq.heappop(self.events)
            if kind == "computed":
                self.computed[who] = at
                self.maybe_end(who, index)
            elif kind == "arrived":
                self.arrived(who, index, at)
            elif kind == "staged":  # every member's copy to the host is done: the round starts
                self.links.start((index, who), self.scheme.rounds(index)[who], at)
            else:  # "ended"
                self.end_step(who, index, at)
        ends = self.run.rank_ends
        if len({len(e) for e in ends}) == 1:  # equal step counts: also step by step
            self.run.ends = [list(step) for step in zip(*ends, strict=True)]
        return self.run

    def arrived(self, group: int, round_index: int, at: float) -> None:
        scheme, rounds = self.scheme, self.rounds
        for r in scheme.phase(round_index)[group].ranks:
            if scheme.delay == 0:  # blocking: the next forward starts once the round is folded in
                launch_step = rounds.launch_step[r][round_index]
                if launch_step + 1 < rounds.steps[r]:
                    self.run.waited[r] += at - self.run.rank_ends[r][launch_step]
                    self.proceed(r, launch_step + 1, at + scheme.stage_in_s + scheme.fold_s)
                continue
            self.arrivals[(round_index, r)] = at
            if self.step_of[r] == rounds.fold_step[r][round_index]:
                self.maybe_end(r, self.step_of[r])

    def start_step(self, rank: int, step: int, at: float) -> None:
        self.step_of[rank] = step
        self.computed[rank] = None
        self.push(at + self.draws[rank][step], "computed", rank, step)

    def maybe_end(self, rank: int, step: int) -> None:
        """Step ``step`` of ``rank`` ends ``o`` (and its rounds' CPU time) after its compute and the
        round it folds in (if any) are both done."""
        computed, scheme = self.computed[rank], self.scheme
        if computed is None:
            return
        end = computed + scheme.overhead_s
        folded = self.rounds.folds[rank][step]
        if folded is not None:
            arrival = self.arrivals.get((folded, rank))
            if arrival is None:
                return
            del self.arrivals[(folded, rank)]
            self.run.waited[rank] += max(0.0, arrival - computed)
            end = max(computed, arrival) + scheme.overhead_s + scheme.stage_in_s + scheme.fold_s
        if self.rounds.launches[rank][step] is not None:
            end += scheme.encode_s
        self.computed[rank] = None
        self.push(end, "ended", rank, step)

    def end_step(self, rank: int, step: int, at: float) -> None:
        self.run.rank_ends[rank][step] = at
        round_index = self.rounds.launches[rank][step]
        if round_index is not None:
            phase = self.scheme.phase(round_index)
            if round_index not in self.group_of:
                self.group_of[round_index] = {r: i for i, g in enumerate(phase) for r in g.ranks}
            group = self.group_of[round_index][rank]
            launched = self.launched.setdefault((round_index, group), [])
            launched.append(at)
            if len(launched) == phase[group].size:  # every member has launched: the round starts
                del self.launched[(round_index, group)]
                if self.scheme.stage_out_s > 0:  # once the last member's copy to the host is done
                    self.push(at + self.scheme.stage_out_s, "staged", group, round_index)
                else:
                    self.links.start((round_index, group), self.scheme.rounds(round_index)[group], at)
            if self.scheme.delay == 0:
                return  # the next step starts when the round arrives
        if step + 1 < self.rounds.steps[rank]:
            self.proceed(rank, step + 1, at)

    def proceed(self, rank: int, step: int, at: float) -> None:
        """``rank`` may start step ``step`` at ``at``, or wait there for the barrier before it."""
        if step != self.barrier_at:
            self.start_step(rank, step, at)
            return
        self.at_barrier[rank] = at
        if len(self.at_barrier) == self.scheme.world_size:  # the last rank is in: every rank goes
            self.run.barriers[step] = at
            for r in range(self.scheme.world_size):
                self.run.waited[r] += at - self.at_barrier[r]
                self.start_step(r, step, at)

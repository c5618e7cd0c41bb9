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
  ``d_G`` is not fixed: a round is a :class:`~.sharing.Transfer`, and rounds in flight at the same
  time on the same link (two ranks of a node sending to other nodes, or a round of step ``t + 1``
  catching up with a neighbour's round of step ``t``) share it only while they overlap
  (:class:`~.sharing.LinkSharing`).

Every time is the earliest the graph allows (its longest path). No communication and DDP (one
all-reduce at a time, so nothing shares a link) are found step by step: the graph's edges only go
from step ``t - 1`` to step ``t``. Gossip is simulated event by event in time order (compute done,
step ended, round started, round's last byte sent, round arrived), since a round's duration depends
on what else is in flight. A ``barrier_at`` step starts on every rank when the last rank has ended the
step before (the benchmark's barrier before its timed window).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from decent_optim_wrapper.plan.compute import ComputeTimes
from decent_optim_wrapper.plan.sharing import LinkSharing, SharingModel, Transfer
from decent_optim_wrapper.topo.group import Phase

__all__ = ["AllReduce", "Gossip", "NoComm", "Run", "Scheme", "simulate"]


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
    """Per-step gossip: ``phase(t)`` groups the ranks at step ``t``, ``rounds(t)`` is each group's round.

    ``rounds(t)[i]`` is the :class:`~.sharing.Transfer` of group ``phase(t)[i]`` (``Transfer.fixed``
    for a round of a fixed length); ``sharing`` says how rounds that overlap on a link split it. Build
    one from a topology with :func:`~decent_optim_wrapper.plan.schemes.gossip_scheme`.
    """

    world_size: int
    phase: Callable[[int], Phase]
    rounds: Callable[[int], Sequence[Transfer]]
    overhead_s: float = 0.0
    sharing: SharingModel = field(default_factory=SharingModel)
    blocking: bool = False  # the next compute waits for the round (sync_every=1, sync_delay=0)


Scheme = NoComm | AllReduce | Gossip


@dataclass
class Run:
    """The simulated end of every step on every rank (``ends[t][r]``, seconds from the start).

    ``barriers[t]`` is when the barrier before step ``t`` let every rank go.
    """

    ends: list[list[float]] = field(default_factory=list)
    barriers: dict[int, float] = field(default_factory=dict)

    def iteration_s(self, skip: int = 0) -> float:
        """Mean seconds per step over the ranks, steps ``skip ..`` (``skip`` steps of warm-up left out).

        Timed from the barrier before step ``skip`` if there is one (as the benchmark times).
        """
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


def simulate(scheme: Scheme, compute: ComputeTimes, steps: int, barrier_at: int | None = None) -> Run:
    """Run ``scheme`` for ``steps`` steps with compute times from ``compute``; all ranks start at 0."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    n = scheme.world_size
    draws = [compute.draws(rank, steps) for rank in range(n)]
    if isinstance(scheme, Gossip):
        return _simulate_gossip(scheme, draws, steps, barrier_at)
    run = Run()
    previous = [0.0] * n
    for t in range(steps):
        if t == barrier_at:
            previous = [max(previous)] * n
            run.barriers[t] = previous[0]
        computed = [previous[r] + draws[r][t] for r in range(n)]
        if isinstance(scheme, NoComm):
            ends = [c + scheme.overhead_s for c in computed]
        else:
            done = 0.0
            for seconds, fraction in scheme.buckets:
                ready = max(previous[r] + fraction * draws[r][t] for r in range(n))
                done = max(done, ready) + seconds
            ends = [max(c, done) + scheme.overhead_s for c in computed]
        run.ends.append(ends)
        previous = ends
    return run


class _GossipRun:
    """The event loop of one gossip simulation (see the module docstring)."""

    def __init__(self, scheme: Gossip, draws: list[list[float]], steps: int, barrier_at: int | None):
        self.scheme, self.draws, self.steps, self.barrier_at = scheme, draws, steps, barrier_at
        n = scheme.world_size
        self.run = Run(ends=[[0.0] * n for _ in range(steps)])
        self.links: LinkSharing[tuple[int, int]] = LinkSharing(scheme.sharing)  # keyed by (step, group)
        self.events: list[tuple[float, int, str, int, int]] = []  # (time, order, kind, rank or group, step)
        self.order = 0
        self.computed: list[float | None] = [None] * n  # when the current step's compute is done
        self.arrived: list[float | None] = [0.0] * n  # when the round of the previous step arrived
        self.launched: dict[tuple[int, int], list[float]] = {}  # (step, group) -> members' launches
        self.at_barrier = 0
        self.group_of: dict[int, dict[int, int]] = {}  # step -> rank -> index of its group

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
                step, group = key
                self.push(at + transfer.latency_s, "arrived", group, step)
                continue
            at, _, kind, who, step = heapq.heappop(self.events)
            if kind == "computed":
                self.computed[who] = at
                self.maybe_end(who, step)
            elif kind == "arrived":
                for r in self.scheme.phase(step)[who].ranks:
                    self.arrived[r] = at
                    if step + 1 < self.steps:
                        if self.scheme.blocking:  # the next forward starts at the mixed point
                            self.proceed(r, step + 1, at)
                        else:
                            self.maybe_end(r, step + 1)
            else:  # "ended"
                self.end_step(who, step, at)
        return self.run

    def start_step(self, rank: int, step: int, at: float) -> None:
        self.computed[rank] = None
        self.push(at + self.draws[rank][step], "computed", rank, step)

    def maybe_end(self, rank: int, step: int) -> None:
        """Step ``step`` of ``rank`` ends ``o`` after its compute and its previous round are both done."""
        computed, arrived = self.computed[rank], self.arrived[rank]
        if computed is not None and arrived is not None:
            self.computed[rank] = self.arrived[rank] = None
            self.push(max(computed, arrived) + self.scheme.overhead_s, "ended", rank, step)

    def end_step(self, rank: int, step: int, at: float) -> None:
        self.run.ends[step][rank] = at
        phase = self.scheme.phase(step)
        if step not in self.group_of:
            self.group_of[step] = {r: i for i, g in enumerate(phase) for r in g.ranks}
        group = self.group_of[step][rank]
        launched = self.launched.setdefault((step, group), [])
        launched.append(at)
        if len(launched) == phase[group].size:  # every member has launched: the round starts
            del self.launched[(step, group)]
            self.links.start((step, group), self.scheme.rounds(step)[group], at)
        if step + 1 < self.steps and not self.scheme.blocking:
            self.proceed(rank, step + 1, at)

    def proceed(self, rank: int, step: int, at: float) -> None:
        """``rank`` may start step ``step`` at ``at``, or wait there for the barrier before it."""
        if step != self.barrier_at:
            self.start_step(rank, step, at)
            return
        self.at_barrier += 1
        if self.at_barrier == self.scheme.world_size:  # the last rank is in: every rank goes
            self.run.barriers[step] = at
            for r in range(self.scheme.world_size):
                self.start_step(r, step, at)


def _simulate_gossip(scheme: Gossip, draws: list[list[float]], steps: int, barrier_at: int | None) -> Run:
    return _GossipRun(scheme, draws, steps, barrier_at).go()

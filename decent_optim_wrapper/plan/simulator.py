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
  ``D = 0`` blocks: the step after the launch starts ``f`` after the round has arrived.
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
    """Gossip: ``phase(k)`` groups the ranks for round ``k``, ``rounds(k)`` is each group's round.

    ``rounds(k)[i]`` is the :class:`~.sharing.Transfer` of group ``phase(k)[i]`` (``Transfer.fixed``
    for a round of a fixed length); ``sharing`` says how rounds that overlap on a link split it.
    Per-step gossip launches round ``k`` at step ``k``; with ``sync_every=H`` round ``k`` is launched
    at step ``(k + 1) H - 1`` and folded in ``sync_delay`` steps later (see the module docstring).
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

    def __post_init__(self) -> None:
        if self.sync_every < 1 or not 0 <= self.sync_delay <= self.sync_every:
            raise ValueError(
                f"need sync_every >= 1 and 0 <= sync_delay <= sync_every, got sync_every="
                f"{self.sync_every}, sync_delay={self.sync_delay}"
            )
        if self.encode_s < 0 or self.fold_s < 0:
            raise ValueError(f"encode_s and fold_s must be >= 0, got {self.encode_s} and {self.fold_s}")

    @property
    def delay(self) -> int:
        """How many steps pass between a round's launch and its fold; 0 blocks."""
        return 0 if self.blocking else self.sync_delay

    def round_of(self, step: int) -> int | None:
        """The round launched at the end of ``step``, or None."""
        return step // self.sync_every if (step + 1) % self.sync_every == 0 else None

    def folded_at(self, step: int) -> int | None:
        """The round folded in at the end of ``step`` (``D >= 1``), or None."""
        if self.delay == 0 or step < self.delay:
            return None
        return self.round_of(step - self.delay)


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
        self.links: LinkSharing[tuple[int, int]] = LinkSharing(scheme.sharing)  # keyed by (round, group)
        self.events: list[tuple[float, int, str, int, int]] = []  # (time, order, kind, rank or group, step)
        self.order = 0
        self.step_of = [0] * n  # the step each rank is in
        self.computed: list[float | None] = [None] * n  # when the current step's compute is done
        self.arrivals: dict[tuple[int, int], float] = {}  # (round, rank) -> when it reached the rank
        self.launched: dict[tuple[int, int], list[float]] = {}  # (round, group) -> members' launches
        self.at_barrier = 0
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
            else:  # "ended"
                self.end_step(who, index, at)
        return self.run

    def arrived(self, group: int, round_index: int, at: float) -> None:
        scheme = self.scheme
        launch_step = (round_index + 1) * scheme.sync_every - 1
        for r in scheme.phase(round_index)[group].ranks:
            if scheme.delay == 0:  # blocking: the next forward starts once the round is folded in
                if launch_step + 1 < self.steps:
                    self.proceed(r, launch_step + 1, at + scheme.fold_s)
                continue
            self.arrivals[(round_index, r)] = at
            if self.step_of[r] == launch_step + scheme.delay:
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
        folded = scheme.folded_at(step)
        if folded is not None:
            arrival = self.arrivals.get((folded, rank))
            if arrival is None:
                return
            del self.arrivals[(folded, rank)]
            end = max(computed, arrival) + scheme.overhead_s + scheme.fold_s
        if scheme.round_of(step) is not None:
            end += scheme.encode_s
        self.computed[rank] = None
        self.push(end, "ended", rank, step)

    def end_step(self, rank: int, step: int, at: float) -> None:
        self.run.ends[step][rank] = at
        round_index = self.scheme.round_of(step)
        if round_index is not None:
            phase = self.scheme.phase(round_index)
            if round_index not in self.group_of:
                self.group_of[round_index] = {r: i for i, g in enumerate(phase) for r in g.ranks}
            group = self.group_of[round_index][rank]
            launched = self.launched.setdefault((round_index, group), [])
            launched.append(at)
            if len(launched) == phase[group].size:  # every member has launched: the round starts
                del self.launched[(round_index, group)]
                self.links.start((round_index, group), self.scheme.rounds(round_index)[group], at)
            if self.scheme.delay == 0:
                return  # the next step starts when the round arrives
        if step + 1 < self.steps:
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

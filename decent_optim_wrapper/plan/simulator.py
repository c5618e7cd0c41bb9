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
  every member has launched it and lasts ``d_G`` seconds, overlapping the members' next compute:

  .. math::
      \mathrm{end}[r, t] = \max\bigl(\mathrm{end}[r, t-1] + c[r, t],\;
      \max_{m \in G(r, t-1)} \mathrm{end}[m, t-1] + d_{G(r, t-1)}\bigr) + o.

  A rank therefore waits only for its group, and only when the exchange is slower than its compute.

Every time is the earliest the graph allows (its longest path), found step by step: the graph's
edges only go from step ``t - 1`` to step ``t``, so visiting steps in order visits events in a valid
order. A ``barrier_at`` step starts on every rank when the last rank has ended the step before (the
benchmark's barrier before its timed window).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from decent_optim_wrapper.plan.compute import ComputeTimes
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
    """Per-step gossip: ``phase(t)`` groups the ranks at step ``t``, ``seconds(t)`` times each group's round.

    Build one from a topology with :func:`~decent_optim_wrapper.plan.schemes.gossip_scheme`.
    """

    world_size: int
    phase: Callable[[int], Phase]
    seconds: Callable[[int], Sequence[float]]
    overhead_s: float = 0.0


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
    run = Run()
    previous = [0.0] * n
    arrival = [0.0] * n  # when the round a rank launched at the previous step has arrived
    for t in range(steps):
        if t == barrier_at:
            previous = [max(previous)] * n
            run.barriers[t] = previous[0]
        computed = [previous[r] + draws[r][t] for r in range(n)]
        if isinstance(scheme, NoComm):
            ends = [c + scheme.overhead_s for c in computed]
        elif isinstance(scheme, AllReduce):
            done = 0.0
            for seconds, fraction in scheme.buckets:
                ready = max(previous[r] + fraction * draws[r][t] for r in range(n))
                done = max(done, ready) + seconds
            ends = [max(c, done) + scheme.overhead_s for c in computed]
        else:
            ends = [max(c, a) + scheme.overhead_s for c, a in zip(computed, arrival, strict=True)]
            arrival = _gossip_arrivals(scheme, t, ends)
        run.ends.append(ends)
        previous = ends
    return run


def _gossip_arrivals(scheme: Gossip, step: int, launched: list[float]) -> list[float]:
    """When the round each rank launched at ``step`` has arrived (its group's last launch + its time)."""
    arrival = [0.0] * scheme.world_size
    for group, seconds in zip(scheme.phase(step), scheme.seconds(step), strict=True):
        done = max(launched[r] for r in group.ranks) + seconds
        for r in group.ranks:
            arrival[r] = done
    return arrival

"""The :class:`Topology` contract: a periodic schedule of gossip groups, validated before use."""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property

import torch

from decent_optim_wrapper.topo import analysis
from decent_optim_wrapper.topo.group import Group

__all__ = ["Phase", "Topology"]

#: One phase of a schedule: disjoint groups that together cover every rank.
Phase = tuple[Group, ...]


def _check_positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r} of type {type(value).__name__}.")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}.")
    return value


class Topology:
    """A periodic schedule that says, for every step, which ranks average together.

    Subclasses implement :meth:`assign_groups`, which returns for every rank its list of groups, one
    per phase; phases cycle with the step (phase ``t % period`` at step ``t``). A group is a sorted
    list of ranks (the rank itself included), or a :class:`Group` when it needs a non-uniform
    self-weight. Inside ``assign_groups`` read ``self._world_size``, ``self._local_world_size`` and
    ``self._num_nodes``.

    The schedule is validated once, on first use and before any communication: every rank is in
    exactly one group per phase, every member of a group lists the same group, every phase's mixing
    matrix is doubly stochastic with non-negative entries (so the mean of the parameters is preserved),
    and the groups of one period connect all ranks (otherwise replicas on the two sides of the cut would
    never agree). Problems are a :class:`ValueError` naming the phase and the ranks.

    Example::

        class Swap(Topology):  # needs an even world size
            def assign_groups(self):
                n = self._world_size
                right = [[r - r % 2, r - r % 2 + 1] for r in range(n)]  # (0, 1), (2, 3), ...
                left = [sorted({r, (r + 1) % n if r % 2 else (r - 1) % n}) for r in range(n)]
                return [[right[r], left[r]] for r in range(n)]

        TopologyFactory.add_topology("swap", Swap)

    Args:
        world_size: number of ranks.
        local_world_size: ranks per node; must divide ``world_size``.
    """

    def __init__(self, world_size: int, local_world_size: int = 1) -> None:
        self._world_size = _check_positive_int("world_size", world_size)
        self._local_world_size = _check_positive_int("local_world_size", local_world_size)
        if world_size % local_world_size != 0:
            raise ValueError(
                f"local_world_size={local_world_size} must divide world_size={world_size}: every node "
                "runs the same number of ranks. Set LOCAL_WORLD_SIZE (or local_world_size) to the "
                "number of processes per node."
            )
        self._num_nodes = world_size // local_world_size

    # -- the part a subclass writes ------------------------------------------------------------
    def assign_groups(self) -> Sequence[Sequence[Sequence[int] | Group]]:
        """Return ``groups[rank][phase]``: each rank's group (sorted ranks, or a :class:`Group`) per phase."""
        raise NotImplementedError(f"{type(self).__name__} must implement assign_groups().")

    # -- derived, validated views ----------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def local_world_size(self) -> int:
        return self._local_world_size

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @property
    def name(self) -> str:
        """The name this topology is registered under, else its class name."""
        from decent_optim_wrapper.topo.factory import TopologyFactory

        return TopologyFactory.name_of(type(self))

    @cached_property
    def schedule(self) -> tuple[Phase, ...]:
        """The validated schedule: one :data:`Phase` per step of the period, groups ordered by first rank."""
        return _validate(self._world_size, self.assign_groups(), type(self).__name__)

    @property
    def period(self) -> int:
        return len(self.schedule)

    def phase(self, step: int) -> Phase:
        """The groups that average at ``step``."""
        return self.schedule[step % self.period]

    def group(self, rank: int, step: int) -> Group:
        """The group ``rank`` belongs to at ``step``."""
        if not 0 <= rank < self._world_size:
            raise ValueError(f"rank={rank} is outside [0, {self._world_size}).")
        for group in self.phase(step):
            if rank in group:
                return group
        raise AssertionError("a validated schedule covers every rank")  # pragma: no cover

    def distinct_groups(self) -> list[Group]:
        """Every group of size > 1 that the schedule uses, in first-use order.

        This order is identical on all ranks, so process groups can be created from it collectively.
        Groups with the same ranks but different weights share one entry (one process group).
        """
        seen: dict[tuple[int, ...], Group] = {}
        for phase in self.schedule:
            for group in phase:
                if group.size > 1 and group.ranks not in seen:
                    seen[group.ranks] = group
        return list(seen.values())

    def mixing_matrix(self, step: int) -> torch.Tensor:
        """``W`` of ``step`` as an ``n x n`` float64 tensor: one gossip round maps ``x`` to ``W @ x``."""
        n = self._world_size
        rows: list[int] = []
        cols: list[int] = []
        values: list[float] = []
        for group in self.phase(step):
            for i in group.ranks:
                rows += [i] * group.size
                cols += group.ranks
                values += [group.own_weight if j == i else group.peer_weight for j in group.ranks]
        w = torch.zeros(n, n, dtype=torch.float64)
        w[rows, cols] = torch.tensor(values, dtype=torch.float64)
        return w

    def exact_consensus_steps(self) -> int | None:
        """After how many steps (from a period boundary) every rank holds exactly the average, else ``None``.

        ``s`` means :math:`W_{s-1} \\cdots W_0 = \\mathbf{1}\\mathbf{1}^\\top / n`: one run of ``s`` gossip
        rounds without local updates in between leaves every rank with the exact mean. Built-ins state
        the ``s`` their construction guarantees; the default ``None`` claims nothing (consensus is then
        only asymptotic, at :meth:`consensus_rate`).
        """
        return 0 if self._world_size == 1 else None

    def num_process_groups(self) -> int:
        """How many process groups the schedule needs: ``len(distinct_groups())``."""
        return len(self.distinct_groups())

    def models_sent_per_step(self) -> float:
        """Models a rank sends per step, averaged over ranks and one period.

        Cost model: a group of ``k`` ranks is one ring all-reduce, in which every member sends
        ``2 (k - 1) / k`` models (1 for a pair, 0 for a resting rank). See
        :mod:`decent_optim_wrapper.topo.analysis` for the per-rank figures.
        """
        sent = analysis.models_sent_per_rank(self)
        return sum(sent) / len(sent)

    def consensus_rate(self, *, per_step: bool = False) -> float:
        """:math:`1 - \\lVert P - J \\rVert_2` for the product :math:`P = W_{p-1} \\cdots W_0` of one period.

        :math:`J = \\mathbf{1}\\mathbf{1}^\\top / n`. The distance to the mean shrinks by at least the
        factor :math:`1 - \\rho` every period; 1 means exact consensus within one period. With
        ``per_step=True``, returns :math:`1 - (1 - \\rho)^{1/p}` to compare schedules of different periods.
        """
        return analysis.consensus_rate(self, per_step=per_step)

    def fingerprint(self) -> tuple[object, ...]:
        """A picklable summary that two ranks compare to check they run the same schedule."""
        return (
            self._world_size,
            self._local_world_size,
            tuple(tuple((g.ranks, g.self_weight) for g in phase) for phase in self.schedule),
        )

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(world_size={self._world_size}, local_world_size={self._local_world_size})"
        )


def _as_group(entry: Sequence[int] | Group, rank: int, phase: int, owner: str) -> Group:
    if isinstance(entry, Group):
        return entry
    if isinstance(entry, str | bytes) or not isinstance(entry, Sequence):
        raise TypeError(
            f"{owner}.assign_groups(): rank {rank}, phase {phase}: a group must be a list of ranks or a "
            f"Group, got {entry!r}."
        )
    try:
        return Group(tuple(entry))
    except (TypeError, ValueError) as err:
        raise type(err)(f"{owner}.assign_groups(): rank {rank}, phase {phase}: {err}") from None


def _validate(
    world_size: int, groups: Sequence[Sequence[Sequence[int] | Group]], owner: str
) -> tuple[Phase, ...]:
    """Turn ``groups[rank][phase]`` into validated phases, or raise a ValueError naming phase and ranks."""
    if isinstance(groups, str | bytes) or not isinstance(groups, Sequence):
        raise TypeError(f"{owner}.assign_groups() must return a list (one entry per rank), got {groups!r}.")
    if len(groups) != world_size:
        raise ValueError(
            f"{owner}.assign_groups() returned {len(groups)} entries; it needs one per rank "
            f"(world_size={world_size})."
        )
    periods = {len(per_rank) for per_rank in groups}
    if len(periods) != 1:
        lengths = {rank: len(per_rank) for rank, per_rank in enumerate(groups)}
        raise ValueError(
            f"{owner}.assign_groups(): every rank needs the same number of phases, got {lengths} "
            "(rank: phases)."
        )
    period = periods.pop()
    if period == 0:
        raise ValueError(f"{owner}.assign_groups() returned no phases; a schedule needs at least one.")

    schedule: list[Phase] = []
    for phase in range(period):
        per_rank = [_as_group(groups[rank][phase], rank, phase, owner) for rank in range(world_size)]
        for rank, group in enumerate(per_rank):
            if rank not in group:
                raise ValueError(
                    f"{owner}: phase {phase}: rank {rank} is assigned group {list(group.ranks)}, which "
                    "does not contain it. Every rank's group must include the rank itself."
                )
            for member in group.ranks:
                if not 0 <= member < world_size:
                    raise ValueError(
                        f"{owner}: phase {phase}: rank {rank}'s group {list(group.ranks)} names rank "
                        f"{member}, outside [0, {world_size})."
                    )
                if per_rank[member] != group:
                    raise ValueError(
                        f"{owner}: phase {phase}: rank {rank} lists group {_describe(group)} but rank "
                        f"{member} lists {_describe(per_rank[member])}. Members of a group must list the "
                        "same group (same ranks, same weight), so every rank is in exactly one group."
                    )
        unique = sorted(set(per_rank), key=lambda g: g.ranks[0])
        for group in unique:
            _check_weights(group, phase, owner)
        schedule.append(tuple(unique))
    _check_connected(world_size, schedule, owner)
    return tuple(schedule)


def _check_weights(group: Group, phase: int, owner: str) -> None:
    """The group's block of ``W`` must be non-negative with rows (and, by symmetry, columns) summing to 1."""
    own, peer = group.own_weight, group.peer_weight
    row_sum = own + (group.size - 1) * peer
    # 1e-12 absorbs the rounding of w + (k-1) * (1-w)/(k-1) in float64 for any k a process group can have.
    if not (own >= 0.0 and peer >= 0.0 and abs(row_sum - 1.0) <= 1e-12):
        raise ValueError(
            f"{owner}: phase {phase}: group {list(group.ranks)} mixes with W_ii={own}, W_ij={peer}, so its "
            f"rows sum to {row_sum}. Mixing must be doubly stochastic with non-negative weights (rows and "
            "columns summing to 1) to preserve the mean; use Group(ranks, self_weight=w) with 0 <= w <= 1."
        )


def _check_connected(world_size: int, schedule: Sequence[Phase], owner: str) -> None:
    components = analysis.connected_components(world_size, schedule)
    if len(components) > 1:
        shown = "; ".join(f"{{{analysis.format_ranks(c)}}}" for c in components[:8])
        more = f"; ... ({len(components) - 8} more)" if len(components) > 8 else ""
        raise ValueError(
            f"{owner}: over its period of {len(schedule)} phase(s) the groups never connect the rank sets "
            f"{shown}{more}, so their parameters never mix. Add groups that join these sets (in any phase)."
        )


def _describe(group: Group) -> str:
    if group.self_weight is None:
        return str(list(group.ranks))
    return f"{list(group.ranks)} (self_weight={group.self_weight})"

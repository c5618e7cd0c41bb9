"""The :class:`Topology` contract: a periodic schedule of gossip groups, validated before use."""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property

import torch

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
    exactly one group per phase, every member of a group lists the same group, and weights are valid.
    Problems are a :class:`ValueError` naming the phase and the ranks.

    Example::

        class Pairs(Topology):
            def assign_groups(self):
                n = self._world_size
                return [[[r - r % 2, r - r % 2 + 1]] for r in range(n)]  # needs an even n

        TopologyFactory.add_topology("pairs", Pairs)

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
        w = torch.zeros(n, n, dtype=torch.float64)
        for group in self.phase(step):
            idx = torch.tensor(group.ranks)
            w[idx.unsqueeze(1), idx.unsqueeze(0)] = group.peer_weight
            w[idx, idx] = group.own_weight
        return w

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
    """Turn ``groups[rank][phase]`` into validated phases; a ValueError names the phase and ranks."""
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
        schedule.append(tuple(unique))
    return tuple(schedule)


def _describe(group: Group) -> str:
    if group.self_weight is None:
        return str(list(group.ranks))
    return f"{list(group.ranks)} (self_weight={group.self_weight})"

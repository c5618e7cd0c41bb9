"""Schedule validation: turn what ``assign_groups()`` returns into phases, or say what is wrong with it.

Checked once per topology, before any communication: every rank is in exactly one group per phase,
every member of a group lists the same group, every phase's mixing matrix is doubly stochastic with
non-negative entries, and the groups of one period connect all ranks. Errors name the phase and ranks;
:func:`format_ranks` keeps them short at 1000 ranks.

This module depends only on :mod:`~decent_optim_wrapper.topo.group`, so that
:mod:`~decent_optim_wrapper.topo.base` and :mod:`~decent_optim_wrapper.topo.analysis` can both use it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from decent_optim_wrapper.topo.group import Group, Phase

__all__ = ["connected_components", "format_ranks", "validate_schedule"]


def validate_schedule(
    world_size: int, groups: Sequence[Sequence[Sequence[int] | Group]], owner: str
) -> tuple[Phase, ...]:
    """Turn ``groups[rank][phase]`` into validated phases, or raise a ValueError naming phase and ranks.

    Args:
        world_size: number of ranks the schedule must cover.
        groups: what ``assign_groups()`` returned: for every rank, its group (sorted ranks or a
            :class:`Group`) in each phase.
        owner: the topology's class name, which starts every error message.

    Returns:
        One :data:`Phase` per step of the period, groups ordered by first rank.

    Raises:
        TypeError: ``groups`` or one of its groups is not a list of ranks or a :class:`Group`.
        ValueError: the schedule breaks one of the rules in the module docstring.
    """
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


def connected_components(world_size: int, phases: Iterable[Sequence[Group]]) -> list[list[int]]:
    """Rank sets that the union over all phases of the communication graph splits into, by first rank.

    Two ranks are linked when they share a group whose off-diagonal weight is positive.
    """
    parent = list(range(world_size))

    def find(r: int) -> int:
        while parent[r] != r:
            parent[r] = parent[parent[r]]
            r = parent[r]
        return r

    for phase in phases:
        for group in phase:
            if group.size > 1 and group.peer_weight > 0.0:
                root = find(group.ranks[0])
                for member in group.ranks[1:]:
                    parent[find(member)] = root
    components: dict[int, list[int]] = {}
    for rank in range(world_size):
        components.setdefault(find(rank), []).append(rank)
    return sorted(components.values())


def format_ranks(ranks: Sequence[int]) -> str:
    """``[0, 1, 2, 3, 8]`` as ``"0-3, 8"``: short enough for error messages about 1000 ranks."""
    parts: list[str] = []
    start = prev = None
    for r in sorted(ranks):
        if prev is not None and r == prev + 1:
            prev = r
            continue
        if start is not None:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = r
    if start is not None:
        parts.append(str(start) if start == prev else f"{start}-{prev}")
    return ", ".join(parts)


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
    components = connected_components(world_size, schedule)
    if len(components) > 1:
        shown = "; ".join(f"{{{format_ranks(c)}}}" for c in components[:8])
        more = f"; ... ({len(components) - 8} more)" if len(components) > 8 else ""
        raise ValueError(
            f"{owner}: over its period of {len(schedule)} phase(s) the groups never connect the rank sets "
            f"{shown}{more}, so their parameters never mix. Add groups that join these sets (in any phase)."
        )


def _describe(group: Group) -> str:
    if group.self_weight is None:
        return str(list(group.ranks))
    return f"{list(group.ranks)} (self_weight={group.self_weight})"

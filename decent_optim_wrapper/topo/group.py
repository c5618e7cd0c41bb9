"""One gossip group: the ranks that average together in one phase, and their weights; a phase of groups."""

from __future__ import annotations

from dataclasses import dataclass

from decent_optim_wrapper.checks import is_int

__all__ = ["Group", "Phase"]


@dataclass(frozen=True)
class Group:
    """The ranks that average their parameters together in one phase of a schedule.

    Every member ``i`` of a group of size ``k`` performs

    .. math::
        x_i \\leftarrow w\\,x_i + \\frac{1 - w}{k - 1} \\sum_{j \\in G,\\, j \\ne i} x_j,

    where ``w`` is :attr:`self_weight` (``1/k`` by default, the plain average). This is the most
    general doubly stochastic mixing that one all-reduce per group can carry: the all-reduce hands
    every member the same sum, so every member must weigh the others alike, and column sums of one
    force one self-weight for all members. ``0 <= w <= 1`` keeps every weight non-negative.

    Args:
        ranks: the members, sorted ascending, without repeats.
        self_weight: weight ``w`` a member keeps of its own parameters; ``None`` means ``1/k``.
    """

    ranks: tuple[int, ...]
    self_weight: float | None = None

    def __post_init__(self) -> None:
        ranks = tuple(self.ranks)
        if not ranks:
            raise ValueError("Group(ranks=()) is empty: a group needs at least one rank.")
        for r in ranks:
            if not is_int(r):
                raise TypeError(f"Group ranks must be ints, got {r!r} in ranks={list(ranks)}.")
        if list(ranks) != sorted(set(ranks)):
            raise ValueError(
                f"Group ranks={list(ranks)} must be sorted ascending without repeats; "
                f"use ranks={sorted(set(ranks))}."
            )
        object.__setattr__(self, "ranks", ranks)
        if self.self_weight is not None:
            w = float(self.self_weight)
            if not 0.0 <= w <= 1.0:
                raise ValueError(
                    f"Group(ranks={list(ranks)}) has self_weight={self.self_weight}; it must lie in [0, 1] "
                    "so that every mixing weight is non-negative (doubly stochastic mixing)."
                )
            if len(ranks) == 1 and w != 1.0:
                raise ValueError(
                    f"Group(ranks={list(ranks)}) has a single member, so its self_weight must be 1.0 "
                    f"(got {self.self_weight}); leave it as None."
                )
            object.__setattr__(self, "self_weight", w)

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def is_uniform(self) -> bool:
        """Whether every member gets weight ``1/k`` (the plain average)."""
        return self.self_weight is None or self.self_weight * self.size == 1.0

    @property
    def own_weight(self) -> float:
        """``W_ii``: the weight a member keeps of its own parameters."""
        return 1.0 / self.size if self.self_weight is None else self.self_weight

    @property
    def peer_weight(self) -> float:
        """``W_ij`` for ``j != i``: the weight each other member's parameters get."""
        if self.size == 1:
            return 0.0
        if self.self_weight is None:
            return 1.0 / self.size
        return (1.0 - self.self_weight) / (self.size - 1)

    def __contains__(self, rank: object) -> bool:
        return rank in self.ranks


#: One phase of a schedule, disjoint groups that together cover every rank.
Phase = tuple[Group, ...]

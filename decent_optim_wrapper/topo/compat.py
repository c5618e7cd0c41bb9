"""decent-dp's topology format: :class:`Edge` lists per phase, and their conversion into :class:`Group` s.

decent-dp (0.2.3) describes a schedule by ``_get_topo_edges()``: one list of :class:`Edge` per phase,
the edges of a phase partitioning the ranks. Its gossip step runs, for every member ``i`` of an edge of
``k`` ranks with weight ``w``,

.. math::
    x_i \\leftarrow \\Big(w - \\frac{1 - w}{k - 1}\\Big) x_i + \\frac{1 - w}{k - 1} \\sum_{j \\in E} x_j
        = w\\,x_i + \\frac{1 - w}{k - 1} \\sum_{j \\in E,\\, j \\ne i} x_j,

(``param.mul_(w - (1 - w) / (k - 1))`` plus an all-reduce of ``x * (1 - w) / (k - 1)``), so ``w`` is a
self-weight, exactly :attr:`Group.self_weight`. decent-dp's ``Edge`` docstring writes
:math:`w x_i + \\frac{1}{k} \\sum_{j \\in E} (1 - w) x_j` instead, which gives ``x_i`` the weight
``w + (1 - w)/k``; we follow the code, so schedules ported from decent-dp mix as they did there.

:func:`edges_to_groups` turns edges into ``groups[rank][phase]`` without touching the caller's lists
(decent-dp sorted ``Edge.ranks`` in place) and checks what the format itself can get wrong (a rank in
no edge or in two, a weight outside ``[0, 1]``); the usual schedule validation
(:func:`~decent_optim_wrapper.topo.validation.validate_schedule`) then checks the rest, including the
connectivity decent-dp never checked.

This module depends only on :mod:`~decent_optim_wrapper.topo.group` and
:mod:`~decent_optim_wrapper.topo.validation`, so that :mod:`~decent_optim_wrapper.topo.base` can use it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from numbers import Real

from decent_optim_wrapper.checks import is_int
from decent_optim_wrapper.topo.group import Group
from decent_optim_wrapper.topo.validation import format_ranks

__all__ = ["Edge", "edges_to_groups"]


@dataclass
class Edge:
    """decent-dp's group: the ranks that average together in one phase, and the weight each one keeps.

    Every member ``i`` of an edge of ``k`` ranks performs

    .. math::
        x_i \\leftarrow w\\,x_i + \\frac{1 - w}{k - 1} \\sum_{j \\in E,\\, j \\ne i} x_j,

    the rule of :class:`Group` with ``self_weight = w`` (what decent-dp's code computes; see
    :mod:`decent_optim_wrapper.topo.compat` for its docstring's different formula). ``w = 1/k`` is the
    plain average. ``Edge(ranks, w)`` is read as ``Group(sorted(ranks), self_weight=w)``.

    Args:
        ranks: the members, in any order, without repeats; never modified.
        weight: the self-weight ``w``, in ``[0, 1]`` (``1.0`` for a single rank, which keeps its model).
        group: decent-dp's process group for the edge, which its ``Topology`` filled in. Accepted so that
            decent-dp code constructs unchanged, and ignored: the engine creates its own process groups.
    """

    ranks: list[int]
    weight: float
    group: object | None = None


def edges_to_groups(world_size: int, edges: Sequence[Sequence[Edge]], owner: str) -> list[list[Group]]:
    """Turn ``edges[phase]`` (decent-dp's ``_get_topo_edges()``) into ``groups[rank][phase]``.

    An edge of ``k`` ranks with weight exactly ``1/k`` (as a float, e.g. decent-dp's ``0.5`` for pairs
    or ``1.0 / world_size`` for everyone) becomes a plain uniform :class:`Group`; any other weight
    becomes ``Group(sorted(ranks), self_weight=weight)``.

    Args:
        world_size: number of ranks each phase must partition.
        edges: for every phase, its list of :class:`Edge`.
        owner: the topology's class name, which starts every error message.

    Raises:
        TypeError: ``edges`` is not a list of lists of :class:`Edge`, or a rank or weight is not a number.
        ValueError: a phase does not partition the ranks, or a weight lies outside ``[0, 1]``.
    """
    where = f"{owner}._get_topo_edges()"
    if isinstance(edges, str | bytes) or not isinstance(edges, Sequence):
        raise TypeError(f"{where} must return a list of phases (each a list of Edge), got {edges!r}.")
    if not edges:
        raise ValueError(f"{where} returned no phases; a schedule needs at least one.")
    groups: list[list[Group]] = [[] for _ in range(world_size)]
    for phase, phase_edges in enumerate(edges):
        if isinstance(phase_edges, str | bytes | Edge) or not isinstance(phase_edges, Sequence):
            raise TypeError(
                f"{where}: phase {phase} must be a list of Edge (one per group), got {phase_edges!r}."
            )
        owners: dict[int, Edge] = {}
        for edge in phase_edges:
            group = _as_group(edge, world_size, phase, where)
            for rank in group.ranks:
                if rank in owners:
                    raise ValueError(
                        f"{where}: phase {phase}: rank {rank} is in {_show(owners[rank])} and in "
                        f"{_show(edge)}. The edges of a phase must partition the ranks: every rank in "
                        "exactly one edge."
                    )
                owners[rank] = edge
                groups[rank].append(group)
        missing = [rank for rank in range(world_size) if rank not in owners]
        if missing:
            raise ValueError(
                f"{where}: phase {phase}: ranks {format_ranks(missing)} are in no edge. The edges of a "
                "phase must partition the ranks; a rank that sits out is Edge(ranks=[rank], weight=1.0)."
            )
    return groups


def _as_group(edge: object, world_size: int, phase: int, where: str) -> Group:
    """One edge as a :class:`Group`, or an error naming the phase and the edge."""
    if not isinstance(edge, Edge):
        raise TypeError(f"{where}: phase {phase}: expected an Edge(ranks, weight), got {edge!r}.")
    ranks, weight = edge.ranks, edge.weight
    if isinstance(ranks, str | bytes) or not isinstance(ranks, Sequence) or not ranks:
        raise TypeError(f"{where}: phase {phase}: {_show(edge)}: ranks must be a non-empty list of ints.")
    for rank in ranks:
        if not is_int(rank):
            raise TypeError(f"{where}: phase {phase}: {_show(edge)}: rank {rank!r} is not an int.")
        if not 0 <= rank < world_size:
            raise ValueError(
                f"{where}: phase {phase}: {_show(edge)} names rank {rank}, outside [0, {world_size})."
            )
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"{where}: phase {phase}: {_show(edge)} lists a rank twice.")
    if isinstance(weight, bool) or not isinstance(weight, Real):
        raise TypeError(f"{where}: phase {phase}: {_show(edge)}: weight must be a float in [0, 1].")
    w, k = float(weight), len(ranks)
    if not 0.0 <= w <= 1.0:  # also rejects NaN
        raise ValueError(
            f"{where}: phase {phase}: {_show(edge)}: the weight is the fraction each member keeps of its "
            "own parameters, so it must lie in [0, 1]; outside it some mixing weights are negative and "
            "the mixing matrix is not doubly stochastic with non-negative entries."
        )
    if k == 1 and w != 1.0:
        raise ValueError(
            f"{where}: phase {phase}: {_show(edge)} has a single rank, which keeps its parameters: its "
            "weight must be 1.0."
        )
    # Exact float comparison on purpose: only a weight that *is* 1/k may drop to the plain average,
    # so that the schedule (and its fingerprint) equals the one written with plain rank lists.
    return Group(tuple(sorted(ranks)), None if w == 1.0 / k else w)


def _show(edge: Edge) -> str:
    return f"Edge(ranks={edge.ranks!r}, weight={edge.weight!r})"

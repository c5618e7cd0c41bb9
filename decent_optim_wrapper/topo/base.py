"""The :class:`Topology` contract: a periodic schedule of gossip groups, validated before use."""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property
from typing import ClassVar, Literal

import torch

from decent_optim_wrapper.checks import is_int
from decent_optim_wrapper.topo import mixing
from decent_optim_wrapper.topo.compat import Edge, edges_to_groups
from decent_optim_wrapper.topo.group import Group, Phase
from decent_optim_wrapper.topo.validation import validate_schedule

__all__ = ["Phase", "Topology"]


def _check_positive_int(name: str, value: object) -> int:
    if not is_int(value):
        raise TypeError(f"{name} must be an int, got {value!r} of type {type(value).__name__}.")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}.")
    return value


def _schedule_source(cls: type[Topology]) -> Literal["assign_groups", "_get_topo_edges"] | None:
    """``"assign_groups"`` or ``"_get_topo_edges"``: which one the most derived class defining either defines.

    Walking the MRO, rather than asking which method is overridden anywhere, lets a decent-dp-style
    subclass of a built-in replace the built-in's schedule; a class defining both uses ``assign_groups``.
    ``None`` when no class below :class:`Topology` defines either.
    """
    for klass in cls.__mro__:
        if klass is Topology:
            break
        if "assign_groups" in vars(klass):
            return "assign_groups"
        if "_get_topo_edges" in vars(klass):
            return "_get_topo_edges"
    return None


class Topology:
    """A periodic schedule that says, for every step, which ranks average together.

    Subclasses implement :meth:`assign_groups`, which returns for every rank its list of groups, one
    per phase; phases cycle with the step (phase ``t % period`` at step ``t``). A group is a sorted
    list of ranks (the rank itself included), or a :class:`Group` when it needs a non-uniform
    self-weight. Inside ``assign_groups`` read the public properties :attr:`world_size`,
    :attr:`local_world_size` and :attr:`num_nodes`; the attributes ``self._world_size``,
    ``self._local_world_size`` and ``self._num_nodes`` that seed-era topologies read hold the same
    values and keep working.

    A topology written for decent-dp implements :meth:`_get_topo_edges` instead: one list of
    :class:`~decent_optim_wrapper.topo.compat.Edge` per phase, the edges of a phase partitioning the
    ranks, ``Edge(ranks, weight)`` read as ``Group(sorted(ranks), self_weight=weight)``. It may read
    ``self._n_nodes`` (decent-dp's name for :attr:`num_nodes`) besides ``self._world_size`` and
    ``self._local_world_size``. Unlike decent-dp's, this constructor takes the world size: the
    front-ends build a registered class as ``cls(world_size, local_world_size)``, so such a class
    works unchanged; build one by hand as ``MyTopology(world_size, local_world_size)``. The schedule
    comes from whichever of the two methods the most derived class defining either defines.

    The schedule is validated once, on first use and before any communication: every rank is in
    exactly one group per phase, every member of a group lists the same group, every phase's mixing
    matrix is doubly stochastic with non-negative entries (so the mean of the parameters is preserved),
    and the groups of one period connect all ranks (otherwise replicas on the two sides of the cut would
    never agree). Problems are a :class:`ValueError` naming the phase and the ranks (see
    :mod:`decent_optim_wrapper.topo.validation`).

    Example::

        class Swap(Topology):  # needs an even world size
            def assign_groups(self):
                n = self.world_size
                right = [[r - r % 2, r - r % 2 + 1] for r in range(n)]  # (0, 1), (2, 3), ...
                left = [sorted({r, (r + 1) % n if r % 2 else (r - 1) % n}) for r in range(n)]
                return [[right[r], left[r]] for r in range(n)]

        TopologyFactory.add_topology("swap", Swap)

    Args:
        world_size: number of ranks.
        local_world_size: ranks per node; must divide ``world_size``.
    """

    #: The name this very class is registered under (the first in the registry's order if several), set
    #: and kept up to date by ``TopologyFactory.add_topology``; ``None`` while unregistered. Stored on the
    #: class so that :attr:`name` needs no factory (which builds on this module).
    _registered_name: ClassVar[str | None] = None

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

    # -- the part a subclass writes: one of the two ------------------------------------------------
    def assign_groups(self) -> Sequence[Sequence[Sequence[int] | Group]]:
        """Return ``groups[rank][phase]``: each rank's group (sorted ranks, or a :class:`Group`) per phase.

        For a subclass that implements :meth:`_get_topo_edges` instead, the default returns its edges
        converted to this format (not yet validated; :attr:`schedule` is).
        """
        if _schedule_source(type(self)) == "_get_topo_edges":
            return edges_to_groups(self._world_size, self._get_topo_edges(), type(self).__name__)
        raise NotImplementedError(self._no_schedule_message())

    def _get_topo_edges(self) -> Sequence[Sequence[Edge]]:
        """decent-dp's spelling: return one list of :class:`Edge` per phase, partitioning the ranks.

        For a subclass that implements :meth:`assign_groups` instead (every built-in), the default
        returns its validated schedule as fresh ``Edge(ranks, weight)`` lists, the weight being the
        self-weight (``1/k`` for a plain average).
        """
        if _schedule_source(type(self)) == "assign_groups":
            return [[Edge(list(g.ranks), g.own_weight) for g in phase] for phase in self.schedule]
        raise NotImplementedError(self._no_schedule_message())

    def _no_schedule_message(self) -> str:
        return (
            f"{type(self).__name__} must implement assign_groups(), returning groups[rank][phase], or "
            "decent-dp's _get_topo_edges(), returning one list of Edge(ranks, weight) per phase."
        )

    # -- derived, validated views ----------------------------------------------------------------
    @property
    def world_size(self) -> int:
        """Number of ranks ``n``; ranks are ``0 .. n - 1``."""
        return self._world_size

    @property
    def local_world_size(self) -> int:
        """Ranks per node ``L``; node ``a`` holds ranks ``a * L .. a * L + L - 1``."""
        return self._local_world_size

    @property
    def num_nodes(self) -> int:
        """Number of nodes, ``world_size // local_world_size``."""
        return self._num_nodes

    @property
    def _n_nodes(self) -> int:
        """decent-dp's name for :attr:`num_nodes`, read by topologies written for decent-dp (read-only)."""
        return self._num_nodes

    @property
    def name(self) -> str:
        """The name this topology is registered under, else its class name."""
        # vars(), not getattr(): a subclass of a registered class is not registered under its parent's name.
        return vars(type(self)).get("_registered_name") or type(self).__name__

    @cached_property
    def schedule(self) -> tuple[Phase, ...]:
        """The validated schedule, one :data:`Phase` per step of the period, groups ordered by first rank."""
        owner = type(self).__name__
        source = _schedule_source(type(self))
        if source is None:
            raise NotImplementedError(self._no_schedule_message())
        if source == "_get_topo_edges":
            groups: Sequence[Sequence[Sequence[int] | Group]] = edges_to_groups(
                self._world_size, self._get_topo_edges(), owner
            )
        else:
            groups = self.assign_groups()
        return validate_schedule(self._world_size, groups, owner)

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
        sent = mixing.models_sent_per_rank(self)
        return sum(sent) / len(sent)

    def consensus_rate(self, *, per_step: bool = False) -> float:
        """:math:`1 - \\lVert P - J \\rVert_2` for the product :math:`P = W_{p-1} \\cdots W_0` of one period.

        :math:`J = \\mathbf{1}\\mathbf{1}^\\top / n`. The distance to the mean shrinks by at least the
        factor :math:`1 - \\rho` every period; 1 means exact consensus within one period. With
        ``per_step=True``, returns :math:`1 - (1 - \\rho)^{1/p}` to compare schedules of different periods.
        """
        return mixing.consensus_rate(self, per_step=per_step)

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

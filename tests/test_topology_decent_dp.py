"""Pure logic: topologies written for decent-dp 0.2.3 (``Edge``, ``_get_topo_edges``, ``TopologyReg``).

The decent-dp classes below are its built-ins as its documentation lists them (logging dropped), so
these tests show that its code runs here unchanged and yields our schedules, and that the bugs of its
validation (ranks sorted in place, weights and connectivity never checked) are not carried over.
Mixing matrices are compared exactly: both spellings build the same :class:`Group` s.
"""

from __future__ import annotations

import math
from typing import List  # noqa: UP035 -- decent-dp's own spelling, kept to show its code runs as written

import pytest
import torch
from topologies import BUILTIN_TOPOLOGIES, scratch_registry

from decent_optim_wrapper.engine.options import resolve_topology
from decent_optim_wrapper.topo import (
    AlternatingExpRingTopology,
    CompleteTopology,
    Edge,
    Group,
    OnePeerExpTopology,
    RingTopology,
    Topology,
    TopologyFactory,
    TopologyReg,
)

pytestmark = pytest.mark.pure


# -- decent-dp's built-ins, as written there (not registered: the names are ours) ---------------------------
class DecentDpComplete(Topology):
    def _get_topo_edges(self) -> List[List[Edge]]:  # noqa: UP006
        return [[Edge(ranks=list(range(self._world_size)), weight=1.0 / self._world_size)]]


class DecentDpRing(Topology):
    def _get_topo_edges(self) -> List[List[Edge]]:  # noqa: UP006
        if self._world_size % 2 != 0:
            raise ValueError()
        edges: List[List[Edge]] = [[], []]  # noqa: UP006
        for i in range(0, self._world_size, 2):
            edges[0].append(Edge(ranks=sorted([i, (i + 1) % self._world_size]), weight=0.5))
        for i in range(0, self._world_size, 2):
            edges[1].append(
                Edge(ranks=sorted([i, (i - 1 + self._world_size) % self._world_size]), weight=0.5)
            )
        return edges


class DecentDpOnePeerExp(Topology):
    def _get_topo_edges(self) -> List[List[Edge]]:  # noqa: UP006
        rounds = round(math.log2(self._world_size))
        if self._world_size != 2**rounds:
            raise ValueError()
        edges: List[List[Edge]] = []  # noqa: UP006
        for i in range(rounds):
            edges.append([])
            used = [False] * self._world_size
            for j in range(self._world_size):
                if not used[j]:
                    used[j] = True
                    used[(j + 2**i) % self._world_size] = True
                    edges[i].append(Edge(ranks=sorted([j, (j + 2**i) % self._world_size]), weight=0.5))
        return edges


def _same_schedule(a: Topology, b: Topology) -> None:
    assert a.schedule == b.schedule
    assert a.fingerprint() == b.fingerprint()
    for step in range(a.period):
        assert torch.equal(a.mixing_matrix(step), b.mixing_matrix(step))


@pytest.mark.parametrize("world_size", [2, 4, 8, 16])
def test_decent_dp_builtins_give_our_schedules(world_size):
    _same_schedule(DecentDpRing(world_size), RingTopology(world_size))
    _same_schedule(DecentDpOnePeerExp(world_size), OnePeerExpTopology(world_size))
    _same_schedule(DecentDpComplete(world_size), CompleteTopology(world_size))
    # Weights 1/2 and 1/n are exactly 1/k, so the groups are plain averages, as in our built-ins.
    assert all(g.self_weight is None for phase in DecentDpRing(world_size).schedule for g in phase)


def test_decent_dp_readme_names_import_from_topo():
    import decent_optim_wrapper.topo as topo

    for name in ("Topology", "TopologyReg", "Edge", "CompleteTopology", "RingTopology", "OnePeerExpTopology"):
        assert name in topo.__all__ and hasattr(topo, name)
    assert TopologyReg.registry["alternating-exp-ring"] is AlternatingExpRingTopology


# -- a custom decent-dp topology, registered with TopologyReg ------------------------------------------------
class LazyRingEdges(Topology):
    """decent-dp's spelling: the one-peer ring where each rank keeps 3/4 of its model; ranks unsorted."""

    def _get_topo_edges(self) -> List[List[Edge]]:  # noqa: UP006
        n = self._world_size
        return [
            [Edge(ranks=[i + 1, i], weight=0.75) for i in range(0, n, 2)],
            [Edge(ranks=[(i - 1) % n, i], weight=0.75) for i in range(0, n, 2)],
        ]


class LazyRingGroups(Topology):
    """The same schedule in our spelling."""

    def assign_groups(self):
        n = self.world_size
        phases = [
            [Group((i, i + 1), 0.75) for i in range(0, n, 2)],
            [Group(tuple(sorted({i, (i - 1) % n})), 0.75) for i in range(0, n, 2)],
        ]
        return [[next(g for g in phase if r in g) for phase in phases] for r in range(n)]


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_custom_edges_topology_equals_assign_groups_topology(world_size):
    with scratch_registry():
        TopologyReg.register("test-lazy-ring")(LazyRingEdges)
        edges = TopologyFactory.create("test-lazy-ring", world_size)
        assert edges.name == "test-lazy-ring"
        _same_schedule(edges, LazyRingGroups(world_size))
        # The weight is the self-weight (decent-dp's code, not its docstring): W_ii = w, W_ij = 1 - w.
        w = edges.mixing_matrix(0)
        assert w[0, 0].item() == 0.75 and w[0, 1].item() == 0.25
        assert edges.distinct_groups()[0] == Group((0, 1), 0.75)
        assert edges.assign_groups()[0][0] == Group((0, 1), 0.75)


def test_decorator_registers_and_front_ends_build_with_world_size():
    with scratch_registry():

        @TopologyReg.register("test-columns")
        class Columns(Topology):
            """Intra-node averages, then local rank l of every node together: reads decent-dp's names."""

            def _get_topo_edges(self) -> List[List[Edge]]:  # noqa: UP006
                lws, nodes = self._local_world_size, self._n_nodes
                inside = [Edge(list(range(a * lws, (a + 1) * lws)), 1.0 / lws) for a in range(nodes)]
                across = [Edge([a * lws + i for a in range(nodes)], 1.0 / nodes) for i in range(lws)]
                return [inside, across]

        # What DecentOptimWrapper / DecentralizedDataParallel do with topology="test-columns".
        topo = resolve_topology("test-columns", 6, 2)
        assert [[g.ranks for g in phase] for phase in topo.schedule] == [
            [(0, 1), (2, 3), (4, 5)],
            [(0, 2, 4), (1, 3, 5)],
        ]
        assert resolve_topology(Columns, 6, 2).fingerprint() == topo.fingerprint()
        assert TopologyReg.registry["test-columns"](6, 2).fingerprint() == topo.fingerprint()


# -- one registry, two spellings -----------------------------------------------------------------------------
def test_registry_is_shared_both_ways():
    class ViaReg(Topology):
        def _get_topo_edges(self) -> List[List[Edge]]:  # noqa: UP006
            return [[Edge(list(range(self._world_size)), 1.0 / self._world_size)]]

    class ViaFactory(Topology):
        def assign_groups(self):
            return [[list(range(self.world_size))] for _ in range(self.world_size)]

    with scratch_registry():
        TopologyReg.register("test-via-reg")(ViaReg)
        TopologyFactory.add_topology("test-via-factory", ViaFactory)
        assert TopologyFactory.get("test-via-reg") is ViaReg
        assert "test-via-reg" in TopologyFactory.names()
        _same_schedule(TopologyFactory.create("test-via-reg", 4), CompleteTopology(4))
        assert TopologyReg.registry["test-via-factory"] is ViaFactory
        assert TopologyReg.registry["test-via-factory"](4).name == "test-via-factory"
        assert set(TopologyReg.registry) == set(TopologyFactory.names())
    assert "test-via-reg" not in TopologyReg.registry
    assert set(TopologyReg.registry) >= set(BUILTIN_TOPOLOGIES)


def test_registry_view_is_read_only():
    with pytest.raises(TypeError):
        TopologyReg.registry["test-sneaky"] = RingTopology


# -- decent-dp's validation bugs, not carried over ----------------------------------------------------------
class FromEdges(Topology):
    """A decent-dp topology whose ``_get_topo_edges()`` returns the given edges as they are."""

    def __init__(self, edges, world_size: int, local_world_size: int = 1) -> None:
        super().__init__(world_size, local_world_size)
        self._edges = edges

    def _get_topo_edges(self):
        return self._edges


def test_unsorted_ranks_accepted_and_left_as_given():
    # decent-dp's _validate_edges sorted every edge.ranks in place.
    ranks = [3, 1, 0, 2]
    edge = Edge(ranks, 0.25)
    topo = FromEdges([[edge]], 4)
    assert topo.schedule == ((Group((0, 1, 2, 3)),),)
    assert ranks == [3, 1, 0, 2] and edge.ranks is ranks


@pytest.mark.parametrize("weight", [1.5, -0.1, float("nan")])
def test_weight_outside_unit_interval_rejected(weight):
    # decent-dp ran these: w = 1.5 on a pair gives W_ij = -0.5, mixing that is not a convex combination.
    topo = FromEdges([[Edge([0, 1], weight)]], 2)
    with pytest.raises(ValueError, match=r"FromEdges._get_topo_edges\(\): phase 0: .* must lie in \[0, 1\]"):
        _ = topo.schedule


def test_weight_exactly_one_over_k_is_the_plain_average():
    assert FromEdges([[Edge([0, 1, 2], 1.0 / 3)]], 3).schedule == ((Group((0, 1, 2)),),)
    almost = FromEdges([[Edge([0, 1, 2], 1.0 / 3 + 1e-9)]], 3).schedule[0][0]
    assert almost.self_weight == 1.0 / 3 + 1e-9


def test_disconnected_schedule_rejected():
    # decent-dp accepted it: {0, 1} and {2, 3} would train two separate models.
    halves = [Edge([0, 1], 0.5), Edge([2, 3], 0.5)]
    with pytest.raises(ValueError, match=r"never connect the rank sets \{0-1\}; \{2-3\}"):
        _ = FromEdges([halves, halves], 4).schedule
    # A weight of 1.0 keeps everything: the edge mixes nothing and connects nothing.
    with pytest.raises(ValueError, match="never connect"):
        _ = FromEdges([[Edge([0, 1], 1.0)]], 2).schedule


@pytest.mark.parametrize(
    ("edges", "message"),
    [
        ([[Edge([0, 1], 0.5), Edge([1, 2], 0.5)]], r"phase 0: rank 1 is in Edge\(ranks=\[0, 1\].* and in"),
        ([[Edge([0, 1], 0.5)]], r"phase 0: ranks 2 are in no edge"),
        ([[Edge([0, 1, 2], 1 / 3)], [Edge([0, 3], 0.5), Edge([1, 2], 0.5)]], r"phase 1: .*rank 3, outside"),
        ([[Edge([0, 0, 1], 1 / 3), Edge([2], 1.0)]], "lists a rank twice"),
        ([[Edge([0, 1], 0.5), Edge([2], 0.5)]], r"single rank, .* weight must be 1.0"),
        ([], "returned no phases"),
    ],
)
def test_edges_that_do_not_partition_the_ranks_rejected(edges, message):
    with pytest.raises(ValueError, match=message):
        _ = FromEdges(edges, 3).schedule


@pytest.mark.parametrize(
    ("edges", "message"),
    [
        ([[[0, 1, 2]]], r"phase 0: expected an Edge\(ranks, weight\)"),
        ([Edge([0, 1, 2], 1 / 3)], "phase 0 must be a list of Edge"),
        ([[Edge([0, 1, 2], "1/3")]], "weight must be a float"),
        ([[Edge([0, 1.0, 2], 1 / 3)]], "rank 1.0 is not an int"),
    ],
)
def test_edges_of_the_wrong_type_rejected(edges, message):
    with pytest.raises(TypeError, match=message):
        _ = FromEdges(edges, 3).schedule


def test_resting_rank_and_ignored_process_group_field():
    # A rank sits out as a one-rank edge of weight 1.0; Edge.group (decent-dp's ProcessGroup) is ignored.
    edges = [[Edge([0, 1], 0.5, group="ignored"), Edge([2], 1.0)], [Edge([1, 2], 0.5), Edge([0], 1)]]
    assert FromEdges(edges, 3).schedule == (
        (Group((0, 1)), Group((2,))),
        (Group((0,)), Group((1, 2))),
    )


# -- the two spellings on one class ------------------------------------------------------------------------
def test_neither_method_names_both():
    with pytest.raises(NotImplementedError, match=r"assign_groups\(\).*_get_topo_edges\(\)"):
        _ = Topology(4).schedule
    with pytest.raises(NotImplementedError, match=r"assign_groups\(\).*_get_topo_edges\(\)"):
        Topology(4)._get_topo_edges()


def test_subclass_of_a_builtin_overriding_edges_uses_its_edges():
    class CompleteAsRing(RingTopology):
        def _get_topo_edges(self) -> List[List[Edge]]:  # noqa: UP006
            return [[Edge(list(range(self._world_size)), 1.0 / self._world_size)]]

    _same_schedule(CompleteAsRing(4), CompleteTopology(4))


@pytest.mark.parametrize("name", BUILTIN_TOPOLOGIES)
@pytest.mark.parametrize(("world_size", "local_world_size"), [(1, 1), (6, 1), (8, 2), (12, 4)])
def test_builtins_expose_their_schedule_as_edges(name, world_size, local_world_size):
    builtin = TopologyFactory.create(name, world_size, local_world_size)
    edges = builtin._get_topo_edges()
    assert all(isinstance(e, Edge) for phase in edges for e in phase)
    _same_schedule(FromEdges(edges, world_size, local_world_size), builtin)


@pytest.mark.parametrize(("world_size", "local_world_size"), [(1, 1), (8, 1), (8, 2), (12, 4)])
def test_n_nodes_alias(world_size, local_world_size):
    topo = RingTopology(world_size, local_world_size)
    assert topo._n_nodes == topo.num_nodes == world_size // local_world_size
    assert (topo._world_size, topo._local_world_size) == (world_size, local_world_size)
    with pytest.raises(AttributeError):
        topo._n_nodes = 3


def test_coming_from_decent_dp_guide_example():
    # The example of "Coming from decent-dp" in docs/topologies.md: decent-dp's ring, ranks unsorted.
    with scratch_registry():

        @TopologyReg.register("custom-topology")
        class CustomTopology(Topology):
            def _get_topo_edges(self) -> list[list[Edge]]:
                n = self._world_size
                return [
                    [Edge(ranks=[i, i + 1], weight=0.5) for i in range(0, n, 2)],
                    [Edge(ranks=[i, (i - 1) % n], weight=0.5) for i in range(0, n, 2)],
                ]

        _same_schedule(TopologyFactory.create("custom-topology", 8), RingTopology(8))

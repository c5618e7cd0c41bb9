"""Pure logic: the Topology contract that custom topologies rely on (seed README format)."""

from __future__ import annotations

import pytest
import torch

from decent_optim_wrapper import Group, Topology, TopologyFactory


class FromList(Topology):
    def __init__(self, groups, world_size):
        super().__init__(world_size)
        self._groups = groups

    def assign_groups(self):
        return self._groups


def test_ring_even_schedule_and_matrix():
    topo = TopologyFactory.create("ring", 6)
    assert [[g.ranks for g in phase] for phase in topo.schedule] == [
        [(0, 1), (2, 3), (4, 5)],
        [(0, 5), (1, 2), (3, 4)],
    ]
    w = topo.mixing_matrix(1)
    assert w[0, 5] == w[0, 0] == 0.5 and w.sum(0).eq(1).all() and w.sum(1).eq(1).all()
    assert topo.mixing_matrix(3).equal(w)  # phases cycle with the step


def test_complete_matrix_is_uniform():
    assert (
        TopologyFactory.create("complete", 3)
        .mixing_matrix(0)
        .equal(torch.full((3, 3), 1 / 3, dtype=torch.float64))
    )


def test_seed_format_with_weighted_group():
    groups = [[[0, 1], Group((0, 2), 0.75)], [[0, 1], [1]], [[2], Group((0, 2), 0.75)]]
    topo = FromList(groups, 3)
    w = topo.mixing_matrix(1)
    assert w[0, 0] == 0.75 and w[0, 2] == 0.25 and w[1, 1] == 1.0
    assert topo.distinct_groups() == [Group((0, 1)), Group((0, 2), 0.75)]


@pytest.mark.parametrize(
    ("groups", "match"),
    [
        ([[[0, 1]], [[0, 1]], [[1, 2]]], r"phase 0: rank 2 lists group \[1, 2\] but rank 1 lists \[0, 1\]"),
        ([[[0, 1]], [[0, 1]]], r"returned 2 entries; it needs one per rank \(world_size=3\)"),
        ([[[0]], [[1]], [[2], [2]]], r"same number of phases"),
        ([[[1]], [[1]], [[2]]], r"phase 0: rank 0 is assigned group \[1\], which does not contain it"),
        ([[[0, 5]], [[1]], [[2]]], r"names rank 5, outside \[0, 3\)"),
        ([[[1, 0]], [[1, 0]], [[2]]], r"rank 0, phase 0: .*sorted ascending"),
        ([[Group((0, 1), 0.6)], [Group((0, 1), 0.7)], [[2]]], r"self_weight=0.6\) but rank 1 lists"),
    ],
)
def test_invalid_schedules_name_phase_and_ranks(groups, match):
    with pytest.raises(ValueError, match=match):
        _ = FromList(groups, 3).schedule


def test_group_weights_are_checked():
    with pytest.raises(ValueError, match=r"self_weight=1.5; it must lie in \[0, 1\]"):
        Group((0, 1), 1.5)
    with pytest.raises(ValueError, match=r"single member"):
        Group((0,), 0.5)


def test_unknown_name_lists_registered_ones():
    with pytest.raises(
        ValueError, match=r"Unknown topology 'torus'. Registered topologies: .*complete.*ring"
    ):
        TopologyFactory.create("torus", 4)


def test_local_world_size_must_divide():
    with pytest.raises(ValueError, match=r"local_world_size=3 must divide world_size=4"):
        TopologyFactory.create("ring", 4, 3)

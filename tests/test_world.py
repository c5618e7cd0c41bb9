"""Pure: the gossip world's local world size along a mesh dimension, and the check that gossip groups
split the job."""

from __future__ import annotations

import pytest

from decent_optim_wrapper.engine.fleet.world import GossipWorld, members_per_node
from decent_optim_wrapper.engine.options import LocalLayout, check_layouts_agree

pytestmark = pytest.mark.pure


@pytest.mark.parametrize(
    ("members", "ranks_per_node", "expected"),
    [
        ((0, 2, 4, 6), 2, 1),  # mesh (4, 2) on 4 nodes of 2: "replicate" has one member per node
        ((0, 1), 2, 2),  # ... and "shard" is a node
        ((0, 1, 2, 3), 2, 2),  # the whole job of 2 nodes
        ((0, 1, 4, 5), 2, 2),  # two members on each of nodes 0 and 2
        ((1, 3, 5, 7), 4, 2),  # mesh (4, 2) on 2 nodes of 4: two replicas share a node
        ((0, 1, 2), 2, 1),  # uneven over nodes: every member a node of its own
        ((0, 3), 2, 1),
        ((0, 1, 2, 3), 0, 1),
    ],
)
def test_members_per_node(members, ranks_per_node, expected):
    assert members_per_node(members, ranks_per_node) == expected


def test_gossip_world_translates_its_ranks_to_the_jobs():
    world = GossipWorld(ranks=(1, 3, 5, 7), rank=2, local_world_size=1, subgroup=True)
    assert world.world_size == 4
    assert world.global_ranks((0, 2)) == (1, 5)


def _layout(world: tuple[int, ...], buckets: tuple[object, ...] = ("b",)) -> LocalLayout:
    return LocalLayout(local_world_size=1, topology=("ring", ()), buckets=buckets, groups=(world, ()))


def test_layouts_are_compared_within_each_gossip_world_only():
    # Two worlds {0, 2} and {1, 3}: their bucket layouts differ (different shards), which is fine.
    reports = [
        _layout((0, 2), ("a",)),
        _layout((1, 3), ("b",)),
        _layout((0, 2), ("a",)),
        _layout((1, 3), ("b",)),
    ]
    check_layouts_agree(reports, (0, 2))
    check_layouts_agree(reports, (1, 3))
    reports[3] = _layout((1, 3), ("c",))
    with pytest.raises(ValueError, match=r"bucket layout .* rank\(s\) \[1\]"):
        check_layouts_agree(reports, (1, 3))


def test_agreed_options_are_compared_one_by_one_and_named():
    def layout(clipped: object) -> LocalLayout:
        return LocalLayout(
            local_world_size=1,
            topology=("ring", ()),
            buckets=("b",),
            groups=((0, 1, 2), ()),
            options=(("gradient_tracking", False), ("clipped_gossip", clipped)),
        )

    check_layouts_agree([layout(None), layout(None), layout(None)], (0, 1, 2))
    with pytest.raises(
        ValueError, match=r"^clipped_gossip differs between rank 0 and rank\(s\) \[2\]\. Pass "
    ):
        check_layouts_agree([layout(None), layout(None), layout("x")], (0, 1, 2))


def test_worlds_that_do_not_split_the_job_are_refused():
    reports = [_layout((0, 1)), _layout((0, 1)), _layout((0, 1, 2, 3)), _layout((0, 1, 2, 3))]
    with pytest.raises(
        ValueError,
        match=r"rank 2 gossips over ranks \[0, 1, 2, 3\], but ranks \[0, 1\] name other groups.*split",
    ):
        check_layouts_agree(reports, (0, 1))

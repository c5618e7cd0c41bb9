"""Pure logic: the contract custom topologies rely on, its validation errors, the registry and the CLI.

The built-in schedules themselves are tested in ``test_topology_schedules.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from topologies import BUILTIN_TOPOLOGIES, scratch_registry

from decent_optim_wrapper import Group, Topology, TopologyFactory
from decent_optim_wrapper.plan import main as plan_main
from decent_optim_wrapper.topo.__main__ import main
from decent_optim_wrapper.topo.analysis import format_ranks

pytestmark = pytest.mark.pure


class FromList(Topology):
    """A custom topology whose ``assign_groups()`` returns the given ``groups[rank][phase]`` as they are."""

    def __init__(self, groups, world_size: int) -> None:
        super().__init__(world_size)
        self._groups = groups

    def assign_groups(self):
        return self._groups


# -- writing a topology: the seed format and the public properties ----------------------------------------
def _nodes_then_columns(world_size: int, local_world_size: int, num_nodes: int) -> list[list[list[int]]]:
    """Phase 0: every node averages inside; phase 1: local rank ``l`` of all nodes averages across nodes."""
    groups = []
    for rank in range(world_size):
        node, local = divmod(rank, local_world_size)
        inside = list(range(node * local_world_size, (node + 1) * local_world_size))
        across = [other * local_world_size + local for other in range(num_nodes)]
        groups.append([inside, across])
    return groups


class PublicSpelling(Topology):
    """The recommended spelling: the public properties."""

    def assign_groups(self):
        return _nodes_then_columns(self.world_size, self.local_world_size, self.num_nodes)


class SeedSpelling(Topology):
    """The seed's spelling: the attributes seed-era topologies read."""

    def assign_groups(self):
        return _nodes_then_columns(self._world_size, self._local_world_size, self._num_nodes)


@pytest.mark.parametrize(
    ("world_size", "local_world_size"), [(1, 1), (4, 1), (6, 2), (6, 3), (8, 8), (12, 4)]
)
def test_public_properties_and_seed_attributes_give_the_same_schedule(world_size, local_world_size):
    public = PublicSpelling(world_size, local_world_size)
    seed = SeedSpelling(world_size, local_world_size)
    assert public.schedule == seed.schedule  # both validate
    assert public.fingerprint() == seed.fingerprint()
    if (world_size, local_world_size) == (6, 2):
        assert [[g.ranks for g in phase] for phase in public.schedule] == [
            [(0, 1), (2, 3), (4, 5)],
            [(0, 2, 4), (1, 3, 5)],
        ]


def test_seed_format_with_weighted_group():
    groups = [[[0, 1], Group((0, 2), 0.75)], [[0, 1], [1]], [[2], Group((0, 2), 0.75)]]
    topo = FromList(groups, 3)
    w = topo.mixing_matrix(1)
    assert w[0, 0] == 0.75 and w[0, 2] == 0.25 and w[1, 1] == 1.0
    assert topo.distinct_groups() == [Group((0, 1)), Group((0, 2), 0.75)]


def test_custom_topologies_from_the_guide():
    # The two examples of "Writing your own" in docs/topologies.md.
    class Shift(Topology):
        """Plain sorted lists; pairs (i, i + 1) then (i, i - 1) for even i."""

        def assign_groups(self):
            n = self.world_size
            right = [sorted({r, r + 1 if r % 2 == 0 else r - 1}) for r in range(n)]
            left = [sorted({r, (r - 1) % n if r % 2 == 0 else (r + 1) % n}) for r in range(n)]
            return [[right[r], left[r]] for r in range(n)]

    class LazyComplete(Topology):
        """Weighted: keep half of your own model, spread the rest over the others."""

        def assign_groups(self):
            everyone = Group(tuple(range(self.world_size)), self_weight=0.5)
            return [[everyone] for _ in range(self.world_size)]

    with scratch_registry():
        TopologyFactory.add_topology("test-shift", Shift)
        TopologyFactory.register("test-lazy-complete")(LazyComplete)
        shift = TopologyFactory.create("test-shift", 8)
        assert shift.schedule == TopologyFactory.create("ring", 8).schedule
        assert shift.name == "test-shift"
        lazy = TopologyFactory.create("test-lazy-complete", 4)
        assert lazy.mixing_matrix(0)[0].tolist() == [0.5, 1 / 6, 1 / 6, 1 / 6]
        # W = I/3 + 2J/3, so P - J = (I - J)/3 and the rate is 1 - 1/3.
        assert lazy.consensus_rate() == pytest.approx(2 / 3, rel=0, abs=1e-12)


def test_base_docstring_example_is_connected():
    class Swap(Topology):
        def assign_groups(self):
            n = self.world_size
            right = [[r - r % 2, r - r % 2 + 1] for r in range(n)]
            left = [sorted({r, (r + 1) % n if r % 2 else (r - 1) % n}) for r in range(n)]
            return [[right[r], left[r]] for r in range(n)]

    assert Swap(6).schedule == TopologyFactory.create("ring", 6).schedule


# -- validation: errors name the phase and the ranks -------------------------------------------------------
def _unchecked_group(ranks: tuple[int, ...], self_weight: float) -> Group:
    """A Group whose weight skipped the constructor's check (as a deserialised or hand-patched one would)."""
    group = Group(ranks)
    object.__setattr__(group, "self_weight", self_weight)
    return group


A01, A23, A12 = [0, 1], [2, 3], [1, 2]
G4 = Group((0, 1, 2, 3), self_weight=1.0)  # a group that keeps everything: no mixing, no link

INVALID = [
    pytest.param(
        [[A01, A12], [A01, A12], [A23, A12], [A23, [3]]],
        ["FromList: phase 1: rank 0 is assigned group [1, 2], which does not contain it"],
        id="rank-missing",
    ),
    pytest.param(
        [[A01], [A12], [A12], [A23]],
        ["FromList: phase 0: rank 0 lists group [0, 1] but rank 1 lists [1, 2]"],
        id="rank-in-two-groups",
    ),
    pytest.param(
        [[Group((0, 1), 0.3)], [Group((0, 1), 0.6)], [A23], [A23]],
        ["phase 0: rank 0 lists group [0, 1] (self_weight=0.3) but rank 1 lists [0, 1] (self_weight=0.6)"],
        id="inconsistent-weight",
    ),
    pytest.param(
        [[_unchecked_group((0, 1), -0.5)]] * 2 + [[A23]] * 2,
        ["phase 0: group [0, 1] mixes with W_ii=-0.5, W_ij=1.5"],
        id="negative-weight",
    ),
    pytest.param(
        [[_unchecked_group((0, 1), 1.5)]] * 2 + [[A23]] * 2,
        ["phase 0: group [0, 1] mixes with W_ii=1.5, W_ij=-0.5"],
        id="over-one-weight",
    ),
    pytest.param(
        [[A01], [A01], [A23]],
        ["FromList.assign_groups() returned 3 entries; it needs one per rank (world_size=4)"],
        id="too-few-ranks",
    ),
    pytest.param(
        [[A01, A12], [A01, A12], [A23], [A23]],
        ["every rank needs the same number of phases, got {0: 2, 1: 2, 2: 1, 3: 1}"],
        id="ragged-phases",
    ),
    pytest.param(
        [[A01], [A01], [A23], [A23]],
        ["over its period of 1 phase(s) the groups never connect the rank sets {0-1}; {2-3}"],
        id="disconnected",
    ),
    pytest.param(
        [[G4, A01], [G4, A01], [G4, A23], [G4, A23]],
        ["over its period of 2 phase(s) the groups never connect the rank sets {0-1}; {2-3}"],
        id="disconnected-self-weight-one",
    ),
    pytest.param(
        [[[0, 5]], [A01], [A23], [A23]],
        ["FromList: phase 0: rank 0's group [0, 5] names rank 5, outside [0, 4)"],
        id="rank-out-of-range",
    ),
    pytest.param(
        [[A01], [A01], [[3, 2]], [A23]],
        ["FromList.assign_groups(): rank 2, phase 0: Group ranks=[3, 2] must be sorted ascending"],
        id="unsorted",
    ),
]


@pytest.mark.parametrize(("groups", "fragments"), INVALID)
def test_invalid_schedules_name_phase_and_ranks(groups, fragments):
    with pytest.raises(ValueError) as info:
        _ = FromList(groups, 4).schedule
    for fragment in fragments:
        assert fragment in str(info.value)


@pytest.mark.parametrize("weight", [-0.1, 1.1, float("nan")])
def test_group_rejects_weights_outside_unit_interval_at_construction(weight):
    with pytest.raises(
        ValueError, match=r"Group\(ranks=\[0, 1\]\) has self_weight=.*; it must lie in \[0, 1\]"
    ):
        Group((0, 1), self_weight=weight)


def test_group_of_one_keeps_everything():
    with pytest.raises(ValueError, match=r"single member, so its self_weight must be 1.0 \(got 0.5\)"):
        Group((0,), 0.5)


def test_format_ranks():
    assert format_ranks([0, 1, 2, 3, 8, 10, 11]) == "0-3, 8, 10-11"
    assert format_ranks([]) == ""


# -- the registry -----------------------------------------------------------------------------------------
def test_unknown_name_lists_registered_names():
    with pytest.raises(ValueError) as info:
        TopologyFactory.create("torus", 4)
    registered = ", ".join(TopologyFactory.names())
    assert str(info.value) == (
        f"Unknown topology 'torus'. Registered topologies: {registered}. "
        "Register your own with TopologyFactory.add_topology(name, cls)."
    )
    assert set(BUILTIN_TOPOLOGIES) <= set(TopologyFactory.names())


def test_name_is_the_registered_name_else_the_class_name():
    class Mine(Topology):
        pass

    class Child(Mine):
        pass

    with scratch_registry():
        assert Mine(1).name == "Mine"
        TopologyFactory.add_topology("zz-mine", Mine)
        TopologyFactory.add_topology("aa-mine", Mine)
        # Registered twice: the first name in the registry, as name_of says.
        assert Mine(1).name == TopologyFactory.name_of(Mine) == "zz-mine"
        assert Child(1).name == "Child"  # a subclass is not registered under its parent's names
        TopologyFactory.add_topology("zz-mine", Child)  # the name now belongs to Child
        assert Mine(1).name == "aa-mine" and Child(1).name == TopologyFactory.name_of(Child) == "zz-mine"
    assert TopologyFactory.create("ring", 4).name == "ring"


def test_local_world_size_must_divide():
    with pytest.raises(ValueError, match=r"local_world_size=3 must divide world_size=4"):
        TopologyFactory.create("ring", 4, 3)


# -- the command line -------------------------------------------------------------------------------------
def test_cli_prints_schedule_and_figures(capsys):
    assert main(["one-peer-exp", "--world-size", "6"]) == 0
    out = capsys.readouterr().out
    assert "one-peer-exp: world_size=6" in out
    assert "step   0 (phase 0): {0, 1}  {2, 3}  {4, 5}" in out
    assert "period:                    4" in out
    assert "exact consensus after:     4 steps" in out
    assert "consensus rate:            1.0000 per period" in out
    assert "process groups:" in out and "models sent per rank/step:" in out


def test_cli_local_world_size_and_steps(capsys):
    assert main(["hierarchical", "-n", "8", "-l", "2", "--steps", "3"]) == 0
    out = capsys.readouterr().out
    assert sum(line.startswith("step ") for line in out.splitlines()) == 3
    assert "4 node(s)" in out


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        # pairs: one fp32 copy (4 bytes/parameter) uncompressed, 2 bytes with 16 bits, and with int8
        # 1 byte plus one fp32 scale per 256 parameters: 1 + 4/256 = 1.015625
        (["ring", "-n", "8", "-c", "bf16"], "with bf16 compression: 2.0000 (uncompressed 4.0000; x0.500)"),
        (["ring", "-n", "8", "-c", "int8"], "with int8 compression: 1.0156 (uncompressed 4.0000; x0.254)"),
        # a group of 8 gathers 7 payloads: no fewer bytes than the all-reduce's 2 * 7/8 * 4, so it
        # stays uncompressed
        (
            ["complete", "-n", "8", "-c", "bf16"],
            "with bf16 compression: 7.0000 (uncompressed 7.0000; x1.000)",
        ),
        # one-peer-exp at 16 has 4 groups per rank; a cap of 2 compresses the first two phases only
        (
            ["one-peer-exp", "-n", "16", "-c", "bf16", "--max-references", "2"],
            "with bf16 compression: 3.0000 (uncompressed 4.0000; x0.750)",
        ),
    ],
)
def test_plan_prints_bytes_per_parameter_with_compression(argv, expected, capsys):
    assert plan_main(["bytes", *argv]) == 0
    assert expected in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["torus", "-n", "4"], "unknown topology 'torus'; registered: alternating-exp-ring, complete"),
        (["ring", "-n", "0"], "world_size must be >= 1, got 0"),
        (["ring", "-n", "6", "-l", "4"], "local_world_size=4 must divide world_size=6"),
        (["ring", "-n", "6", "--steps", "0"], "--steps must be >= 1"),
    ],
)
def test_cli_errors_exit_2_with_a_message(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["ring", "-n", "4", "-c", "bf8"], "compression='bf8' is not a wire format"),
        (["ring", "-n", "4", "-c", "bf16", "--max-references", "0"], "--max-references must be >= 1, got 0"),
        (["torus", "-n", "4"], "unknown topology 'torus'; registered: alternating-exp-ring, complete"),
        (["ring", "-n", "6", "-l", "4"], "local_world_size=4 must divide world_size=6"),
    ],
)
def test_plan_errors_exit_2_with_a_message(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        plan_main(["bytes", *argv])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_plan_without_compression_prints_every_wire_format(capsys):
    assert plan_main(["bytes", "ring", "-n", "4"]) == 0
    out = capsys.readouterr().out
    assert "uncompressed: 4.0000" in out
    assert all(f"with {wire} compression" in out for wire in ("bf16", "fp16", "int8"))


@pytest.mark.timeout(300)
def test_cli_subprocess():
    # The checkout's package first, as `python -m` from the repository root would find it. The
    # subprocess imports torch: seconds on an idle machine, over a minute on a 2-core one under a load
    # burst (CI saw one), so its deadline is generous; it only guards against a hang.
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [sys.executable, "-m", "decent_optim_wrapper.topo", "ring", "--world-size", "5"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240, check=False)
    assert done.returncode == 0, done.stderr
    assert "{2, 3, 4}" in done.stdout and "exact consensus after:     never (asymptotic)" in done.stdout

"""Pure logic: the built-in schedules, their mixing matrices and figures, for every size up to 64 ranks.

The custom-topology contract (validation, registry, command line) is in ``test_topology_contract.py``;
the same schedules run on real process groups in ``test_topologies_dist.py``.

Numerical tolerance: products of mixing matrices are compared with ``atol=1e-12, rtol=0``. Every entry of
a product of at most ~2 log2(n) + 1 matrices is a sum of products of weights in [0, 1]; float64 rounds
each operation by ~1e-16, so exact schedules land within ~1e-14 of ``J = 11^T/n``, while a schedule
that is not exact is off by far more (its entries are rationals whose distance to ``1/n`` is at
least of order ``1/n^2 >= 2e-4`` here). Row and column sums get the same tolerance.
"""

from __future__ import annotations

import math
from functools import cache

import pytest
import torch
from topologies import BUILTIN_TOPOLOGIES

from decent_optim_wrapper.topo import Group, Topology, TopologyFactory
from decent_optim_wrapper.topo.analysis import (
    allreduce_models_sent,
    connected_components,
    models_sent_per_rank,
    period_product,
)
from decent_optim_wrapper.topo.exponential import exponential_phases

pytestmark = pytest.mark.pure

USES_LOCAL_WORLD_SIZE = {"alternating-exp-ring", "hierarchical"}
MAX_WORLD = 64
ATOL = 1e-12


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # Hundreds of 64x64 products: thread start-up costs more than the maths on a loaded CI machine.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _cases(name: str) -> list[tuple[int, int]]:
    """Every (world_size, local_world_size) to test: all divisors where the topology reads the node size."""
    cases = []
    for n in range(1, MAX_WORLD + 1):
        sizes = [d for d in range(1, n + 1) if n % d == 0] if name in USES_LOCAL_WORLD_SIZE else [1]
        cases += [(n, lws) for lws in sizes]
    return cases


@cache
def _topology(name: str, n: int, lws: int = 1) -> Topology:
    return TopologyFactory.create(name, n, lws)


@cache
def _matrices(name: str, n: int, lws: int) -> tuple[torch.Tensor, ...]:
    topo = _topology(name, n, lws)
    return tuple(topo.mixing_matrix(step) for step in range(topo.period))


def _product(name: str, n: int, lws: int, steps: int) -> torch.Tensor:
    ws = _matrices(name, n, lws)
    p = torch.eye(n, dtype=torch.float64)
    for step in range(steps):
        p = ws[step % len(ws)] @ p
    return p


def _is_average(p: torch.Tensor) -> bool:
    n = p.shape[0]
    return torch.allclose(p, torch.full((n, n), 1.0 / n, dtype=torch.float64), rtol=0, atol=ATOL)


def _pairs(phase) -> list[tuple[int, ...]]:
    return sorted(g.ranks for g in phase)


# -- every built-in, every size ---------------------------------------------------------------------------
def test_all_builtins_registered():
    assert set(BUILTIN_TOPOLOGIES) <= set(TopologyFactory.names())
    for name in BUILTIN_TOPOLOGIES:
        assert TopologyFactory.create(name, 4).name == name


@pytest.mark.parametrize("name", BUILTIN_TOPOLOGIES)
def test_builtin_schedules_are_valid_doubly_stochastic_and_connected(name):
    for n, lws in _cases(name):
        topo = _topology(name, n, lws)
        assert topo.period >= 1
        for step, phase in enumerate(topo.schedule):
            covered = sorted(r for g in phase for r in g.ranks)
            assert covered == list(range(n)), (name, n, lws, step)
            w = _matrices(name, n, lws)[step]
            assert (w >= 0).all(), (name, n, lws, step)
            assert torch.equal(w, w.T)
            ones = torch.ones(n, dtype=torch.float64)
            torch.testing.assert_close(w.sum(0), ones, rtol=0, atol=ATOL)
            torch.testing.assert_close(w.sum(1), ones, rtol=0, atol=ATOL)
        assert connected_components(n, topo.schedule) == [list(range(n))], (name, n, lws)
        if n == 1:
            assert topo.schedule == ((Group((0,)),),)


@pytest.mark.parametrize("name", BUILTIN_TOPOLOGIES)
def test_exact_consensus_claims_hold_and_are_minimal(name):
    for n, lws in _cases(name):
        topo = _topology(name, n, lws)
        steps = topo.exact_consensus_steps()
        if steps is None:
            # Not exact within two periods, and the rate says consensus is only asymptotic.
            assert not _is_average(_product(name, n, lws, 2 * topo.period)), (name, n, lws)
            assert topo.consensus_rate() < 1.0
            continue
        assert _is_average(_product(name, n, lws, steps)), (name, n, lws, steps)
        if steps > 0:
            assert not _is_average(_product(name, n, lws, steps - 1)), (name, n, lws, steps)
        if steps <= topo.period:
            assert topo.consensus_rate() == 1.0


def test_exact_consensus_claims_per_topology():
    assert [_topology("complete", n).exact_consensus_steps() for n in (1, 2, 64)] == [0, 1, 1]
    assert [_topology("ring", n).exact_consensus_steps() for n in (1, 2, 3, 4, 5, 6)] == [
        0,
        1,
        1,
        2,
        None,
        None,
    ]
    for n in range(1, MAX_WORLD + 1):
        assert _topology("one-peer-exp", n).exact_consensus_steps() == exponential_phases(n)
        assert _topology("one-peer-exp", n).period == max(1, exponential_phases(n))


def test_schedule_and_mixing_matrices_by_hand():
    ring = _topology("ring", 6)
    # Groups are ordered by first rank, so (0, 5) comes first in phase 1.
    assert [[g.ranks for g in phase] for phase in ring.schedule] == [
        [(0, 1), (2, 3), (4, 5)],
        [(0, 5), (1, 2), (3, 4)],
    ]
    w = ring.mixing_matrix(1)
    # Weights 1/2 are exact in float64, so the sums must be exactly 1.
    assert w[0, 5] == w[0, 0] == 0.5 and w.sum(0).eq(1).all() and w.sum(1).eq(1).all()
    assert ring.mixing_matrix(3).equal(w)  # phases cycle with the step
    complete = _topology("complete", 3).mixing_matrix(0)
    assert complete.equal(torch.full((3, 3), 1 / 3, dtype=torch.float64))


# -- ring -------------------------------------------------------------------------------------------------
def test_even_ring_matches_decent_dp():
    for n in range(2, MAX_WORLD + 1, 2):
        topo = _topology("ring", n)
        # decent-dp: edges[0] = sorted([i, i+1]), edges[1] = sorted([i, (i-1) % n]) for even i.
        right = sorted(tuple(sorted({i, (i + 1) % n})) for i in range(0, n, 2))
        left = sorted(tuple(sorted({i, (i - 1) % n})) for i in range(0, n, 2))
        assert topo.period == 2
        assert _pairs(topo.schedule[0]) == right
        assert _pairs(topo.schedule[1]) == left
        assert all(g.self_weight is None for phase in topo.schedule for g in phase)


def test_even_ring_assign_groups_is_unchanged():
    # The exact per-rank lists of version 0.2.0, so fingerprints match across versions.
    for n in range(2, MAX_WORLD + 1, 2):
        expected = []
        for rank in range(n):
            right = rank + 1 if rank % 2 == 0 else rank - 1
            left = (rank - 1) % n if rank % 2 == 0 else (rank + 1) % n
            expected.append([sorted({rank, right}), sorted({rank, left})])
        assert TopologyFactory.get("ring")(n).assign_groups() == expected


def test_odd_ring_turns_its_matching_one_rank_a_phase_so_no_pair_is_grouped_at_every_step():
    assert _pairs(_topology("ring", 3).schedule[0]) == [(0, 1, 2)] and _topology("ring", 3).period == 1
    ring_edges = lambda n: {tuple(sorted((i, (i + 1) % n))) for i in range(n)}  # noqa: E731
    for n in range(5, MAX_WORLD + 1, 2):
        topo = _topology("ring", n)
        assert topo.period == n
        for start, phase in enumerate(topo.schedule):
            # pairs of ring neighbours from `start` on, then the three ranks just before `start`
            pairs = [
                tuple(sorted(((start + 2 * i) % n, (start + 2 * i + 1) % n))) for i in range((n - 3) // 2)
            ]
            triple = tuple(sorted((start - k) % n for k in (3, 2, 1)))
            assert _pairs(phase) == sorted([*pairs, triple])
        used = {(a, b) for phase in topo.schedule for g in phase for a in g.ranks for b in g.ranks if a < b}
        assert ring_edges(n) <= used
        together = [
            {(a, b) for g in phase for a in g.ranks for b in g.ranks if a < b} for phase in topo.schedule
        ]
        assert not set.intersection(*together)  # no two ranks average together at every step
        for rank in range(n):  # each rank spends as many phases with its left neighbour as with its right one
            with_left = sum(((rank - 1) % n) in topo.group(rank, s).ranks for s in range(n))
            with_right = sum(((rank + 1) % n) in topo.group(rank, s).ranks for s in range(n))
            assert with_left == with_right


class _TripleInOnePlace(Topology):
    """The odd ring with its triple at the end of both phases (ranks n-2 and n-1 always together)."""

    def assign_groups(self):
        n = self.world_size
        phases = [
            [[2 * i, 2 * i + 1] for i in range((n - 3) // 2)] + [[n - 3, n - 2, n - 1]],
            [[2 * i + 1, 2 * i + 2] for i in range((n - 3) // 2)] + [[0, n - 2, n - 1]],
        ]
        return [[next(sorted(g) for g in phase if r in g) for phase in phases] for r in range(n)]


@pytest.mark.parametrize("n", [5, 7, 9, 15, 31])
def test_odd_ring_mixes_faster_per_step_than_with_its_triple_in_one_place(n):
    # the distance to the mean shrinks by 1 - rate a step: the steps to shrink it by a given factor go as
    # 1 / -log(1 - rate), and the turning matching needs at most 2/3 of them (1/2 from 7 ranks on)
    turning = -math.log(1 - _topology("ring", n).consensus_rate(per_step=True))
    in_one_place = -math.log(1 - _TripleInOnePlace(n).consensus_rate(per_step=True))
    assert turning > (1.5 if n == 5 else 2.0) * in_one_place


# -- one-peer-exp -----------------------------------------------------------------------------------------
def test_one_peer_exp_power_of_two_is_decent_dps_hypercube():
    for k in range(1, 7):
        n = 2**k
        topo = _topology("one-peer-exp", n)
        assert topo.period == k
        for i in range(k):
            xor = sorted({tuple(sorted((j, j ^ 2**i))) for j in range(n)})
            # decent-dp pairs j with (j + 2^i) mod n, greedily by increasing j.
            used, greedy = [False] * n, []
            for j in range(n):
                if not used[j]:
                    t = (j + 2**i) % n
                    used[j] = used[t] = True
                    greedy.append(tuple(sorted((j, t))))
            assert _pairs(topo.schedule[i]) == xor == sorted(greedy)
            assert all(g.self_weight is None for g in topo.schedule[i])


def test_one_peer_exp_phase_count_formula_and_bound():
    assert [exponential_phases(n) for n in range(1, 10)] == [0, 1, 3, 2, 5, 4, 5, 3, 7]
    for n in range(2, 2049):
        t = exponential_phases(n)
        h = n // 2
        if n % 2 == 0:
            assert t == 1 + exponential_phases(h)
        else:
            assert t == 2 + max(exponential_phases(h + 1), exponential_phases(h))
        assert t <= 2 * math.ceil(math.log2(n)) - 1
    for n in range(1, MAX_WORLD + 1):
        topo = _topology("one-peer-exp", n)
        assert max(g.size for phase in topo.schedule for g in phase) <= 2
        assert max(models_sent_per_rank(topo)) <= 1.0


def test_one_peer_exp_odd_split_weights():
    # n = 3: A = [0, 2], B = [1]. Uniform pair (2, 1), then (0, 1) with w = 2/3, then (0, 2).
    topo = _topology("one-peer-exp", 3)
    assert [[(g.ranks, g.self_weight) for g in phase if g.size > 1] for phase in topo.schedule] == [
        [((1, 2), None)],
        [((0, 1), 2 / 3)],
        [((0, 2), None)],
    ]


# -- hierarchical schedules -------------------------------------------------------------------------------
def _decent_dp_alternating(nodes: int, lws: int) -> list[list[tuple[int, ...]]]:
    """decent-dp's alternating-exp-ring, restated: round i pairs node j with j + 2^i (greedy by j); the c-th
    pair overall merges its 2L ranks in the round's second phase if c is even, else in the first, and
    averages inside each node in the other phase."""
    phases: list[list[tuple[int, ...]]] = []
    count = 0
    for i in range(round(math.log2(nodes))):
        first: list[tuple[int, ...]] = []
        second: list[tuple[int, ...]] = []
        used = [False] * nodes
        for j in range(nodes):
            if used[j]:
                continue
            t = (j + 2**i) % nodes
            used[j] = used[t] = True
            node_j = tuple(range(j * lws, (j + 1) * lws))
            node_t = tuple(range(t * lws, (t + 1) * lws))
            merged = tuple(sorted(node_j + node_t))
            if count % 2 == 0:
                second.append(merged)
                first += [node_j, node_t]
            else:
                first.append(merged)
                second += [node_j, node_t]
            count += 1
        phases += [sorted(first), sorted(second)]
    return phases


def test_alternating_exp_ring_matches_decent_dp_for_power_of_two_nodes():
    for nodes in (2, 4, 8, 16):
        for lws in (2, 3, 4):
            topo = _topology("alternating-exp-ring", nodes * lws, lws)
            assert [_pairs(phase) for phase in topo.schedule] == _decent_dp_alternating(nodes, lws)
            assert all(g.self_weight is None for phase in topo.schedule for g in phase)


@pytest.mark.parametrize("name", ["alternating-exp-ring", "hierarchical"])
def test_hierarchical_schedules_reduce_to_one_peer_exp_with_one_rank_per_node(name):
    for n in range(1, MAX_WORLD + 1):
        assert _topology(name, n, 1).schedule == _topology("one-peer-exp", n).schedule


@pytest.mark.parametrize("name", ["alternating-exp-ring", "hierarchical"])
def test_hierarchical_schedules_on_one_node_are_one_intra_node_average(name):
    for lws in range(2, 9):
        assert _topology(name, lws, lws).schedule == ((Group(tuple(range(lws))),),)
        assert _topology(name, lws, lws).exact_consensus_steps() == 1


def test_hierarchical_alternates_intra_node_average_and_same_local_rank_pairs():
    for n, lws in _cases("hierarchical"):
        if lws == 1 or n == lws:
            continue
        topo = _topology("hierarchical", n, lws)
        nodes = [tuple(range(a * lws, (a + 1) * lws)) for a in range(n // lws)]
        assert topo.period == 2 * exponential_phases(n // lws) == topo.exact_consensus_steps()
        for t in range(0, topo.period, 2):
            assert _pairs(topo.schedule[t]) == nodes
            for g in topo.schedule[t + 1]:
                assert g.size <= 2
                if g.size == 2:
                    a, b = g.ranks
                    assert a % lws == b % lws and a // lws != b // lws


def test_alternating_weighted_merge_keeps_node_weight():
    # 3 nodes of 2: the odd split's weighted node pair (w = 2/3) becomes w_r = 1 - (1/3) * 3/2 = 1/2.
    topo = _topology("alternating-exp-ring", 6, 2)
    weighted = [g for phase in topo.schedule for g in phase if not g.is_uniform]
    assert weighted == [Group((0, 1, 2, 3), self_weight=0.5)]


# -- inspection figures -----------------------------------------------------------------------------------
def test_figures_by_hand():
    complete = _topology("complete", 8)
    assert complete.num_process_groups() == 1
    assert complete.models_sent_per_step() == pytest.approx(2 * 7 / 8, rel=0, abs=1e-15)
    assert complete.consensus_rate() == 1.0
    ring = _topology("ring", 8)
    assert ring.num_process_groups() == 8
    assert ring.models_sent_per_step() == 1.0
    assert 0.0 < ring.consensus_rate() < 1.0
    assert ring.consensus_rate(per_step=True) == pytest.approx(1 - (1 - ring.consensus_rate()) ** 0.5)
    exp = _topology("one-peer-exp", 8)
    assert exp.num_process_groups() == 12
    assert exp.models_sent_per_step() == 1.0
    assert _topology("ring", 7).models_sent_per_step() == pytest.approx((4 * 1 + 3 * 4 / 3) / 7)
    assert [allreduce_models_sent(k) for k in (1, 2, 4)] == [0.0, 1.0, 1.5]


def test_consensus_rate_is_one_for_exact_periods():
    # Two ranks averaging once per step: P = J. Ring of four = 2-cube: P = J after its two phases.
    assert _topology("ring", 2).consensus_rate() == 1.0
    assert torch.allclose(period_product(_topology("ring", 4)), torch.full((4, 4), 0.25, dtype=torch.float64))

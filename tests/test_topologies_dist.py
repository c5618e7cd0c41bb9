"""Multi-process: every built-in topology mixes exactly by its mixing matrices, and reaches consensus."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from helpers import flat, gather, set_distinct, tiny_model
from topologies import BUILTIN_TOPOLOGIES

from decent_optim_wrapper import DecentOptimWrapper, Group, Topology, TopologyFactory

WORLDS = [(2, 1), (3, 1), (4, 1), (4, 2)]  # (world size, ranks per node); (4, 2) is 2 nodes x 2


def _history(topology: str | type[Topology], local_world_size: int, steps: int) -> list[torch.Tensor]:
    model = tiny_model(dtype=torch.float64)
    opt = DecentOptimWrapper(
        torch.optim.SGD(model.parameters(), lr=0.0), local_world_size=local_world_size, topology=topology
    )
    set_distinct(model, dist.get_rank())
    history = [gather(flat(model))]
    for _ in range(steps):
        opt.step()
        history.append(gather(flat(model)))
    return history


def _check_rounds(history: list[torch.Tensor], topo: Topology) -> None:
    # history[t + 1] holds the replicas after step t; step t >= 1 mixes the round launched at t - 1.
    # Float64 with groups of at most 2L <= 4 members: each entry has at most 4 roundings, so
    # 4 * 4 * eps * max|x| bounds the difference to the float64 product.
    atol = 16 * torch.finfo(torch.float64).eps * history[0].abs().max().item()
    for t in range(1, len(history) - 1):
        expected = topo.mixing_matrix(t - 1) @ history[t]
        torch.testing.assert_close(history[t + 1], expected, rtol=0, atol=atol, msg=f"round of step {t - 1}")


@pytest.mark.parametrize(
    ("world_size", "local_world_size"), WORLDS, ids=[f"{n}x{local}" for n, local in WORLDS]
)
@pytest.mark.parametrize("name", BUILTIN_TOPOLOGIES)
def test_builtin_rounds_equal_mixing_matrices_and_reach_exact_consensus(
    pool, name, world_size, local_world_size
):
    topo = TopologyFactory.create(name, world_size, local_world_size)
    exact = topo.exact_consensus_steps()
    steps = 1 + max(2 * topo.period, exact or 0)
    history = pool(world_size).run(_history, name, local_world_size, steps)[0]
    _check_rounds(history, topo)
    spread0 = (history[0] - history[0].mean(0)).abs().max().item()
    if exact is not None:
        # rounds 0 .. exact-1 are mixed by step `exact`, i.e. in history[exact + 1]
        after = history[exact + 1]
        spread = (after - after.mean(0)).abs().max().item()
        assert spread <= 1e-13 * spread0, f"{name}: not exact after {exact} rounds (spread {spread:.3g})"


class WeightedRing(Topology):
    """Alternating pairs like 'ring' (even n), but every rank keeps 3/4 of itself."""

    def assign_groups(self):
        n = self.world_size
        groups = []
        for rank in range(n):
            first = rank - rank % 2
            partner = (rank + 1) % n if rank % 2 else (rank - 1) % n
            groups.append([Group((first, first + 1), 0.75), Group(tuple(sorted((rank, partner))), 0.75)])
        return groups


def test_weighted_custom_topology_is_honoured(pool):
    topo = WeightedRing(4)
    assert topo.mixing_matrix(0)[0, 0] == 0.75 and topo.mixing_matrix(0)[0, 1] == 0.25
    history = pool(4).run(_history, WeightedRing, 1, 5)[0]
    _check_rounds(history, topo)
    # the mean never moves: weights are doubly stochastic
    torch.testing.assert_close(history[-1].mean(0), history[0].mean(0), rtol=0, atol=1e-14)

"""Multi-process: one gossip round is W @ x; mean preserved; complete and ring reach consensus."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
from helpers import flat, gather, set_distinct, tiny_model, train_steps
from simulation import reference_algorithm

from decent_optim_wrapper import DecentOptimWrapper

CASES = [(1, "complete"), (2, "ring"), (2, "complete"), (3, "complete"), (4, "ring"), (4, "complete")]


def _one_round(topology: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    rank = dist.get_rank()
    model = tiny_model(dtype=dtype)
    opt = DecentOptimWrapper(
        torch.optim.SGD(model.parameters(), lr=0.0), topology=topology, bucket_cap_mb=0.0001
    )
    set_distinct(model, rank)
    before = gather(flat(model)).double()
    opt.step()  # step 0: nothing to mix; launches phase 0 (no grads: SGD leaves parameters as they are)
    opt.step()  # step 1: mixes phase 0
    after = gather(flat(model)).double()
    return before, after, [opt.topology.mixing_matrix(0)]


@pytest.mark.parametrize(("world_size", "topology"), CASES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_one_round_equals_mixing_matrix(pool, world_size, topology, dtype):
    before, after, (w,) = pool(world_size).run(_one_round, topology, dtype)[0]
    expected = w @ before
    # Each entry is sum_j x_j / k over the k members of its group, computed in `dtype`: k divisions
    # (each off by at most u max|x| / k) and k - 1 additions of partial sums below max|x| (each off
    # by at most u max|x|), so |after - W x| <= k u max|x| with u = eps / 2. The float64 reference
    # W @ x rounds too: fl(1/k) and k products (2 u64 max|x| together), k - 1 additions.
    k = int((w != 0).sum(1).max())
    u, u64 = torch.finfo(dtype).eps / 2, torch.finfo(torch.float64).eps / 2
    atol = (k * u + (k + 1) * u64) * before.abs().max().item()
    torch.testing.assert_close(after, expected, rtol=0, atol=atol)
    assert not torch.equal(after, before) or world_size == 1


def _rounds(topology: str, steps: int) -> list[torch.Tensor]:
    rank = dist.get_rank()
    model = tiny_model(dtype=torch.float64)
    opt = DecentOptimWrapper(torch.optim.SGD(model.parameters(), lr=0.0), topology=topology)
    set_distinct(model, rank, dyadic=True)
    history = [gather(flat(model))]
    for _ in range(steps):
        opt.step()
        history.append(gather(flat(model)))
    return history


@pytest.mark.parametrize(
    ("world_size", "topology"), [(2, "ring"), (3, "complete"), (4, "ring"), (4, "complete")]
)
def test_mean_is_preserved_exactly(pool, world_size, topology):
    history = pool(world_size).run(_rounds, topology, 8)[0]
    # Integer data, group sizes 2, 3 or 4, and values that are multiples of 12: every division and
    # sum is exact in float64, so the mean must not move by a single bit (rtol=0, atol=0).
    mean = history[0].sum(0)
    for snapshot in history[1:]:
        torch.testing.assert_close(snapshot.sum(0), mean, rtol=0, atol=0)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_complete_gives_exact_mean_in_one_round(pool, world_size):
    history = pool(world_size).run(_rounds, "complete", 2)[0]
    exact_mean = history[0].sum(0) / world_size
    after = history[2]  # step 1 mixed the round launched at step 0
    for rank in range(world_size):
        torch.testing.assert_close(after[rank], exact_mean, rtol=0, atol=0)


def test_ring_reaches_consensus_with_zero_lr(pool):
    history = pool(4).run(_rounds, "ring", 80)[0]
    spread = [(h - h.mean(0)).abs().max().item() for h in history]
    # a ring of 4 with alternating pairs contracts the spread every two rounds; it never grows
    assert all(b <= a for a, b in itertools.pairwise(spread))
    assert spread[-1] <= 1e-9 * spread[0]


def _wrapped_run(topology: str, steps: int) -> torch.Tensor:
    model = tiny_model()
    opt = DecentOptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), topology=topology)
    train_steps(model, opt, dist.get_rank(), range(steps))
    return flat(model)


@pytest.mark.parametrize(
    ("world_size", "topology"), [(2, "ring"), (4, "ring"), (2, "complete"), (4, "complete")]
)
def test_same_numbers_as_the_reference_algorithm(pool, world_size, topology):
    # Groups of 2 and 4: x / k is exact, and the all-reduce sums 2 terms (order-free) or 4 terms
    # (gloo's order may differ from this loop's), so pairs must match bit for bit and groups of 4
    # within 4 roundings of the parameter scale.
    reference = reference_algorithm(world_size, topology, steps=6)
    results = pool(world_size).run(_wrapped_run, topology, 6)
    for rank in range(world_size):
        if world_size == 2 or topology == "ring":
            assert torch.equal(results[rank], reference[rank]), f"rank {rank} differs from the reference"
        else:
            atol = 4 * torch.finfo(torch.float32).eps * reference[rank].abs().max().item()
            torch.testing.assert_close(results[rank], reference[rank], rtol=0, atol=atol)

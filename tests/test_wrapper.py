"""Multi-process: drop-in behaviour (schedulers, closures, world size 1, the seed README examples)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from helpers import bare_and_wrapped, batch, flat, gather, tiny_model, train_steps
from simulation import Gossip
from torch import nn

from decent_optim_wrapper import AccumAdamW, DecentOptimWrapper, Topology, TopologyFactory


def _bare_vs_wrapped(optimizer_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    def make(params):
        if optimizer_name == "adamw":
            return torch.optim.AdamW(params, lr=0.01)
        if optimizer_name == "accum-adamw":  # the optimizers of the module front-end work here too
            return AccumAdamW(params, lr=0.01, weight_decay=0.1, accum_iter=2)
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)

    return bare_and_wrapped(make_optimizer=make, topology="ring")


@pytest.mark.parametrize("optimizer_name", ["sgd", "adamw", "accum-adamw"])
def test_world_size_one_is_the_bare_optimizer_bit_for_bit(pool, optimizer_name):
    ((bare, wrapped),) = pool(1).run(_bare_vs_wrapped, optimizer_name)
    assert torch.equal(bare, wrapped)


def _scheduler_lrs(on_inner: bool) -> tuple[list[float], list[str]]:
    model = tiny_model()
    inner = torch.optim.SGD(model.parameters(), lr=1.0)
    opt = DecentOptimWrapper(inner, topology="complete")
    scheduler = torch.optim.lr_scheduler.StepLR(inner if on_inner else opt, step_size=1, gamma=0.5)
    used = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            before = flat(model)
            x, y = batch(dist.get_rank(), step)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
            opt.step()
            opt.global_avg(may_revert=False)  # remove gossip from the picture: mean moves by -lr * mean grad
            moved = (before - flat(model)).double()
            mean_grad = grads.double().clone()
            dist.all_reduce(mean_grad)
            mean_grad /= dist.get_world_size()
            used.append((moved.norm() / mean_grad.norm()).item())
            scheduler.step()
    return used, [str(w.message) for w in caught]


@pytest.mark.parametrize("on_inner", [False, True], ids=["on-wrapper", "on-inner"])
def test_lr_scheduler_changes_the_lr_actually_used(pool, on_inner):
    for used, caught in pool(2).run(_scheduler_lrs, on_inner):
        # |x_before - x_after| / |mean grad| is the lr used: 1, 0.5, 0.25 (fp32 arithmetic, rtol 1e-4)
        assert used == pytest.approx([1.0, 0.5, 0.25], rel=1e-4)
        assert not [w for w in caught if "lr_scheduler.step()" in w]


def _closure_step() -> tuple[float, float]:
    model = tiny_model()
    opt = DecentOptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1), topology="ring")
    x, y = batch(dist.get_rank(), 0)
    computed = []

    def closure():
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        computed.append(float(loss))
        return loss

    first = opt.step(closure)
    second = opt.step(closure)
    return [float(first), float(second)], computed


def test_step_with_closure_returns_the_loss(pool):
    for returned, computed in pool(2).run(_closure_step):
        assert returned == computed  # each step returns the loss its closure computed
        assert returned[1] < returned[0]


def _zero_grad() -> list[bool]:
    model = tiny_model()
    opt = DecentOptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1), topology="ring")
    train_steps(model, opt, dist.get_rank(), range(1))
    opt.zero_grad(set_to_none=False)
    zeroed = all(p.grad is not None and not p.grad.any() for p in model.parameters())
    opt.zero_grad()
    return [zeroed, all(p.grad is None for p in model.parameters())]


def test_zero_grad(pool):
    assert pool(2).run(_zero_grad) == [[True, True]] * 2


def _seed_quick_start() -> float:
    # The seed README's quick start as written, with backend "gloo" and CPU tensors instead of NCCL/CUDA.
    import torch.nn as nn
    from torch.optim import SGD

    from decent_optim_wrapper.wrapper import DecentOptimWrapper

    rank = dist.get_rank()
    world_size = dist.get_world_size()
    local_world_size = world_size
    model = nn.Linear(10, 10)
    base_optimizer = SGD(model.parameters(), lr=0.01)
    optimizer = DecentOptimWrapper(
        optimizer=base_optimizer,
        rank=rank,
        world_size=world_size,
        local_world_size=local_world_size,
        topology="ring",  # or 'complete'
        bucket_cap_mb=25,
    )
    start = gather(flat(model))  # (the test's) where the replicas start
    criterion = nn.MSELoss()
    g = torch.Generator().manual_seed(rank)
    dataloader = [(torch.randn(8, 10, generator=g), torch.randn(8, 10, generator=g)) for _ in range(5)]
    num_epochs = 2
    for _epoch in range(num_epochs):
        for batch_ in dataloader:
            optimizer.zero_grad()
            inputs, targets = batch_
            outputs = model(inputs)
            loss = criterion(outputs, targets)
            loss.backward()
            optimizer.step()  # Handles decentralized averaging
    trained = flat(model)  # (the test's)
    optimizer.global_avg()
    averaged = gather(flat(model))  # (the test's)
    optimizer.revert_global_avg()
    return {
        "start": start,
        "data": dataloader,
        "trained": trained,
        "averaged": averaged,
        "reverted": flat(model),
    }


def test_seed_quick_start_runs_as_written(pool):
    results = pool(2).run(_seed_quick_start)
    # The claim: step() does decentralized SGD. Its rule, simulated from the same start and data: a
    # ring of two averages the pair (x/2 + y/2, exact), so the replicas must follow it bit for bit.
    models = [nn.Linear(10, 10) for _ in results]
    for model, replica in zip(models, results[0]["start"], strict=True):
        torch.nn.utils.vector_to_parameters(replica, model.parameters())
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.01) for m in models]
    data = [r["data"] for r in results]
    simulation = Gossip(
        "ring",
        models,
        optimizers,
        data=lambda rank, step: data[rank][step % 5],
        loss_fn=nn.functional.mse_loss,
    )
    expected = simulation.run(10)
    mean = (expected[0] + expected[1]) / 2  # exact for two replicas, as above
    for rank, r in enumerate(results):
        assert torch.equal(r["trained"], expected[rank]), f"rank {rank}"
        assert torch.equal(r["averaged"][rank], mean) and torch.equal(r["averaged"][1 - rank], mean)
        assert torch.equal(r["reverted"], r["trained"])


class MyCustomTopology(Topology):
    """The seed README's custom-topology example, with its logic filled in.

    Phase 0 pairs (0,1), (2,3), ...; phase 1 pairs (1,2), ..., (n-1,0) (a ring, written by hand).
    """

    def assign_groups(self):
        groups = [[] for _ in range(self._world_size)]
        n = self._world_size
        for rank in range(n):
            first = rank - rank % 2
            groups[rank].append([first, first + 1])
            partner = (rank + 1) % n if rank % 2 else (rank - 1) % n
            groups[rank].append(sorted([rank, partner]))
        return groups


def _seed_custom_topology() -> torch.Tensor:
    TopologyFactory.add_topology("my_custom", MyCustomTopology)
    rank = dist.get_rank()
    model = tiny_model(dtype=torch.float64)
    optimizer = DecentOptimWrapper(
        optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
        rank=rank,
        world_size=dist.get_world_size(),
        local_world_size=1,
        topology="my_custom",
    )
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float(rank))
    optimizer.step()
    optimizer.step()
    return flat(model)


def test_seed_custom_topology_example(pool):
    results = pool(4).run(_seed_custom_topology)
    for rank, params in enumerate(results):
        expected = 0.5 if rank < 2 else 2.5  # phase 0 averaged the pairs (0, 1) and (2, 3)
        assert torch.equal(params, torch.full_like(params, expected))


def _break_views() -> str:
    model = tiny_model()
    opt = DecentOptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1), topology="ring")
    train_steps(model, opt, dist.get_rank(), range(1))
    model.to(torch.float64)  # replaces every parameter's storage
    try:
        opt.step()
    except RuntimeError as err:
        return str(err)
    return ""


def test_broken_bucket_views_are_detected(pool):
    for message in pool(2).run(_break_views):
        assert "param_groups[0]['params'][0]" in message and "model.to()" in message

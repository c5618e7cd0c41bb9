"""Train several methods side by side on the synthetic task, on ranks that are already started.

Every rank of a gloo process group calls :func:`run`; each method (a name in the grammar of
``methods.py``) trains from the same initial model with the same seeds and hyper-parameters on the
rank's part of a split of the training set (``synthetic_task.py``), and rank 0 gets one
:class:`Result` per method. ``benchmarks/convergence/convergence.py`` starts the ranks and judges the
results.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from benchmarks.harness.methods import Method, optimizer_factory, parse_method
from benchmarks.harness.synthetic_task import describe_split, make_data, make_model, split_data, split_label
from decent_optim_wrapper import DecentOptimWrapper, DecentralizedDataParallel


@dataclass
class Result:
    """What one method produced, as rank 0 reports it."""

    method: str
    losses: list[float]  # per step, averaged over ranks
    distance_steps: list[int] = field(default_factory=list)
    distances: list[float] = field(default_factory=list)
    final_loss: float = 0.0
    accuracy: float = 0.0
    final_distance: float = 0.0
    ms_per_iteration: float = 0.0
    bytes_per_step: float = 0.0
    split: str = "iid"
    alpha: float | None = None  # the Dirichlet concentration; None for the iid split


def model_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def build_training(
    spec: Method,
    model: nn.Module,
    make_optimizer: Callable[[list[tuple[str, torch.Tensor]]], torch.optim.Optimizer],
    steps: int,
) -> tuple[
    nn.Module,
    torch.optim.Optimizer | None,
    DecentOptimWrapper | DecentralizedDataParallel | None,
    torch.optim.lr_scheduler.LRScheduler | None,
]:
    """What trains ``model`` with ``spec``: the module to call, the optimizer to step (None for the
    module front-end, which steps inside backward), what gossips (None for DDP), and a cosine
    schedule over ``steps`` (None for the module front-end, which steps its own per bucket)."""
    optimizer: torch.optim.Optimizer | None = None
    replicas: DecentOptimWrapper | DecentralizedDataParallel | None = None
    if spec.topology is None:
        net: nn.Module = DistributedDataParallel(model)
        optimizer = make_optimizer(list(model.named_parameters()))
    elif spec.module:  # the update happens inside backward, one optimizer per bucket
        net = replicas = DecentralizedDataParallel(
            model,
            make_optimizer,
            lr_scheduler_fn=lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps),
            **spec.engine_options(),
        )
    else:
        net = model
        optimizer = replicas = DecentOptimWrapper(
            make_optimizer(list(model.named_parameters())), **spec.engine_options()
        )
    scheduler = None
    if optimizer is not None:
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)
    return net, optimizer, replicas, scheduler


def train_one_method(
    method: str,
    steps: int,
    batch_size: int,
    lr: float,
    log_every: int,
    adam_lr: float = 3e-3,
    split: str = "iid",
    alpha: float = 0.1,
) -> Result | None:
    """Train from scratch with ``method``; every rank calls this; rank 0 gets the Result.

    Each rank trains on its part of the ``split`` of the training set (``split_data``); a
    Dirichlet split gives every worker at least ``batch_size`` points, so no batch repeats a point
    for want of data.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = parse_method(method)
    make_optimizer = optimizer_factory(spec.optimizer or "sgd", lr, adam_lr)
    train_x, train_y, test_x, test_y = make_data()
    shard = split_data(train_y, world, split, alpha, min_size=batch_size)[rank]
    shard_x, shard_y = train_x[shard], train_y[shard]
    model = make_model()
    net, optimizer, replicas, scheduler = build_training(spec, model, make_optimizer, steps)
    loss_fn = nn.CrossEntropyLoss()
    sampler = torch.Generator().manual_seed(100 + rank)
    losses = torch.zeros(steps, dtype=torch.float64)
    distance_steps, distances = [], []
    train_seconds = 0.0
    for step in range(steps):
        start = time.perf_counter()
        idx = torch.randint(0, len(shard_x), (batch_size,), generator=sampler)
        if optimizer is not None:
            optimizer.zero_grad()
        loss = loss_fn(net(shard_x[idx]), shard_y[idx])
        loss.backward()  # the module front-end updates here
        if optimizer is not None and scheduler is not None:
            optimizer.step()
            scheduler.step()
        train_seconds += time.perf_counter() - start
        losses[step] = loss.item()
        if step % log_every == 0 or step == steps - 1:  # measuring is a collective: kept out of the timing
            distance = replicas.consensus_distance() if replicas is not None else 0.0
            distance_steps.append(step)
            distances.append(distance)
            if rank == 0:
                print(
                    f"  {method:>13}  step {step:4d}/{steps}  loss {loss.item():.4f}  "
                    f"consensus distance {distance:.2e}",
                    flush=True,
                )

    if replicas is not None:
        replicas.global_avg()  # evaluate the average of the replicas ...
    with torch.no_grad():
        accuracy = (model(test_x).argmax(1) == test_y).float().mean().item()
    if replicas is not None:
        replicas.revert_global_avg()  # ... and leave each replica as it was

    dist.all_reduce(losses)
    losses /= world
    timing = torch.tensor([train_seconds], dtype=torch.float64)
    dist.all_reduce(timing)
    if replicas is None:
        # ring all-reduce of the gradients: every rank sends 2(n-1)/n gradient-sized messages
        bytes_per_step = 2 * (world - 1) / world * model_bytes(model)
    else:  # the engine's own count: the topology's period, buckets and compression included
        bytes_per_step = replicas.engine.bytes_sent_per_step()
    if rank != 0:
        return None
    tail = max(1, steps // 20)
    return Result(
        method=method,
        losses=losses.tolist(),
        distance_steps=distance_steps,
        distances=distances,
        final_loss=losses[-tail:].mean().item(),
        accuracy=accuracy,
        final_distance=distances[-1],
        ms_per_iteration=1000 * timing.item() / world / steps,
        bytes_per_step=bytes_per_step,
        split=split,
        alpha=alpha if split == "dirichlet" else None,
    )


def run(
    methods: list[str],
    steps: int,
    batch_size: int,
    lr: float,
    log_every: int,
    adam_lr: float = 3e-3,
    split: str = "iid",
    alpha: float = 0.1,
) -> list[Result]:
    """Train every method in turn on the ``split`` of the data (all ranks); rank 0 returns the results."""
    for method in methods:  # a misspelt method fails now, not after the ones before it have trained
        parse_method(method)
    world = dist.get_world_size()
    if dist.get_rank() == 0:
        labels = make_data()[1]
        shards = split_data(labels, world, split, alpha, min_size=batch_size)
        print(f"Split {split_label(split, alpha)}: {describe_split(shards, labels)}", flush=True)
    results = []
    for method in methods:
        if dist.get_rank() == 0:
            print(f"[{method}] training {steps} steps on {world} workers", flush=True)
        result = train_one_method(method, steps, batch_size, lr, log_every, adam_lr, split, alpha)
        if result is not None:
            results.append(result)
        dist.barrier()
    return results

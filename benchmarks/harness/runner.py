"""Train several methods side by side on the synthetic task, on ranks that are already started.

Every rank of a gloo process group calls :func:`run`; each method (a name in the grammar of
``methods.py``) trains from the same initial model with the same seeds and hyper-parameters on the
rank's part of a split of the training set (``synthetic_task.py``), and rank 0 gets one
:class:`Result` per method. ``benchmarks/convergence/convergence.py`` starts the ranks and judges the
results.

A paced method (``~h8n0.1p``: ``methods.HalfFastSchedule``, half the ranks twice as fast) trains by
rounds, ``steps // H`` of them, each of ``N H`` inner steps over the fleet: the same samples as
``steps`` steps of the unpaced method or of DDP (with ``H = 1``, ``~h1d0p``, fast ranks take 2 steps per
round and the others 1: fewer rounds of more steps, the same samples). Each rank's cosine schedule spans
its own total of inner steps (a fast rank's is longer), so every rank's schedule ends at the last round;
the losses are kept per round and the consensus distance is measured at round ends (a collective: the
same rounds on every rank).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from benchmarks.harness.digits_task import make_digits, make_digits_model
from benchmarks.harness.methods import HalfFastSchedule, Method, optimizer_factory, parse_method
from benchmarks.harness.synthetic_task import describe_split, make_data, make_model, split_data, split_label
from decent_optim_wrapper import DecentOptimWrapper, DecentralizedDataParallel


@dataclass
class Result:
    """What one method produced, as rank 0 reports it."""

    method: str
    losses: list[float]  # per step, averaged over ranks (a paced method: per round, over its samples)
    distance_steps: list[int] = field(default_factory=list)
    distances: list[float] = field(default_factory=list)
    final_loss: float = 0.0
    accuracy: float = 0.0
    final_distance: float = 0.0
    ms_per_iteration: float = 0.0
    bytes_per_step: float = 0.0
    split: str = "iid"
    alpha: float | None = None  # the Dirichlet concentration; None for the iid split
    steps_per_rank: list[int] = field(default_factory=list)  # inner steps each rank took (paced: uneven)
    task: str = "synthetic"
    seed: int = 0
    accuracies: list[float] = field(default_factory=list)  # per seed, where results were averaged over seeds


def model_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def warmup_cosine(
    optimizer: torch.optim.Optimizer, steps: int, warmup: int = 0
) -> torch.optim.lr_scheduler.LRScheduler:
    """torch's own schedules: a linear warmup from 1/``warmup`` of the learning rate over ``warmup``
    steps, then a cosine down to 0 over the rest of ``steps`` (``CosineAnnealingLR`` alone when
    ``warmup`` is 0, as every benchmark before warmup existed)."""
    if warmup <= 0:
        return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)
    if warmup >= steps:
        raise ValueError(f"warmup={warmup} must be shorter than the run's {steps} steps")
    lr = torch.optim.lr_scheduler
    ramp = lr.LinearLR(optimizer, start_factor=1.0 / warmup, end_factor=1.0, total_iters=warmup)
    decay = lr.CosineAnnealingLR(optimizer, T_max=steps - warmup)
    return lr.SequentialLR(optimizer, [ramp, decay], milestones=[warmup])


def build_training(
    spec: Method,
    model: nn.Module,
    make_optimizer: Callable[[list[tuple[str, torch.Tensor]]], torch.optim.Optimizer],
    steps: int,
    warmup: int = 0,
) -> tuple[
    nn.Module,
    torch.optim.Optimizer | None,
    DecentOptimWrapper | DecentralizedDataParallel | None,
    torch.optim.lr_scheduler.LRScheduler | None,
]:
    """What trains ``model`` with ``spec``: the module to call, the optimizer to step (None for the
    module front-end, which steps inside backward), what gossips (None for DDP), and a cosine
    schedule over ``steps`` after ``warmup`` steps of linear warmup (:func:`warmup_cosine`; None for the
    module front-end, which steps its own per bucket). For a
    paced method ``steps`` is this rank's own total (:func:`paced_plan`)."""
    optimizer: torch.optim.Optimizer | None = None
    replicas: DecentOptimWrapper | DecentralizedDataParallel | None = None
    if spec.topology is None:
        net: nn.Module = DistributedDataParallel(model)
        optimizer = make_optimizer(list(model.named_parameters()))
    elif spec.module:  # the update happens inside backward, one optimizer per bucket
        net = replicas = DecentralizedDataParallel(
            model,
            make_optimizer,
            lr_scheduler_fn=lambda opt: warmup_cosine(opt, steps, warmup),
            **spec.engine_options(),
        )
    else:
        net = model
        optimizer = replicas = DecentOptimWrapper(
            make_optimizer(list(model.named_parameters())), **spec.engine_options()
        )
    scheduler = None
    if optimizer is not None:
        scheduler = warmup_cosine(optimizer, steps, warmup)
    return net, optimizer, replicas, scheduler


def paced_plan(spec: Method, steps: int, rank: int, world: int) -> tuple[HalfFastSchedule | None, int, int]:
    """A method's schedule (None unless paced), its rounds (those that process the samples of ``steps``
    steps on every rank: ``steps // H``, or with ``H = 1`` fewer rounds of more steps; 0 unless paced)
    and this rank's own total of inner steps (``steps`` unless paced). ``ValueError`` if no whole
    number of rounds processes the samples of ``steps`` steps."""
    schedule = spec.schedule(world)
    if schedule is None:
        return None, 0, steps
    try:
        rounds = schedule.rounds_for(steps)
    except ValueError as err:
        raise ValueError(f"method {spec.name!r}: {err}") from err
    return schedule, rounds, schedule.total(rank, rounds)


def covers_multiple(first: int, last: int, every: int) -> bool:
    """Whether a multiple of ``every`` lies in ``[first, last]`` (a round's fleet steps)."""
    return last // every > (first - 1) // every


def train_one_method(
    method: str,
    steps: int,
    batch_size: int,
    lr: float,
    log_every: int,
    adam_lr: float = 3e-3,
    split: str = "iid",
    alpha: float = 0.1,
    task: str = "synthetic",
    seed: int = 0,
) -> Result | None:
    """Train from scratch with ``method``; every rank calls this; rank 0 gets the Result.

    Each rank trains on its part of the ``split`` of the training set (``split_data``); a
    Dirichlet split gives every worker at least ``batch_size`` points, so no batch repeats a point
    for want of data. ``task``: ``"synthetic"`` (``synthetic_task.py``) or ``"digits"``
    (``digits_task.py``); ``seed`` draws the initial model and the batches (seed 0: the runs of
    before seeds existed).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = parse_method(method)
    make_optimizer = optimizer_factory(spec.optimizer or "sgd", lr, adam_lr)
    train_x, train_y, test_x, test_y = task_data(task)
    shard = split_data(train_y, world, split, alpha, min_size=batch_size, seed=seed)[rank]
    shard_x, shard_y = train_x[shard], train_y[shard]
    model = make_digits_model(seed) if task == "digits" else make_model(seed)
    schedule, rounds, own_steps = paced_plan(spec, steps, rank, world)
    net, optimizer, replicas, scheduler = build_training(spec, model, make_optimizer, own_steps)
    loss_fn = nn.CrossEntropyLoss()
    sampler = torch.Generator().manual_seed(100 + rank + 1000 * seed)
    losses = torch.zeros(rounds if schedule is not None else steps, dtype=torch.float64)
    distance_steps, distances = [], []
    train_seconds = 0.0

    def train_step() -> float:
        """One inner step on a fresh batch; its loss. Adds its time (the loss's read left out) to
        ``train_seconds``."""
        nonlocal train_seconds
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
        return loss.item()

    def measure(step: int, label: str, loss: float) -> None:
        """The consensus distance (a collective: every rank at the same point), printed by rank 0."""
        distance = replicas.consensus_distance() if replicas is not None else 0.0
        distance_steps.append(step)
        distances.append(distance)
        if rank == 0:
            print(f"  {method:>13}  {label}  loss {loss:.4f}  consensus distance {distance:.2e}", flush=True)

    if schedule is None:
        for step in range(steps):
            loss = train_step()
            losses[step] = loss
            # measuring is a collective: kept out of the timing
            if step % log_every == 0 or step == steps - 1:
                measure(step, f"step {step:4d}/{steps}", loss)
    else:  # by rounds: ranks take different steps, and every rank ends at the same round
        assert replicas is not None
        taken = torch.zeros(rounds, dtype=torch.float64)  # steps per round, summed over ranks below
        while replicas.round_count < rounds:
            loss = train_step()
            ended = replicas.round_ended
            current = replicas.round_count - (1 if ended else 0)  # the round this step belongs to
            losses[current] += loss
            taken[current] += 1
            done = replicas.round_count  # rounds 0 .. done - 1 have ended: fleet steps 0 .. done * H - 1
            first, last = (done - 1) * spec.sync_every, done * spec.sync_every - 1
            if ended and (covers_multiple(first, last, log_every) or done == rounds):  # at a round's end
                measure(last, f"round {done:4d}/{rounds}", loss)

    if replicas is not None:
        replicas.global_avg()  # evaluate the average of the replicas ...
    with torch.no_grad():
        accuracy = (model(test_x).argmax(1) == test_y).float().mean().item()
    if replicas is not None:
        replicas.revert_global_avg()  # ... and leave each replica as it was

    dist.all_reduce(losses)
    if schedule is None:
        losses /= world
    else:  # the mean over every sample of the round
        dist.all_reduce(taken)
        losses /= taken
    timing = torch.tensor([train_seconds], dtype=torch.float64)
    dist.all_reduce(timing)
    per_rank = torch.zeros(world, dtype=torch.int64)
    per_rank[rank] = own_steps
    dist.all_reduce(per_rank)
    if replicas is None:
        # ring all-reduce of the gradients: every rank sends 2(n-1)/n gradient-sized messages
        bytes_per_step = 2 * (world - 1) / world * model_bytes(model)
    else:  # the engine's own count: the topology's period, buckets and compression included
        bytes_per_step = replicas.engine.bytes_sent_per_step()
    if rank != 0:
        return None
    tail = max(1, steps // 20)
    if schedule is not None:  # the rounds that cover the last `tail` fleet steps
        tail = -(-tail // spec.sync_every)
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
        steps_per_rank=per_rank.tolist(),
        task=task,
        seed=seed,
    )


def task_data(task: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Train and test sets of ``task`` (``"synthetic"`` or ``"digits"``)."""
    if task == "digits":
        return make_digits()
    if task == "synthetic":
        return make_data()
    raise ValueError(f"unknown task {task!r}; choose synthetic or digits")


def run(
    methods: list[str],
    steps: int,
    batch_size: int,
    lr: float,
    log_every: int,
    adam_lr: float = 3e-3,
    split: str = "iid",
    alpha: float = 0.1,
    task: str = "synthetic",
    seed: int = 0,
) -> list[Result]:
    """Train every method in turn on the ``split`` of ``task``'s data (all ranks), from ``seed``'s
    model and batches; rank 0 returns the results."""
    for method in methods:  # a misspelt method fails now, not after the ones before it have trained
        parse_method(method)
    world = dist.get_world_size()
    if dist.get_rank() == 0:
        labels = task_data(task)[1]
        shards = split_data(labels, world, split, alpha, min_size=batch_size, seed=seed)
        print(f"Split {split_label(split, alpha)}: {describe_split(shards, labels)}", flush=True)
    results = []
    for method in methods:
        if dist.get_rank() == 0:
            spec = parse_method(method)
            paced = f" ({steps // spec.sync_every} paced rounds)" if spec.paced else ""
            print(f"[{method}] training {steps} steps{paced} on {world} workers", flush=True)
        result = train_one_method(method, steps, batch_size, lr, log_every, adam_lr, split, alpha, task, seed)
        if result is not None:
            results.append(result)
        dist.barrier()
    return results

"""Train methods side by side on started ranks, each from the same model and seeds (:func:`train`: by steps,
or a paced method by rounds, ``steps // H`` of ``N H`` inner steps over the fleet: DDP's samples; :func:`run`:
the classification tasks), and start a driver's local ranks (:func:`on_local_ranks`)."""

import math
import os
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import lr_scheduler

from benchmarks.harness.common import collect_from_ranks
from benchmarks.harness.digits_task import make_digits, make_digits_model
from benchmarks.harness.lm_task import CONTEXT, VOCAB, make_lm_data, make_lm_model, validation_loss, windows
from benchmarks.harness.methods import HalfFastSchedule, Method, optimizer_factory, parse_method
from benchmarks.harness.synthetic_task import describe_split, make_data, make_model, split_data, split_label
from decent_optim_wrapper import DecentOptimWrapper, DecentralizedDataParallel

Replicas = DecentOptimWrapper | DecentralizedDataParallel
MakeOptimizer = Callable[[list[tuple[str, torch.Tensor]]], torch.optim.Optimizer]  # from (name, parameter)s
BatchLoss = Callable[[nn.Module], torch.Tensor]
#: ``hook(taken, span, last, loss, replicas)``: ``taken`` fleet steps done, ``span`` since the last call
Hook = Callable[[int, int, bool, float, Replicas | None], None]


@dataclass
class Result:
    """What one method produced on the classification task, as rank 0 reports it."""

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


@dataclass
class Trained:
    losses: torch.Tensor  # per step (paced: per round), the mean over the ranks' samples
    final_loss: float  # the mean of the last twentieth of the steps (paced: the rounds covering them)
    seconds: float  # training time per rank, the hook's left out
    bytes_per_step: float
    steps_per_rank: list[int]


@dataclass
class Task:
    """A task's model and this rank's batches; ``evaluate``: held-out (loss, accuracy; NaN for the LM)."""

    model: nn.Module
    batch_loss: BatchLoss
    evaluate: Callable[[nn.Module], tuple[float, float]]


def task_data(task: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    if task not in ("synthetic", "digits"):
        raise ValueError(f"unknown task {task!r}; choose synthetic or digits")
    return make_digits() if task == "digits" else make_data()


def make_task(
    task: str, rank: int, world: int, seed: int, batch_size: int, draws: torch.Generator, split: str = "iid",
    alpha: float = 0.1, width: int = 64, depth: int = 2, hidden: tuple[int, ...] = (128, 128),
) -> Task:  # fmt: skip
    """``task`` (``synthetic``, ``digits`` or ``lm``: ``width``, ``depth``) on this rank's part of ``split``,
    the model drawn from ``seed``, batches from ``draws``; a Dirichlet split gives every rank a batch."""
    if task == "lm":
        tokens, validation = make_lm_data(world, rank, split)

        def lm_loss(net: nn.Module) -> torch.Tensor:
            starts = torch.randint(0, len(tokens) - CONTEXT - 1, (batch_size,), generator=draws)
            x, y = windows(tokens, starts)
            return nn.functional.cross_entropy(net(x).reshape(-1, VOCAB), y.reshape(-1))

        lm_evaluate = lambda net: (validation_loss(net, validation), math.nan)  # noqa: E731
        return Task(make_lm_model(width, depth, seed), lm_loss, lm_evaluate)
    train_x, train_y, test_x, test_y = task_data(task)
    shard = split_data(train_y, world, split, alpha, min_size=batch_size, seed=seed)[rank]
    shard_x, shard_y = train_x[shard], train_y[shard]

    def batch_loss(net: nn.Module) -> torch.Tensor:
        idx = torch.randint(0, len(shard_x), (batch_size,), generator=draws)
        return nn.functional.cross_entropy(net(shard_x[idx]), shard_y[idx])

    @torch.no_grad()
    def evaluate(net: nn.Module) -> tuple[float, float]:
        logits = net(test_x)
        accuracy = (logits.argmax(1) == test_y).float().mean().item()
        return nn.functional.cross_entropy(logits, test_y).item(), accuracy

    model = make_digits_model(seed, hidden) if task == "digits" else make_model(seed)
    return Task(model, batch_loss, evaluate)


def warmup_cosine(optimizer: torch.optim.Optimizer, steps: int, warmup: int = 0) -> lr_scheduler.LRScheduler:
    """A linear warmup from 1/``warmup`` of the learning rate over ``warmup`` steps, then a cosine to 0."""
    if warmup <= 0:
        return lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)
    if warmup >= steps:
        raise ValueError(f"warmup={warmup} must be shorter than the run's {steps} steps")
    ramp = lr_scheduler.LinearLR(optimizer, start_factor=1.0 / warmup, end_factor=1.0, total_iters=warmup)
    decay = lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps - warmup)
    return lr_scheduler.SequentialLR(optimizer, [ramp, decay], milestones=[warmup])


def paced_plan(spec: Method, steps: int, rank: int, world: int) -> tuple[HalfFastSchedule | None, int, int]:
    """A paced method's schedule, rounds for ``steps`` steps' samples and this rank's inner steps."""
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


def train(
    spec: Method, model: nn.Module, make_optimizer: MakeOptimizer, batch_loss: BatchLoss, steps: int,
    hook: Hook | None = None, warmup: int = 0,
) -> tuple[Trained, Replicas | None]:  # fmt: skip
    """Train ``model`` with ``spec`` for the samples of ``steps`` steps (every rank calls this); ``hook``
    runs after every step or, paced, at every round's end, and may measure (a collective)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    schedule, rounds, own_steps = paced_plan(spec, steps, rank, world)
    optimizer: torch.optim.Optimizer | None = None  # None for the module front-end: it steps inside backward
    replicas: Replicas | None = None  # what gossips (None: DDP)
    options = spec.engine_options()
    if spec.topology is None:
        net: nn.Module = DistributedDataParallel(model)
        optimizer = make_optimizer(list(model.named_parameters()))
    elif spec.module:
        cosine = lambda opt: warmup_cosine(opt, own_steps, warmup)  # noqa: E731
        net = replicas = DecentralizedDataParallel(model, make_optimizer, lr_scheduler_fn=cosine, **options)
    else:
        net = model
        optimizer = replicas = DecentOptimWrapper(make_optimizer(list(model.named_parameters())), **options)
    scheduler = None if optimizer is None else warmup_cosine(optimizer, own_steps, warmup)
    hook = hook or (lambda *_: None)
    losses = torch.zeros(rounds or steps, dtype=torch.float64)
    # the samples behind each loss, summed over ranks below (paced: counted per round)
    taken = torch.zeros(rounds, dtype=torch.float64) if schedule else torch.ones(steps, dtype=torch.float64)
    seconds = 0.0

    def step() -> float:
        nonlocal seconds
        start = time.perf_counter()
        if optimizer is not None:
            optimizer.zero_grad()
        loss = batch_loss(net)
        loss.backward()  # the module front-end updates here
        if optimizer is not None:
            optimizer.step()
            scheduler.step()
        seconds += time.perf_counter() - start
        return loss.item()

    if schedule is None:
        for index in range(steps):
            losses[index] = loss = step()
            hook(index + 1, 1, index + 1 == steps, loss, replicas)
    else:  # by rounds: ranks take different steps, and every rank ends at the same round
        assert replicas is not None
        while replicas.round_count < rounds:
            loss = step()
            ended = replicas.round_ended
            current = replicas.round_count - (1 if ended else 0)  # the round this step belongs to
            losses[current] += loss
            taken[current] += 1
            if ended:
                done = replicas.round_count
                hook(done * spec.sync_every, spec.sync_every, done == rounds, loss, replicas)
    dist.all_reduce(losses)
    dist.all_reduce(taken)
    losses /= taken
    totals = torch.zeros(1 + world, dtype=torch.float64)  # the ranks' seconds, then each one's steps
    totals[0], totals[1 + rank] = seconds, own_steps
    dist.all_reduce(totals)
    if replicas is None:  # a ring all-reduce of the gradients: 2(n-1)/n gradient-sized messages
        sent = 2 * (world - 1) / world * sum(p.numel() * p.element_size() for p in model.parameters())
    else:  # the engine's own count: the topology's period, buckets and compression included
        sent = replicas.engine.bytes_sent_per_step()
    tail = max(1, steps // 20)
    if schedule is not None:  # the rounds that cover the last `tail` fleet steps
        tail = -(-tail // spec.sync_every)
    final = losses[-tail:].mean().item()
    return Trained(losses, final, totals[0].item() / world, sent, totals[1:].long().tolist()), replicas


def on_average(replicas: Replicas | None, measure: Callable[[], Any]) -> Any:
    """``measure()`` on the replicas' exact average (a collective), each replica left as it was."""
    if replicas is not None:
        replicas.global_avg()
    value = measure()
    if replicas is not None:
        replicas.revert_global_avg()
    return value


def run(
    methods: list[str], steps: int, batch_size: int, lr: float, log_every: int, adam_lr: float = 3e-3,
    split: str = "iid", alpha: float = 0.1, task: str = "synthetic", seed: int = 0,
) -> list[Result]:  # fmt: skip
    """Train each method in turn from ``seed``'s model and batches on this rank's part of ``split``; rank 0
    returns the Results (consensus distance every ``log_every`` steps, the averaged model's accuracy)."""
    specs = [parse_method(method) for method in methods]  # a misspelt method fails before any trains
    rank, world = dist.get_rank(), dist.get_world_size()

    def train_one(method: str, spec: Method) -> Result:
        draws = torch.Generator().manual_seed(100 + rank + 1000 * seed)
        setup = make_task(task, rank, world, seed, batch_size, draws, split, alpha)
        distance_steps, distances = [], []

        def measure(taken: int, span: int, last: bool, loss: float, replicas: Replicas | None) -> None:
            if last or covers_multiple(taken - span, taken - 1, log_every):
                distance_steps.append(taken - 1)
                distances.append(0.0 if replicas is None else replicas.consensus_distance())
                if rank == 0:
                    line = f"  {method:>13}  step {taken:4d}/{steps}  loss {loss:.4f}"
                    print(f"{line}  consensus {distances[-1]:.2e}", flush=True)

        make_optimizer = optimizer_factory(spec.optimizer or "sgd", lr, adam_lr)
        trained, replicas = train(spec, setup.model, make_optimizer, setup.batch_loss, steps, measure)
        accuracy = on_average(replicas, lambda: setup.evaluate(setup.model)[1])
        consensus = dict(distance_steps=distance_steps, distances=distances, final_distance=distances[-1])
        data = dict(split=split, alpha=alpha if split == "dirichlet" else None, task=task, seed=seed)
        cost = dict(ms_per_iteration=1000 * trained.seconds / steps, bytes_per_step=trained.bytes_per_step)
        return Result(
            method, trained.losses.tolist(), final_loss=trained.final_loss, accuracy=accuracy,
            steps_per_rank=trained.steps_per_rank, **consensus, **data, **cost,
        )  # fmt: skip

    if rank == 0:
        labels = task_data(task)[1]
        shards = split_data(labels, world, split, alpha, min_size=batch_size, seed=seed)
        print(f"Split {split_label(split, alpha)}: {describe_split(shards, labels)}", flush=True)
    results = []
    for method, spec in zip(methods, specs, strict=True):
        if rank == 0:
            print(f"[{method}] training {steps} steps on {world} workers", flush=True)
        results.append(train_one(method, spec))
        dist.barrier()
    return results if rank == 0 else []


def rank_main(rank: int, port: int, results: Any, job: Callable[[dict], Any], config: dict[str, Any]) -> None:
    """A local rank: torchrun's environment, a gloo group (unless ``config["own_group"]``: the job forms
    its own, as Accelerate does), then ``job(config)``'s value (``config["rank"]`` added) on ``results``."""
    world = config["workers"]
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    os.environ.update(LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        if not config.get("own_group"):
            dist.init_process_group("gloo", rank=rank, world_size=world)
        results.put((rank, job({**config, "rank": rank})))
    except BaseException:  # a lost job's rounds never complete, and tearing down would wait for them
        traceback.print_exc()
        os._exit(1)
    if dist.is_initialized():
        dist.destroy_process_group()


def on_local_ranks(job: Callable[[dict], Any], config: dict[str, Any], what: str) -> list[Any]:
    """``job(config)``'s values on ``config["workers"]`` local ranks in rank order, within its deadline."""
    args_for = lambda rank, port, results: (rank, port, results, job, config)  # noqa: E731
    by_rank = collect_from_ranks(config["workers"], rank_main, args_for, config["deadline"], what)
    return [by_rank[rank] for rank in range(config["workers"])]

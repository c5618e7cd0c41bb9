"""Decentralized training on local CPU workers, compared with all-reduce (DDP).

    uv run examples/quickstart.py                          # starts 4 local gloo workers itself
    torchrun --nproc-per-node 4 examples/quickstart.py     # or let torchrun start them

Every worker trains its own replica of a small MLP on its own shard of a synthetic task, once per
topology (ring, one-peer-exp, complete) with DecentOptimWrapper, once with the module front-end
DecentralizedDataParallel on a ring (``ring-module``: the update happens inside backward), and once
with PyTorch's DistributedDataParallel as the all-reduce baseline, with the same seeds and
hyper-parameters. Then it prints a table (final training loss, test accuracy of the globally
averaged model, consensus distance, ms per iteration, bytes each rank sends per step) and writes a
figure of loss and consensus distance against step.

A method may name its optimizer after a ``+``: ``ddp+adamw`` and ``ring-module+accum-adamw``
(AccumAdamW, accum_iter 4) train with ``--adam-lr``; without one it is SGD with momentum at ``--lr``.

The task needs no download: 10 Gaussian clusters in 32 dimensions with overlapping classes
(generated from a fixed seed), 16384 training points split across workers and 8192 test points.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from decent_optim_wrapper import AccumAdamW, DecentOptimWrapper, DecentralizedDataParallel, TopologyFactory

METHODS = ("ring", "ring-module", "one-peer-exp", "complete", "ddp")
MODULE_SUFFIX = "-module"  # a topology name + this suffix: the module front-end
OPTIMIZERS = ("sgd", "adamw", "accum-adamw")  # "method+optimizer"; sgd when none is named
FEATURES, CLASSES = 32, 10


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


def make_data(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Train and test sets of the synthetic task (identical on every rank)."""
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(CLASSES, FEATURES, generator=g) * 0.5
    n_train, n_test = 16384, 8192
    labels = torch.randint(0, CLASSES, (n_train + n_test,), generator=g)
    points = centers[labels] + torch.randn(n_train + n_test, FEATURES, generator=g)
    return points[:n_train], labels[:n_train], points[n_train:], labels[n_train:]


def make_model() -> nn.Module:
    torch.manual_seed(0)  # the same initial model for every method
    return nn.Sequential(
        nn.Linear(FEATURES, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, CLASSES)
    )


def model_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def optimizer_factory(name: str, lr: float, adam_lr: float):
    """Builds the optimizer ``name`` from (name, parameter) pairs (the module front-end's optim_fn)."""
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r} after '+'; choose one of {', '.join(OPTIMIZERS)}")

    def build(named: list[tuple[str, torch.Tensor]]) -> torch.optim.Optimizer:
        params = [p for _, p in named]
        if name == "adamw":
            return torch.optim.AdamW(params, lr=adam_lr, weight_decay=0.0)
        if name == "accum-adamw":  # moments move once per 4 steps, from the mean gradient
            return AccumAdamW(params, lr=adam_lr, weight_decay=0.0, accum_iter=4)
        return torch.optim.SGD(params, lr=lr, momentum=0.9)

    return build


def train_one_method(
    method: str, steps: int, batch_size: int, lr: float, log_every: int, adam_lr: float = 3e-3
) -> Result | None:
    """Train from scratch with ``method``; every rank calls this; rank 0 gets the Result."""
    rank, world = dist.get_rank(), dist.get_world_size()
    front, _, optimizer_name = method.partition("+")
    make_optimizer = optimizer_factory(optimizer_name or "sgd", lr, adam_lr)
    train_x, train_y, test_x, test_y = make_data()
    shard_x, shard_y = train_x[rank::world], train_y[rank::world]
    model = make_model()
    optimizer: torch.optim.Optimizer | None = None
    replicas: DecentOptimWrapper | DecentralizedDataParallel | None = None  # what gossips
    if front == "ddp":
        net: nn.Module = DistributedDataParallel(model)
        optimizer = make_optimizer(list(model.named_parameters()))
        # ring all-reduce of the gradients: every rank sends 2(n-1)/n gradient-sized messages
        sent_models = 2 * (world - 1) / world
    elif front.endswith(MODULE_SUFFIX):  # the update happens inside backward, one optimizer per bucket
        topology = front.removesuffix(MODULE_SUFFIX)
        net = replicas = DecentralizedDataParallel(
            model,
            make_optimizer,
            lr_scheduler_fn=lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps),
            topology=topology,
        )
        sent_models = TopologyFactory.create(topology, world).models_sent_per_step()
    else:
        net = model
        optimizer = replicas = DecentOptimWrapper(
            make_optimizer(list(model.named_parameters())), topology=front
        )
        sent_models = TopologyFactory.create(front, world).models_sent_per_step()
    scheduler = None
    if optimizer is not None:  # the module front-end steps its own per-bucket schedulers
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)
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
        bytes_per_step=sent_models * model_bytes(model),
    )


def run(
    methods: list[str], steps: int, batch_size: int, lr: float, log_every: int, adam_lr: float = 3e-3
) -> list[Result]:
    """Train every method in turn (all ranks); rank 0 returns the results."""
    results = []
    for method in methods:
        if dist.get_rank() == 0:
            print(f"[{method}] training {steps} steps on {dist.get_world_size()} workers", flush=True)
        result = train_one_method(method, steps, batch_size, lr, log_every, adam_lr)
        if result is not None:
            results.append(result)
        dist.barrier()
    return results


def print_table(results: list[Result], world: int) -> None:
    print(f"\nResults ({world} workers, gloo on CPU; bytes use the ring all-reduce cost model):")
    header = (
        f"{'method':>13} | {'final loss':>10} | {'avg-model acc':>13} | {'consensus dist':>14} | "
        f"{'ms/iter':>8} | {'bytes sent/rank/step':>20}"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        print(
            f"{r.method:>13} | {r.final_loss:>10.4f} | {r.accuracy:>13.4f} | {r.final_distance:>14.3e} | "
            f"{r.ms_per_iteration:>8.2f} | {r.bytes_per_step:>20,.0f}"
        )


def plot(results: list[Result], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        window = max(1, len(r.losses) // 40)
        smooth = torch.tensor(r.losses).unfold(0, window, 1).mean(1)
        left.plot(range(window - 1, len(r.losses)), smooth, label=r.method)
        if not r.method.startswith("ddp"):  # DDP replicas are identical: distance 0
            right.semilogy(r.distance_steps, [max(d, 1e-12) for d in r.distances], marker=".", label=r.method)
    left.set(xlabel="step", ylabel="training loss (mean over workers)", title="Training loss")
    right.set(xlabel="step", ylabel="consensus distance", title="Distance of replicas to their average")
    left.legend()
    right.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main_on_rank(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    results = run(args.methods, args.steps, args.batch_size, args.lr, args.log_every, args.adam_lr)
    if dist.get_rank() == 0:
        print_table(results, dist.get_world_size())
        plot(results, Path(args.figure))
        print(f"\nFigure written to {args.figure}")
        if args.json:
            Path(args.json).write_text(json.dumps([asdict(r) for r in results]))


def _spawned(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        main_on_rank(args)
    finally:
        dist.destroy_process_group()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workers", type=int, default=4, help="local gloo workers to start (default 4)")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), help=f"default: {' '.join(METHODS)}")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch-size", type=int, default=32, help="per worker")
    parser.add_argument("--lr", type=float, default=0.05, help="SGD's learning rate")
    parser.add_argument("--adam-lr", type=float, default=3e-3, help="learning rate of +adamw, +accum-adamw")
    parser.add_argument("--log-every", type=int, default=50, help="steps between progress lines")
    parser.add_argument("--figure", default="runs/quickstart.png")
    parser.add_argument("--json", default=None, help="also write the results here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if "RANK" in os.environ:  # started by torchrun
        dist.init_process_group("gloo")
        try:
            main_on_rank(args)
        finally:
            dist.destroy_process_group()
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_spawned, args=(args.workers, port, args), nprocs=args.workers)


if __name__ == "__main__":
    main()

"""Decentralized training on local CPU workers, compared with all-reduce (DDP).

    uv run examples/quickstart.py                          # starts 4 local gloo workers itself
    torchrun --nproc-per-node 4 examples/quickstart.py     # or let torchrun start them

Each worker trains its own replica of a small MLP on its own shard of a synthetic task, once per method:
``ring``, ``one-peer-exp``, ``complete`` wrap SGD in ``DecentOptimWrapper`` (``step()`` updates, then
averages with the topology's neighbours), ``ring@bf16`` gossips in bf16, ``ring-module`` wraps the model
in ``DecentralizedDataParallel`` (backward updates), ``ddp`` is all-reduce, the baseline. It prints a
table and plots loss against step and bytes sent. More methods: benchmarks/convergence/run.py classification.
"""

import argparse
import json
import os
import socket
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from decent_optim_wrapper import DecentOptimWrapper, DecentralizedDataParallel

METHODS = {  # name: (front-end, keywords of the front-end)
    "ring": ("optimizer", {"topology": "ring"}),
    "ring-module": ("module", {"topology": "ring"}),
    "ring@bf16": ("optimizer", {"topology": "ring", "compression": "bf16"}),
    "one-peer-exp": ("optimizer", {"topology": "one-peer-exp"}),
    "complete": ("optimizer", {"topology": "complete"}),
    "ddp": ("all-reduce", {}),
}
FEATURES, CLASSES, TRAIN_POINTS, TEST_POINTS = 32, 10, 16384, 8192
LOG_EVERY = 50  # steps between progress lines (and measurements of the consensus distance)


@dataclass
class Result:
    method: str
    losses: list[float]  # per step, averaged over workers
    final_loss: float  # the mean over the last 5% of the steps: one batch's loss is noisy
    accuracy: float  # of the globally averaged model, on the test set
    distances: list[tuple[int, float]]  # (step, consensus distance), every LOG_EVERY steps and at the end
    ms_per_iteration: float
    bytes_per_step: float  # sent by each worker


def make_data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Train and test sets, the same on every worker: points scattered around 10 random centres."""
    g = torch.Generator().manual_seed(0)
    centers = torch.randn(CLASSES, FEATURES, generator=g) * 0.5
    labels = torch.randint(0, CLASSES, (TRAIN_POINTS + TEST_POINTS,), generator=g)
    points = centers[labels] + torch.randn(TRAIN_POINTS + TEST_POINTS, FEATURES, generator=g)
    return points[:TRAIN_POINTS], labels[:TRAIN_POINTS], points[TRAIN_POINTS:], labels[TRAIN_POINTS:]


def make_model() -> nn.Module:
    torch.manual_seed(0)  # the same initial model for every method and worker
    return nn.Sequential(
        nn.Linear(FEATURES, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, CLASSES)
    )


def train(method: str, args: argparse.Namespace) -> Result:
    """Train from scratch with ``method`` (every worker calls this)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        print(f"[{method}] training {args.steps} steps on {world} workers", flush=True)
    front_end, gossip = METHODS[method]
    train_x, train_y, test_x, test_y = make_data()
    shard_x, shard_y = train_x[rank::world], train_y[rank::world]  # each worker its own shard
    model = make_model()
    sgd = partial(torch.optim.SGD, lr=0.05, momentum=0.9)
    cosine = partial(torch.optim.lr_scheduler.CosineAnnealingLR, T_max=args.steps)
    net, optimizer, replicas = model, None, None  # what runs forward; what steps after backward; what gossips
    if front_end == "all-reduce":
        net, optimizer = DistributedDataParallel(model), sgd(model.parameters())
    elif front_end == "optimizer":  # wraps the optimizer you would use anyway
        optimizer = replicas = DecentOptimWrapper(sgd(model.parameters()), **gossip)
    else:  # wraps the model, and builds an optimizer and a scheduler per bucket from (name, param) pairs
        net = replicas = DecentralizedDataParallel(
            model, lambda named: sgd([p for _, p in named]), lr_scheduler_fn=cosine, **gossip
        )
    scheduler = cosine(optimizer) if optimizer is not None else None

    loss_fn, sampler = nn.CrossEntropyLoss(), torch.Generator().manual_seed(100 + rank)
    losses, distances, seconds = torch.zeros(args.steps, dtype=torch.float64), [], 0.0
    for step in range(args.steps):
        start = time.perf_counter()
        batch = torch.randint(0, len(shard_x), (args.batch_size,), generator=sampler)
        if optimizer is not None:
            optimizer.zero_grad()
        loss = loss_fn(net(shard_x[batch]), shard_y[batch])
        loss.backward()  # DecentralizedDataParallel updates each bucket here, as its gradients are ready
        if optimizer is not None:
            optimizer.step()  # DecentOptimWrapper: the SGD step, then the gossip with the neighbours
            scheduler.step()
        seconds += time.perf_counter() - start
        losses[step] = loss.item()
        if step % LOG_EVERY == 0 or step == args.steps - 1:  # a collective: kept out of the timing
            distances.append((step, replicas.consensus_distance() if replicas is not None else 0.0))
            if rank == 0:
                progress = f"step {step:4d}/{args.steps}  loss {loss.item():.4f}"
                print(f"  {method:>13}  {progress}  consensus distance {distances[-1][1]:.2e}", flush=True)

    if replicas is not None:
        replicas.global_avg()  # every replica becomes the average of all of them, to evaluate ...
    with torch.no_grad():
        accuracy = (model(test_x).argmax(1) == test_y).float().mean().item()
    if replicas is not None:
        replicas.revert_global_avg()  # ... then goes back to where it was, to train on

    timing = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(losses)
    dist.all_reduce(timing)
    if replicas is not None:  # the engine's own count: topology, buckets and compression included
        sent = replicas.engine.bytes_sent_per_step()
    else:  # a ring all-reduce: each rank sends 2 (n - 1) / n of the gradients
        sent = 2 * (world - 1) / world * sum(p.nbytes for p in model.parameters())
    losses /= world
    final_loss = losses[-max(1, args.steps // 20) :].mean().item()
    ms = 1000 * timing.item() / world / args.steps
    return Result(method, losses.tolist(), final_loss, accuracy, distances, ms, sent)


def print_table(results: list[Result], world: int) -> None:
    print(f"\nResults ({world} workers, gloo on CPU; bytes: the engine's count, DDP: ring all-reduce):")
    row = "{:>13} | {:>10} | {:>13} | {:>14} | {:>8} | {:>20}".format
    header = row("method", "final loss", "avg-model acc", "consensus dist", "ms/iter", "bytes sent/rank/step")
    print(header + "\n" + "-" * len(header))
    for r in results:
        loss, accuracy, distance = f"{r.final_loss:.4f}", f"{r.accuracy:.4f}", f"{r.distances[-1][1]:.3e}"
        ms, sent = f"{r.ms_per_iteration:.2f}", f"{r.bytes_per_step:,.0f}"
        print(row(r.method, loss, accuracy, distance, ms, sent))


def plot(results: list[Result], path: Path) -> None:
    """Loss against step (the methods learn alike) and bytes sent (they pay differently); the spread."""
    import matplotlib.pyplot as plt  # here, not at the top: only worker 0 draws

    plt.switch_backend("Agg")  # to a file, with or without a display
    fig, (by_step, by_bytes, spread) = plt.subplots(1, 3, figsize=(16, 4.5))
    for r in results:
        window = max(1, len(r.losses) // 40)  # a moving mean: one batch's loss is noisy
        loss = torch.tensor(r.losses).unfold(0, window, 1).mean(1)
        steps = torch.arange(window, len(r.losses) + 1)  # steps done at the end of each window
        style = {"label": r.method, "linestyle": "--" if r.method == "ring-module" else "-"}
        by_step.plot(steps, loss, **style)
        by_bytes.semilogx(steps * r.bytes_per_step / 1e6, loss, **style)  # twice the bytes: a fixed shift
        if r.method != "ddp":  # DDP's replicas are identical: distance 0
            spread.semilogy(*zip(*r.distances, strict=True), marker=".", **style)
    by_step.set(xlabel="step", ylabel="training loss (mean over workers)", title="Loss per step: alike")
    by_bytes.set(xlabel="MB sent by each worker so far (log scale)", title="Loss per byte sent: what differs")
    by_bytes.minorticks_off()  # label round numbers, not the powers of ten only or every minor tick
    by_bytes.set_xticks([1, 2, 5, 10, 20, 50, 100], ["1", "2", "5", "10", "20", "50", "100"])
    spread.set(xlabel="step", ylabel="consensus distance", title="Distance of replicas to their average")
    by_bytes.legend()  # the colours are the same in all three panels
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main(args: argparse.Namespace) -> None:
    if "RANK" not in os.environ:  # not started by torchrun: start the workers here, on a free port
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(spawned, args=(args.workers, port, args), nprocs=args.workers)
        return
    dist.init_process_group("gloo")  # who and where: from torchrun's environment, or spawned's
    torch.set_num_threads(1)  # the workers share the CPU cores
    results = [train(method, args) for method in args.methods]
    if dist.get_rank() == 0:
        print_table(results, dist.get_world_size())
        plot(results, Path(args.figure))
        print(f"\nFigure written to {args.figure}")
        if args.json:
            Path(args.json).write_text(json.dumps([asdict(r) for r in results]))
    dist.destroy_process_group()


def spawned(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    main(args)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--workers", type=int, default=4, help="local gloo workers to start (default 4)")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS), help="default: all")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch-size", type=int, default=32, help="per worker")
    parser.add_argument("--figure", default="runs/quickstart.png")
    parser.add_argument("--json", default=None, help="also write the results here")
    main(parser.parse_args())

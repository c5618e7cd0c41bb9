"""Decentralized training on local CPU workers: each rank trains its own replica and gossips.

    uv run examples/quickstart.py            # starts 4 local gloo workers
    torchrun --nproc-per-node 4 examples/quickstart.py   # or let torchrun start them

Task: a synthetic 10-class problem (Gaussian clusters, generated in place: no download). Every rank
sees its own shard; the replicas are averaged globally at the end to evaluate the average model.
"""

from __future__ import annotations

import argparse
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from decent_optim_wrapper import DecentOptimWrapper


def make_data(rank: int, world_size: int, n: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    centers = torch.randn(10, 32, generator=g) * 0.6
    labels = torch.randint(0, 10, (n,), generator=g)
    points = centers[labels] + torch.randn(n, 32, generator=g) * 1.2
    return points[rank::world_size], labels[rank::world_size]


def train(rank: int, world_size: int, topology: str, steps: int) -> None:
    torch.manual_seed(rank)
    x, y = make_data(rank, world_size)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    optimizer = DecentOptimWrapper(inner, topology=topology)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)
    loss_fn = nn.CrossEntropyLoss()
    for step in range(steps):
        idx = torch.randint(0, len(x), (64,))
        optimizer.zero_grad()
        loss = loss_fn(model(x[idx]), y[idx])
        loss.backward()
        optimizer.step()
        scheduler.step()
        if rank == 0 and (step % 50 == 0 or step == steps - 1):
            print(f"[{topology}] step {step:4d}  loss {loss.item():.4f}", flush=True)

    optimizer.global_avg()  # evaluate the average of all replicas
    with torch.no_grad():
        test_x, test_y = make_data(0, 1)
        accuracy = (model(test_x).argmax(1) == test_y).float().mean().item()
    optimizer.revert_global_avg()  # each replica continues exactly where it was
    if rank == 0:
        print(f"[{topology}] accuracy of the averaged model: {accuracy:.3f}", flush=True)


def worker(rank: int, world_size: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.set_num_threads(1)
    try:
        train(rank, world_size, args.topology, args.steps)
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workers", type=int, default=4, help="local gloo workers to start (default 4)")
    parser.add_argument("--topology", default="ring", help="ring, complete, or any registered name")
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    if "RANK" in os.environ:  # started by torchrun
        dist.init_process_group("gloo")
        train(dist.get_rank(), dist.get_world_size(), args.topology, args.steps)
        dist.destroy_process_group()
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(args.workers, port, args), nprocs=args.workers)


if __name__ == "__main__":
    main()

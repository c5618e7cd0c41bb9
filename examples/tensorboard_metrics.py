"""The gossip counters in TensorBoard: local CPU workers train and write ``metrics()`` as scalars.

    uv run --group examples examples/tensorboard_metrics.py          # 4 local gloo workers
    torchrun --nproc-per-node 4 examples/tensorboard_metrics.py      # or let torchrun start them
    uv run --group examples tensorboard --logdir runs/tensorboard    # then look

Each worker trains its replica of a small MLP with ``DecentOptimWrapper`` on a ring; every
``--log-every`` steps it reads ``optimizer.metrics()`` (what happened since the last read: steps,
rounds, bytes sent, seconds waiting for gossip, guard events, world size; a local read, no collective)
and writes each value with ``SummaryWriter.add_scalar`` under its name (``gossip/bytes_sent``, ...),
beside the training loss. Every worker writes its own run (``runs/tensorboard/rank<r>``), so TensorBoard
shows the workers side by side: a worker whose ``gossip/wait_s`` stands out waits for slow peers.
"""

import argparse
import json
import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.utils.tensorboard import SummaryWriter

from decent_optim_wrapper import DecentOptimWrapper

FEATURES, CLASSES = 32, 10


def batches(rank: int, steps: int, size: int = 64) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This worker's batches of a synthetic task: points scattered around 10 fixed centres."""
    centers = torch.randn(CLASSES, FEATURES, generator=torch.Generator().manual_seed(0)) * 0.5
    g = torch.Generator().manual_seed(1 + rank)
    out = []
    for _ in range(steps):
        labels = torch.randint(0, CLASSES, (size,), generator=g)
        out.append((centers[labels] + torch.randn(size, FEATURES, generator=g), labels))
    return out


def train(args: argparse.Namespace) -> None:
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, 128), nn.ReLU(), nn.Linear(128, CLASSES))
    optimizer = DecentOptimWrapper(torch.optim.SGD(model.parameters(), lr=0.05), topology="ring")
    writer = SummaryWriter(os.path.join(args.logdir, f"rank{rank}"))
    totals = {"gossip/steps": 0.0, "gossip/bytes_sent": 0.0, "gossip/wait_s": 0.0}
    for step, (x, y) in enumerate(batches(rank, args.steps), start=1):
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        if step % args.log_every == 0 or step == args.steps:
            writer.add_scalar("train/loss", loss.item(), step)
            for name, value in optimizer.metrics().items():  # since the last read
                writer.add_scalar(name, value, step)
                if name in totals:
                    totals[name] += value
    writer.close()
    print(
        f"rank {rank}: {totals['gossip/steps']:.0f} steps, {totals['gossip/bytes_sent'] / 1e6:.2f} MB sent, "
        f"{totals['gossip/wait_s']:.3f} s waiting for gossip; scalars in {writer.log_dir}",
        flush=True,
    )
    if args.json and rank == 0:
        Path(args.json).write_text(json.dumps({"log_dir": writer.log_dir, **totals}))


def spawned(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    main(args)


def main(args: argparse.Namespace) -> None:
    if "RANK" not in os.environ:  # not started by torchrun: start the workers here, on a free port
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(spawned, args=(args.workers, port, args), nprocs=args.workers)
        return
    dist.init_process_group("gloo")  # who and where: from torchrun's environment, or spawned's
    torch.set_num_threads(1)  # the workers share the CPU cores
    try:
        train(args)
    finally:
        dist.destroy_process_group()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=4, help="local workers to start (without torchrun)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--log-every", type=int, default=25, help="steps between reads of metrics()")
    parser.add_argument("--logdir", default="runs/tensorboard")
    parser.add_argument("--json", default=None, help="write rank 0's totals to this file")
    return parser.parse_args()


if __name__ == "__main__":
    main(parse_args())

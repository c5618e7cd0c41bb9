"""Language-model convergence: validation loss of low-communication gossip against DDP.

    uv run benchmarks/lm_convergence.py                     # 4 local gloo workers, ~9 min on 2 cores
    uv run benchmarks/lm_convergence.py --methods ring~h8n+adamw --splits files

Trains the byte-level causal transformer of ``lm_task.py`` on the Python standard library's source
(no download) with every method (names as in ``methods.py``; each needs an Adam optimizer after its
``+``; ``ddp+adamw`` is added as the reference), the same steps, seeds and hyper-parameters for
each, and prints per split the validation loss (nats per byte) of the globally averaged model, the
bytes each rank sends per step (the engine's count; the ring all-reduce cost model for DDP) and
the ratio to DDP's validation loss. Target, marked met or MISSED: every method with ``sync_every``
at most 8 within 2% of DDP's validation loss on the iid split; the others are reported.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from common import free_port
from lm_task import (
    CONTEXT,
    LM_SPLITS,
    VOCAB,
    describe_corpus,
    make_lm_data,
    make_lm_model,
    validation_loss,
    windows,
)
from methods import optimizer_factory, parse_method
from runner import build_training, model_bytes
from torch import nn

METHODS = [
    "ddp+adamw",
    "ring+adamw",
    "ring~h8+adamw",
    "ring~h8n+adamw",
    "ring~h8n0.2+adamw",
    "one-peer-exp~h8n0.2+adamw",
    "complete~h8n0.2d0+adamw",
    "ring~h32n0.2+adamw",
]
TARGET_RATIO = 1.02  # validation loss within 2% of DDP's, for sync_every <= 8, iid split
JUDGED_SYNC_EVERY = 8


@dataclass
class LMResult:
    method: str
    split: str
    validation_loss: float
    final_train_loss: float
    bytes_per_step: float
    seconds: float


def train_lm(method: str, split: str, steps: int, batch: int, adam_lr: float) -> LMResult | None:
    """Train one method on this rank's part of ``split`` (every rank calls this); rank 0 gets the result."""
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = parse_method(method)
    if spec.optimizer not in ("adamw", "accum-adamw"):
        raise ValueError(f"method {method!r}: the language model trains with Adam; add '+adamw'")
    tokens, validation = make_lm_data(world, rank, split)
    model = make_lm_model()
    make_optimizer = optimizer_factory(spec.optimizer, lr=0.0, adam_lr=adam_lr)
    net, optimizer, replicas, scheduler = build_training(spec, model, make_optimizer, steps)
    sampler = torch.Generator().manual_seed(100 + rank)
    losses = torch.zeros(steps, dtype=torch.float64)
    start = time.perf_counter()
    for step in range(steps):
        x, y = windows(tokens, torch.randint(0, len(tokens) - CONTEXT - 1, (batch,), generator=sampler))
        if optimizer is not None:
            optimizer.zero_grad()
        loss = nn.functional.cross_entropy(net(x).reshape(-1, VOCAB), y.reshape(-1))
        loss.backward()
        if optimizer is not None and scheduler is not None:
            optimizer.step()
            scheduler.step()
        losses[step] = loss.item()
    seconds = time.perf_counter() - start
    if replicas is not None:
        replicas.global_avg(False)  # evaluate the average of the replicas
    loss_value = validation_loss(model, validation)
    dist.all_reduce(losses)
    losses /= world
    if replicas is None:
        sent = 2 * (world - 1) / world * model_bytes(model)
    else:
        sent = replicas.engine.bytes_sent_per_step()
    if rank != 0:
        return None
    tail = max(1, steps // 20)
    return LMResult(method, split, loss_value, losses[-tail:].mean().item(), sent, seconds)


def report(results: list[LMResult], args: argparse.Namespace, world: int) -> None:
    split = results[0].split
    reference = next(r for r in results if r.method == "ddp+adamw").validation_loss
    print(
        f"\nLanguage model ({describe_corpus()}), {split} split: {world} workers, {args.steps} steps, "
        f"batch {args.batch_size} x {CONTEXT} bytes/worker, AdamW lr {args.adam_lr}"
    )
    header = (
        f"{'method':>28} | {'val loss':>8} | {'train loss':>10} | {'bytes/step':>10} | {'vs DDP':>7} | target"
    )
    print(header)
    print("-" * (len(header) + 10))
    for r in results:
        ratio = r.validation_loss / reference
        spec = parse_method(r.method)
        status = "-"
        if spec.topology is not None and split == "iid" and spec.sync_every <= JUDGED_SYNC_EVERY:
            status = "met" if ratio <= TARGET_RATIO else "MISSED"
        print(
            f"{r.method:>28} | {r.validation_loss:>8.4f} | {r.final_train_loss:>10.4f} | "
            f"{r.bytes_per_step:>10,.0f} | {ratio:>7.4f} | {status}"
        )
    print(
        f"Target: gossip with sync_every <= {JUDGED_SYNC_EVERY} within {TARGET_RATIO:.2f}x DDP's "
        "validation loss (iid split)."
    )


def worker(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        results: list[LMResult] = []
        for split in args.splits:
            for method in args.methods:
                if rank == 0:
                    print(f"[{split}] {method}", flush=True)
                result = train_lm(method, split, args.steps, args.batch_size, args.adam_lr)
                if result is not None:
                    results.append(result)
                    print(
                        f"    validation loss {result.validation_loss:.4f} ({result.seconds:.0f} s)",
                        flush=True,
                    )
                dist.barrier()
        if rank == 0:
            for split in args.splits:
                report([r for r in results if r.split == split], args, world)
            if args.json:
                Path(args.json).write_text(json.dumps([asdict(r) for r in results], indent=1))
    finally:
        dist.destroy_process_group()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--methods", nargs="+", default=METHODS)
    parser.add_argument("--splits", nargs="+", choices=LM_SPLITS, default=["iid"])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--adam-lr", type=float, default=3e-3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    try:
        for method in args.methods:
            parse_method(method)
    except ValueError as error:
        parser.error(str(error))
    if "ddp+adamw" not in args.methods:
        args.methods = ["ddp+adamw", *args.methods]
    return args


def main() -> None:
    args = parse_args()
    mp.spawn(worker, args=(args.workers, free_port(), args), nprocs=args.workers)


if __name__ == "__main__":
    main()

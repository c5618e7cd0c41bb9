"""Convergence: does decentralized training reach the accuracy of all-reduce?

    uv run benchmarks/convergence.py                  # 8 local gloo workers, ~2-3 min on 2 cores

Trains the main job's task (examples/quickstart.py: 10 overlapping Gaussian clusters, an MLP) with
the same steps, seeds and hyper-parameters for every topology and for DistributedDataParallel, and
prints the test accuracy of the globally averaged model for each, and its difference from DDP in
percentage points. Target: every topology within 0.5 points of DDP. ``ring-module+accum-adamw`` (the
module front-end with AccumAdamW, accum_iter 4) is compared with ``ddp+adamw`` (all-reduce with AdamW,
the same learning rate), with the same target.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from common import free_port

QUICKSTART = Path(__file__).resolve().parents[1] / "examples" / "quickstart.py"
TARGET_POINTS = 0.5


def load_quickstart():
    spec = importlib.util.spec_from_file_location("quickstart", QUICKSTART)
    module = importlib.util.module_from_spec(spec)
    sys.modules["quickstart"] = module
    spec.loader.exec_module(module)
    return module


def worker(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        quickstart = load_quickstart()
        results = quickstart.run(
            args.methods, args.steps, args.batch_size, args.lr, log_every=args.steps, adam_lr=args.adam_lr
        )
        if rank == 0:
            report(results, world, args)
    finally:
        dist.destroy_process_group()


def report(results, world: int, args: argparse.Namespace) -> None:
    by_method = {r.method: r for r in results}
    print(f"\nConvergence: {world} workers, {args.steps} steps, batch {args.batch_size}/worker, lr {args.lr}")
    print(
        f"{'method':>24} | {'final loss':>10} | {'avg-model accuracy':>18} | {'vs DDP (points)':>15} | target"
    )
    print("-" * 88)
    for r in results:
        # an Adam-family method is compared with DDP + AdamW, the others with DDP + SGD
        reference = "ddp+adamw" if "adam" in r.method and "ddp+adamw" in by_method else "ddp"
        delta = 100 * (r.accuracy - by_method[reference].accuracy)
        met = "-" if r.method.startswith("ddp") else ("met" if abs(delta) <= TARGET_POINTS else "MISSED")
        print(f"{r.method:>24} | {r.final_loss:>10.4f} | {r.accuracy:>18.4f} | {delta:>+15.2f} | {met}")
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in results]))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument(
        "--methods",
        nargs="+",
        default=[
            "ring",
            "one-peer-exp",
            "complete",
            "alternating-exp-ring",
            "hierarchical",
            "ddp",
            "ring-module+accum-adamw",
            "ddp+adamw",
        ],
    )
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--adam-lr", type=float, default=3e-3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if "ddp" not in args.methods:
        args.methods.append("ddp")
    mp.spawn(worker, args=(args.workers, free_port(), args), nprocs=args.workers)


if __name__ == "__main__":
    main()

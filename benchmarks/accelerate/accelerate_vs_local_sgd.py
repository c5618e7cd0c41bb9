"""An Accelerate loop three ways: Accelerate's DDP, Accelerate's LocalSGD every K steps, and gossip
every K steps (``DecentralizedAccelerator(sync_every=K)``): loss at equal steps, 3 seeds.

    uv run benchmarks/accelerate/accelerate_vs_local_sgd.py [--json PATH] [--table PATH]

Every run starts ``--workers`` local CPU processes that form their gloo group the way ``accelerate
launch`` does (torchrun's environment; ``Accelerator(cpu=True)``), and trains the same model from the
same seed with each method, the loop differing only in the line that builds the accelerator (and, for
LocalSGD, its context manager and ``local_sgd.step()``, as Accelerate's docs write it). Tasks: the
synthetic classification task (``harness/synthetic_task.py``, iid split, SGD with momentum) and the
byte-level language model (``harness/lm_task.py``, iid windows, AdamW). Reported per task and method,
mean and spread over the seeds: the validation loss of the final model (the exact average of the
replicas for LocalSGD's last mean and for gossip's ``global_avg``; DDP's replicas are equal) and, for
classification, its test accuracy, and the mean time per step on this machine's shared memory (no
slow link: a reference for the loop's overhead, not the speed on a network).

Methods (K = ``--every``):

* ``ddp``: ``Accelerator`` (DDP, an all-reduce of the gradients every step);
* ``local-sgd``: ``Accelerator`` + ``accelerate.local_sgd.LocalSGD(local_sgd_steps=K)`` (no gradient
  sync, a blocking exact mean of the parameters every K steps);
* ``gossip-complete``: ``DecentralizedAccelerator(topology="complete", sync_every=K)`` (an exact mean
  every K steps, overlapped with the next K steps: applied one round late);
* ``gossip-ring``: ``DecentralizedAccelerator(topology="ring", sync_every=K)`` (each rank averages
  with its two ring neighbours every K steps, overlapped);
* ``gossip-complete-d1``, ``gossip-ring-d1``: the same with ``sync_delay=1``: each round is mixed in
  one step after its launch instead of a whole round later (the low-communication page's advice
  where one step's compute hides the exchange).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks.harness import lm_task, synthetic_task
from benchmarks.harness.common import collect_from_ranks

METHODS = ("ddp", "local-sgd", "gossip-complete", "gossip-ring", "gossip-complete-d1", "gossip-ring-d1")
TASKS = ("classification", "lm")


def _environment(rank: int, world: int, port: int) -> None:
    """What ``accelerate launch`` (torchrun) sets for a rank; Accelerate forms the gloo group from it."""
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
        }
    )
    torch.set_num_threads(1)


def gossip_options(method: str) -> dict[str, Any]:
    """``gossip-<topology>[-d<D>]`` -> the accelerator's keywords (``-dD``: ``sync_delay=D``)."""
    _, topology, *delay = method.split("-")
    return {"topology": topology, **({"sync_delay": int(delay[0][1:])} if delay else {})}


def train_rank(rank: int, port: int, results: Any, config: dict[str, Any]) -> None:
    """One rank of one run: the Accelerate loop with ``config["method"]`` on ``config["task"]``."""
    _environment(rank, config["workers"], port)
    from accelerate import Accelerator
    from accelerate.local_sgd import LocalSGD

    from decent_optim_wrapper.integrations.accelerate import DecentralizedAccelerator

    method, task, seed, every = config["method"], config["task"], config["seed"], config["every"]
    world = config["workers"]
    if method.startswith("gossip"):
        accelerator = DecentralizedAccelerator(cpu=True, sync_every=every, **gossip_options(method))
    else:
        accelerator = Accelerator(cpu=True)
    g = torch.Generator().manual_seed(1000 * seed + rank)
    if task == "classification":
        x_train, y_train, x_test, y_test = synthetic_task.make_data(0)
        shard = synthetic_task.split_data(y_train, world, "iid")[rank]
        model = synthetic_task.make_model(seed)
        optimizer: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

        def batch() -> tuple[torch.Tensor, torch.Tensor]:
            index = shard[torch.randint(0, len(shard), (config["batch"],), generator=g)]
            return x_train[index], y_train[index]

        def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return nn.functional.cross_entropy(model(x), y)
    else:
        tokens, validation = lm_task.make_lm_data(world, rank, "iid")
        model = lm_task.make_lm_model(seed=seed)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)

        def batch() -> tuple[torch.Tensor, torch.Tensor]:
            starts = torch.randint(0, len(tokens) - lm_task.CONTEXT - 1, (config["batch"],), generator=g)
            return lm_task.windows(tokens, starts)

        def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return nn.functional.cross_entropy(model(x).reshape(-1, lm_task.VOCAB), y.reshape(-1))

    model, optimizer = accelerator.prepare(model, optimizer)
    local_sgd: Any = (
        LocalSGD(accelerator=accelerator, model=model, local_sgd_steps=every)
        if method == "local-sgd"
        else contextlib.nullcontext()
    )
    losses = []
    start = time.perf_counter()
    with local_sgd:
        for _ in range(config["steps"]):
            x, y = batch()
            loss = loss_of(model, x, y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            if method == "local-sgd":
                local_sgd.step()
            losses.append(loss.item())
    seconds = time.perf_counter() - start
    if method.startswith("gossip"):
        accelerator.global_avg(may_revert=False)  # the model every rank ends on: the exact average
    plain = accelerator.unwrap_model(model)
    plain.eval()
    with torch.no_grad():
        if task == "classification":
            logits = plain(x_test)
            result = {
                "val_loss": nn.functional.cross_entropy(logits, y_test).item(),
                "accuracy": (logits.argmax(-1) == y_test).float().mean().item(),
            }
        else:
            result = {"val_loss": lm_task.validation_loss(plain, validation)}
    result.update(
        {
            "train_loss_last": statistics.fmean(losses[-20:]),
            "ms_per_step": 1000 * seconds / config["steps"],
        }
    )
    results.put((rank, result))
    accelerator.end_training()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def run(task: str, method: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    steps = args.classification_steps if task == "classification" else args.lm_steps
    config = {
        "task": task,
        "method": method,
        "seed": seed,
        "every": args.every,
        "workers": args.workers,
        "steps": steps,
        "batch": 32 if task == "classification" else 16,
    }
    by_rank = collect_from_ranks(
        args.workers,
        train_rank,
        lambda rank, port, results: (rank, port, results, config),
        max_seconds=args.deadline,
        what=f"{task} {method} seed {seed}",
    )
    ranks = [by_rank[r] for r in range(args.workers)]
    return {
        **config,
        "val_loss": ranks[0]["val_loss"],
        "accuracy": ranks[0].get("accuracy"),
        "val_loss_all_ranks": [r["val_loss"] for r in ranks],
        "train_loss_last": statistics.fmean(r["train_loss_last"] for r in ranks),
        "ms_per_step": statistics.fmean(r["ms_per_step"] for r in ranks),
    }


def table(records: list[dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [
        f"{args.workers} CPU processes (gloo), K = {args.every}, seeds {args.seeds}; "
        f"classification {args.classification_steps} steps (batch 32/rank), "
        f"language model {args.lm_steps} steps (batch 16/rank)",
        "",
        "| task | method | val loss (mean +- sd) | accuracy | train loss, last 20 steps | ms per step |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for task in args.tasks:
        for method in args.methods:
            rows = [r for r in records if r["task"] == task and r["method"] == method]
            if not rows:
                continue
            loss = [r["val_loss"] for r in rows]
            spread = statistics.stdev(loss) if len(loss) > 1 else 0.0
            accuracy = (
                f"{statistics.fmean(r['accuracy'] for r in rows):.4f}"
                if rows[0]["accuracy"] is not None
                else "-"
            )
            lines.append(
                f"| {task} | {method} | {statistics.fmean(loss):.4f} +- {spread:.4f} | {accuracy} | "
                f"{statistics.fmean(r['train_loss_last'] for r in rows):.4f} | "
                f"{statistics.fmean(r['ms_per_step'] for r in rows):.1f} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument(
        "--every", type=int, default=8, help="K: LocalSGD's local_sgd_steps, gossip's sync_every"
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--classification-steps", type=int, default=300)
    parser.add_argument("--lm-steps", type=int, default=200)
    parser.add_argument("--deadline", type=float, default=600, help="seconds per run")
    parser.add_argument("--json", help="write every run's record here")
    parser.add_argument("--table", help="write the table here")
    args = parser.parse_args()
    records = []
    for task in args.tasks:
        for seed in args.seeds:
            for method in args.methods:
                record = run(task, method, seed, args)
                print(
                    f"{task} {method} seed {seed}: val loss {record['val_loss']:.4f}, "
                    f"{record['ms_per_step']:.1f} ms/step",
                    flush=True,
                )
                records.append(record)
    text = table(records, args)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=1))
    if args.table:
        Path(args.table).write_text(text + "\n")


if __name__ == "__main__":
    main()

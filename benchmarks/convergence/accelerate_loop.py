"""The ``accelerate`` question: the same Accelerate loop with three kinds of accelerator.

Accelerate forms the gloo group (``cpu=True``); the loop differs only in the line that builds the
accelerator (and LocalSGD's context manager and ``local_sgd.step()``, as Accelerate's docs write it).
Methods (K = ``every``): ``ddp`` (``Accelerator``), ``local-sgd`` (``LocalSGD(local_sgd_steps=K)``: a
blocking exact mean every K steps), ``gossip-<topology>[-dD]`` (``DecentralizedAccelerator(topology=...,
sync_every=K)``, overlapped with the next K steps; ``-d1``: ``sync_delay=1``), on the synthetic
classification task (SGD with momentum) and the language model (AdamW), iid.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import statistics
import time
from typing import Any

import torch

from benchmarks.convergence import attack
from benchmarks.harness.report import markdown_table
from benchmarks.harness.runner import on_local_ranks


def gossip_options(method: str) -> dict[str, Any]:
    """``gossip-<topology>[-d<D>]`` -> the accelerator's keywords (``-dD``: ``sync_delay=D``)."""
    _, topology, *delay = method.split("-")
    return {"topology": topology, **({"sync_delay": int(delay[0][1:])} if delay else {})}


def train_rank(config: dict[str, Any]) -> dict[str, Any]:
    """One rank of one run: the Accelerate loop with ``config["method"]`` on ``config["task"]`` (its data,
    model, optimizer and batches those of ``attack.setup``, drawn with this question's seeds)."""
    from accelerate import Accelerator
    from accelerate.local_sgd import LocalSGD

    from decent_optim_wrapper.integrations.accelerate import DecentralizedAccelerator

    method, task, seed, every = config["method"], config["task"], config["seed"], config["every"]
    rank, world = config["rank"], config["workers"]
    if method.startswith("gossip"):
        accelerator = DecentralizedAccelerator(cpu=True, sync_every=every, **gossip_options(method))
    else:
        accelerator = Accelerator(cpu=True)
    draws = torch.Generator().manual_seed(1000 * seed + rank)
    setup = attack.setup(task, rank, world, seed, draws)
    optimizer = attack.make_optimizer(task)(setup.model.parameters())
    model, optimizer = accelerator.prepare(setup.model, optimizer)
    local_sgd: Any = contextlib.nullcontext()
    if method == "local-sgd":
        local_sgd = LocalSGD(accelerator=accelerator, model=model, local_sgd_steps=every)
    losses = []
    start = time.perf_counter()
    with local_sgd:
        for _ in range(config["steps"]):
            loss = setup.batch_loss(model)
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
    loss, accuracy = setup.evaluate(plain)
    result = {"val_loss": loss} | ({"accuracy": accuracy} if task == "classification" else {})
    result.update(train_loss_last=statistics.fmean(losses[-20:]), ms_per_step=1e3 * seconds / config["steps"])
    accelerator.end_training()
    return result


def answer(args: argparse.Namespace) -> tuple[Any, str]:
    """Every task, seed and method in turn, each run on fresh ranks; means and spread over the seeds."""
    records = []
    for task, seed, method in itertools.product(args.tasks, args.seeds, args.methods):
        steps = args.classification_steps if task == "classification" else args.lm_steps
        config = dict(task=task, method=method, seed=seed, every=args.every, workers=args.workers)
        config.update(steps=steps, batch=32 if task == "classification" else 16)
        run = {**config, "own_group": True, "deadline": args.deadline}
        ranks = on_local_ranks(train_rank, run, f"{task} {method} seed {seed}")
        record = {**config, "val_loss": ranks[0]["val_loss"], "accuracy": ranks[0].get("accuracy")}
        record["val_loss_all_ranks"] = [r["val_loss"] for r in ranks]
        means = {key: statistics.fmean(r[key] for r in ranks) for key in ("train_loss_last", "ms_per_step")}
        records.append(record | means)
        print(f"{task} {method} seed {seed}: val loss {records[-1]['val_loss']:.4f}", flush=True)
    rows = []
    for task, method in itertools.product(args.tasks, args.methods):
        mine = [r for r in records if r["task"] == task and r["method"] == method]
        loss = [r["val_loss"] for r in mine]
        spread = statistics.stdev(loss) if len(loss) > 1 else 0.0
        accuracy = None if mine[0]["accuracy"] is None else statistics.fmean(r["accuracy"] for r in mine)
        ms = f"{statistics.fmean(r['ms_per_step'] for r in mine):.1f}"
        train = statistics.fmean(r["train_loss_last"] for r in mine)
        rows.append([task, method, f"{statistics.fmean(loss):.4f} +- {spread:.4f}", accuracy, train, ms])
    title = f"{args.workers} CPU processes (gloo), K = {args.every}, seeds {args.seeds}; classification "
    title += f"{args.classification_steps} steps (batch 32/rank), language model {args.lm_steps} steps "
    header = ["task", "method", "val loss (mean +- sd)", "accuracy", "train loss, last 20 steps"]
    table = markdown_table([*header, "ms per step"], rows, ".4f")
    return records, f"{title}(batch 16/rank)\n\n{table}"

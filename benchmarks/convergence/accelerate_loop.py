"""``accelerate``: one Accelerate loop (``cpu=True``) with ``ddp`` (``Accelerator``), ``local-sgd``
(``LocalSGD(local_sgd_steps=K)``) or ``gossip-<topology>[-dD]`` (``DecentralizedAccelerator(topology=...,
sync_every=K, sync_delay=D)``), on ``attack.setup``'s tasks.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import time
from statistics import fmean, stdev
from typing import Any

import torch

from benchmarks.convergence import attack
from benchmarks.harness.report import markdown_table
from benchmarks.harness.runner import on_local_ranks


def train_rank(config: dict[str, Any]) -> dict[str, Any]:
    """One rank of one run: the Accelerate loop with ``config["method"]`` on ``config["task"]``."""
    from accelerate import Accelerator
    from accelerate.local_sgd import LocalSGD

    from decent_optim_wrapper.integrations.accelerate import DecentralizedAccelerator

    method, task, every, steps = config["method"], config["task"], config["every"], config["steps"]
    if method.startswith("gossip"):
        _, topology, *delay = method.split("-")
        delays = {"sync_delay": int(delay[0][1:])} if delay else {}
        accelerator = DecentralizedAccelerator(cpu=True, sync_every=every, topology=topology, **delays)
    else:
        accelerator = Accelerator(cpu=True)
    draws = torch.Generator().manual_seed(1000 * config["seed"] + config["rank"])
    setup = attack.setup(task, config["rank"], config["workers"], config["seed"], draws)
    optimizer = attack.make_optimizer(task)(setup.model.parameters())
    model, optimizer = accelerator.prepare(setup.model, optimizer)
    local_sgd: Any = contextlib.nullcontext()
    if method == "local-sgd":
        local_sgd = LocalSGD(accelerator=accelerator, model=model, local_sgd_steps=every)
    losses, start = [], time.perf_counter()
    with local_sgd:
        for _ in range(steps):
            loss = setup.batch_loss(model)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            if method == "local-sgd":
                local_sgd.step()
            losses.append(loss.item())
    ms_per_step = 1e3 * (time.perf_counter() - start) / steps
    if method.startswith("gossip"):
        accelerator.global_avg(may_revert=False)  # the model every rank ends on: the exact average
    plain = accelerator.unwrap_model(model)
    plain.eval()
    loss, accuracy = setup.evaluate(plain)
    result = {"val_loss": loss} | ({"accuracy": accuracy} if task == "classification" else {})
    accelerator.end_training()
    return result | {"train_loss_last": fmean(losses[-20:]), "ms_per_step": ms_per_step}


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
        records.append(record | {k: fmean(r[k] for r in ranks) for k in ("train_loss_last", "ms_per_step")})
        print(f"{task} {method} seed {seed}: val loss {record['val_loss']:.4f}", flush=True)
    rows = []
    for task, method in itertools.product(args.tasks, args.methods):
        mine = [r for r in records if r["task"] == task and r["method"] == method]
        loss = [r["val_loss"] for r in mine]
        accuracy = None if mine[0]["accuracy"] is None else fmean(r["accuracy"] for r in mine)
        spread = f"{fmean(loss):.4f} +- {stdev(loss) if len(loss) > 1 else 0.0:.4f}"
        ms = f"{fmean(r['ms_per_step'] for r in mine):.1f}"
        rows.append([task, method, spread, accuracy, fmean(r["train_loss_last"] for r in mine), ms])
    title = f"{args.workers} CPU processes (gloo), K = {args.every}, seeds {args.seeds}; classification "
    title += f"{args.classification_steps} steps (batch 32/rank), language model {args.lm_steps} steps "
    header = ["task", "method", "val loss (mean +- sd)", "accuracy", "train loss, last 20 steps"]
    table = markdown_table([*header, "ms per step"], rows, ".4f")
    return records, f"{title}(batch 16/rank)\n\n{table}"

"""Convergence after a lost worker (docs/survival-benchmarks.md): ``synthetic_task.py``'s task with ring
gossip, per seed 8 workers of which one (drawn from the seed) is SIGKILLed at ``--kill-at`` (its shard is
not seen again), against 7 from the start; batches seeded by seed and rank, so only the lost worker
differs. Target: the averaged model's accuracy within 0.5 points of 7's, on average over the seeds."""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.harness.fault_runs import injected, run_workers
from benchmarks.harness.report import titled_table
from benchmarks.harness.synthetic_task import make_data, make_model, split_data
from decent_optim_wrapper import DecentOptimWrapper

TARGET_POINTS = 0.5
ARMS = ("7", "8 -> 7")


def train(rank: int, world: int, store: dist.Store, config: dict[str, Any]) -> dict[str, Any]:
    """One worker's run; the victim kills itself at ``config["kill_at"]``, leaving its losses so far."""
    train_x, train_y, test_x, test_y = make_data()
    shard = split_data(train_y, world, "iid")[rank]
    shard_x, shard_y = train_x[shard], train_y[shard]
    model = make_model()
    sgd = torch.optim.SGD(model.parameters(), lr=config["lr"], momentum=0.9)
    timeout = timedelta(seconds=config["timeout_s"])
    opt = DecentOptimWrapper(sgd, topology="ring", timeout=timeout, on_peer_failure="continue", store=store)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=config["steps"])
    sampler = torch.Generator().manual_seed(1000 * config["seed"] + 100 + rank)
    losses = []
    for step in range(config["steps"]):
        if rank == config["victim"] and step == config["kill_at"]:
            injected({"mode": "kill", "step": step, "losses": losses})
            os.kill(os.getpid(), signal.SIGKILL)
        idx = torch.randint(0, len(shard_x), (config["batch_size"],), generator=sampler)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(shard_x[idx]), shard_y[idx])
        loss.backward()
        opt.step()
        scheduler.step()
        losses.append(loss.item())
    opt.global_avg()
    with torch.no_grad():
        accuracy = (model(test_x).argmax(1) == test_y).float().mean().item()
    failures = [(f.step, list(f.lost)) for f in opt.peer_failures]
    return {"losses": losses, "accuracy": accuracy, "world_size": opt.world_size, "failures": failures}


def run_arm(workers: int, victim: int | None, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    config = {k: getattr(args, k) for k in ("steps", "batch_size", "lr", "kill_at", "timeout_s")}
    outcome = run_workers(train, workers, (config | {"seed": seed, "victim": victim},), args.deadline_s)
    expected = [r for r in range(workers) if r != victim]
    if outcome.errors or sorted(outcome.results) != expected:
        raise RuntimeError(f"{workers} workers, victim {victim}, seed {seed}: {outcome.errors or outcome}")
    results = [outcome.results[r] for r in expected]
    accuracies = {r["accuracy"] for r in results}
    assert len(accuracies) == 1, f"global_avg left the survivors with different models: {accuracies}"
    # Final loss: per step the mean over the workers alive at that step, then over the last 5 % of steps.
    victim_losses = [] if victim is None else outcome.injected[victim]["losses"]
    per_step = [
        statistics.fmean([r["losses"][t] for r in results] + victim_losses[t : t + 1])
        for t in range(args.steps)
    ]
    arm = {"arm": ARMS[victim is not None], "seed": seed, "workers": workers, "victim": victim}
    arm |= {"world_size_at_end": results[0]["world_size"], "failures": results[0]["failures"]}
    arm |= {
        "final_loss": statistics.fmean(per_step[-max(1, args.steps // 20) :]),
        "accuracy": accuracies.pop(),
    }
    print(
        f"seed {seed}: {arm['arm']} workers: accuracy {arm['accuracy']:.4f} ({outcome.seconds:.1f} s)",
        flush=True,
    )
    return arm | {"seconds": round(outcome.seconds, 1)}


def answer(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """Both arms of every seed: per seed both runs and the difference, then the means; the verdict."""
    rows, table, diffs = [], [], []
    for seed in args.seeds:
        victim = random.Random(seed).randrange(8)
        lost, whole = run_arm(8, victim, seed, args), run_arm(7, None, seed, args)
        rows += [lost, whole]
        diffs.append(100 * (lost["accuracy"] - whole["accuracy"]))
        table.append((str(seed), "7", None, whole["final_loss"], whole["accuracy"], None))
        table.append(
            (str(seed), "8 -> 7", str(victim), lost["final_loss"], lost["accuracy"], f"{diffs[-1]:+.2f}")
        )
    for arm in ARMS:
        mean = [statistics.fmean(r[k] for r in rows if r["arm"] == arm) for k in ("final_loss", "accuracy")]
        table.append(("mean", arm, "", *mean, ""))
    mean = statistics.fmean(diffs)
    verdict = "met" if abs(mean) <= TARGET_POINTS else "MISSED"
    title = f"Survival: ring gossip, {args.steps} steps, batch {args.batch_size}/worker, lr {args.lr}, "
    title += f"kill at step {args.kill_at}; {args.machine}"
    header = ("seed", "run", "victim", "final loss", "avg-model acc", "diff (points)")
    text = titled_table(title, header, table, ".4f")
    text += f"\n8 -> 7 vs 7 workers: {mean:+.2f} points on average over {len(diffs)} seeds; "
    text += f"target within {TARGET_POINTS}: {verdict}"
    summary = {"mean_difference_points": mean, "target_points": TARGET_POINTS, "verdict": verdict}
    return {"summary": summary, "runs": rows}, text

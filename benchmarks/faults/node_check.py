"""What a job of nodes pays per step to survive a lost node (docs/big-models.md, "A job of nodes"): an
FSDP2-sharded MLP over ``node_mesh()`` with ``"raise"`` against ``"continue"`` (whose ranks all-gather a
flag and a count over the node after every gossip wait), interleaved ``--rounds`` times; and that
all-gather alone, times the checks per step (one per bucket)."""

from __future__ import annotations

import argparse
import os
import statistics
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from benchmarks.harness.common import build_mlp
from benchmarks.harness.fault_runs import run_workers
from decent_optim_wrapper import DecentOptimWrapper, node_mesh


def worker(rank: int, world: int, store: dist.Store, args: argparse.Namespace, mode: str) -> dict[str, Any]:
    """One rank of an elastic job of nodes (``init_elastic(..., shards=)``, formed by ``run_workers``)."""
    torch.manual_seed(0)
    model = build_mlp(64, args.width, args.depth, 8)
    mesh = node_mesh("cpu")
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    shard_bytes = sum(p.to_local().numel() * 4 for p in model.parameters())
    optimizer = DecentOptimWrapper(
        torch.optim.AdamW(model.parameters(), lr=1e-3),
        topology="ring",
        on_peer_failure=mode,
        bucket_cap_mb=shard_bytes / args.buckets / 2**20 * 1.01,
        timeout=timedelta(seconds=60),
    )
    times, checks = [], []
    for step in range(args.steps):
        begin = time.perf_counter()
        x = torch.randn(32, 64, generator=torch.Generator().manual_seed(1000 * rank + step))
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()
        time.sleep(args.step_time)  # the rest of a step's compute
        times.append(time.perf_counter() - begin)
    for _ in range(args.checks):  # the node check's collective, on its own
        flag, gathered = torch.zeros(2, dtype=torch.int64), torch.empty(2 * args.shards, dtype=torch.int64)
        begin = time.perf_counter()
        dist.all_gather_into_tensor(gathered, flag, async_op=True).wait(timedelta(seconds=60))
        checks.append(time.perf_counter() - begin)
    step_s, buckets = statistics.median(times[args.warmup :]), len(optimizer.engine.buckets)
    return {"step_s": step_s, "buckets": buckets, "check_s": statistics.median(checks)}


def answer(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """Both jobs, interleaved ``--rounds`` times: the step times, one check, and the checks' share."""
    world, elastic = args.nodes * args.shards, {"job": "node-check", "shards": args.shards}
    runs: dict[str, list[dict[str, Any]]] = {"raise": [], "continue": []}
    for _ in range(args.rounds):
        for mode, results in runs.items():
            # The launcher hosts the store: with "continue" a rank polls it in every gossip wait, and a
            # store in rank 0 would vanish under the ranks still in their last step.
            outcome = run_workers(worker, world, (args, mode), deadline_s=300, elastic=elastic)
            if outcome.errors or len(outcome.results) != world:
                raise RuntimeError(f"job {mode}: {outcome.errors or outcome}")
            ranks = outcome.results.values()
            job = {k: statistics.median(r[k] for r in ranks) for k in ("step_s", "check_s")}
            results.append(job | {"buckets": min(r["buckets"] for r in ranks)})
    step = {mode: statistics.median(r["step_s"] for r in rs) for mode, rs in runs.items()}
    check_s = statistics.median(r["check_s"] for r in runs["continue"])
    buckets = runs["continue"][0]["buckets"]
    figures = {"nodes": args.nodes, "shards": args.shards, "buckets": buckets, "cpus": os.cpu_count()}
    figures |= {"step_s": step, "continue_over_raise": step["continue"] / step["raise"], "check_s": check_s}
    figures["checks_over_step"] = buckets * check_s / step["continue"]
    text = (
        f"{args.nodes} nodes x {args.shards} shards, {buckets} buckets: step "
        f"{step['raise'] * 1e3:.1f} ms with 'raise', {step['continue'] * 1e3:.1f} ms with 'continue' "
        f"({figures['continue_over_raise']:.3f}x); one node check {check_s * 1e6:.0f} us, {buckets} per "
        f"step = {figures['checks_over_step']:.2%} of a step"
    )
    return figures, text

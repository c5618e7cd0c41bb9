"""Losing workers and getting them back: live join against a run without failures and a restart.

    sudo uv run benchmarks/faults/run.py grow-back              # 8 nodes of the emulated cluster, ~5 min
    uv run benchmarks/faults/run.py grow-back --local --workers 4 --steps 80 --lose-at 30  # loopback

The same training (AdamW on an MLP of ``--params`` parameters, ring, ``--step-time`` of emulated
compute, worker ``i`` on node ``i`` of the emulated cluster, links at ``--link``) three ways: *steady*
(no failure); *grow back* (elastic; after ``--lose-at`` the last two ranks SIGKILL themselves with
their round in flight and are restarted at once, joining from a member's replica); *restart*
(``on_peer_failure="raise"``, a checkpoint every ``--checkpoint-every`` steps; the same two die, and
the launcher, as torchrun's elastic agent does, restarts every worker from the last checkpoint).
Reported: time from launch to the last rank's step ``--steps``, steps computed again, and the global
average's loss on a fixed probe set (restart equals steady bit for bit; docs/joining.md, "The mean").
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from benchmarks.faults.joins import Placement, connect, start_worker

LOST = 2  # ranks lost at --lose-at


# -- the worker ----------------------------------------------------------------------------------------
def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    from decent_optim_wrapper import DecentOptimWrapper

    elastic = args.scenario == "grow-back"  # else each start of the job forms its group anew
    rank, world, store = connect("grow-back" if elastic else None, f"start-{args.attempt}")
    width = int(args.params**0.5)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(32, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 4)
    )
    teacher = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))
    options: dict[str, Any] = {"timeout": timedelta(seconds=args.timeout)}
    if elastic:
        options |= {"on_peer_failure": "continue", "store": store}
    opt = DecentOptimWrapper(torch.optim.AdamW(model.parameters(), lr=args.lr), topology="ring", **options)
    out = Path(args.out)
    if args.resume_step:
        opt.load_state_dict(torch.load(out / f"ckpt-{rank}-{args.resume_step}.pt", weights_only=False))
    loss_fn = nn.MSELoss()
    waited = 0.0
    for t in range(opt.step_count, args.steps):
        x = torch.randn(64, 32, generator=torch.Generator().manual_seed(1000 * opt.rank + t))
        opt.zero_grad()
        loss_fn(model(x), torch.tanh(x @ teacher)).backward()
        opt.step()
        time.sleep(args.step_time)  # the rest of a step's compute
        dying = args.scenario != "steady" and args.attempt == 0 and opt.joined is None
        if dying and t == args.lose_at and opt.rank >= world - LOST:
            os.kill(os.getpid(), signal.SIGKILL)
        if elastic and opt.world_size < world and t >= args.steps - 10:
            # Do not finish before the lost workers are back (a restart takes seconds): slow the
            # last steps down until they are admitted (up to 10 s). Counted, and printed with the figures.
            time.sleep(1.0)
            waited += 1.0
        if args.scenario == "restart" and (t + 1) % args.checkpoint_every == 0:
            path = out / f"ckpt-{rank}-{t + 1}.pt"
            torch.save(opt.state_dict(), path.with_suffix(".part"))
            path.with_suffix(".part").replace(path)  # complete or absent
    end = time.time()
    opt.global_avg(may_revert=False)
    probe = torch.randn(1024, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        final_loss = loss_fn(model(probe), torch.tanh(probe @ teacher)).item()
    result = {"rank": opt.rank, "end": end, "final_loss": final_loss, "joined": opt.joined is not None}
    result |= {"world_size": opt.world_size, "waited_s": waited}
    (out / f"result-{args.attempt}-{os.getpid()}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


# -- the launcher --------------------------------------------------------------------------------------
def run(scenario: str, args: argparse.Namespace, placement: Placement) -> dict[str, Any]:
    """One run of ``scenario``, as a launcher runs it; its time to the last step and final loss."""
    out = Path(tempfile.mkdtemp(prefix=f"dow-grow-back-{scenario}-"))
    names = ("params", "steps", "lose_at", "checkpoint_every", "step_time", "timeout", "lr")
    options = {"scenario": scenario, "out": str(out), **{name: getattr(args, name) for name in names}}
    procs: dict[int, subprocess.Popen] = {}  # node -> its current process
    restarts, recomputed, starts = 0, 0, 0
    with placement.store() as (host, port):

        def start(node: int, attempt: int = 0, resume_step: int = 0) -> None:
            nonlocal starts
            starts += 1
            env = {"MASTER_ADDR": host, "MASTER_PORT": str(port), "RANK": str(node)}
            env |= {"WORLD_SIZE": str(args.workers), "OMP_NUM_THREADS": "1", **placement.env(node)}
            log = out / f"log-{node}-{attempt}-{starts}.txt"
            restart = {"attempt": attempt, "resume_step": resume_step}
            procs[node] = start_worker(__name__, {**options, **restart}, log, env, placement.launcher(node))

        began = time.time()
        for node in range(args.workers):
            start(node)
        attempt, deadline = 0, time.monotonic() + args.deadline_s
        try:
            while any(p.poll() is None for p in procs.values()):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{scenario}: the run passed {args.deadline_s} s: logs in {out}")
                failed = [n for n, p in procs.items() if p.poll() not in (None, 0)]
                if failed and scenario == "grow-back":
                    for node in failed:  # bring the node back: the new process joins the running job
                        restarts += 1
                        start(node)
                elif failed and scenario == "restart" and attempt == 0:
                    # as torchrun's agent does: stop everyone, restart all from a checkpoint
                    for proc in procs.values():
                        if proc.poll() is None:
                            proc.kill()
                        proc.wait()
                    saved = range(args.checkpoint_every, args.steps + 1, args.checkpoint_every)
                    resume_step = max((s for s in saved if complete(out, s, args)), default=0)
                    recomputed = args.lose_at + 1 - resume_step
                    attempt, restarts = 1, args.workers
                    for node in range(args.workers):
                        start(node, attempt, resume_step)
                elif failed:
                    raise RuntimeError(f"{scenario}: a worker failed (nodes {failed}): logs in {out}")
                time.sleep(0.05)
            if any(p.returncode != 0 for p in procs.values()):
                raise RuntimeError(f"{scenario}: a worker failed at the end: logs in {out}")
        finally:
            for proc in procs.values():
                if proc.poll() is None:
                    proc.kill()
    results = [json.loads(p.read_text()) for p in out.glob(f"result-{attempt}-*.json")]
    if len(results) != args.workers:
        raise RuntimeError(f"{scenario}: {len(results)} of {args.workers} workers finished: logs in {out}")
    losses = {r["final_loss"] for r in results}
    figures = {"scenario": scenario, "seconds": max(r["end"] for r in results) - began}
    figures |= {"final_loss": results[0]["final_loss"], "losses_identical": len(losses) == 1}
    figures |= {"processes_restarted": restarts, "steps_recomputed": recomputed}
    figures |= {
        "joiners": sum(r["joined"] for r in results),
        "final_world_size": min(r["world_size"] for r in results),
    }
    return figures | {"waited_for_joiners_s": max(r["waited_s"] for r in results)}


def complete(out: Path, step: int, args: argparse.Namespace) -> bool:
    """Whether every rank wrote its checkpoint of ``step``."""
    return all((out / f"ckpt-{rank}-{step}.pt").exists() for rank in range(args.workers))


# -- the answer ----------------------------------------------------------------------------------------
def row_text(row: dict[str, Any], first: dict[str, Any]) -> str:
    time_ratio, loss_ratio = row["seconds"] / first["seconds"], row["final_loss"] / first["final_loss"]
    return (
        f"{row['scenario']:>9}: {row['seconds']:6.1f} s to the last step ({time_ratio:.2f}x of "
        f"{first['scenario']}), final loss {row['final_loss']:.6f} ({loss_ratio:.4f}x), "
        f"processes restarted {row['processes_restarted']}, steps computed again {row['steps_recomputed']}, "
        f"joiners {row['joiners']}, waited for them {row['waited_for_joiners_s']:.2f} s"
    )


def answer(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """The runs asked for (``--runs``), on the emulated cluster or, with ``--local``, on loopback."""
    rows: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        placement = Placement()
        if not args.local:
            from benchmarks.harness.emulated_cluster import Cluster, ready_to_emulate

            if not ready_to_emulate():
                return {"runs": []}, "grow-back: the emulated cluster needs root (or use --local)"
            cluster = stack.enter_context(Cluster(args.workers))
            cluster.shape(args.link)
            placement = Placement(cluster)
        for scenario in args.runs:
            rows.append(run(scenario, args, placement))
            print(row_text(rows[-1], rows[0]), flush=True)
    setup = {k: getattr(args, k) for k in ("workers", "params", "steps", "lose_at", "checkpoint_every")}
    figures = {**setup, "link": None if args.local else args.link, "cpus": os.cpu_count(), "runs": rows}
    return figures, "\n".join(row_text(row, rows[0]) for row in rows)


if __name__ == "__main__":  # a worker, started by start_worker
    worker(argparse.Namespace(**json.loads(sys.argv[1])))

"""One rank of the uneven-fleet benchmark: train with each method under each speed scenario, log step ends.

Started by ``uneven_fleet.py`` inside a node's network namespace (``MASTER_ADDR``, ``MASTER_PORT``,
``GLOO_SOCKET_IFNAME`` set). Forward and backward are sleeps (``emulated_compute.EmulatedMLP``: the
parameters, the AdamW step, the bytes and the collectives stay real), ``--compute-ms`` times this
rank's factor in the scenario:

* ``half2x``: the first half of the ranks take twice as long per step;
* ``one3x``: rank 0 takes three times as long;
* ``shift``: rank 0 takes three times as long until ``--shift-s`` seconds into the run, then the last
  rank does (rank 0 is back to normal): speeds that change mid-run.

Methods: ``nocomm`` (each rank alone for ``--nocomm-s``: its own rate), ``ddp`` (DistributedDataParallel),
``sync``
(``DecentOptimWrapper`` ring, ``sync_every=H``, DiLoCo's outer Nesterov, the round a whole round
behind: today's synchronous gossip) and ``paced`` (the same with ``pacing="measured"``). Fixed-step
methods take ``--rounds * H`` steps; the gossip methods run until ``--rounds`` rounds are launched
(paced ranks take different numbers of steps). Every step's end (wall clock) is written to
``--out`` (JSON), with each paced rank's pace report.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.harness.emulated_compute import ROWS, EmulatedMLP
from decent_optim_wrapper import DecentOptimWrapper

COLLECTIVE_TIMEOUT = timedelta(seconds=180)
SCENARIOS = ("half2x", "one3x", "shift")
METHODS = ("nocomm", "ddp", "sync", "paced")


def speed_factor(scenario: str, rank: int, world_size: int, elapsed_s: float, shift_s: float) -> float:
    """How many times ``--compute-ms`` a step of ``rank`` takes ``elapsed_s`` into the run."""
    if scenario == "half2x":
        return 2.0 if rank < world_size // 2 else 1.0
    if scenario == "one3x":
        return 3.0 if rank == 0 else 1.0
    if scenario == "shift":
        slow = 0 if elapsed_s < shift_s else world_size - 1
        return 3.0 if rank == slow else 1.0
    raise ValueError(f"scenario must be one of {SCENARIOS}, got {scenario!r}")


def outer_nesterov(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)  # DiLoCo's


def run_segment(scenario: str, method: str, args: argparse.Namespace) -> dict[str, object]:
    """Train ``method`` under ``scenario``; the wall-clock end of every step, and the pace report."""
    torch.manual_seed(0)
    net = EmulatedMLP(args.inputs, args.width, args.depth, 10, 1 / 3)
    model: nn.Module = net
    optimizer: torch.optim.Optimizer
    wrapper: DecentOptimWrapper | None = None
    if method == "ddp":
        model = nn.parallel.DistributedDataParallel(net)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    elif method == "nocomm":
        optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    else:
        wrapper = DecentOptimWrapper(
            torch.optim.AdamW(net.parameters(), lr=1e-3),
            topology="ring",
            sync_every=args.sync_every,
            outer_optimizer=outer_nesterov,
            pacing="measured" if method == "paced" else None,
            timeout=COLLECTIVE_TIMEOUT,
        )
        optimizer = wrapper
    generator = torch.Generator().manual_seed(args.rank)
    x = torch.randn(ROWS, args.inputs, generator=generator)
    y = torch.randint(0, 10, (ROWS,), generator=generator)
    total = args.rounds * args.sync_every

    def running() -> bool:
        if wrapper is not None:
            return wrapper.round_count < args.rounds
        if method == "nocomm":
            return time.time() - start < args.nocomm_s
        return len(ends) < total

    dist.barrier()  # every rank starts together
    start = time.time()
    ends: list[float] = []
    round_ends: list[float] = []
    while running():
        net.compute_s = (
            args.compute_ms
            / 1e3
            * speed_factor(scenario, args.rank, args.world_size, time.time() - start, args.shift_s)
        )
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        ends.append(time.time())
        if wrapper is not None and wrapper.round_ended:
            round_ends.append(ends[-1])
    segment: dict[str, object] = {"start": start, "ends": ends, "round_ends": round_ends}
    if wrapper is not None:
        report = wrapper.pace_report()
        if report is not None:
            segment["pace"] = {
                "round_s": report.round_seconds,
                "step_s": report.step_seconds,
                "waited_s": report.waited_seconds,
            }
        wrapper.global_avg(may_revert=False)  # finishes the last round; untimed
    dist.barrier()
    return segment


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS))
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--sync-every", type=int, default=8)
    parser.add_argument("--compute-ms", type=float, default=40.0)
    parser.add_argument("--shift-s", type=float, default=6.0)
    parser.add_argument("--nocomm-s", type=float, default=5.0, help="how long each rank trains alone")
    parser.add_argument("--inputs", type=int, default=256)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=args.rank, world_size=args.world_size, timeout=COLLECTIVE_TIMEOUT)
    results: dict[str, object] = {}
    try:
        for scenario in args.scenarios:
            for method in args.methods:
                results[f"{scenario}/{method}"] = run_segment(scenario, method, args)
                partial = f"{args.out}.partial"
                with open(partial, "w") as f:
                    json.dump(results, f)
                os.replace(partial, args.out)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

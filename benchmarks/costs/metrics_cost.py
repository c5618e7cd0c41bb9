"""What the counters of ``metrics()`` cost: a training step with them off and on, side by side.

(a) **Training step**, 2 gloo ranks on loopback, one torch thread each: forward + backward + AdamW
    step of an MLP with ``DecentOptimWrapper`` on a ring, interleaved (the order rotates every step):
    ``uncounted`` (the rounds' waits not timed: :class:`~decent_optim_wrapper.engine.counters.WaitClock`
    left out when the wrapper is built), ``counted`` (the default, never read), ``counted_control``
    (the same again: its distance from 1 is the measurement's own spread), and ``read_every_step``
    (the default, ``metrics()`` read after every step: more than any logger option does, which read
    every ``log_every_n_steps``/``logging_steps``). Ratios are against ``uncounted`` (the first two)
    and ``counted`` (the last).
(b) **One read alone**: ``metrics()`` on the same wrapper, and the wait clock around a wait that
    returns at once, in microseconds per call (best of 5 runs of many calls).

Run: ``uv run benchmarks/costs/metrics_cost.py`` (about a minute on 2 cores); ``--json PATH`` saves the
results.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import platform
import statistics
import timeit
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.costs.second_moment_cost import commit, paired, timed
from benchmarks.harness.common import build_mlp, collect_from_ranks
from decent_optim_wrapper import DecentOptimWrapper
from decent_optim_wrapper.engine.counters import WaitClock

RUNS = ("uncounted", "counted", "counted_control", "read_every_step")
RATIOS = (("counted", "uncounted"), ("counted_control", "uncounted"), ("read_every_step", "counted"))


def build(args: argparse.Namespace, name: str) -> tuple[nn.Module, DecentOptimWrapper]:
    torch.manual_seed(0)
    model = build_mlp(args.width, args.width, args.depth, 10)
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if name != "uncounted":
        return model, DecentOptimWrapper(adamw, topology="ring")
    timed_waits = WaitClock.timed
    WaitClock.timed = lambda self, waiter: waiter  # type: ignore[method-assign]
    try:
        return model, DecentOptimWrapper(adamw, topology="ring")
    finally:
        WaitClock.timed = timed_waits  # type: ignore[method-assign]


def step(model: nn.Module, optimizer: DecentOptimWrapper, batch: Any, read: bool) -> None:
    optimizer.zero_grad()
    nn.functional.cross_entropy(model(batch[0]), batch[1]).backward()
    optimizer.step()
    if read:
        optimizer.metrics()


def training_steps(args: argparse.Namespace) -> dict[str, Any]:
    runs = {name: build(args, name) for name in RUNS}
    batch = (torch.randn(args.batch, args.width), torch.randint(0, 10, (args.batch,)))
    times: dict[str, list[float]] = {name: [] for name in RUNS}
    for i in range(args.warmup + args.iters):
        for name in RUNS[i % len(RUNS) :] + RUNS[: i % len(RUNS)]:
            seconds = timed(lambda name=name: step(*runs[name], batch, name == "read_every_step"))
            if i >= args.warmup:
                times[name].append(seconds)
    wrapper = runs["counted"][1]
    clock, no_wait = WaitClock(), lambda works, device, timeout, failure: None
    waiter, cpu = clock.timed(no_wait), torch.device("cpu")
    return {
        "params": sum(p.numel() for p in runs["counted"][0].parameters()),
        "buckets": len(wrapper.buckets),
        "ms": {name: statistics.median(seconds) * 1e3 for name, seconds in times.items()},
        "ratios": {f"{a}/{b}": paired(times, a, b) for a, b in RATIOS},
        "read_us": per_call_us(wrapper.metrics),
        "timed_wait_us": per_call_us(lambda: waiter([], cpu, None, RuntimeError)),
        "bare_wait_us": per_call_us(lambda: no_wait([], cpu, None, RuntimeError)),
    }


def per_call_us(fn: Any, calls: int = 2000) -> float:
    """Microseconds per call of ``fn``: the best of 5 runs of ``calls`` calls."""
    return min(timeit.repeat(fn, number=calls, repeat=5)) / calls * 1e6


def worker(rank: int, port: int, args: argparse.Namespace, results: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        results.put((rank, training_steps(args)))
    finally:
        dist.destroy_process_group()


def report(results: dict[str, Any]) -> None:
    t = results["time"][0]
    args = results["args"]
    print(
        f"commit {results['commit']}, torch {torch.__version__}, {platform.machine()}, "
        f"{results['cpus']} CPUs, 1 thread per rank"
    )
    print(
        f"(a) 2 ranks, ring, AdamW, MLP {t['params'] / 1e6:.2f}M params ({t['buckets']} buckets), "
        f"batch {args['batch']}, {args['iters']} interleaved steps each (rank 0)"
    )
    for name, ms in t["ms"].items():
        print(f"    {name:<18} {ms:8.2f} ms")
    for pair, r in t["ratios"].items():
        print(
            f"    {pair:<28} ratio of medians {r['ratio_of_medians']:.3f}, "
            f"median paired ratio {r['median_paired_ratio']:.3f}"
        )
    print(
        f"(b) one metrics() read {t['read_us']:.1f} us; a wait that returns at once: "
        f"{t['bare_wait_us']:.2f} us bare, {t['timed_wait_us']:.2f} us timed"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--max-seconds", type=float, default=600.0)
    parser.add_argument("--json", default=None, help="write the results to this file")
    args = parser.parse_args()
    results: dict[str, Any] = {"args": vars(args), "cpus": mp.cpu_count(), "commit": commit()}
    results["time"] = collect_from_ranks(
        2, worker, lambda rank, port, out: (rank, port, args, out), args.max_seconds, "metrics cost"
    )
    report(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
        print(f"results written to {args.json}")


if __name__ == "__main__":
    main()

"""Fault-injection soak: workers die or hang while training with ``on_peer_failure="continue"``.

    uv run benchmarks/survival/soak.py                          # 8 workers, floor 4, about 10 min on 2 cores
    uv run benchmarks/survival/soak.py --workers 5 --floor 3 --runs 1 --json /tmp/soak.json    # one short run

Each run forks ``--workers`` gloo workers around a store hosted by this process (``fault_runs.py``).
Every worker trains a small MLP with ``DecentOptimWrapper`` (ring topology, SGD with momentum and a
cosine schedule, ``timeout`` of ``--timeout-s``), takes ``global_avg()`` then ``revert_global_avg()``
every ``--average-every`` steps as an evaluation would, and carries a *witness*: a parameter in a
param group of its own with ``lr=0``, so only gossip moves it, set after construction to values in
[1, 2] that differ between ranks (every coordinate takes both 1 and 2 on some rank at world size
8). Gossip and averaging are convex combinations, so the witness must stay inside [1, 2]: a round
mixed with wrong weights, a lost peer's values taken as zeros, a stale or doubled round would push
it out.

One worker fails every ``--spacing`` steps (a few seconds) until ``--floor`` workers remain; the
victim, the step, the mode and the moment inside it are drawn from the run's seed:

- ``kill-in-step``: SIGKILL from a timer started just before ``step()``, after 0 to
  ``--kill-window-ms`` ms: it lands in the local update or a gossip round (where it landed is recorded);
- ``kill-in-flight``: SIGKILL right after ``step()``, its gossip round in flight;
- ``kill-in-global-avg``: SIGKILL from a timer started just before ``global_avg()``;
- ``stop``: SIGSTOP, a frozen process (its heartbeat stops too);
- ``hang``: the main thread sleeps, the heartbeat goes on: dropped once ``timeout`` passes.

The victim writes the time and what it does before failing; survivors note the time in their
peer-failure hook, once the new groups stand. At the end every survivor all-gathers its replica,
calls ``global_avg()`` and all-gathers the result. What is counted (summed over runs):

- *survived*: an injected failure whose run's survivors all finished every step, all recorded the
  same recoveries (lost ranks, survivors, world sizes), and count the victim among the lost;
- *steps lost*: over survivors, the steps of the run minus the updates the survivor's replica holds
  at the end (its ``step_count``; its LR scheduler must have stepped as often). A survivor keeps its
  replica, optimizer state and schedule through a recovery, so this is 0; a survivor that raised
  loses every step it did not finish;
- *recovery time*: per recovery, from the first injection it covers to the last survivor's hook;
- *corruption* (each must be 0): survivors with a NaN/inf parameter or loss at any step; survivors
  whose witness left [1, 2] by more than rounding (``WITNESS_ULPS`` units of 2^-23 per round, the
  error of one fp32 convex combination of values up to 2); runs whose survivors' final averages are
  not bitwise identical; survivors whose average is farther from the float64 mean of the survivors'
  replicas than ``k u max|x|`` (``k`` fp32 replicas summed, each addition rounded once, u = 2^-24);
  survivors whose world size (front-end, process group, recorded recoveries) disagrees with the
  others' or with the number of workers not failed.

A run that passes ``--run-deadline-s`` stops the soak with every running worker's stacks. Results
are printed and, with ``--json``, written (summary and every run).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import statistics
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.harness.common import build_mlp
from benchmarks.harness.fault_runs import Outcome, injected, run_workers
from decent_optim_wrapper import DecentOptimWrapper
from decent_optim_wrapper.engine.fleet.membership import PeerFailure

MODES = ("kill-in-step", "kill-in-flight", "kill-in-global-avg", "stop", "hang")
TIMED_MODES = ("kill-in-step", "kill-in-global-avg")  # SIGKILL from a timer
FEATURES, OUTPUTS, WITNESS = 16, 4, 64
WARMUP_STEPS, TAIL_STEPS = 20, 40  # steps before the first failure and after the last one
JUDGE_TIMEOUT_S = 60  # the final gathers' timeout (they are not under test)
WITNESS_ULPS = 4  # rounding allowed per round, in units of 2^-23 (an ulp at 2): see module docstring


# -- the workers -------------------------------------------------------------------------------------


def witness_values(rank: int) -> torch.Tensor:
    """Rank ``r``'s witness: coordinate ``i`` is ``1 + ((3 r + i) mod 8) / 7``, in [1, 2]."""
    return 1 + ((3 * rank + torch.arange(WITNESS)) % 8).float() / 7


def _inputs(rank: int, step: int) -> torch.Tensor:
    return torch.randn(16, FEATURES, generator=torch.Generator().manual_seed(100_003 * rank + step))


def build_worker(store: dist.Store, config: dict) -> tuple[nn.Module, nn.Parameter, DecentOptimWrapper]:
    """The soak's model, its witness (a parameter only gossip moves: a group with ``lr=0``) and the
    wrapped SGD with momentum (ring, ``on_peer_failure="continue"``)."""
    torch.manual_seed(0)
    model = build_mlp(FEATURES, 32, 3, OUTPUTS)
    witness = nn.Parameter(torch.zeros(WITNESS))
    inner = torch.optim.SGD(
        [{"params": list(model.parameters())}, {"params": [witness], "lr": 0.0}], lr=0.05, momentum=0.9
    )
    opt = DecentOptimWrapper(
        inner,
        topology="ring",
        timeout=timedelta(seconds=config["timeout_s"]),
        on_peer_failure="continue",
        store=store,
    )
    return model, witness, opt


def soak_worker(rank: int, world: int, store: dist.Store, plan: list[dict], config: dict) -> dict:
    """Train ``config["steps"]`` steps, failing where ``plan`` says; return what the parent judges."""
    steps, every = config["steps"], config["average_every"]
    model, witness, opt = build_worker(store, config)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    with torch.no_grad():  # after construction, which broadcast rank 0's values
        witness.copy_(witness_values(rank))
    params = [*model.parameters(), witness]
    teacher = torch.randn(FEATURES, OUTPUTS, generator=torch.Generator().manual_seed(0))
    loss_fn = nn.MSELoss()

    members = list(range(world))  # launch ranks, in the current rank order
    events: list[dict[str, Any]] = []

    def on_failure(failure: PeerFailure) -> None:
        events.append(
            {
                "time": time.time(),
                "step": failure.step,
                "lost": [members[i] for i in failure.lost],
                "survivors": [members[i] for i in failure.survivors],
                "world_size": failure.world_size,
                "previous_world_size": failure.previous_world_size,
            }
        )
        members[:] = [members[i] for i in failure.survivors]

    opt.register_peer_failure_hook(on_failure)

    faults = {f["step"]: f for f in plan if f["rank"] == rank}
    failing, health = Injector(), Health(params)
    for t in range(steps):
        fault = faults.get(t)
        x = _inputs(rank, t)
        opt.zero_grad()
        loss = loss_fn(model(x), x @ teacher)
        loss.backward()
        health.loss(loss)
        failing.before_step(fault)
        with failing.inside("step"):
            opt.step()
        scheduler.step()
        failing.after_step(fault)
        health.check()
        if (t + 1) % every == 0:
            failing.before_global_avg(fault)
            with failing.inside("global_avg"):
                opt.global_avg()
            health.check()
            opt.revert_global_avg()

    return {
        "rank": rank,
        "members": members,
        "events": events,
        "scheduler_steps": scheduler.last_epoch,
        **final_checks(opt, params, health),
        "final_loss": float(loss),
    }


class Injector:
    """Fails this worker as a planned fault says, and records where the main thread was when it did."""

    def __init__(self) -> None:
        self.phase = "train"  # read by a kill timer: where the kill landed

    @contextlib.contextmanager
    def inside(self, phase: str) -> Iterator[None]:
        self.phase = phase
        try:
            yield
        finally:
            self.phase = "train"

    def now(self, fault: dict) -> None:
        injected({**fault, "landed": self.phase})
        if fault["mode"] == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif fault["mode"] == "hang":
            time.sleep(3600)
        else:
            os.kill(os.getpid(), signal.SIGKILL)

    def soon(self, fault: dict) -> None:
        timer = threading.Timer(fault["delay_ms"] / 1000, self.now, (fault,))
        timer.daemon = True
        timer.start()

    def before_step(self, fault: dict | None) -> None:
        if fault is not None and fault["mode"] in ("stop", "hang"):
            self.now(fault)
        if fault is not None and fault["mode"] == "kill-in-step":
            self.soon(fault)

    def after_step(self, fault: dict | None) -> None:
        if fault is not None and fault["mode"] == "kill-in-flight":
            self.now(fault)

    def before_global_avg(self, fault: dict | None) -> None:
        if fault is not None and fault["mode"] == "kill-in-global-avg":
            self.soon(fault)


class Health:
    """Counts non-finite values and the witness's largest step outside [1, 2] (the last parameter)."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params = params
        self.nonfinite, self.excursion, self.rounds = 0, 0.0, 0

    def loss(self, loss: torch.Tensor) -> None:
        self.nonfinite += int(not torch.isfinite(loss))

    def check(self) -> None:
        self.rounds += 1
        witness = self.params[-1]
        with torch.no_grad():
            self.nonfinite += int(not all(bool(torch.isfinite(p).all()) for p in self.params))
            self.excursion = max(self.excursion, float(1 - witness.min()), float(witness.max() - 2))


def final_checks(opt: DecentOptimWrapper, params: list[torch.Tensor], health: Health) -> dict[str, Any]:
    """The survivors' final average, against their replicas gathered just before it.

    The gathers are the judge's, outside the optimizer and its failure handling: on a group of their
    own whose timeout allows for a slow machine (a rank finishing seconds after another is not a
    failure).
    """
    flat = lambda: torch.cat([p.detach().reshape(-1) for p in params])  # noqa: E731
    size = dist.get_world_size()
    judge_group = dist.new_group(timeout=timedelta(seconds=JUDGE_TIMEOUT_S))
    replica = flat()
    replicas = [torch.empty_like(replica) for _ in range(size)]
    dist.all_gather(replicas, replica, group=judge_group)
    opt.global_avg(may_revert=False)
    health.check()
    average = flat()
    averages = [torch.empty_like(average) for _ in range(opt.world_size)]
    dist.all_gather(averages, average, group=judge_group if opt.world_size == size else None)
    stacked = torch.stack(replicas).double()
    return {
        "final_rank": opt.rank,
        "world_size": opt.world_size,
        "dist_world_size": size,
        "step_count": opt.step_count,
        "nonfinite": health.nonfinite,
        "witness_excursion": health.excursion,
        "witness_rounds": health.rounds,
        "average_identical": all(torch.equal(a, averages[0]) for a in averages),
        "average_deviation": float((average.double() - stacked.mean(0)).abs().max()),
        "average_bound": size * 2**-24 * float(stacked.abs().max()),
    }


# -- one run: plan, run, judge -----------------------------------------------------------------------


def make_plan(seed: int, world: int, floor: int, spacing: int, every: int, window_ms: float) -> list[dict]:
    """The failures of one run, in order: victim (launch rank), step, mode, and a timer's delay."""
    rng = random.Random(seed)
    alive, plan, step = list(range(world)), [], WARMUP_STEPS
    for _ in range(world - floor):
        step += rng.randint(spacing // 2, spacing)
        mode = rng.choice(MODES)
        if mode == "kill-in-global-avg":  # the next step after which global_avg runs
            step = (step // every + 1) * every - 1
        victim = alive.pop(rng.randrange(len(alive)))
        plan.append({"rank": victim, "step": step, "mode": mode, "delay_ms": rng.uniform(0, window_ms)})
    return plan


def judge(plan: list[dict], world: int, steps: int, outcome: Outcome) -> dict[str, Any]:
    """The figures of one run (see the module docstring for what each means)."""
    victims = outcome.injected
    survivors = [r for r in range(world) if r not in victims]
    results = [outcome.results[r] for r in survivors if r in outcome.results]
    finished = len(results) == len(survivors) and not outcome.errors
    history = [[(e["lost"], e["survivors"], e["world_size"]) for e in r["events"]] for r in results]
    agree = finished and all(h == history[0] for h in history)
    lost = {rank for event in (history[0] if history else []) for rank in event[0]}
    survived = [v for v in victims if agree and v in lost]
    recoveries = []
    if agree:
        for i, event in enumerate(results[0]["events"]):
            start = min(victims[v]["time"] for v in event["lost"] if v in victims)
            recoveries.append(max(r["events"][i]["time"] for r in results) - start)
    steps_lost = sum(steps - r["step_count"] for r in results) + steps * (len(survivors) - len(results))
    expected_world = world - len(victims)
    world_disagrees = sum(
        (r["world_size"], r["dist_world_size"], len(r["members"])) != (expected_world,) * 3
        or r["members"] != results[0]["members"]
        for r in results
    )
    tolerance = [WITNESS_ULPS * 2**-23 * r["witness_rounds"] for r in results]
    return {
        "plan": plan,
        "seconds": round(outcome.seconds, 2),
        "injected": {v: {k: victims[v][k] for k in ("mode", "step", "landed")} for v in victims},
        "not_injected": [f["rank"] for f in plan if f["rank"] not in victims],
        "survived": len(survived),
        "survived_modes": [victims[v]["mode"] for v in survived],
        "dropped_alive": sorted(lost - set(victims)),
        "survivors": len(survivors),
        "survivors_finished": len(results) if not outcome.errors else 0,
        "errors": {r: e[-2000:] for r, e in outcome.errors.items()},
        "steps_lost": steps_lost,
        "scheduler_behind": sum(r["scheduler_steps"] != r["step_count"] for r in results),
        "recovery_s": recoveries,
        "corruption": {
            "nonfinite": sum(r["nonfinite"] > 0 for r in results),
            "witness_outside_hull": sum(
                r["witness_excursion"] > tol for r, tol in zip(results, tolerance, strict=True)
            ),
            "average_not_identical": int(not all(r["average_identical"] for r in results)),
            "average_not_mean": sum(r["average_deviation"] > r["average_bound"] for r in results),
            "world_size_disagrees": world_disagrees,
        },
        "witness_excursion_max": max((r["witness_excursion"] for r in results), default=0.0),
        "average_deviation_max": max((r["average_deviation"] for r in results), default=0.0),
        "final_loss": statistics.fmean(r["final_loss"] for r in results) if results else None,
    }


# -- the soak ----------------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]


def summarize(runs: list[dict], args: argparse.Namespace, seconds: float) -> dict[str, Any]:
    injected_by_mode = {m: 0 for m in MODES}
    survived_by_mode = {m: 0 for m in MODES}
    landed: dict[str, dict[str, int]] = {m: {} for m in TIMED_MODES}
    for run in runs:
        for record in run["injected"].values():
            injected_by_mode[record["mode"]] += 1
            if record["mode"] in landed:
                landed[record["mode"]][record["landed"]] = landed[record["mode"]].get(record["landed"], 0) + 1
        for mode in run["survived_modes"]:
            survived_by_mode[mode] += 1
    recoveries = [s for run in runs for s in run["recovery_s"]]
    corruption = {k: sum(run["corruption"][k] for run in runs) for k in runs[0]["corruption"]} if runs else {}
    return {
        "machine": args.machine,
        "workers": args.workers,
        "floor": args.floor,
        "timeout_s": args.timeout_s,
        "seconds": round(seconds, 1),
        "runs": len(runs),
        "seeds": [args.seed + i for i in range(len(runs))],
        "injected": sum(injected_by_mode.values()),
        "injected_by_mode": injected_by_mode,
        "timed_kills_landed_in": landed,
        "survived": sum(survived_by_mode.values()),
        "survived_by_mode": survived_by_mode,
        "not_injected": sum(len(run["not_injected"]) for run in runs),
        "dropped_alive": sum(len(run["dropped_alive"]) for run in runs),
        "survivors": sum(run["survivors"] for run in runs),
        "survivors_finished": sum(run["survivors_finished"] for run in runs),
        "steps_lost": sum(run["steps_lost"] for run in runs),
        "scheduler_behind": sum(run["scheduler_behind"] for run in runs),
        "recoveries": len(recoveries),
        "recovery_s": {
            "mean": statistics.fmean(recoveries) if recoveries else None,
            "p95": percentile(recoveries, 0.95) if recoveries else None,
            "max": max(recoveries) if recoveries else None,
        },
        "corruption": corruption,
        "witness_excursion_max": max((run["witness_excursion_max"] for run in runs), default=0.0),
        "average_deviation_max": max((run["average_deviation_max"] for run in runs), default=0.0),
    }


def report(summary: dict[str, Any]) -> None:
    s = summary
    print(
        f"\nSoak: {s['runs']} runs of {s['workers']} gloo workers down to {s['floor']} "
        f"(timeout {s['timeout_s']} s), {s['seconds']:.0f} s, {s['machine']}"
    )
    print(
        f"  failures injected  {s['injected']:5d}   "
        + ", ".join(f"{m} {n}" for m, n in s["injected_by_mode"].items())
    )
    for mode, where in s["timed_kills_landed_in"].items():
        print(f"    {mode} landed in: " + ", ".join(f"{k} {n}" for k, n in sorted(where.items())))
    print(
        f"  failures survived  {s['survived']:5d}   "
        + ", ".join(f"{m} {n}" for m, n in s["survived_by_mode"].items())
    )
    print(f"  planned, not reached {s['not_injected']}; live ranks dropped {s['dropped_alive']}")
    print(f"  survivors finished {s['survivors_finished']:5d} of {s['survivors']}")
    print(
        f"  steps lost         {s['steps_lost']:5d}   "
        f"(LR schedules behind their step count: {s['scheduler_behind']})"
    )
    r = s["recovery_s"]
    if r["mean"] is not None:
        print(
            f"  recovery (s)       mean {r['mean']:.2f}  p95 {r['p95']:.2f}  max {r['max']:.2f}  "
            f"over {s['recoveries']} recoveries"
        )
    print("  corruption         " + ", ".join(f"{k} {n}" for k, n in s["corruption"].items()))
    print(
        f"  largest witness excursion outside [1, 2]: {s['witness_excursion_max']:.3g}; largest deviation "
        f"of a final average from the float64 mean: {s['average_deviation_max']:.3g}"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--floor", type=int, default=4, help="stop failing workers when this many remain")
    parser.add_argument("--seed", type=int, default=0, help="run i uses seed SEED + i")
    parser.add_argument("--runs", type=int, default=1000, help="at most this many runs")
    parser.add_argument("--budget-s", type=float, default=600, help="start no run after this many seconds")
    parser.add_argument("--spacing", type=int, default=40, help="steps between failures: half to all of it")
    parser.add_argument("--average-every", type=int, default=10)
    parser.add_argument("--timeout-s", type=float, default=3.0)
    parser.add_argument("--kill-window-ms", type=float, default=4.0, help="a kill timer fires within this")
    parser.add_argument("--run-deadline-s", type=float, default=150)
    parser.add_argument("--machine", default="2-core Intel Xeon VM, CPU, gloo")
    parser.add_argument("--json", default=None, help="write the summary and every run here")
    args = parser.parse_args(argv)
    if not 1 < args.floor < args.workers:
        parser.error(
            f"--floor must be between 2 and --workers - 1, got {args.floor} with {args.workers} workers"
        )
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    runs: list[dict] = []
    start = time.monotonic()
    for i in range(args.runs):
        elapsed = time.monotonic() - start
        if runs and elapsed + max(run["seconds"] for run in runs) > args.budget_s:
            break
        seed = args.seed + i
        plan = make_plan(
            seed, args.workers, args.floor, args.spacing, args.average_every, args.kill_window_ms
        )
        steps = plan[-1]["step"] + TAIL_STEPS
        config = {"steps": steps, "average_every": args.average_every, "timeout_s": args.timeout_s}
        outcome = run_workers(soak_worker, args.workers, (plan, config), deadline_s=args.run_deadline_s)
        run = {"seed": seed, "steps": steps, **judge(plan, args.workers, steps, outcome)}
        runs.append(run)
        modes = ", ".join(f"{r}:{v['mode']}@{v['step']}({v['landed']})" for r, v in run["injected"].items())
        print(
            f"run {i:3d} seed {seed}: {run['seconds']:5.1f} s, {steps} steps, survived "
            f"{run['survived']}/{len(run['injected'])} [{modes}], recoveries "
            f"{', '.join(f'{s:.2f}' for s in run['recovery_s'])} s, corruption "
            f"{sum(run['corruption'].values())}",
            flush=True,
        )
        if run["errors"]:
            for rank, error in run["errors"].items():
                print(f"  rank {rank} raised:\n{error}", flush=True)
    summary = summarize(runs, args, time.monotonic() - start)
    report(summary)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"summary": summary, "runs": runs}, indent=1))
    return summary


if __name__ == "__main__":
    main()

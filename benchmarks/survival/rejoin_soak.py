"""Kill and restart soak: workers die over and over and come back by joining the running job.

    uv run benchmarks/survival/rejoin_soak.py             # 8 workers, 48 cycles, about 10 min on 2 cores
    uv run benchmarks/survival/rejoin_soak.py --workers 5 --floor 3 --cycles 4 --json /tmp/rejoin.json
    # one worker 15x slower, a global average every 3 steps: joiners must not starve
    uv run benchmarks/survival/rejoin_soak.py --workers 4 --floor 3 --cycles 10 --average-every 3 \
        --slow-factor 15

The soak of ``soak.py`` (same model, SGD with momentum and a cosine schedule, ring,
``on_peer_failure="continue"``, ``global_avg()``/``revert_global_avg()`` every ``--average-every``
steps, the same *witness* that only gossip moves and that must stay inside [1, 2]), on an elastic
job: the workers enter through ``init_elastic``, and every worker that fails is brought back. A
*cycle* is one failure and its restart: a victim fails (drawn as in ``soak.py``: SIGKILL inside a
step or a global average from a timer, right after a step with its round in flight, SIGSTOP, or a
hung main thread), then ``--restart-window-s`` seconds at most later (plus ``timeout`` for a
stopped or hung victim, which the members must first drop) the parent kills what is left of it
and starts a fresh process, which imports torch, finds the job running and joins it from a
member's replica; the world returns to ``--workers``. Failures are ``--spacing`` steps apart at
most, so kills land while earlier victims are still being dropped, restarted or admitted, and
restarts land during other admissions and recoveries; a failure waits while the world is at
``--floor``. The victim is drawn by its rank in the current world, joiners included.

Every worker holds the plan's position (a joiner receives its donor's with the replica, through
``register_join_state``, like the LR schedule). The run ends ``END_MARGIN`` steps after the first
worker sees the last failure recovered and the world whole again (its proposal in the store wins;
everyone stops at the same step). Counted (targets in brackets):

- *cycles*: failures injected, restarts, joins admitted (one per restart), losses recorded by the
  members (one per failure), and whether the world was whole at the end (every finisher at
  ``--workers``, ``--workers`` finishers);
- *steps lost* (0): over the finishers, the run's steps minus the updates their replica holds (a
  joiner's count starts at its donor's); an LR schedule behind its step count counts too;
- *corruption* (0): as in ``soak.py`` — a non-finite value, the witness outside [1, 2] by more than
  rounding, final averages not bitwise identical or not the float64 mean of the replicas, a world
  size on which the finishers disagree;
- *join time*: a joiner's process start to the end of its first step, and its parts (start-up,
  admission, group, transfer, check); *pause*: each member's time inside an admission and inside a
  recovery; and where kills and restarts landed (during another's admission, recovery or join).

Results are printed and, with ``--json``, written (summary and every cycle).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.harness.fault_runs import Outcome, note, process_started, run_workers
from benchmarks.survival.soak import (
    FEATURES,
    MODES,
    OUTPUTS,
    TIMED_MODES,
    WARMUP_STEPS,
    WITNESS_ULPS,
    Health,
    Injector,
    build_worker,
    final_checks,
    percentile,
    witness_values,
)
from benchmarks.survival.soak import _inputs as inputs
from decent_optim_wrapper import PeerJoin
from decent_optim_wrapper.engine.fleet.membership import PeerFailure

END_MARGIN = 30  # steps between the proposal of the end and the end: the workers are a step or two apart
QUIET_STEPS = 1000  # after the last failure fired, steps without a loss after which it is taken as a miss


# -- the workers -------------------------------------------------------------------------------------


class FaultClock:
    """The planned failures, taken in order: failure ``k`` is due ``gap`` steps after failure ``k - 1``
    fired, once the world is whole (or, for an ``overlap`` failure, above the floor), and for a kill
    inside a global average at a step that takes one. Every worker holds one; a joiner receives its
    donor's (``register_join_state``), so everyone agrees on which failure comes next."""

    def __init__(self, plan: list[dict], workers: int, floor: int, every: int, spare_rank_0: bool) -> None:
        self.plan, self.workers, self.floor, self.every = plan, workers, floor, every
        self.spare_rank_0 = spare_rank_0  # the slow worker (launch index 0, rank 0 for good) never fails
        self.next, self.last_fired = 0, WARMUP_STEPS

    @property
    def done(self) -> bool:
        return self.next == len(self.plan)

    def due(self, step: int, rank: int, world_size: int) -> dict | None:
        """The failure this worker must inject at ``step`` (it is the victim), if any."""
        if self.done:
            return None
        fault = self.plan[self.next]
        if step < self.last_fired + fault["gap"]:
            return None
        if world_size < self.workers and not (fault["overlap"] and world_size > self.floor):
            return None
        if fault["mode"] == "kill-in-global-avg" and (step + 1) % self.every:
            return None
        self.next, self.last_fired = self.next + 1, step
        if self.spare_rank_0:
            return fault if 1 + fault["victim"] % (world_size - 1) == rank else None
        return fault if fault["victim"] % world_size == rank else None

    def state_dict(self) -> dict[str, int]:
        return {"next": self.next, "last_fired": self.last_fired}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.next, self.last_fired = state["next"], state["last_fired"]


class AgreedEnd:
    """The step at which every worker stops: the first worker to see every failure fired and recovered
    and the world whole proposes its step plus ``END_MARGIN`` in the store (first proposal wins); all
    read it."""

    KEY = "rejoin-soak/end"

    def __init__(self, store: dist.Store, limit: int) -> None:
        self.store, self.step = store, limit

    def update(self, step: int, finished: bool) -> int:
        if finished:
            self.store.compare_set(self.KEY, "", str(step + END_MARGIN))
        if self.store.check([self.KEY]):
            self.step = int(self.store.get(self.KEY))
        return self.step


def rejoin_worker(index: int, world: int, store: dist.Store, plan: list[dict], config: dict) -> dict:
    """Train until the agreed end, failing where ``plan`` says; a replacement joins first."""
    limit, every = config["max_steps"], config["average_every"]
    before_front_end = time.time()
    model, witness, opt = build_worker(store, config)
    after_front_end = time.time()
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=limit)
    slow = config["slow_factor"] > 1
    clock = FaultClock(plan, world, config["floor"], every, spare_rank_0=slow)
    # With --slow-factor, launch index 0 computes that many times longer per step (a slower machine).
    step_time_s = config["step_time_s"] * (config["slow_factor"] if index == 0 and slow else 1)
    opt.register_join_state("scheduler", scheduler)  # a joiner loads its donor's here
    opt.register_join_state("faults", clock)
    if opt.joined is None:
        with torch.no_grad():  # after construction, which broadcast rank 0's values
            witness.copy_(witness_values(index))
    params = [*model.parameters(), witness]
    teacher = torch.randn(FEATURES, OUTPUTS, generator=torch.Generator().manual_seed(0))
    loss_fn = nn.MSELoss()
    membership = opt.engine.survival.membership  # its generation numbers the decisions

    losses: list[int] = []  # the steps at which this worker recorded a loss

    def on_failure(failure: PeerFailure) -> None:
        losses.append(failure.step)
        note(
            {
                "kind": "lost",
                "generation": membership.generation,
                "time": time.time(),
                "step": failure.step,
                "lost": len(failure.lost),
                "previous_world_size": failure.previous_world_size,
                "world_size": failure.world_size,
            }
        )

    def on_join(join: PeerJoin) -> None:
        note(
            {
                "kind": "admitted",
                "generation": membership.generation,
                "time": time.time(),
                "step": join.step,
                "joined": len(join.joined),
                "donors": list(join.donors),
                "previous_world_size": join.previous_world_size,
                "world_size": join.world_size,
            }
        )

    opt.register_peer_failure_hook(on_failure)
    opt.register_join_hook(on_join)
    pauses = opt.engine.survival.pauses  # seconds of every recovery or admission this rank took part in
    failing, health = Injector(), Health(params)
    end = AgreedEnd(store, limit)
    first_step = t = opt.step_count
    while t < end.step:
        fault = clock.due(t, opt.rank, opt.world_size)
        x = inputs(index, t)
        opt.zero_grad()
        loss = loss_fn(model(x), x @ teacher)
        loss.backward()
        health.loss(loss)
        failing.before_step(fault)
        counts = (len(pauses), len(opt.peer_joins), len(opt.peer_failures))
        with failing.inside("step"):
            opt.step()
        note_pauses(pauses, counts, opt)
        scheduler.step()
        failing.after_step(fault)
        health.check()
        time.sleep(step_time_s)  # the rest of a step's compute: leaves a core to a starting worker
        if t == first_step and opt.joined is not None:
            note(
                {
                    "kind": "joined",
                    "step": t,
                    "world_size": opt.world_size,
                    "started": process_started(),
                    "before_front_end": before_front_end,
                    "after_front_end": after_front_end,
                    "first_step_end": time.time(),
                    "seconds": opt.engine.growth.join_seconds,
                }
            )
        if (t + 1) % every == 0:
            failing.before_global_avg(fault)
            counts = (len(pauses), len(opt.peer_joins), len(opt.peer_failures))
            with failing.inside("global_avg"):
                opt.global_avg()
            note_pauses(pauses, counts, opt)
            health.check()
            opt.revert_global_avg()
        t += 1
        # The end comes once the last failure was recovered and its victim is back: a loss noted
        # after it fired, then a whole world (or, if nobody died of it, a long quiet stretch).
        recovered = (losses and losses[-1] >= clock.last_fired) or t > clock.last_fired + QUIET_STEPS
        end.update(t, clock.done and recovered and opt.world_size == world)
    return {
        "index": index,
        "joined": opt.joined is not None,
        "first_step": first_step,
        "steps": t,
        "failures_fired": clock.next,
        "scheduler_steps": scheduler.last_epoch,
        **final_checks(opt, params, health),
        "final_loss": float(loss),
    }


def note_pauses(pauses: list[float], before: tuple[int, int, int], opt: Any) -> None:
    """Note the pauses a call added: an admission's if it admitted and lost nobody, else a recovery's."""
    new = pauses[before[0] :]
    if not new:
        return
    joins, failures = len(opt.peer_joins) - before[1], len(opt.peer_failures) - before[2]
    kind = "admission" if joins and not failures and len(new) == 1 else "recovery"
    end = time.time()
    note({"kind": f"{kind}-pause", "seconds": sum(new), "start": end - sum(new), "end": end})


# -- the plan and the judge --------------------------------------------------------------------------


def make_plan(args: argparse.Namespace) -> list[dict]:
    """The failures, in order: steps after the previous one, victim (a rank, modulo the world size
    then), mode, timer delay, whether it may fire while the world is short, and its restart's delay."""
    rng = random.Random(args.seed)
    plan = []
    for cycle in range(args.cycles):
        mode = rng.choice(MODES)
        restart_s = rng.uniform(0, args.restart_window_s)
        if mode in ("stop", "hang"):  # the members drop it after the timeout; a launcher acts later
            restart_s += args.timeout_s
        plan.append(
            {
                "cycle": cycle,
                "gap": rng.randint(args.spacing // 2, args.spacing),
                "victim": rng.randrange(args.workers),
                "mode": mode,
                "delay_ms": rng.uniform(0, args.kill_window_ms),
                "overlap": rng.random() < args.overlap,
                "restart_s": restart_s,
            }
        )
    return plan


def distinct(events: list[dict], keys: tuple[str, ...]) -> list[dict]:
    """One event per decision: every member notes the same admission or loss."""
    seen: dict[tuple, dict] = {}
    for event in events:
        seen.setdefault(tuple(event[k] for k in keys), event)
    return sorted(seen.values(), key=lambda e: e["time"])


def spread(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"n": 0, "median": None, "p95": None, "max": None}
    return {
        "n": len(values),
        "median": statistics.median(values),
        "p95": percentile(values, 0.95),
        "max": max(values),
    }


def judge(args: argparse.Namespace, outcome: Outcome) -> dict[str, Any]:
    """The soak's figures (see the module docstring)."""
    processes = len(outcome.exitcodes)
    victims = outcome.injected
    finishers = [outcome.results[i] for i in range(processes) if i not in victims and i in outcome.results]
    steps = max((r["steps"] for r in finishers), default=0)
    notes = {i: outcome.notes(i) for i in range(processes)}
    every_note = [n for i in notes for n in notes[i]]
    keys = ("kind", "generation")
    losses = distinct([n for n in every_note if n["kind"] == "lost"], keys)
    admissions = distinct([n for n in every_note if n["kind"] == "admitted"], keys)
    joined = [n for n in every_note if n["kind"] == "joined"]
    pauses = {
        kind: [n for n in every_note if n["kind"] == f"{kind}-pause"] for kind in ("admission", "recovery")
    }

    def during(moment: float, intervals: list[tuple[float, float]]) -> bool:
        return any(start <= moment <= end for start, end in intervals)

    admitting = [(p["start"], p["end"]) for p in pauses["admission"]]
    recovering = [(p["start"], p["end"]) for p in pauses["recovery"]]
    joining = [(j["started"], j["first_step_end"]) for j in joined]
    injections = list(victims.values())
    expected = args.workers
    world_disagrees = sum(
        (r["world_size"], r["dist_world_size"]) != (expected, expected) for r in finishers
    ) + abs(expected - len(finishers))
    tolerance = [WITNESS_ULPS * 2**-23 * r["witness_rounds"] for r in finishers]
    landed: dict[str, dict[str, int]] = {m: {} for m in TIMED_MODES}
    for record in injections:
        if record["mode"] in landed:
            landed[record["mode"]][record["landed"]] = landed[record["mode"]].get(record["landed"], 0) + 1
    return {
        "seconds": round(outcome.seconds, 1),
        "processes": processes,
        "steps": steps,
        "ends_disagree": len({r["steps"] for r in finishers}) > 1,
        "failures_fired": min((r["failures_fired"] for r in finishers), default=0),
        "injected": len(injections),
        "bursts": sum(not r["overlap"] for r in injections),
        "injected_by_mode": {m: sum(r["mode"] == m for r in injections) for m in MODES},
        "timed_kills_landed_in": landed,
        "restarts": processes - args.workers,
        "joins": sum(a["joined"] for a in admissions),
        "joiners_recorded": len(joined),
        "losses": sum(e["lost"] for e in losses),
        "world_whole_again": sum(a["world_size"] == expected for a in admissions),
        "smallest_world": min([e["world_size"] for e in losses], default=expected),
        "finishers": len(finishers),
        "errors": {i: e[-3000:] for i, e in outcome.errors.items()},
        "steps_lost": sum(steps - r["step_count"] for r in finishers)
        + steps * max(0, expected - len(finishers)),
        "scheduler_behind": sum(r["scheduler_steps"] != r["step_count"] for r in finishers),
        "corruption": {
            "nonfinite": sum(r["nonfinite"] > 0 for r in finishers),
            "witness_outside_hull": sum(
                r["witness_excursion"] > tol for r, tol in zip(finishers, tolerance, strict=True)
            ),
            "average_not_identical": int(not all(r["average_identical"] for r in finishers)),
            "average_not_mean": sum(r["average_deviation"] > r["average_bound"] for r in finishers),
            "world_size_disagrees": world_disagrees,
        },
        "witness_excursion_max": max((r["witness_excursion"] for r in finishers), default=0.0),
        "landed_during": {
            "kills during an admission": sum(during(r["time"], admitting) for r in injections),
            "kills during a recovery": sum(during(r["time"], recovering) for r in injections),
            "kills while a worker was joining": sum(during(r["time"], joining) for r in injections),
            "joins overlapping a recovery": sum(
                any(s <= end and start <= e for s, e in recovering) for start, end in joining
            ),
            "joins overlapping another join": sum(
                any(s < end and start < e and (s, e) != (start, end) for s, e in joining)
                for start, end in joining
            ),
        },
        "join_s": spread([j["first_step_end"] - j["started"] for j in joined]),
        "join_parts_median_s": {
            "start-up": statistics.median([j["before_front_end"] - j["started"] for j in joined])
            if joined
            else None,
            **{
                part: statistics.median([j["seconds"][part] for j in joined]) if joined else None
                for part in ("admission", "group", "donor", "transfer", "verify")
            },
            "first step": statistics.median([j["first_step_end"] - j["after_front_end"] for j in joined])
            if joined
            else None,
        },
        "admission_pause_s": spread([p["seconds"] for p in pauses["admission"]]),
        "recovery_pause_s": spread([p["seconds"] for p in pauses["recovery"]]),
        "final_loss": statistics.fmean(r["final_loss"] for r in finishers) if finishers else None,
    }


def report(s: dict[str, Any], args: argparse.Namespace) -> None:
    print(
        f"\nKill/restart soak: {args.workers} gloo workers, {s['failures_fired']} of {args.cycles} planned "
        f"failures fired over {s['steps']} steps, "
        f"floor {args.floor}, timeout {args.timeout_s} s, {s['seconds']:.0f} s, {args.machine}"
    )
    print(
        f"  failures injected  {s['injected']:4d}   "
        + ", ".join(f"{m} {n}" for m, n in s["injected_by_mode"].items())
    )
    for mode, where in s["timed_kills_landed_in"].items():
        print(f"    {mode} landed in: " + ", ".join(f"{k} {n}" for k, n in sorted(where.items())))
    print(
        f"  restarts {s['restarts']}, joins admitted {s['joins']} "
        f"(recorded by joiners {s['joiners_recorded']}), "
        f"losses recorded {s['losses']}; world whole again {s['world_whole_again']} times "
        f"after {s['bursts']} failures that waited for it, "
        f"smallest {s['smallest_world']}"
    )
    print("  landed: " + ", ".join(f"{k} {n}" for k, n in s["landed_during"].items()))
    print(f"  finishers {s['finishers']} of {args.workers}, errors {len(s['errors'])}")
    print(f"  steps lost {s['steps_lost']} (LR schedules behind their step count: {s['scheduler_behind']})")
    print("  corruption " + ", ".join(f"{k} {n}" for k, n in s["corruption"].items()))
    for name in ("join_s", "admission_pause_s", "recovery_pause_s"):
        d = s[name]
        if d["n"]:
            print(
                f"  {name.replace('_', ' ')}: median {d['median']:.2f}  p95 {d['p95']:.2f}  "
                f"max {d['max']:.2f}  (n {d['n']})"
            )
    parts = s["join_parts_median_s"]
    if parts["start-up"] is not None:
        print("  join, median parts (s): " + ", ".join(f"{k} {v:.2f}" for k, v in parts.items()))
    for index, error in s["errors"].items():
        print(f"  process {index} raised:\n{error}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument(
        "--floor", type=int, default=6, help="an overlapping failure waits while the world is this small"
    )
    parser.add_argument("--cycles", type=int, default=48, help="failures (each followed by a restart)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--spacing", type=int, default=30, help="steps between failures: half to all of it")
    parser.add_argument(
        "--overlap", type=float, default=0.35, help="share of failures that do not wait for a whole world"
    )
    parser.add_argument("--step-time-s", type=float, default=0.02, help="emulated compute per step")
    parser.add_argument("--max-steps", type=int, default=20_000, help="stop here if the plan is not done")
    parser.add_argument("--average-every", type=int, default=10)
    parser.add_argument(
        "--slow-factor",
        type=float,
        default=1.0,
        help="launch index 0 takes this many times --step-time-s per step and is never a victim "
        "(the fast members then wait for it inside every global average)",
    )
    parser.add_argument("--timeout-s", type=float, default=5.0)
    parser.add_argument("--kill-window-ms", type=float, default=4.0, help="a kill timer fires within this")
    parser.add_argument("--restart-window-s", type=float, default=4.0, help="a restart starts within this")
    parser.add_argument("--deadline-s", type=float, default=2400)
    parser.add_argument("--machine", default="2-core VM, CPU, gloo")
    parser.add_argument("--json", default=None, help="write the summary and the plan here")
    args = parser.parse_args(argv)
    if not 1 < args.floor < args.workers:
        parser.error(
            f"--floor must be between 2 and --workers - 1, got {args.floor} with {args.workers} workers"
        )
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    plan = make_plan(args)
    config = {
        "max_steps": args.max_steps,
        "average_every": args.average_every,
        "timeout_s": args.timeout_s,
        "floor": args.floor,
        "step_time_s": args.step_time_s,
        "slow_factor": args.slow_factor,
    }
    outcome = run_workers(
        rejoin_worker,
        args.workers,
        (plan, config),
        deadline_s=args.deadline_s,
        restart_after=lambda record: record["restart_s"],
    )
    summary = judge(args, outcome)
    report(summary, args)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(
            json.dumps({"summary": summary, "plan": plan, "args": vars(args)}, indent=1)
        )
    return summary


if __name__ == "__main__":
    main()

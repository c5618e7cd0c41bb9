"""Fault-injection soak with ``on_peer_failure="continue"``: ``kills`` (seeded runs down to ``--floor``,
docs/survival-benchmarks.md) and ``rejoins`` (one elastic run, every victim restarted as a joiner,
docs/joining.md). Forked workers train an MLP and carry a *witness* only gossip moves; a victim fails
in one of ``MODES`` at a seeded moment; the survivors are checked for lost steps and corruption."""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import signal
import statistics
import threading
import time
from collections import Counter
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.harness.common import build_mlp
from benchmarks.harness.fault_runs import Launch, Outcome, injected, note, process_started, run_workers, shown
from decent_optim_wrapper import DecentOptimWrapper, PeerJoin
from decent_optim_wrapper.engine.fleet.membership import PeerFailure

MODES = ("kill-in-step", "kill-in-flight", "kill-in-global-avg", "stop", "hang")
TIMED_MODES = ("kill-in-step", "kill-in-global-avg")  # SIGKILL from a timer
FEATURES, OUTPUTS, WITNESS = 16, 4, 64
WARMUP_STEPS, TAIL_STEPS = 20, 40  # steps before the first failure and (kills) after the last one
JUDGE_TIMEOUT_S = 60  # the final gathers' timeout (they are not under test)
WITNESS_ULPS = 4  # rounding allowed per round, in units of 2^-23: one fp32 convex combination at 2
END_MARGIN = 30  # rejoins: steps between the proposal of the end and the end (workers a step or two apart)
END_KEY, CLOCK_KEY = "rejoin-soak/end", "rejoin-soak/failures"  # rejoins: the agreed end, the failures fired
QUIET_STEPS = 1000  # rejoins: after the last failure fired, steps without a loss that make it a miss
#: (call, mode) -> the fault fires at once before the call, from a timer started before it, or after it
WHEN = {("step", "stop"): "before", ("step", "hang"): "before", ("step", "kill-in-flight"): "after"}
WHEN |= {("step", "kill-in-step"): "timer", ("global_avg", "kill-in-global-avg"): "timer"}


class FaultClock:
    """rejoins: failure ``k`` is due ``gap`` steps after failure ``k - 1`` fired, once the world is whole
    (an ``overlap`` failure: above the floor). The schedule lives in the store, as members a step apart
    would disagree on it: the count fired and each failure's claim (``compare_set``: it fires once)."""

    def __init__(self, store: dist.Store, plan: list[dict], config: dict, index: int, spare_rank_0: bool):
        self.store, self.plan, self.index, self.config = store, plan, index, config
        self.spare_rank_0 = spare_rank_0  # the slow worker (launch index 0, rank 0 for good) never fails
        self._fired_at: dict[int, int] = {}  # failure -> the step it fired at (claims never change)

    @property
    def next(self) -> int:
        """How many failures have fired."""
        return int(self.store.add(f"{CLOCK_KEY}/fired", 0))

    def fired_step(self, failure: int) -> int:
        if failure < 0:
            return WARMUP_STEPS
        if failure not in self._fired_at:  # claimed before ``fired`` counts it: the key is there
            self._fired_at[failure] = int(self.store.get(f"{CLOCK_KEY}/claim/{failure}").split(b":")[1])
        return self._fired_at[failure]

    def due(self, step: int, rank: int, world_size: int) -> dict | None:
        """The failure this worker must inject at ``step`` (it is the victim and claimed it), if any."""
        failure, workers = self.next, self.config["workers"]
        if failure == len(self.plan):
            return None
        fault = self.plan[failure]
        if step < self.fired_step(failure - 1) + fault["gap"]:
            return None
        if world_size < workers and not (fault["overlap"] and world_size > self.config["floor"]):
            return None
        if fault["mode"] == "kill-in-global-avg" and (step + 1) % self.config["average_every"]:
            return None  # a kill inside a global average waits for a step that takes one
        victim = 1 + fault["victim"] % (world_size - 1) if self.spare_rank_0 else fault["victim"] % world_size
        mine, claim = f"{self.index}:{step}", f"{CLOCK_KEY}/claim/{failure}"
        if victim != rank or self.store.compare_set(claim, "", mine) != mine.encode():
            return None  # not the victim, or another worker a step or a world apart claimed it first
        self.store.add(f"{CLOCK_KEY}/fired", 1)
        return fault


def soak_worker(index: int, world: int, store: dist.Store, plan: list[dict], config: dict) -> dict:
    """Train (kills: the run's steps; rejoins: until the agreed end), failing where ``plan`` says; a
    replacement joins first. Returns what the parent judges."""
    elastic, steps, every = config["scenario"] == "rejoins", config["steps"], config["average_every"]
    before_front_end = time.time()
    torch.manual_seed(0)
    model = build_mlp(FEATURES, 32, 3, OUTPUTS)
    witness = nn.Parameter(torch.zeros(WITNESS))
    groups = [{"params": list(model.parameters())}, {"params": [witness], "lr": 0.0}]
    inner = torch.optim.SGD(groups, lr=0.05, momentum=0.9)
    timeout = timedelta(seconds=config["timeout_s"])
    opt = DecentOptimWrapper(inner, topology="ring", timeout=timeout, on_peer_failure="continue", store=store)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    slow = config["slow_factor"] > 1  # launch index 0 computes that many times longer per step
    step_time_s = config["step_time_s"] * (config["slow_factor"] if index == 0 and slow else 1)
    clock = FaultClock(store, plan, {**config, "workers": world}, index, slow) if elastic else None
    planned = {f["step"]: f for f in plan if f.get("rank") == index}  # kills: victims by launch rank
    if elastic:
        opt.register_join_state("scheduler", scheduler)  # a joiner loads its donor's here
    if opt.joined is None:
        with torch.no_grad():  # after construction, which broadcast rank 0's values; in [1, 2]
            witness.copy_(1 + ((3 * index + torch.arange(WITNESS)) % 8).float() / 7)
    params = [*model.parameters(), witness]
    teacher = torch.randn(FEATURES, OUTPUTS, generator=torch.Generator().manual_seed(0))
    members = list(range(world))  # kills: launch ranks, in the current rank order
    events: list[dict[str, Any]] = []

    def on_change(change: PeerFailure | PeerJoin) -> None:
        event = {"time": time.time(), "step": change.step, "world_size": change.world_size}
        if isinstance(change, PeerJoin):
            record = {"kind": "admitted", "joined": len(change.joined)}
        else:
            record = {"kind": "lost", "lost": len(change.lost)}
            if not elastic:
                event["lost"] = [members[i] for i in change.lost]
                event["survivors"] = members[:] = [members[i] for i in change.survivors]
            events.append(event)
        if elastic:  # every member notes it; the parent keeps one per generation
            note({**record, "generation": opt.engine.survival.membership.generation, **event})

    opt.register_peer_failure_hook(on_change)
    if elastic:
        opt.register_join_hook(on_change)
    failing, health = Injector(opt, elastic), Health(params)
    first_step = t = opt.step_count
    end = steps  # rejoins: until the first worker to see the run done proposes an end (first one wins)
    while t < end:
        fault = (clock.due(t, opt.rank, opt.world_size) if clock else planned.get(t)) or {}
        x = torch.randn(16, FEATURES, generator=torch.Generator().manual_seed(100_003 * index + t))
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), x @ teacher)
        loss.backward()
        health.nonfinite += int(not torch.isfinite(loss))
        with failing.around("step", fault):
            opt.step()
        scheduler.step()
        health.check()
        if step_time_s:
            time.sleep(step_time_s)  # the rest of a step's compute: leaves a core to a starting worker
        if t == first_step and opt.joined is not None:
            times = {"started": process_started(), "before_front_end": before_front_end}
            seconds = opt.engine.growth.join_seconds
            note({"kind": "joined", "first_step_end": time.time(), **times, "seconds": seconds})
        if (t + 1) % every == 0:
            with failing.around("global_avg", fault):
                opt.global_avg()
            health.check()
            opt.revert_global_avg()
        t += 1
        if clock is not None:
            # The end comes once the last failure was recovered and its victim is back: a loss noted
            # after it fired, then a whole world (or, if nobody died of it, a long quiet stretch).
            last_fired = clock.fired_step(clock.next - 1)
            recovered = (bool(events) and events[-1]["step"] >= last_fired) or t > last_fired + QUIET_STEPS
            if clock.next == len(plan) and recovered and opt.world_size == world:
                store.compare_set(END_KEY, "", str(t + END_MARGIN))
            if store.check([END_KEY]):
                end = int(store.get(END_KEY))
    run = {"members": members, "events": events, "steps": t, "failures_fired": clock.next if clock else None}
    run |= {"scheduler_steps": scheduler.last_epoch, **final_checks(opt, params, health)}
    return run | {"final_loss": float(loss)}


class Injector:
    """Fails this worker where a planned fault says, around the call it wraps, recording where the main
    thread was; with ``elastic``, notes the pauses the call added (admission or recovery)."""

    def __init__(self, opt: DecentOptimWrapper, elastic: bool) -> None:
        self.opt, self.elastic = opt, elastic
        self.phase = "train"  # read by a kill timer: where the kill landed

    def fail(self, fault: dict) -> None:
        injected({**fault, "landed": self.phase})
        if fault["mode"] == "hang":
            time.sleep(3600)
        os.kill(os.getpid(), signal.SIGSTOP if fault["mode"] == "stop" else signal.SIGKILL)

    @contextlib.contextmanager
    def around(self, call: str, fault: dict) -> Iterator[None]:
        when = WHEN.get((call, fault.get("mode", "")))
        if when == "before":
            self.fail(fault)
        elif when == "timer":
            timer = threading.Timer(fault["delay_ms"] / 1000, self.fail, (fault,))
            timer.daemon = True
            timer.start()
        opt, pauses = self.opt, self.opt.engine.survival.pauses  # seconds of every recovery or admission
        before = (len(pauses), len(opt.peer_joins), len(opt.peer_failures))
        self.phase = call
        try:
            yield
        finally:
            self.phase = "train"
        if self.elastic and len(pauses) > before[0]:
            new = pauses[before[0] :]
            joins, failures = len(opt.peer_joins) - before[1], len(opt.peer_failures) - before[2]
            kind = "admission" if joins and not failures and len(new) == 1 else "recovery"
            end = time.time()
            note({"kind": f"{kind}-pause", "seconds": sum(new), "start": end - sum(new), "end": end})
        if when == "after":
            self.fail(fault)


class Health:
    """Counts non-finite values and the witness's largest step outside [1, 2] (the last parameter)."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params = params
        self.nonfinite, self.excursion, self.rounds = 0, 0.0, 0

    def check(self) -> None:
        self.rounds += 1
        witness = self.params[-1]
        with torch.no_grad():
            self.nonfinite += int(not all(bool(torch.isfinite(p).all()) for p in self.params))
            self.excursion = max(self.excursion, float(1 - witness.min()), float(witness.max() - 2))


def final_checks(opt: DecentOptimWrapper, params: list[torch.Tensor], health: Health) -> dict[str, Any]:
    """The survivors' final average against their replicas gathered just before it (on a judge's group
    with a timeout that allows for a slow machine)."""
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
    figures = {"world_size": opt.world_size, "dist_world_size": size, "step_count": opt.step_count}
    figures |= {"nonfinite": health.nonfinite, "witness_excursion": health.excursion}
    figures["witness_rounds"] = health.rounds
    figures["average_identical"] = all(torch.equal(a, averages[0]) for a in averages)
    figures["average_deviation"] = float((average.double() - stacked.mean(0)).abs().max())
    return figures | {"average_bound": size * 2**-24 * float(stacked.abs().max())}  # k u max|x|


def kills_plan(seed: int, args: argparse.Namespace) -> list[dict]:
    """One run's failures, in order: victim (launch rank), step, mode, and a timer's delay."""
    rng = random.Random(seed)
    alive, plan, step = list(range(args.workers)), [], WARMUP_STEPS
    for _ in range(args.workers - args.floor):
        step += rng.randint(args.spacing // 2, args.spacing)
        mode = rng.choice(MODES)
        if mode == "kill-in-global-avg":  # the next step after which global_avg runs
            step = (step // args.average_every + 1) * args.average_every - 1
        victim = alive.pop(rng.randrange(len(alive)))
        delay_ms = rng.uniform(0, args.kill_window_ms)
        plan.append({"rank": victim, "step": step, "mode": mode, "delay_ms": delay_ms})
    return plan


def rejoins_plan(args: argparse.Namespace) -> list[dict]:
    """The failures, in order: steps after the previous one, victim (a rank, modulo the world size
    then), mode, timer delay, whether it may fire while the world is short, and its restart's delay."""
    rng = random.Random(args.seed)
    plan = []
    for cycle in range(args.cycles):
        mode = rng.choice(MODES)
        restart_s = rng.uniform(0, args.restart_window_s)
        if mode in ("stop", "hang"):  # the members drop it after the timeout; a launcher acts later
            restart_s += args.timeout_s
        draws = dict(gap=rng.randint(args.spacing // 2, args.spacing), victim=rng.randrange(args.workers))
        draws |= dict(delay_ms=rng.uniform(0, args.kill_window_ms), overlap=rng.random() < args.overlap)
        plan.append({"cycle": cycle, **draws, "mode": mode, "restart_s": restart_s})
    return plan


def injection_figures(injections: list[dict]) -> dict[str, Any]:
    """The failures injected, by mode, and where the timed kills landed (the main thread's phase)."""
    landed = {m: dict(Counter(r["landed"] for r in injections if r["mode"] == m)) for m in TIMED_MODES}
    by_mode = dict.fromkeys(MODES, 0) | Counter(r["mode"] for r in injections)
    return {"injected": len(injections), "injected_by_mode": by_mode, "timed_kills_landed_in": landed}


def finisher_figures(finishers: list[dict], steps: int, expected: int, disagrees: int) -> dict[str, Any]:
    """Of the workers that finished (``expected`` of them, ``steps`` each): steps lost, schedules behind
    their step count, corruption (each must be 0), the largest errors, the mean final loss."""
    missing = max(0, expected - len(finishers))
    figures = {"steps_lost": sum(steps - r["step_count"] for r in finishers) + steps * missing}
    figures["scheduler_behind"] = sum(r["scheduler_steps"] != r["step_count"] for r in finishers)
    corruption = {"nonfinite": sum(r["nonfinite"] > 0 for r in finishers)}
    outside = sum(r["witness_excursion"] > WITNESS_ULPS * 2**-23 * r["witness_rounds"] for r in finishers)
    corruption["witness_outside_hull"] = outside
    corruption["average_not_identical"] = int(not all(r["average_identical"] for r in finishers))
    corruption["average_not_mean"] = sum(r["average_deviation"] > r["average_bound"] for r in finishers)
    figures["corruption"] = corruption | {"world_size_disagrees": disagrees}
    for key in ("witness_excursion", "average_deviation"):
        figures[f"{key}_max"] = max((r[key] for r in finishers), default=0.0)
    losses = [r["final_loss"] for r in finishers]
    return figures | {"final_loss": statistics.fmean(losses) if losses else None}


def spread(values: list[float], middle: str = "median") -> dict[str, float | None]:
    """``n``, the ``middle`` (median or mean), p95 and max of ``values`` (None where empty)."""
    if not values:
        return {"n": 0, middle: None, "p95": None, "max": None}
    centre = statistics.median(values) if middle == "median" else statistics.fmean(values)
    ordered = sorted(values)
    p95 = ordered[min(len(ordered) - 1, max(0, round(0.95 * len(ordered)) - 1))]
    return {"n": len(values), middle: centre, "p95": p95, "max": max(values)}


def judge_kills(plan: list[dict], world: int, steps: int, outcome: Outcome) -> dict[str, Any]:
    """One kills run: a failure is survived if every survivor finished, all recorded the same
    recoveries, and count the victim among the lost."""
    victims = outcome.injected
    survivors = [r for r in range(world) if r not in victims]
    results = [outcome.results[r] for r in survivors if r in outcome.results]
    finished = len(results) == len(survivors) and not outcome.errors
    history = [[(e["lost"], e["survivors"], e["world_size"]) for e in r["events"]] for r in results]
    agree = finished and all(h == history[0] for h in history)
    lost = {rank for event in (history[0] if history else []) for rank in event[0]}
    survived = [v for v in victims if agree and v in lost]
    recoveries = []  # from the (first) victim's failure to the last survivor's hook
    for i, event in enumerate(results[0]["events"] if agree else []):
        start = min(victims[v]["time"] for v in event["lost"] if v in victims)
        recoveries.append(max(r["events"][i]["time"] for r in results) - start)
    expected_world = world - len(victims)
    world_disagrees = sum(
        (r["world_size"], r["dist_world_size"], len(r["members"])) != (expected_world,) * 3
        or r["members"] != results[0]["members"]
        for r in results
    )
    run = {"plan": plan, "seconds": round(outcome.seconds, 2)}
    run["injected"] = {v: {k: victims[v][k] for k in ("mode", "step", "landed")} for v in victims}
    run["not_injected"] = [f["rank"] for f in plan if f["rank"] not in victims]
    run |= {"survived": len(survived), "survived_modes": [victims[v]["mode"] for v in survived]}
    run |= {"dropped_alive": sorted(lost - set(victims)), "survivors": len(survivors)}
    run |= {"survivors_finished": len(results) if not outcome.errors else 0}
    run |= {"errors": {r: e[-2000:] for r, e in outcome.errors.items()}, "recovery_s": recoveries}
    return run | finisher_figures(results, steps, len(survivors), world_disagrees)


def summarize_kills(runs: list[dict], args: argparse.Namespace, seconds: float) -> dict[str, Any]:
    recoveries = [s for run in runs for s in run["recovery_s"]]
    summary = {k: getattr(args, k) for k in ("machine", "workers", "floor", "timeout_s")}
    summary |= {"seconds": round(seconds, 1), "runs": len(runs), "seeds": [run["seed"] for run in runs]}
    summary |= injection_figures([r for run in runs for r in run["injected"].values()])
    survived = Counter(m for run in runs for m in run["survived_modes"])
    summary |= {"survived": survived.total(), "survived_by_mode": dict.fromkeys(MODES, 0) | survived}
    summary |= {k: sum(len(run[k]) for run in runs) for k in ("not_injected", "dropped_alive")}
    for key in ("survivors", "survivors_finished", "steps_lost", "scheduler_behind"):
        summary[key] = sum(run[key] for run in runs)
    summary["recoveries"] = len(recoveries)
    summary["recovery_s"] = {k: v for k, v in spread(recoveries, "mean").items() if k != "n"}
    kinds = runs[0]["corruption"] if runs else ()
    summary["corruption"] = {kind: sum(run["corruption"][kind] for run in runs) for kind in kinds}
    for key in ("witness_excursion_max", "average_deviation_max"):
        summary[key] = max((run[key] for run in runs), default=0.0)
    return summary


def judge_rejoins(args: argparse.Namespace, outcome: Outcome) -> dict[str, Any]:
    """The rejoins run: joins and losses (one note per generation), steps lost, corruption, what
    overlapped what, join times and the members' pauses."""
    processes, victims = len(outcome.exitcodes), outcome.injected
    finishers = [outcome.results[i] for i in range(processes) if i not in victims and i in outcome.results]
    steps = max((r["steps"] for r in finishers), default=0)
    notes = [n for i in range(processes) for n in outcome.notes(i)]
    seen = {(n["kind"], n["generation"]): n for n in reversed(notes) if n["kind"] in ("lost", "admitted")}
    losses = [n for n in seen.values() if n["kind"] == "lost"]
    admissions = [n for n in seen.values() if n["kind"] == "admitted"]
    joined = [n for n in notes if n["kind"] == "joined"]
    pauses = {kind: [n for n in notes if n["kind"] == f"{kind}-pause"] for kind in ("admission", "recovery")}
    recovering = [(p["start"], p["end"]) for p in pauses["recovery"]]
    joining = [(j["started"], j["first_step_end"]) for j in joined]
    injections, expected = list(victims.values()), args.workers
    world_disagrees = sum((r["world_size"], r["dist_world_size"]) != (expected,) * 2 for r in finishers)
    parts = {"start-up": [j["before_front_end"] - j["started"] for j in joined]}
    for part in ("admission", "group", "transfer", "verify"):
        parts[part] = [j["seconds"][part] for j in joined]

    def overlapping(spans: list[tuple[float, float]], others: list[tuple[float, float]]) -> int:
        """How many of ``spans`` overlap one of ``others`` (not themselves)."""
        return sum(
            any(s <= end and begin <= e and (s, e) != (begin, end) for s, e in others) for begin, end in spans
        )

    kills = [(r["time"], r["time"]) for r in injections]
    landed = {"kills while a worker was joining": overlapping(kills, joining)}
    landed["joins overlapping a recovery"] = overlapping(joining, recovering)
    landed["joins overlapping another join"] = overlapping(joining, joining)
    summary = {"seconds": round(outcome.seconds, 1), "steps": steps, "restarts": processes - args.workers}
    summary |= {"failures_fired": min((r["failures_fired"] for r in finishers), default=0)}
    summary |= injection_figures(injections) | {"bursts": sum(not r["overlap"] for r in injections)}
    summary |= {"joins": sum(a["joined"] for a in admissions), "joiners_recorded": len(joined)}
    summary |= {"losses": sum(e["lost"] for e in losses)}
    summary |= {"world_whole_again": sum(a["world_size"] == expected for a in admissions)}
    summary |= {"finishers": len(finishers), "ends_disagree": len({r["steps"] for r in finishers}) > 1}
    summary |= finisher_figures(finishers, steps, expected, world_disagrees + abs(expected - len(finishers)))
    summary |= {"landed_during": landed, "join_s": spread([e - s for s, e in joining])}
    summary["join_parts_median_s"] = {k: statistics.median(v) if v else None for k, v in parts.items()}
    summary |= {f"{kind}_pause_s": spread([p["seconds"] for p in pauses[kind]]) for kind in pauses}
    return summary | {"errors": {i: e[-3000:] for i, e in outcome.errors.items()}}


def report(title: str, summary: dict[str, Any], keys: str) -> str:
    """``title``, then a line per figure in ``keys``."""
    return "\n".join([title, *(f"  {key.replace('_', ' ')}: {shown(summary[key])}" for key in keys.split())])


def worker_config(args: argparse.Namespace, steps: int) -> dict[str, Any]:
    """What every worker of either soak reads (the rest of its plan comes with the run)."""
    config = {k: getattr(args, k) for k in ("average_every", "timeout_s", "floor")}
    config |= {"scenario": args.question, "steps": steps, "step_time_s": getattr(args, "step_time_s", 0.0)}
    return config | {"slow_factor": getattr(args, "slow_factor", 1.0)}  # rejoins only


def kills(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """``--runs`` runs, seeds SEED, SEED + 1, ...: their summary and every run."""
    runs: list[dict] = []
    start = time.monotonic()
    for seed in range(args.seed, args.seed + args.runs):
        plan = kills_plan(seed, args)
        steps = plan[-1]["step"] + TAIL_STEPS
        outcome = run_workers(soak_worker, args.workers, (plan, worker_config(args, steps)), args.deadline_s)
        runs.append(run := {"seed": seed, "steps": steps, **judge_kills(plan, args.workers, steps, outcome)})
        print(f"seed {seed}: {shown({k: run[k] for k in ('seconds', 'injected', 'survived', 'recovery_s')})}")
        print(f"  corruption {shown(run['corruption'])}; errors {shown(run['errors'])}", flush=True)
    s = summarize_kills(runs, args, time.monotonic() - start)
    title = f"Soak: {s['runs']} runs of {s['workers']} gloo workers down to {s['floor']} (timeout "
    title += f"{s['timeout_s']} s), {s['seconds']:.0f} s, {s['machine']}"
    keys = "injected injected_by_mode timed_kills_landed_in survived survived_by_mode not_injected "
    keys += "dropped_alive survivors survivors_finished steps_lost scheduler_behind recoveries recovery_s "
    keys += "corruption witness_excursion_max average_deviation_max"
    return {"summary": s, "runs": runs}, report(title, s, keys)


def rejoins(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """One run on an elastic job, every victim restarted: its summary and the plan."""
    plan = rejoins_plan(args)
    config = worker_config(args, args.max_steps)
    launch = Launch(soak_worker, args.workers, (plan, config), elastic={"job": "soak"})
    for _ in range(args.workers):
        launch.start(fork=True)
    restarts: dict[int, float] = {}  # a failed worker -> when its replacement starts (then inf)

    def restart(launch: Launch) -> bool:
        """Bring back every worker that failed, ``restart_s`` after it failed itself, 1 s after it raised
        (a launcher restarts it too); whether a restart is still to come."""
        now = time.monotonic()
        for index, code in enumerate(launch.exitcodes()):
            if index not in restarts and (record := launch.failed_itself(index)) is not None:
                restarts[index] = now + record["restart_s"]
            elif index not in restarts and code not in (None, 0):
                restarts[index] = now + 1.0
        for index, due in sorted(restarts.items()):
            if due <= now:
                launch.kill([index])  # a stopped or hung worker: the launcher ends it
                restarts[index] = float("inf")
                launch.start()  # spawned: a real restart's start-up, and the store's master is up
        return any(due != float("inf") for due in restarts.values())

    s = judge_rejoins(args, launch.wait(args.deadline_s, restart))
    title = f"Kill/restart soak: {args.workers} gloo workers, {args.cycles} failures planned, floor "
    title += f"{args.floor}, timeout {args.timeout_s} s, {s['seconds']:.0f} s, {args.machine}"
    keys = "failures_fired steps injected injected_by_mode timed_kills_landed_in restarts joins "
    keys += "joiners_recorded losses world_whole_again bursts landed_during finishers steps_lost "
    keys += "scheduler_behind corruption join_s admission_pause_s recovery_pause_s join_parts_median_s errors"
    return {"summary": s, "plan": plan}, report(title, s, keys)

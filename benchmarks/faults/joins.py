"""Live joins on spawned workers training an MLP of ``--params`` with AdamW (ring; on loopback, or worker
``i`` on node ``i`` of the emulated cluster): what a join costs (``joining``: the members' pause, the
joiner's time line, the per-step cost of a job open to joiners, transfer against the link), and growing
back two lost workers against a restart of all from a checkpoint (``grow-back``). docs/joining.md."""

from __future__ import annotations

import argparse
import contextlib
import os
import pickle
import signal
import statistics
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.harness.fault_runs import Launch, process_started, shown, workdir
from decent_optim_wrapper import DecentOptimWrapper

LOST = 2  # grow-back: ranks lost at --lose-at
#: A worker's options where its question sets none.
WORKER_DEFAULTS = {"scenario": "joining", "attempt": 0, "resume_step": 0, "lose_at": -1, "lr": 1e-3}
WORKER_DEFAULTS |= {"checkpoint_every": 0, "join_after": -1, "expect_join": False}
#: Per question: the MLP's inputs and outputs, and the batch size.
TASKS = {"joining": (64, 8, 32), "grow-back": (32, 4, 64)}
JOB_NAME = "bench"
PARTS = ("admission", "group", "donor", "transfer", "verify")  # of a join, as the engine times them


def worker(index: int, world: int, store: dist.Store, options: dict[str, Any]) -> dict[str, Any]:
    """Train (``mode``: ``raise``, ``continue`` or ``elastic``) and return what the launcher reads:
    ``joining``: step times, pauses and the join's parts; ``grow-back``: the final average's loss."""
    args = argparse.Namespace(**{**WORKER_DEFAULTS, **options})
    rank, out = index % world, workdir()
    grow_back, (inputs, outputs, batch) = args.scenario != "joining", TASKS[args.question]
    width = int(args.params**0.5)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(inputs, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, outputs)
    )
    teacher = torch.randn(inputs, outputs, generator=torch.Generator().manual_seed(0))
    adamw = torch.optim.AdamW(model.parameters(), lr=args.lr)  # the first optimizer imports torch._dynamo
    before_front_end = time.time()
    options = {"timeout": timedelta(seconds=args.timeout)}
    if args.mode != "raise":
        options |= {"on_peer_failure": "continue", "store": store}
    opt = DecentOptimWrapper(adamw, topology="ring", **options)
    after_front_end = time.time()
    if args.resume_step:
        opt.load_state_dict(torch.load(out / f"ckpt-{rank}-{args.resume_step}.pt", weights_only=False))
    loss_fn = nn.MSELoss()
    times, waited, step = [], 0.0, opt.step_count

    def last_step() -> float:
        """--steps; with expect_join, also 10 steps past the admission, and no end before it (a joiner
        takes seconds to start, more on a loaded machine: the job must still be there)."""
        if not args.expect_join:
            return args.steps
        admission = opt.joined or (opt.peer_joins[0] if opt.peer_joins else None)
        return float("inf") if admission is None else max(args.steps, admission.step + 10)

    while step < last_step():
        begin = time.time()
        x = torch.randn(batch, inputs, generator=torch.Generator().manual_seed(1000 * opt.rank + step))
        opt.zero_grad()
        loss_fn(model(x), torch.tanh(x @ teacher)).backward()
        opt.step()
        time.sleep(args.step_time)  # the rest of a step's compute
        times.append((begin, time.time()))
        if opt.joined is None and opt.rank == 0 and step == args.join_after:
            (out / "ready").write_text("1")
        if args.expect_join and opt.joined is None and not opt.peer_joins and step >= args.join_after:
            time.sleep(0.25)  # until the joiner arrives (seconds to start): outside the steps' times
        dying = args.scenario in ("grow-back", "restart") and args.attempt == 0 and opt.joined is None
        if dying and step == args.lose_at and opt.rank >= world - LOST:
            os.kill(os.getpid(), signal.SIGKILL)
        if grow_back and opt.world_size < world and step >= args.steps - 10:
            time.sleep(1.0)  # do not finish before the lost workers are back (a restart takes seconds)
            waited += 1.0
        if args.checkpoint_every and (step + 1) % args.checkpoint_every == 0:
            path = out / f"ckpt-{rank}-{step + 1}.pt"
            torch.save(opt.state_dict(), path.with_suffix(".part"))
            path.with_suffix(".part").replace(path)  # complete or absent
        step += 1
    result = {"rank": opt.rank, "world_size": opt.world_size, "joined": opt.joined is not None}
    result |= {"start": process_started(), "end": time.time(), "waited_s": waited}
    if grow_back:
        opt.global_avg(may_revert=False)
        probe = torch.randn(1024, inputs, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            result["final_loss"] = loss_fn(model(probe), torch.tanh(probe @ teacher)).item()
        return result
    survival = opt.engine.survival
    result |= {"before_front_end": before_front_end, "after_front_end": after_front_end}
    result |= {"times": times, "join_seconds": opt.engine.growth.join_seconds}
    result |= {"pauses": [] if survival is None else survival.pauses}
    return result | {"forged_refused": opt.guard_counts.get("forged_application", 0)}


@contextlib.contextmanager
def cluster_at(nodes: int, link: str | None) -> Iterator[Any]:
    """None (loopback) without ``link``, else ``nodes`` nodes of the emulated cluster at ``link``."""
    if not link:
        yield None
        return
    from benchmarks.harness.emulated_cluster import Cluster

    with Cluster(nodes) as cluster:
        cluster.shape(link)
        yield cluster


def launch(world: int, mode: str, options: dict[str, Any], cluster: Any, env: dict | None = None) -> Launch:
    """A job of ``world`` workers in ``mode`` (an elastic job: one the launcher may grow)."""
    elastic = {"job": JOB_NAME, "timeout": timedelta(minutes=10)} if mode == "elastic" else None
    return Launch(worker, world, ({**options, "mode": mode},), elastic=elastic, cluster=cluster, env=env)


def failure(scenario: str, job: Launch) -> RuntimeError:
    codes = {i: code for i, code in enumerate(job.exitcodes()) if code != 0}
    return RuntimeError(
        f"{scenario}: workers failed or did not finish, exit codes {codes}: logs in {job.workdir}"
    )


def run_job(members: int, args: argparse.Namespace, kind: str, join: bool, cluster: Any = None) -> list[dict]:
    """``members`` workers of a ``kind`` of job (a --mode, or ``sealed``: elastic with a secret, ``forged``:
    sealed while an outsider writes ``--forged-per-s`` forged applications a second into the store) and,
    with ``join``, one joiner on node ``members`` once rank 0 is ready; their results."""
    names = ("question", "params", "steps", "join_after", "timeout", "step_time")
    options = {k: getattr(args, k) for k in names} | {"expect_join": join}
    sealed = kind in ("sealed", "forged")
    env = {"DECENT_JOB_SECRET": "the-benchmark-job-secret-0123"} if sealed else {}
    job = launch(members, "elastic" if sealed else kind, options, cluster, env)
    for _ in range(members):
        job.start()
    stop = threading.Event()
    outsider = threading.Thread(target=forge, args=(job.host, job.port, args.forged_per_s, stop))

    def end_outsider() -> None:
        """Before the store goes: a thread still inside a TCPStore call then aborts the process."""
        stop.set()
        if outsider.is_alive():
            outsider.join()

    def watch(job: Launch) -> bool:
        """Start the joiner once rank 0 is ready; a failed worker fails the job."""
        codes = job.exitcodes()
        if any(code not in (None, 0) for code in codes):
            raise failure("joining", job)
        if join and len(job.procs) == members and (job.workdir / "ready").exists():
            job.start(rank=0, node=members)
        if None not in codes:
            end_outsider()
        return join and len(job.procs) == members

    if kind == "forged":
        outsider.start()
    try:
        outcome = job.wait(args.deadline_s, watch)
    finally:
        end_outsider()
    if outcome.errors or any(code != 0 for code in outcome.exitcodes.values()):
        raise failure("joining", job)
    return list(outcome.results.values())


def forge(host: str, port: int, per_s: float, stop: threading.Event) -> None:
    """An outsider without the job's secret: it reads the job's run from the store (entries are not
    hidden) and claims application slots with plain requests, ``per_s`` a second, until ``stop``."""
    from decent_optim_wrapper.engine.fleet.admission import JoinRequest, slot_key
    from decent_optim_wrapper.engine.fleet.jobs import run_prefix
    from decent_optim_wrapper.engine.fleet.sealing import Seal

    store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=60))
    job = f"decent-optim-wrapper/jobs/{JOB_NAME}"
    while not store.check([job]):
        if stop.wait(0.05):
            return
    run = pickle.loads(bytes.fromhex(store.get(job).decode().rpartition(":")[2])).run
    prefix, plain, number = run_prefix(run), Seal(), 1
    while not stop.wait(1.0 / per_s):
        request = plain.seal(JoinRequest(number, 10_000 + number, ()), slot_key(prefix, number))
        while store.compare_set(slot_key(prefix, number), "", request) != request.encode():
            number += 1  # taken: the next slot
            request = plain.seal(JoinRequest(number, 10_000 + number, ()), slot_key(prefix, number))
        number += 1


def admission_figures(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Members' pause and the joiner's time line for one job with one join."""
    (joiner,) = [r for r in results if r["joined"]]
    members = [r for r in results if not r["joined"]]
    first_step_end = joiner["times"][0][1]
    lost, usual_steps = [], []
    for member in members:
        usual_steps.append(statistics.median(end - begin for begin, end in member["times"]))
        # the member's steps that ran while the joiner started, joined and took its first step
        around = [e - b for b, e in member["times"] if e >= joiner["start"] and b <= first_step_end]
        lost.append(max([0.0, *(d - usual_steps[-1] for d in around)]))
    seconds, pauses = joiner["join_seconds"], [p for m in members for p in m["pauses"]]
    timeline = {"start_up_s": joiner["before_front_end"] - joiner["start"]}
    timeline |= {f"{part}_s": seconds[part] for part in PARTS}
    timeline["first_step_s"] = first_step_end - joiner["after_front_end"]
    # the rest of the front-end: the engine in a world of its own, finding the job, loading the replica
    front_end = joiner["after_front_end"] - joiner["before_front_end"]
    timeline["construct_s"] = front_end - sum(seconds[p] for p in PARTS)
    timeline |= {"total_s": first_step_end - joiner["start"], "bytes": seconds["bytes"]}
    figures = {"world_size": joiner["world_size"], "pause_s": max(pauses)}
    figures |= {"pause_median_s": statistics.median(pauses), "step_lost_s": max(lost)}
    return figures | {"member_step_s": statistics.median(usual_steps), "joiner": timeline}


def overhead(args: argparse.Namespace) -> dict[str, Any]:
    """Median step time of each kind of job over ``"raise"``, interleaved ``--rounds`` times."""
    medians: dict[str, list[float]] = {
        kind: [] for kind in ("raise", "continue", "elastic", "sealed", "forged")
    }
    refused: list[int] = []  # forged applications rank 0 refused, per forged job
    for _ in range(args.rounds):
        for kind, times in medians.items():
            results = run_job(args.overhead_ranks, args, kind, join=False)
            times.append(statistics.median(e - b for r in results for b, e in r["times"][5:]))
            if kind == "forged":
                refused.append(next(r["forged_refused"] for r in results if r["rank"] == 0))
    base = statistics.median(medians["raise"])
    ratios = {kind: statistics.median(times) / base for kind, times in medians.items()}
    return {**ratios, "forged/sealed": ratios["forged"] / ratios["sealed"], "forged_refused": refused}


def link_sweep(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Transfer time against the link on the emulated cluster (one worker per namespace)."""
    from benchmarks.harness.emulated_cluster import Cluster, rate_bits

    rows = []
    with Cluster(5) as cluster:
        for link in args.links:
            cluster.shape(link)
            for megabytes in args.sizes_mb:
                params = int(megabytes * 1e6 / 16)  # parameters, AdamW's two moments, the rule's signal
                sized = argparse.Namespace(**{**vars(args), "params": params, "steps": args.join_after + 15})
                joiner = admission_figures(run_job(4, sized, "elastic", join=True, cluster=cluster))["joiner"]
                ideal = joiner["bytes"] * 8 / rate_bits(link)
                row = {"link": link, "megabytes": joiner["bytes"] / 1e6, **joiner, "ideal_s": ideal}
                rows.append(row | {"ratio": joiner["transfer_s"] / ideal})
                print(shown(rows[-1]), flush=True)
    return rows


def joining(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """The parts asked for (link, pause, overhead), in that order: their figures and their lines."""
    args.params = int(args.params)
    figures: dict[str, Any] = {"params": args.params, "cpus": os.cpu_count(), "cluster_link": args.cluster}
    figures["link"] = link_sweep(args) if args.links else []
    lines, figures["pause"] = [shown(row) for row in figures["link"]], []
    with cluster_at(max(args.ranks, default=0), args.cluster) as cluster:
        for world in args.ranks:
            figures["pause"].append(admission_figures(run_job(world - 1, args, "elastic", True, cluster)))
            lines.append(f"{world} ranks: members' pause, step lost, joiner: {shown(figures['pause'][-1])}")
            print(lines[-1], flush=True)
    if args.overhead_ranks:
        figures["overhead"] = overhead(args)
        lines.append(f"step time over on_peer_failure='raise': {shown(figures['overhead'])}")
    return figures, "\n".join(lines)


def grow_back_run(scenario: str, args: argparse.Namespace, cluster: Any) -> dict[str, Any]:
    """One run of ``scenario``, as a launcher runs it; its time to the last step and final loss."""
    names = ("question", "params", "steps", "lose_at", "step_time", "timeout", "lr")
    options = {"scenario": scenario, **{name: getattr(args, name) for name in names}}
    options |= {"checkpoint_every": args.checkpoint_every if scenario == "restart" else 0}
    job = launch(args.workers, "elastic" if scenario == "grow-back" else "raise", options, cluster)
    restarts, recomputed, first = 0, 0, 0  # first: the launch index of the last attempt's first worker
    handled: set[int] = set()  # the failed workers seen

    def on_failure(job: Launch) -> bool:
        """grow back: bring the failed workers back, to join the running job; restart: as torchrun's
        agent does, stop everyone and restart all from the last complete checkpoint."""
        nonlocal restarts, recomputed, first
        lost = [i for i, code in enumerate(job.exitcodes()) if code not in (None, 0) and i not in handled]
        handled.update(lost)
        if lost and scenario == "grow-back":
            restarts += len(lost)
            for i in lost:
                job.start(rank=job.ranks[i])
        elif lost and (scenario != "restart" or first):
            raise failure(scenario, job)
        elif lost:
            job.kill()
            handled.update(range(len(job.procs)))
            saved = range(args.checkpoint_every, args.steps + 1, args.checkpoint_every)
            ranks = range(args.workers)
            complete = [s for s in saved if all((job.workdir / f"ckpt-{r}-{s}.pt").exists() for r in ranks)]
            resume_step = max(complete, default=0)
            recomputed, first, restarts = args.lose_at + 1 - resume_step, len(job.procs), args.workers
            resumed = {**job.args[0], "attempt": 1, "resume_step": resume_step}
            for rank in ranks:
                job.start(rank=rank, attempt=1, args=(resumed,))
        return False

    began = time.time()
    for _ in range(args.workers):
        job.start()
    outcome = job.wait(args.deadline_s, on_failure)
    results = [result for i, result in outcome.results.items() if i >= first]
    if len(results) != args.workers or any(c != 0 for i, c in outcome.exitcodes.items() if i not in handled):
        raise failure(scenario, job)
    losses = {r["final_loss"] for r in results}
    figures = {"scenario": scenario, "seconds": max(r["end"] for r in results) - began}
    figures |= {"final_loss": results[0]["final_loss"], "losses_identical": len(losses) == 1}
    figures |= {"processes_restarted": restarts, "steps_recomputed": recomputed}
    figures |= {"joiners": sum(r["joined"] for r in results)}
    figures |= {"final_world_size": min(r["world_size"] for r in results)}
    return figures | {"waited_for_joiners_s": max(r["waited_s"] for r in results)}


def grow_back(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """The runs asked for (``--runs``), on the emulated cluster or, with ``--local``, on loopback; each
    with its time and final loss over the first run's."""
    from benchmarks.harness.emulated_cluster import ready_to_emulate

    if not args.local and not ready_to_emulate():
        return {"runs": []}, "grow-back: the emulated cluster needs root (or use --local)"
    rows: list[dict[str, Any]] = []
    with cluster_at(args.workers, None if args.local else args.link) as cluster:
        for scenario in args.runs:
            row = grow_back_run(scenario, args, cluster)
            first = rows[0] if rows else row
            rows.append(row | {f"{k}_ratio": row[k] / first[k] for k in ("seconds", "final_loss")})
            print(shown(rows[-1]), flush=True)
    setup = {k: getattr(args, k) for k in ("workers", "params", "steps", "lose_at", "checkpoint_every")}
    figures = {**setup, "link": None if args.local else args.link, "cpus": os.cpu_count(), "runs": rows}
    return figures, "\n".join(map(shown, rows))

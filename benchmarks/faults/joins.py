"""What a live join costs: the members' pause per admission, a joiner's time to its first step, the
transfer against the link, and the per-step cost of a job open to joiners.

    uv run benchmarks/faults/run.py joining                        # local CPU workers, about 4 min
    uv run benchmarks/faults/run.py joining --ranks 4 8 --params 1e6 --json /tmp/joining.json
    sudo uv run benchmarks/faults/run.py joining --links 100mbit 1gbit --sizes-mb 1 10 100  # emulated cluster
    sudo uv run benchmarks/faults/run.py joining --cluster 1gbit --ranks 4 8 16 --overhead-ranks 0  # pause

A job is worker processes (this module run with ``python -m``; :class:`Placement` and
:func:`start_worker` serve ``grow_back.py`` too) around a store the driver hosts, training an MLP of
``--params`` parameters with AdamW (ring, ``on_peer_failure="continue"``, ``init_elastic``). Parts:

- *pause* (``--ranks``; ``--cluster RATE``: a worker per emulated node): ``n - 1`` members start, one
  more joins at ``--join-after``: per admission the members' time inside it and their longest step
  beyond the median, and the joiner's time to its first step, in its parts.
- *overhead* (``--overhead-ranks``): median step time of ``"continue"``, open to joiners, sealed by a
  job secret, and sealed while an outsider writes ``--forged-per-s`` forged applications, each over
  ``on_peer_failure="raise"``, interleaved ``--rounds`` times.
- *link* (``--links``, root): 4 emulated nodes and a joiner on a fifth, replicas of ``--sizes-mb``
  MB: the payload's time on the wire against bytes / link rate.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

from benchmarks.harness.common import free_port


# -- the worker ----------------------------------------------------------------------------------------
def connect(elastic_job: str | None, prefix: str) -> tuple[int, int, Any]:
    """A started worker's rank, world size and store (from the launcher's environment), in the job
    ``elastic_job`` through ``init_elastic``, or else in a gloo group formed under ``prefix``."""
    import torch
    import torch.distributed as dist

    from decent_optim_wrapper import init_elastic

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
    if elastic_job is not None:
        init_elastic(store, rank, world, job=elastic_job)
    else:
        dist.init_process_group("gloo", store=dist.PrefixStore(prefix, store), rank=rank, world_size=world)
    return rank, world, store


def worker(args: argparse.Namespace) -> None:
    started = float(os.environ.get("JOIN_T0", time.time()))
    import torch
    import torch.distributed as dist
    from torch import nn

    from decent_optim_wrapper import DecentOptimWrapper

    _, _, store = connect("bench" if args.mode == "elastic" else None, "start")
    width = int((args.params / 1.0) ** 0.5)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(64, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 8)
    )
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-3)  # the first optimizer imports torch._dynamo
    before_front_end = time.time()
    options: dict[str, Any] = {"timeout": timedelta(seconds=args.timeout)}
    if args.mode != "raise":
        options |= {"on_peer_failure": "continue", "store": store}
    opt = DecentOptimWrapper(adamw, topology="ring", **options)
    after_front_end = time.time()
    ready = Path(args.out) / "ready"
    times = []
    step = opt.step_count

    def last_step() -> float:
        """--steps; with --expect-join, also 10 steps past the admission, and no end before it (a
        joiner takes seconds to start, more on a loaded machine: the job must still be there)."""
        if not args.expect_join:
            return args.steps
        admission = opt.joined or (opt.peer_joins[0] if opt.peer_joins else None)
        return float("inf") if admission is None else max(args.steps, admission.step + 10)

    while step < last_step():
        begin = time.time()
        x = torch.randn(32, 64, generator=torch.Generator().manual_seed(1000 * opt.rank + step))
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        time.sleep(args.step_time)  # the rest of a step's compute
        times.append((begin, time.time()))
        if opt.joined is None and opt.rank == 0 and step == args.join_after:
            ready.write_text("1")
        if args.expect_join and opt.joined is None and not opt.peer_joins and step >= args.join_after:
            time.sleep(0.25)  # until the joiner arrives (seconds to start): outside the steps' times
        step += 1
    survival = opt.engine.survival
    result = {
        "rank": opt.rank,
        "world_size": opt.world_size,
        "joined": opt.joined is not None,
        "start": started,
    }
    result |= {"before_front_end": before_front_end, "after_front_end": after_front_end, "times": times}
    result |= {"first_step": opt.step_count - len(times), "join_seconds": opt.engine.growth.join_seconds}
    result |= {"pauses": [] if survival is None else survival.pauses, "admissions": len(opt.peer_joins)}
    result |= {"forged_refused": opt.guard_counts.get("forged_application", 0)}
    (Path(args.out) / f"worker-{os.getpid()}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


# -- running jobs --------------------------------------------------------------------------------------
def start_worker(
    module: str, options: dict[str, Any], log: Path, env: dict[str, str], launcher: list[str]
) -> subprocess.Popen:
    """A worker process: ``module``'s ``worker`` with ``options`` (its output to ``log``), started
    through ``launcher`` (a namespace of the emulated cluster, a wrapper) with ``env`` added."""
    command = [*launcher, sys.executable, "-m", module, json.dumps(options)]
    with open(log, "w") as out:  # the child holds its own copy of the file
        return subprocess.Popen(command, env=dict(os.environ, **env), stdout=out, stderr=subprocess.STDOUT)


class Placement:
    """Where a job's processes run: on this machine's loopback, or each worker in a namespace of its
    own on the emulated cluster (``harness/emulated_cluster.py``; the store in node 0's, since the
    root namespace has no address on the cluster's bridge)."""

    def __init__(self, cluster: Any = None) -> None:
        self.cluster = cluster

    @contextlib.contextmanager
    def store(self) -> Iterator[tuple[str, int]]:
        """Host the job's store for the duration of the block: its address and port."""
        import torch.distributed as dist

        port = free_port()
        if self.cluster is None:
            store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
            try:
                yield "127.0.0.1", port
            finally:
                del store
            return
        host = self.cluster.address(0)
        hosting = (
            f"import time, torch.distributed as d; "
            f"s = d.TCPStore({host!r}, {port}, is_master=True, wait_for_workers=False); time.sleep(3600)"
        )
        process = subprocess.Popen([*self.launcher(0), sys.executable, "-c", hosting])
        try:
            time.sleep(1.5)  # the store listens before the first worker connects (its client retries anyway)
            yield host, port
        finally:
            process.kill()
            process.wait()

    def launcher(self, node: int) -> list[str]:
        return [] if self.cluster is None else ["ip", "netns", "exec", self.cluster.namespace(node)]

    def env(self, node: int) -> dict[str, str]:
        return {} if self.cluster is None else {"GLOO_SOCKET_IFNAME": self.cluster.ifname(node)}


def run_job(
    members: int,
    args: argparse.Namespace,
    mode: str,
    join: bool,
    placement: Placement | None = None,
    launcher: list[str] | None = None,
    secret: str | None = None,
    forged_per_s: float = 0.0,
) -> list[dict[str, Any]]:
    """``members`` workers (and one joiner once rank 0 is ready, with ``join``); their results.

    On the emulated cluster worker ``i`` runs on node ``i``, the joiner on node ``members``. With
    ``secret`` the workers seal the job's entries; with ``forged_per_s`` an outsider writes that many
    forged applications a second into the store while they run.
    """
    placement = placement or Placement()
    out = Path(tempfile.mkdtemp(prefix="dow-joining-"))
    options = {k: getattr(args, k) for k in ("params", "steps", "join_after", "timeout", "step_time")}
    options |= {"mode": mode, "out": str(out), "expect_join": join}
    procs = []
    with placement.store() as (host, port):

        def start(rank: int, extra: dict[str, str]) -> None:
            node = len(procs)
            env = {"MASTER_ADDR": host, "MASTER_PORT": str(port), "RANK": str(rank)}
            env |= {"WORLD_SIZE": str(members), "OMP_NUM_THREADS": "1", **placement.env(node), **extra}
            env |= {} if secret is None else {"DECENT_JOB_SECRET": secret}
            launch = [*placement.launcher(node), *(launcher or [])]
            procs.append(start_worker(__name__, options, out / f"log-{node}.txt", env, launch))

        stop_forging = threading.Event()
        forger = threading.Thread(target=forge, args=(host, port, forged_per_s, stop_forging), daemon=True)
        if forged_per_s:
            forger.start()
        try:
            for rank in range(members):
                start(rank, {})
            deadline = time.monotonic() + args.deadline_s
            if join:
                while not (out / "ready").exists():
                    if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
                        raise RuntimeError(f"the members did not reach step {args.join_after}: logs in {out}")
                    time.sleep(0.05)
                start(0, {"JOIN_T0": repr(time.time())})
            for proc in procs:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
                if proc.returncode != 0:
                    raise RuntimeError(f"a worker failed (exit {proc.returncode}): logs in {out}")
        finally:
            stop_forging.set()
            # Joined before the store goes and before the interpreter exits: a thread still inside a
            # call to its TCPStore client then aborts the process ("terminate called without an
            # active exception").
            if forger.is_alive():
                forger.join()
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
    return [json.loads(p.read_text()) for p in sorted(out.glob("worker-*.json"))]


def forge(host: str, port: int, per_s: float, stop: threading.Event) -> None:
    """An outsider that reaches the store without the job's secret: it reads the job's run from the
    store (entries are not hidden) and claims application slots with plain requests, ``per_s`` a
    second, until ``stop``."""
    import pickle

    import torch.distributed as dist

    from decent_optim_wrapper.engine.fleet.admission import JoinRequest, slot_key
    from decent_optim_wrapper.engine.fleet.jobs import run_prefix
    from decent_optim_wrapper.engine.fleet.sealing import Seal

    store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=60))
    job = "decent-optim-wrapper/jobs/bench"
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
        durations = [end - begin for begin, end in member["times"]]
        usual = statistics.median(durations)
        usual_steps.append(usual)
        # the member's steps that ran while the joiner started, joined and took its first step
        around = [
            end - begin
            for begin, end in member["times"]
            if end >= joiner["start"] and begin <= first_step_end
        ]
        lost.append(max([0.0, *(d - usual for d in around)]))
    # The join's parts as the engine times them; donor: the donor forming its side and packing its
    # replica; transfer: the payload on the wire.
    seconds, parts = joiner["join_seconds"], ("admission", "group", "donor", "transfer", "verify")
    pauses = [p for m in members for p in m["pauses"]]
    timeline = {"start_up_s": joiner["before_front_end"] - joiner["start"]}
    timeline |= {f"{part}_s": seconds[part] for part in parts}
    timeline["first_step_s"] = first_step_end - joiner["after_front_end"]
    # building the front-end around the join: the engine in a world of its own, finding the job again,
    # loading the replica
    front_end = joiner["after_front_end"] - joiner["before_front_end"]
    timeline["construct_s"] = front_end - sum(seconds[p] for p in parts)
    timeline |= {"total_s": first_step_end - joiner["start"], "bytes": seconds["bytes"]}
    figures = {
        "world_size": joiner["world_size"],
        "pause_s": max(pauses),
        "pause_median_s": statistics.median(pauses),
    }
    figures |= {"step_lost_s": max(lost), "member_step_s": statistics.median(usual_steps)}
    return figures | {"joiner": timeline}


#: The overhead part's jobs: (the workers' --mode, the job secret, forged applications a second).
OVERHEAD_JOBS = {
    "raise": ("raise", None, False),
    "continue": ("continue", None, False),
    "elastic": ("elastic", None, False),
    "sealed": ("elastic", "the-benchmark-job-secret-0123", False),
    "forged": ("elastic", "the-benchmark-job-secret-0123", True),
}


def overhead(args: argparse.Namespace) -> dict[str, Any]:
    medians: dict[str, list[float]] = {name: [] for name in OVERHEAD_JOBS}
    refused: list[int] = []  # forged applications rank 0 refused, per forged job
    for _ in range(args.rounds):
        for name, (mode, secret, forged) in OVERHEAD_JOBS.items():
            rate = args.forged_per_s if forged else 0.0
            results = run_job(args.overhead_ranks, args, mode, join=False, secret=secret, forged_per_s=rate)
            durations = [end - begin for r in results for begin, end in r["times"][5:]]
            medians[name].append(statistics.median(durations))
            if forged:
                refused.append(next(r["forged_refused"] for r in results if r["rank"] == 0))
    base = statistics.median(medians["raise"])
    ratios = {mode: statistics.median(values) / base for mode, values in medians.items()}
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
                results = run_job(4, sized, "elastic", join=True, placement=Placement(cluster))
                figures = admission_figures(results)["joiner"]
                ideal = figures["bytes"] * 8 / rate_bits(link)
                rows.append({"link": link, "megabytes": figures["bytes"] / 1e6, **figures, "ideal_s": ideal})
                print(link_row(rows[-1]), flush=True)
    return rows


def link_row(row: dict[str, Any]) -> str:
    return (
        f"{row['link']:>9} {row['megabytes']:8.1f} MB  donor packing {row['donor_s']:5.2f} s  "
        f"transfer {row['transfer_s']:7.2f} s  bytes/link {row['ideal_s']:7.2f} s  "
        f"ratio {row['transfer_s'] / row['ideal_s']:5.2f}"
    )


# -- the answer ----------------------------------------------------------------------------------------
def pause_row(world: int, entry: dict[str, Any]) -> str:
    joiner = entry["joiner"]
    return (
        f"{world:>3} ranks: members' pause {entry['pause_s']:.2f} s "
        f"(median {entry['pause_median_s']:.2f}), step lost {entry['step_lost_s']:.2f} s "
        f"(step {entry['member_step_s'] * 1e3:.0f} ms); joiner {joiner['total_s']:.1f} s to its first "
        f"step: start-up {joiner['start_up_s']:.1f}, admission {joiner['admission_s']:.2f}, group "
        f"{joiner['group_s']:.2f}, donor packing {joiner['donor_s']:.2f}, "
        f"transfer {joiner['transfer_s']:.2f} ({joiner['bytes'] / 1e6:.1f} MB), "
        f"verify {joiner['verify_s']:.2f}, the rest of the front-end {joiner['construct_s']:.2f}, "
        f"first step {joiner['first_step_s']:.2f}"
    )


def answer(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """The parts asked for (link, pause, overhead), in that order: their figures and their lines."""
    args.params = int(args.params)
    figures: dict[str, Any] = {"params": args.params, "cpus": os.cpu_count()}
    lines = []
    if args.links:
        figures["link"] = link_sweep(args)
        lines += [link_row(row) for row in figures["link"]]
    figures["pause"] = []
    with contextlib.ExitStack() as stack:
        placement = Placement()
        if args.cluster:
            from benchmarks.harness.emulated_cluster import Cluster

            cluster = stack.enter_context(Cluster(max(args.ranks, default=0)))
            cluster.shape(args.cluster)
            placement = Placement(cluster)
            figures["cluster_link"] = args.cluster
        for world in args.ranks:
            figures["pause"].append(admission_figures(run_job(world - 1, args, "elastic", True, placement)))
            lines.append(pause_row(world, figures["pause"][-1]))
            print(lines[-1], flush=True)
    if args.overhead_ranks:
        cost = figures["overhead"] = overhead(args)
        ratios = ", ".join(f"{mode}: {cost[mode]:.3f}x" for mode in OVERHEAD_JOBS)
        lines.append(
            f"step time over on_peer_failure='raise', {ratios}; forged/sealed {cost['forged/sealed']:.3f}x, "
            f"forged applications refused by rank 0 per job {cost['forged_refused']}"
        )
    return figures, "\n".join(lines)


if __name__ == "__main__":  # a worker, started by start_worker
    worker(argparse.Namespace(**json.loads(sys.argv[1])))

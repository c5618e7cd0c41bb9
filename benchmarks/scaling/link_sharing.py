"""How two all-reduces that overlap share an emulated node link, and the simulator's model of it.

Two nodes of the emulated cluster (``emulated_cluster.py``: links shaped with ``tc tbf`` both ways), two ranks
each: ranks 0 and 1 on node 0, ranks 2 and 3 on node 1. Group A = (0, 3) and group B = (1, 2) each
all-reduce one model (the scaling benchmark's 0.54 MB MLP) through gloo, so both cross node 0's
outgoing and node 1's incoming link, as the two ranks of a node do with two ranks per node. B starts
``delta`` seconds after A (after a barrier and an idle pause, as between training steps), for every
``--deltas``; A alone gives the time of one transfer. Printed per delta: each group's mean
duration measured, and predicted by :class:`decent_optim_wrapper.plan.SharingModel` for every
doubling time and head start of a grid, and the pair that fits best (the one ``scaling_report.py``
uses to replay the runs with two ranks per node).

``sudo uv run benchmarks/scaling/link_sharing.py --json benchmarks/results/scaling/link-sharing.json`` (about
two minutes); ``uv run benchmarks/scaling/link_sharing.py --fit benchmarks/results/scaling/link-sharing.json``
fits a stored run again (no root).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.harness.emulated_cluster import Cluster, ready_to_emulate
from decent_optim_wrapper.plan import Link, Network, SharingModel, transfer_seconds
from decent_optim_wrapper.topo.group import Group

GROUPS = {"A": (0, 3), "B": (1, 2)}
DOUBLINGS = (0.0, 0.025, 0.05, 0.1, 0.2)
HEAD_STARTS = (0.0, 0.025, 0.05, 0.1, 0.15)
SEEDS = 100  # head starts are random: the prediction is a mean over this many seeds


def worker(rank: int, deltas: list[float], reps: int, numel: int, out: Path) -> None:
    """One rank: per delta, ``reps`` timed all-reduces of its group (B's ``delta`` after A's; -1: A alone)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=4)
    groups = {name: dist.new_group(list(ranks)) for name, ranks in GROUPS.items()}
    mine = next(name for name, ranks in GROUPS.items() if rank in ranks)
    x = torch.ones(numel)
    for _ in range(2):  # connections and buffers set up
        dist.all_reduce(x, group=groups[mine])
    times: dict[str, list[float]] = {}
    for delta in deltas:
        times[str(delta)] = []
        for _ in range(reps):
            dist.barrier()
            time.sleep(0.3)  # the links idle, as between two steps' exchanges
            if mine == "B":
                if delta < 0:
                    continue
                time.sleep(delta)
            start = time.perf_counter()
            dist.all_reduce(x, group=groups[mine])
            times[str(delta)].append(time.perf_counter() - start)
    dist.barrier()
    out.write_text(json.dumps(times))


def measure(args: argparse.Namespace) -> dict[str, Any]:
    scratch = tempfile.mkdtemp(prefix="dow-sharing-")
    with Cluster(2) as cluster:
        cluster.shape(args.bandwidth)
        procs = []
        for rank in range(4):
            node = rank // 2
            env = dict(
                os.environ,
                MASTER_ADDR=cluster.address(0),
                MASTER_PORT="29655",
                GLOO_SOCKET_IFNAME=cluster.ifname(node),
                OMP_NUM_THREADS="1",
            )
            flags = ["--worker", str(rank), "--reps", str(args.reps), "--numel", str(args.numel)]
            flags += ["--out", f"{scratch}/rank{rank}.json", "--deltas", *map(str, args.deltas)]
            command = ["ip", "netns", "exec", cluster.namespace(node), sys.executable, __file__, *flags]
            procs.append(subprocess.Popen(command, env=env))
        try:
            for proc in procs:
                proc.wait(timeout=args.run_seconds)
        finally:
            for proc in procs:
                proc.kill()
    ranks = [json.loads(Path(f"{scratch}/rank{r}.json").read_text()) for r in range(4)]
    # a group's duration: the mean of its two members' (they start together and end together)
    durations = {
        name: {
            d: [statistics.fmean(pair) for pair in zip(*(ranks[r][d] for r in members), strict=True)]
            for d in ranks[members[0]]
        }
        for name, members in GROUPS.items()
    }
    return {
        "args": {k: v for k, v in vars(args).items() if k not in ("fit", "worker", "out")},
        "numel": args.numel,
        **durations,
    }


def fit(record: dict[str, Any]) -> None:
    """Measured vs predicted per delta for every model of the grid; the best fit last."""
    alone = statistics.median(record["A"]["-1.0"])
    model_bytes = 4 * record["numel"]
    rate = 8 * model_bytes / alone  # the link's rate seen by one transfer alone
    network = Network(Link(rate), Link(10e9), local_world_size=2)
    transfers = [network.transfer(Group(ranks), model_bytes) for ranks in ((0, 2), (1, 3))]
    measured = {
        float(d): (statistics.fmean(record["A"][d]), statistics.fmean(record["B"][d]))
        for d in record["A"]
        if float(d) >= 0
    }
    print(f"one transfer alone: {1e3 * alone:.0f} ms ({rate / 1e6:.1f} Mbit/s)")
    print("delta (ms):" + "".join(f"{1e3 * d:>11.0f}" for d in measured))
    print("measured A/B:" + "".join(f"{1e3 * a:>6.0f}/{1e3 * b:<4.0f}" for a, b in measured.values()))
    fits = []
    for doubling, head in itertools.product(DOUBLINGS, HEAD_STARTS):
        if head and not doubling:
            continue
        predicted = {}
        for d in measured:
            runs = [
                transfer_seconds(transfers, [0.0, d], SharingModel(doubling, head, s)) for s in range(SEEDS)
            ]
            predicted[d] = tuple(statistics.fmean(r[i] for r in runs) for i in (0, 1))
        errors = [p / m - 1 for d in measured for p, m in zip(predicted[d], measured[d], strict=True)]
        rms = statistics.fmean(e * e for e in errors) ** 0.5
        fits.append((rms, doubling, head, predicted))
    fits.sort(key=lambda f: -f[0])
    for rms, doubling, head, predicted in fits:
        cells = "".join(f"{1e3 * a:>6.0f}/{1e3 * b:<4.0f}" for a, b in predicted.values())
        label = f"doubling {1e3 * doubling:>3.0f} ms, head start {1e3 * head:>3.0f} ms:"
        print(f"{label}{cells} rms error {100 * rms:.1f}%")
    rms, doubling, head, _ = fits[-1]
    print(f"best fit: SharingModel(doubling_s={doubling}, head_start_s={head}), rms error {100 * rms:.1f}%")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bandwidth", default="20mbit")
    parser.add_argument(
        "--deltas", type=float, nargs="+", default=[-1, 0, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2]
    )
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--numel", type=int, default=134154, help="fp32 elements (the scaling MLP's)")
    parser.add_argument("--run-seconds", type=float, default=300.0)
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--fit", metavar="PATH", help="fit a stored run instead of measuring")
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker, args.deltas, args.reps, args.numel, args.out)
        return
    if args.fit:
        fit(json.loads(Path(args.fit).read_text()))
        return
    if not ready_to_emulate():
        return
    record = measure(args)
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=1))
        print(f"results written to {args.json}")
    fit(record)


if __name__ == "__main__":
    main()

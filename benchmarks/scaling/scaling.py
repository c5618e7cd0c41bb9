"""How iteration time grows with the number of nodes: DDP vs gossip on 2 to 16 emulated nodes.

Runs the emulated cluster of ``emulated_cluster.py`` (one network namespace per node, every link shaped with
``tc tbf`` both ways) with ``--nodes`` nodes and, by default, forward and backward replaced by waits of
the same length (``emulated_compute.EmulatedMLP``; the parameters, their bytes, the collectives and the
optimizer step stay real), so that 16 ranks fit on 2 cores. Each method runs under each compute-time
scenario (``decent_optim_wrapper.plan.ComputeTimes``): ``none`` (constant), ``lognormal`` (transient
jitter with a heavy tail, same mean) and ``straggler`` (rank 0 persistently ``--slow-factor`` times
slower). Printed per scenario: mean iteration time of each method, relative to no communication and
to DDP, the CPU the ranks used and the CPU the whole machine used (the difference is the emulated
network's kernel work and anything else running).

``--compute real`` runs the real MLP at ``--batch`` instead (to calibrate the waits: it prints the
measured forward and backward times). One invocation is one cluster size; ``scaling_report.py``
gathers the JSON files, compares them with the simulator and draws the figure.

Needs root (``sudo uv run benchmarks/scaling/scaling.py --nodes 4``); without it, it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.harness.cluster_worker import BASELINES, parse_gossip_method
from benchmarks.harness.emulated_cluster import (
    Cluster,
    measure_link,
    rate_bits,
    ready_to_emulate,
    run_workers,
)
from decent_optim_wrapper.plan import JITTERS

METHODS = ("nocomm", "ddp", "ddp-bf16", "ring", "one-peer-exp", "ring@bf16")
#: Processes on this machine: with emulated compute a rank sleeps most of the time.
MAX_PROCESSES = {"real": 4, "emulated": 32}


ECHO_SERVER = """
import socket, sys
server = socket.create_server((sys.argv[1], int(sys.argv[2]))); server.settimeout(20)
conn, _ = server.accept(); conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while data := conn.recv(64):
    conn.sendall(data)
"""
ECHO_CLIENT = """
import socket, statistics, sys, time
for _ in range(100):
    try: conn = socket.create_connection((sys.argv[1], int(sys.argv[2]))); break
    except OSError: time.sleep(0.05)
conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1); times = []
for _ in range(50):
    start = time.perf_counter(); conn.sendall(b"x"); conn.recv(64); times.append(time.perf_counter() - start)
print(1e3 * statistics.median(times))
"""


def round_trip_ms(cluster: Cluster, port: int) -> float:
    """Median round trip of a one-byte TCP message node 1 -> node 0 -> node 1 on the idle link, in ms."""
    addr = cluster.address(0)
    server = subprocess.Popen(
        ["ip", "netns", "exec", cluster.namespace(0), sys.executable, "-c", ECHO_SERVER, addr, str(port)]
    )
    try:
        command = [sys.executable, "-c", ECHO_CLIENT, addr, str(port)]
        done = subprocess.run(
            ["ip", "netns", "exec", cluster.namespace(1), *command],
            capture_output=True,
            text=True,
            timeout=30,
        )
        return float(done.stdout)
    finally:
        server.kill()
        server.wait()


def worker_flags(args: argparse.Namespace) -> list[str]:
    """The flags of ``cluster_worker.py`` that ``emulated_cluster.worker_command`` does not pass itself."""
    flags = ["--inputs", args.inputs, "--width", args.width, "--depth", args.depth, "--compute", args.compute]
    flags += ["--compute-ms", args.compute_ms, "--forward-fraction", args.forward_fraction]
    flags += ["--sigma", args.sigma, "--slow-factor", args.slow_factor, "--seed", args.seed]
    if args.compute == "emulated":
        flags += ["--scenarios", *args.scenarios]
    return [str(f) for f in flags]


def result_keys(args: argparse.Namespace) -> list[str]:
    if args.compute == "real":
        return list(args.methods)
    return [f"{s}/{m}" for s in args.scenarios for m in args.methods]


def busy_cpu_seconds() -> float:
    """Seconds all cores spent busy since boot (``/proc/stat``)."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def table(runs: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Print one table per scenario; return the per-key summary (ms, ratios, CPU per step)."""
    ranks = args.nodes * args.workers_per_node
    cores = os.cpu_count() or 1
    summary: dict[str, Any] = {}
    for scenario in [None] if args.compute == "real" else args.scenarios:
        prefix = "" if scenario is None else f"{scenario}/"
        if not runs.get(prefix + "nocomm"):
            continue
        base = statistics.fmean(runs[prefix + "nocomm"]["rank_means_s"])
        ddp = runs.get(prefix + "ddp")
        ddp_ms = 1e3 * statistics.fmean(ddp["rank_means_s"]) if ddp else None
        where = f"{args.nodes} nodes x {args.workers_per_node} at {args.bandwidth}"
        print(f"\nscenario {scenario or 'real compute'}: {where}")
        print(
            f"  {'method':<16} {'mean ms':>8} {'/ nocomm':>9} {'DDP / it':>9} {'rank CPU':>9} {'machine':>8}"
        )
        for method in args.methods:
            run = runs.get(prefix + method)
            if not run:
                continue
            mean_ms = 1e3 * statistics.fmean(run["rank_means_s"])
            rounds = len(run["round_medians_s"])
            window = rounds * args.iters * mean_ms / 1e3  # seconds of timed steps per rank
            cpu = sum(sum(per_rank) for per_rank in run["measured"].get("cpu_s", []))
            busy = sum(run["measured"].get("busy_s", [[]])[0])
            entry: dict[str, Any] = {
                "mean_ms": mean_ms,
                "relative": mean_ms / (1e3 * base),
                "ddp_over": ddp_ms / mean_ms if ddp_ms else None,
                "ranks_cpu_fraction": cpu / window / cores,
                "machine_cpu_fraction": busy / window / cores,
                "bytes_sent_per_step": max(run["bytes_sent_per_step"] or [0]),
            }
            line = (
                f"  {method:<16} {mean_ms:>8.1f} {entry['relative']:>9.3f} "
                f"{entry['ddp_over'] or float('nan'):>9.3f} {100 * entry['ranks_cpu_fraction']:>8.1f}% "
                f"{100 * entry['machine_cpu_fraction']:>7.1f}%"
            )
            if "compute_s" in run["measured"]:
                compute = [t for per_rank in run["measured"]["compute_s"] for r in per_rank for t in r]
                forward = [t for per_rank in run["measured"]["forward_s"] for r in per_rank for t in r]
                entry["compute_ms"] = 1e3 * statistics.fmean(compute)
                entry["forward_ms"] = 1e3 * statistics.fmean(forward)
                line += f"  compute {entry['compute_ms']:.1f} ms (forward {entry['forward_ms']:.1f})"
            summary[prefix + method] = entry
            print(line)
    print(
        f"\nmean ms: mean over the {ranks} ranks of their mean timed step; rank CPU: the ranks' own CPU "
        f"(all threads) / ({cores} cores x wall); machine: all busy CPU of the machine in the same windows"
    )
    return summary


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--workers-per-node", type=int, default=1)
    parser.add_argument("--bandwidth", default="20mbit", help="tc rate of every link, both ways")
    parser.add_argument("--compute", choices=("real", "emulated"), default="emulated")
    parser.add_argument("--compute-ms", type=float, default=199.0, help="emulated: mean compute per step")
    parser.add_argument("--forward-fraction", type=float, default=0.39, help="emulated: forward's share")
    parser.add_argument("--scenarios", nargs="+", choices=JITTERS, default=list(JITTERS))
    parser.add_argument("--sigma", type=float, default=0.5, help="lognormal: shape (mean unchanged)")
    parser.add_argument("--slow-factor", type=float, default=1.5, help="straggler: rank 0's slowdown")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--methods", nargs="+", default=None, help="default: " + " ".join(METHODS))
    # The MLP 256-256-256-10 (134k parameters, 0.54 MB): its AdamW step takes ~1.3 ms, so 16 ranks'
    # CPU stays well under the waits on 2 cores. At batch 24576 its forward and backward took 199 ms
    # (78 ms forward) on the 2-core VM, and at 20 Mbit/s one exchange takes about as long.
    parser.add_argument("--inputs", type=int, default=256)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--batch", type=int, default=24576, help="real compute: rows per step")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--iters", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--link-check-mb", type=int, default=2)
    parser.add_argument("--run-seconds", type=float, default=540.0, help="deadline of the workers")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    if args.methods is None:
        args.methods = list(METHODS) + (["hierarchical"] if args.workers_per_node > 1 else [])
    ranks = args.nodes * args.workers_per_node
    if ranks > MAX_PROCESSES[args.compute] or args.nodes < 2:
        parser.error(
            f"need 2 <= nodes and ranks <= {MAX_PROCESSES[args.compute]} with {args.compute} compute"
        )
    if "nocomm" not in args.methods:
        parser.error("--methods must include nocomm: every ratio is to its step time")
    for method in args.methods:
        if method not in BASELINES:
            try:
                parse_gossip_method(method)
            except ValueError as err:
                parser.error(str(err))
    try:
        rate_bits(args.bandwidth)
    except ValueError as err:
        parser.error(f"--bandwidth: {err}")
    return args


def main() -> None:
    args = parse_args()
    if not ready_to_emulate():
        return
    ranks = args.nodes * args.workers_per_node
    print(
        f"{args.nodes} nodes x {args.workers_per_node} = {ranks} ranks, {args.compute} compute, "
        f"links {args.bandwidth}"
    )
    with Cluster(args.nodes) as cluster:
        cluster.shape(args.bandwidth)
        link = measure_link(cluster, args.link_check_mb, 29690) if args.link_check_mb else None
        rtt = round_trip_ms(cluster, 29691)
        print(
            f"one TCP stream node1->node0: {link or float('nan'):.1f} Mbit/s; round trip {rtt:.3f} ms",
            flush=True,
        )
        started, busy = time.monotonic(), busy_cpu_seconds()
        runs = run_workers(cluster, 29611, args.run_seconds, args, worker_flags(args), result_keys(args))
        wall, busy = time.monotonic() - started, busy_cpu_seconds() - busy
    if runs is None:
        sys.exit("the workers failed; see the log tail above")
    print(f"({wall:.0f} s; the machine's CPU was {100 * busy / wall / (os.cpu_count() or 1):.0f}% busy)")
    summary = table(runs, args)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        record = {
            "args": vars(args),
            "cores": os.cpu_count(),
            "link_mbit_s": link,
            "round_trip_ms": rtt,
            "wall_s": wall,
            "machine_busy_s": busy,
            "summary": summary,
            "runs": runs,
        }
        Path(args.json).write_text(json.dumps(record, indent=1))
        print(f"results written to {args.json}")


if __name__ == "__main__":
    main()

"""An emulated cluster on one machine: gossip vs DistributedDataParallel vs no communication.

Each node is a Linux network namespace (``dow-n0``, ``dow-n1``, ...) with one veth link to a bridge
that lives in its own namespace (``dow-br``), addresses ``10.213.7.0/24``; nothing touches the root
namespace's network. Every link is shaped with ``tc tbf`` to the same rate in both directions (the
node-side veth shapes what the node sends, the bridge-side veth what it receives), so a node is a
machine on a switch with a full-duplex link of that rate. Workers of the same node talk over the
node's own address, which the kernel routes through loopback: intra-node traffic is not shaped.

For each bandwidth of the sweep the same training runs with: no communication (each rank alone:
the baseline), PyTorch DDP, and ``DecentOptimWrapper`` with each topology. Reported: median
iteration time relative to no communication, and DDP / ring. The workload is an MLP of ~1.6M fp32
parameters (6.3 MB) with a batch of 2048, so that one iteration's compute (~205 ms on a 2-core VM)
is about one model exchange at 250 Mbit/s (203 ms): the targets are judged at the bandwidth where
the two are closest.

Why a large batch and a slow link rather than a small batch and a fast one (same ratio): here the
emulated network is the CPU. Moving one model through veth, bridge and tbf costs the training
processes' own cores a fixed few milliseconds per exchange (copies into and out of the kernel, gloo's
threads), which a real NIC and spare cores would absorb. That cost is fixed per exchange, so the
longer the iteration, the less of it shows; the unshaped row of the table measures it.

Needs root (``sudo uv run benchmarks/cluster.py``); without it, it says so and exits 0. Every run
has a deadline, and namespaces are removed on exit, error or Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PREFIX = "dow-"
BRIDGE_NS = f"{PREFIX}br"
SUBNET = "10.213.7"
WORKER = Path(__file__).with_name("cluster_worker.py")
MAX_PROCESSES = 4
TOPOLOGIES = (
    "ring",
    "ring-module",
    "one-peer-exp",
    "alternating-exp-ring",
)  # -module: DecentralizedDataParallel


def sh(*cmd: str, timeout: float = 20.0) -> str:
    """Run a command (``ip``/``tc``), raise with its stderr if it fails."""
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed: {done.stderr.strip()}")
    return done.stdout


def remove_namespaces() -> None:
    """Delete every namespace this script creates (their veths and qdiscs go with them)."""
    names = [line.split()[0] for line in sh("ip", "netns", "list").splitlines() if line.strip()]
    for name in names:
        if name == BRIDGE_NS or (name.startswith(f"{PREFIX}n") and name[len(PREFIX) + 1 :].isdigit()):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=20)


class Cluster:
    """``nodes`` namespaces on one bridge; a context manager that always removes them."""

    def __init__(self, nodes: int) -> None:
        self.nodes = nodes

    @staticmethod
    def namespace(node: int) -> str:
        return f"{PREFIX}n{node}"

    @staticmethod
    def ifname(node: int) -> str:
        return f"dow{node}"

    @staticmethod
    def address(node: int) -> str:
        return f"{SUBNET}.{node + 1}"

    def __enter__(self) -> Cluster:
        remove_namespaces()  # leftovers of a run that was killed with SIGKILL
        try:
            sh("ip", "netns", "add", BRIDGE_NS)
            sh("ip", "-n", BRIDGE_NS, "link", "add", "dowbr", "type", "bridge")
            sh("ip", "-n", BRIDGE_NS, "link", "set", "dowbr", "up")
            for node in range(self.nodes):
                self._add_node(node)
        except BaseException:
            remove_namespaces()
            raise
        return self

    def _add_node(self, node: int) -> None:
        ns, dev, peer = self.namespace(node), self.ifname(node), f"dow{node}br"
        sh("ip", "netns", "add", ns)
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "-n", ns, "link", "add", dev, "type", "veth", "peer", "name", peer, "netns", BRIDGE_NS)
        sh("ip", "-n", ns, "addr", "add", f"{self.address(node)}/24", "dev", dev)
        sh("ip", "-n", ns, "link", "set", dev, "up")
        sh("ip", "-n", BRIDGE_NS, "link", "set", peer, "master", "dowbr")
        sh("ip", "-n", BRIDGE_NS, "link", "set", peer, "up")

    def __exit__(self, *exc: object) -> None:
        remove_namespaces()

    def shape(self, rate: str | None) -> None:
        """Every link to ``rate`` (a tc rate such as ``1gbit``) both ways; None removes the shaping."""
        for node in range(self.nodes):
            for ns, dev in ((self.namespace(node), self.ifname(node)), (BRIDGE_NS, f"dow{node}br")):
                subprocess.run(
                    ["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"],
                    capture_output=True,
                    timeout=20,
                )
                if rate is not None:
                    burst = max(64 * 1024, rate_bits(rate) // 8 // 250)  # 4 ms at the rate, >= a GSO packet
                    sh(
                        "ip",
                        "netns",
                        "exec",
                        ns,
                        "tc",
                        "qdisc",
                        "add",
                        "dev",
                        dev,
                        "root",
                        "tbf",
                        "rate",
                        rate,
                        "burst",
                        str(burst),
                        "latency",
                        "100ms",
                    )


def rate_bits(rate: str) -> int:
    """``"200mbit"`` -> 200_000_000."""
    units = {"kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "bit": 1}
    for unit, scale in units.items():
        if rate.lower().endswith(unit):
            return int(float(rate[: -len(unit)]) * scale)
    raise ValueError(f"rate {rate!r}: use tc units such as 200mbit or 1gbit")


LINK_RECEIVER = """
import socket, sys, time
server = socket.create_server((sys.argv[1], int(sys.argv[2]))); server.settimeout(20)
conn, _ = server.accept(); total = 0; start = None
while chunk := conn.recv(1 << 20):
    start = start or time.perf_counter(); total += len(chunk)
print(total * 8 / (time.perf_counter() - start) / 1e6)
"""
LINK_SENDER = """
import socket, sys, time
for _ in range(100):
    try: conn = socket.create_connection((sys.argv[1], int(sys.argv[2]))); break
    except OSError: time.sleep(0.05)
conn.sendall(bytes(int(sys.argv[3]))); conn.close()
"""


def measure_link(cluster: Cluster, megabytes: int, port: int) -> float:
    """Mbit/s of one TCP stream from node 1 to node 0 (checks that the shaping works)."""
    addr = cluster.address(0)
    receiver = subprocess.Popen(
        ["ip", "netns", "exec", cluster.namespace(0), sys.executable, "-c", LINK_RECEIVER, addr, str(port)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        sh(
            "ip",
            "netns",
            "exec",
            cluster.namespace(1),
            sys.executable,
            "-c",
            LINK_SENDER,
            addr,
            str(port),
            str(megabytes * 10**6),
            timeout=60,
        )
        out, _ = receiver.communicate(timeout=30)
        return float(out)
    finally:
        if receiver.poll() is None:
            receiver.kill()


def worker_command(cluster: Cluster, rank: int, outdir: Path, args: argparse.Namespace) -> list[str]:
    """``ip netns exec <node> python cluster_worker.py ...`` for ``rank``."""
    options = {
        "--rank": rank,
        "--world-size": args.nodes * args.workers_per_node,
        "--local-world-size": args.workers_per_node,
        "--rounds": args.rounds,
        "--batch": args.batch,
        "--iters": args.iters,
        "--warmup": args.warmup,
        "--out": outdir / f"rank{rank}.json",
    }
    node = cluster.namespace(rank // args.workers_per_node)
    flags = [str(item) for pair in options.items() for item in pair]
    return ["ip", "netns", "exec", node, sys.executable, str(WORKER), *flags, "--methods", *methods(args)]


def start_workers(cluster: Cluster, port: int, outdir: Path, args: argparse.Namespace) -> list:
    """One process per rank, each in its node's namespace, in its own session (killed as a group)."""
    procs = []
    for rank in range(args.nodes * args.workers_per_node):
        env = dict(
            os.environ,
            MASTER_ADDR=cluster.address(0),
            MASTER_PORT=str(port),
            GLOO_SOCKET_IFNAME=cluster.ifname(rank // args.workers_per_node),
            OMP_NUM_THREADS="1",
        )
        with open(outdir / f"rank{rank}.log", "w") as log:  # the child keeps its own descriptor
            cmd = worker_command(cluster, rank, outdir, args)
            procs.append(
                subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            )
    return procs


def stop(procs: list) -> None:
    """Kill the worker sessions this script started (by process group id)."""
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
                os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def run_workers(cluster: Cluster, port: int, seconds: float, args: argparse.Namespace) -> dict | None:
    """All methods, ``--rounds`` times, on every rank; per-method times of all ranks, or None on failure."""
    outdir = Path(tempfile.mkdtemp(prefix=PREFIX))
    procs = start_workers(cluster, port, outdir, args)
    try:
        deadline = time.monotonic() + seconds
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.returncode not in (None, 0) for p in procs):
                break
            time.sleep(0.2)
        failed = [r for r, p in enumerate(procs) if p.poll() != 0]
        if failed:
            status = f"timed out after {seconds:.0f} s" if time.monotonic() >= deadline else "failed"
            tail = (outdir / f"rank{failed[0]}.log").read_text()[-800:]
            print(f"  rank(s) {failed} {status}; rank {failed[0]} log tail:\n{tail}", flush=True)
            return None
        ranks = [json.loads((outdir / f"rank{r}.json").read_text()) for r in range(len(procs))]
    finally:
        stop(procs)
        shutil.rmtree(outdir, ignore_errors=True)
    return {method: summarize(method, ranks) for method in methods(args)}


def summarize(method: str, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Median and mean over all ranks' timed iterations of ``method``, and each round's median."""
    pooled = [t for r in ranks for t in r["times"][method]]
    rounds = len(ranks[0]["round_medians"])
    return {
        "params": ranks[0]["params"],
        "median_s": statistics.median(pooled),
        "mean_s": statistics.fmean(pooled),
        "round_medians_s": [
            statistics.median(r["round_medians"][i][method] for r in ranks) for i in range(rounds)
        ],
    }


def methods(args: argparse.Namespace) -> list[str]:
    return ["nocomm", "ddp", *TOPOLOGIES]


def sweep(cluster: Cluster, args: argparse.Namespace, stop_at: float) -> dict[str, Any]:
    """Every method at every bandwidth, within the overall deadline."""
    results: dict[str, Any] = {}
    for index, bandwidth in enumerate(args.bandwidths):
        port = 29611 + 2 * index  # a fresh port per run: no TIME_WAIT surprises
        left = stop_at - time.monotonic()
        if left < 20:
            print(f"{bandwidth}: skipped, --max-seconds reached", flush=True)
            continue
        cluster.shape(None if bandwidth == "unlimited" else bandwidth)
        link = measure_link(cluster, args.link_check_mb, port + 1) if args.link_check_mb else None
        print(
            f"{bandwidth}: " + (f"one TCP stream node1->node0 measured {link:.0f} Mbit/s" if link else ""),
            flush=True,
        )
        started, load_before = time.monotonic(), os.getloadavg()[0]
        runs = run_workers(cluster, port, min(left, args.run_seconds), args)
        load = (load_before, os.getloadavg()[0])
        results[bandwidth] = {"link_mbit_s": link, "load_average_1min": load, "methods": runs or {}}
        for method, run in (runs or {}).items():
            median, mean = 1e3 * run["median_s"], 1e3 * run["mean_s"]
            per_round = " ".join(f"{1e3 * t:.0f}" for t in run["round_medians_s"])
            print(
                f"  {method:<21} median {median:6.1f} ms  mean {mean:6.1f} ms  rounds {per_round}", flush=True
            )
        print(
            f"  ({time.monotonic() - started:.0f} s; 1-min load average {load[0]:.1f} -> {load[1]:.1f})",
            flush=True,
        )
    return results


def exchange_ms(model_bytes: int, bandwidth: str) -> float | None:
    """Milliseconds to send one model over one link at ``bandwidth`` (None when unlimited)."""
    return None if bandwidth == "unlimited" else 1e3 * model_bytes * 8 / rate_bits(bandwidth)


def report(results: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Print iteration time / no-comm per method and bandwidth, DDP / ring, and the targets."""
    params = next((r["params"] for e in results.values() for r in e["methods"].values() if r), 0)
    model_bytes = 4 * params
    names = methods(args)
    print(
        f"\nmedian iteration time / no-communication median ({args.nodes} nodes x {args.workers_per_node} "
        f"workers, MLP of {params / 1e6:.2f}M params = {model_bytes / 1e6:.1f} MB, batch {args.batch})"
    )
    print(
        f"{'bandwidth':>10} {'exch ms':>8} {'nocomm ms':>9} "
        + " ".join(f"{m:>20}" for m in names[1:])
        + " DDP/ring"
    )
    summary: dict[str, Any] = {}
    for bandwidth, entry in results.items():
        runs = entry["methods"]
        if not runs.get("nocomm"):
            continue
        base = runs["nocomm"]["median_s"]
        rel = {m: runs[m]["median_s"] / base for m in names if runs.get(m)}
        ddp_ring = rel["ddp"] / rel["ring"] if "ddp" in rel and "ring" in rel else None
        exch = exchange_ms(model_bytes, bandwidth)
        summary[bandwidth] = {
            "relative": rel,
            "ddp_over_ring": ddp_ring,
            "exchange_ms": exch,
            "nocomm_ms": 1e3 * base,
        }
        cells = " ".join(f"{rel[m]:>20.3f}" if m in rel else f"{'-':>20}" for m in names[1:])
        exch_cell = f"{exch:>8.1f}" if exch else f"{'-':>8}"
        print(f"{bandwidth:>10} {exch_cell} {1e3 * base:>9.1f} {cells} {ddp_ring or float('nan'):>8.3f}")
    print("exch ms: one model over one link at that rate (bytes x 8 / rate); cells: method / nocomm medians")
    if args.workers_per_node == 1:
        print("with 1 worker per node, alternating-exp-ring has the same schedule as one-peer-exp")
    check_targets(summary)
    return summary


def check_targets(summary: dict[str, Any]) -> None:
    """Targets at the shaped bandwidth where one exchange is closest to one no-comm iteration."""
    shaped = {b: s for b, s in summary.items() if s["exchange_ms"] and "ring" in s["relative"]}
    if not shaped:
        return
    bandwidth = min(shaped, key=lambda b: abs(math.log(shaped[b]["exchange_ms"] / shaped[b]["nocomm_ms"])))
    s = shaped[bandwidth]
    ring, ddp_ring = s["relative"]["ring"], s["ddp_over_ring"]
    print(
        f"targets at {bandwidth} (one exchange {s['exchange_ms']:.0f} ms vs {s['nocomm_ms']:.0f} ms no-comm "
        f"iteration): ring {ring:.3f}x no-comm -> {'met' if ring <= 1.15 else 'NOT met'} (<= 1.15); "
        f"DDP/ring {ddp_ring:.3f} -> {'met' if ddp_ring and ddp_ring >= 1.5 else 'NOT met'} (>= 1.5)"
    )
    module = s["relative"].get("ring-module")
    if module is not None:
        ddp_module = s["relative"]["ddp"] / module
        print(
            f"module front-end at {bandwidth}: ring-module {module:.3f}x no-comm, ring-module / ring "
            f"{module / ring:.3f} -> {'met' if module <= ring else 'NOT met'} (<= 1: at least as fast as the "
            f"optimizer front-end); DDP/ring-module {ddp_module:.3f} -> "
            f"{'met' if ddp_module >= 1.5 else 'NOT met'} (>= 1.5)"
        )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    # 2 processes on this 2-core machine: one core each; 4 processes halve every rank's CPU
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--workers-per-node", type=int, default=1)
    parser.add_argument(
        "--bandwidths",
        nargs="+",
        default=["unlimited", "1gbit", "250mbit", "200mbit"],
        help="tc rates per link, or 'unlimited' (default: unlimited 1gbit 250mbit 200mbit)",
    )
    parser.add_argument(
        "--batch",
        type=int,
        default=2048,
        help="batch per rank; sets the compute per step (2048: ~205 ms on 2 cores, about one 6.3 MB "
        "exchange at 250mbit)",
    )
    parser.add_argument("--iters", type=int, default=15, help="timed iterations per method and round")
    parser.add_argument("--warmup", type=int, default=3, help="untimed iterations before them")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of all methods, interleaved")
    parser.add_argument("--link-check-mb", type=int, default=20, help="MB of the TCP link check; 0 skips it")
    parser.add_argument("--run-seconds", type=float, default=240.0, help="deadline of one bandwidth's run")
    parser.add_argument("--max-seconds", type=float, default=570.0, help="deadline of the whole sweep")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    args = parser.parse_args()
    if args.nodes * args.workers_per_node > MAX_PROCESSES:
        parser.error(f"at most {MAX_PROCESSES} processes in all (the machine has {os.cpu_count()} cores)")
    if args.nodes < 2:
        parser.error("--nodes must be at least 2")
    return args


def main() -> None:
    args = parse_args()
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        print("skipped: needs root for network namespaces (and iproute2's ip and tc)")
        return
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the cleanup in `finally` / __exit__
    stop_at = time.monotonic() + args.max_seconds
    print(
        f"{args.nodes} nodes x {args.workers_per_node} workers = {args.nodes * args.workers_per_node} "
        f"processes on {os.cpu_count()} cores (kept <= {MAX_PROCESSES}: each process has one torch thread "
        "and they share the CPU, so absolute times are those of a loaded machine)",
        flush=True,
    )
    try:
        with Cluster(args.nodes) as cluster:
            results = sweep(cluster, args, stop_at)
    except RuntimeError as err:
        if "netns" in str(err) or "Operation not permitted" in str(err):
            print(f"skipped: needs root for network namespaces ({err})")
            return
        raise
    summary = report(results, args)
    if args.json:
        Path(args.json).write_text(
            json.dumps({"args": vars(args), "results": results, "summary": summary}, indent=2)
        )
        print(f"results written to {args.json}")


if __name__ == "__main__":
    main()

"""An emulated cluster on one machine: gossip vs DistributedDataParallel vs no communication.

Each node is a Linux network namespace (``dow-n0``, ``dow-n1``, ...) with one veth link to a bridge
that lives in its own namespace (``dow-br``), addresses ``10.213.7.0/24``; nothing touches the root
namespace's network. Every link is shaped with ``tc tbf`` to the same rate in both directions (the
node-side veth shapes what the node sends, the bridge-side veth what it receives), so a node is a
machine on a switch with a full-duplex link of that rate. Workers of the same node talk over the
node's own address, which the kernel routes through loopback: intra-node traffic is not shaped.

For each bandwidth of the sweep the same training runs with: no communication (each rank alone:
the baseline), PyTorch DDP, DDP with torch's ``bf16_compress_hook`` (half DDP's bytes), and gossip
methods written ``topology[-module][@compression]``: ``DecentOptimWrapper`` with that topology, or
``DecentralizedDataParallel`` with ``-module``, sending bf16, fp16 or int8 with ``@...`` (``ring``,
``ring@bf16``, ``ring-module@int8``). Reported per method: median iteration time relative to no
communication, DDP / method, ddp-bf16 / method, and bytes sent per step and rank.

The workload is an MLP of ~1.6M fp32 parameters (6.3 MB) with a batch of 2048: one iteration's
compute takes ~205-225 ms on a 2-core VM, one fp32 model exchange takes 203 ms at 250 Mbit/s and
254 ms at 200 Mbit/s, the slower link of the default sweep, where one exchange is ~1.2x the compute.
The targets of uncompressed gossip are judged at the bandwidth where exchange and compute are
closest to equal, those of compressed gossip where the exchange is closest to 1.2x the compute: by
default both at 200mbit (add 250mbit to ``--bandwidths`` to judge the former at their own ratio).

Why a large batch and a slow link rather than a small batch and a fast one (same ratio): here the
emulated network is the CPU. Moving one model through veth, bridge and tbf costs the training
processes' own cores a fixed few milliseconds per exchange (copies into and out of the kernel, gloo's
threads), which a real NIC and spare cores would absorb. That cost is fixed per exchange, so the
longer the iteration, the less of it shows; the ``unlimited`` (unshaped) run measures it.

Needs root (``sudo uv run benchmarks/cluster_speed/cluster.py``); without it, it says so and exits 0.
Every run has a deadline (a run that hits it keeps the rounds every rank finished), and namespaces are
removed on exit, error or Ctrl-C. The default run, ten methods at two bandwidths, takes about 6-7 minutes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
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

MAX_PROCESSES = 4
DEFAULT_METHODS = (
    "nocomm",
    "ddp",
    "ddp-bf16",
    "ring",
    "ring@bf16",
    "ring@int8",
    "ring-module",
    "ring-module@bf16",
    "one-peer-exp",
    "one-peer-exp@bf16",
)
#: Exchange / compute at which each group of targets is defined (see check_targets).
UNCOMPRESSED_TARGET_RATIO = 1.0
COMPRESSED_TARGET_RATIO = 1.2


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
            f"{bandwidth}: "
            + (f"one TCP stream node1->node0 measured {link:.0f} Mbit/s" if link else "(link check skipped)"),
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
    """Per bandwidth and method: time / no-comm, DDP / it, ddp-bf16 / it, and bytes sent per step."""
    params = next((r["params"] for e in results.values() for r in e["methods"].values() if r), 0)
    model_bytes = 4 * params
    print(
        f"\nmedian iteration times ({args.nodes} nodes x {args.workers_per_node} workers, MLP of "
        f"{params / 1e6:.2f}M params = {model_bytes / 1e6:.1f} MB, batch {args.batch})"
    )
    summary: dict[str, Any] = {}
    uncounted = False
    for bandwidth, entry in results.items():
        runs = entry["methods"]
        if not runs.get("nocomm"):
            continue
        base = runs["nocomm"]["median_s"]
        rel = {m: runs[m]["median_s"] / base for m in args.methods if runs.get(m)}
        sent = {m: busiest(runs[m]["bytes_sent_per_step"]) for m in rel}
        exch = exchange_ms(model_bytes, bandwidth)
        ddp_over, bf16_over = speedups("ddp", rel), speedups("ddp-bf16", rel)
        summary[bandwidth] = {
            "relative": rel,
            "ddp_over": ddp_over,
            "ddp_bf16_over": bf16_over,
            "ddp_over_ring": ddp_over.get("ring"),
            "bytes_sent_per_step": sent,
            "exchange_ms": exch,
            "nocomm_ms": 1e3 * base,
        }
        link = f"one fp32 model over one link {exch:.0f} ms" if exch else "link unshaped"
        print(f"{bandwidth}: {link}; no-comm iteration {1e3 * base:.1f} ms")
        columns = ("/ nocomm", 8), ("DDP / it", 9), ("ddp-bf16 / it", 14), ("MB sent/step/rank", 18)
        print(f"  {'method':<21} " + " ".join(f"{name:>{width}}" for name, width in columns))
        for m in rel:
            uncounted |= sent[m] is None
            print(
                f"  {m:<21} {rel[m]:>8.3f} {cell(ddp_over.get(m), 9)} {cell(bf16_over.get(m), 14)} "
                f"{cell(None if sent[m] is None else sent[m] / 1e6, 18)}"
            )
    print(
        "/ nocomm: median step time over no communication's; DDP / it, ddp-bf16 / it: how many times "
        "faster than\nDDP and ddp-bf16; MB sent: the busiest rank's bytes per step (DDP methods: a ring "
        "all-reduce's 2(n-1)/n\ngradients; gossip: the engine's bytes_sent_per_step())"
    )
    if uncounted:
        print("MB sent '-': this library's engine has no bytes_sent_per_step()")
    if args.workers_per_node == 1 and {"one-peer-exp", "alternating-exp-ring"} <= set(args.methods):
        print("with 1 worker per node, alternating-exp-ring has the same schedule as one-peer-exp")
    return summary


def speedups(reference: str, rel: dict[str, float]) -> dict[str, float]:
    """``reference``'s step time / each method's (> 1: faster than ``reference``); {} if not measured."""
    return {m: rel[reference] / r for m, r in rel.items()} if reference in rel else {}


def busiest(per_rank: list[float | None]) -> float | None:
    """The largest of the ranks' byte counts (the rank that sets the pace), None if any is missing."""
    return None if None in per_rank else max(per_rank)


def cell(value: float | None, width: int) -> str:
    return f"{value:>{width}.3f}" if value is not None else f"{'-':>{width}}"


def closest_bandwidth(summary: dict[str, Any], method: str, ratio: float) -> str | None:
    """The shaped bandwidth that measured ``method`` with exchange / compute nearest ``ratio``."""
    shaped = [b for b, s in summary.items() if s["exchange_ms"] and method in s["relative"]]
    return min(shaped, key=lambda b: abs(math.log(exchange_over_compute(summary[b]) / ratio)), default=None)


def exchange_over_compute(entry: dict[str, Any]) -> float:
    return entry["exchange_ms"] / entry["nocomm_ms"]


def check_targets(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """The targets, each group at the shaped bandwidth whose exchange / compute is closest to its own.

    Uncompressed gossip's targets are defined where one exchange takes one iteration's compute,
    compressed gossip's where it takes 1.2x (200 Mbit/s for this workload).
    """
    verdicts: list[dict[str, Any]] = []
    bandwidth = closest_bandwidth(summary, "ring", UNCOMPRESSED_TARGET_RATIO)
    if bandwidth is not None:
        s = summary[bandwidth]
        ring, module = s["relative"]["ring"], s["relative"].get("ring-module")
        print(targets_header("uncompressed gossip", bandwidth, s, UNCOMPRESSED_TARGET_RATIO))
        for name, value, bound, at_most in (
            ("ring / nocomm", ring, 1.15, True),
            ("DDP / ring", s["ddp_over"].get("ring"), 1.5, False),
            (
                "ring-module / ring (module front-end at least as fast)",
                None if module is None else module / ring,
                1.0,
                True,
            ),
            ("DDP / ring-module", s["ddp_over"].get("ring-module"), 1.5, False),
        ):
            verdicts.append(judge(bandwidth, name, value, bound, at_most))
    bandwidth = closest_bandwidth(summary, "ring@bf16", COMPRESSED_TARGET_RATIO)
    if bandwidth is not None:
        s = summary[bandwidth]
        print(targets_header("compressed gossip", bandwidth, s, COMPRESSED_TARGET_RATIO))
        for name, value, bound, at_most in (
            ("ring@bf16 / nocomm", s["relative"]["ring@bf16"], 1.12, True),
            ("DDP / ring@bf16", s["ddp_over"].get("ring@bf16"), 2.0, False),
            ("ddp-bf16 / ring@bf16", s["ddp_bf16_over"].get("ring@bf16"), 1.5, False),
        ):
            verdicts.append(judge(bandwidth, name, value, bound, at_most))
        for m, rel in s["relative"].items():
            if "@" in m and m != "ring@bf16":
                print(
                    f"  reported: {m} {rel:.3f}x no-comm, DDP / it {cell(s['ddp_over'].get(m), 0)}, "
                    f"ddp-bf16 / it {cell(s['ddp_bf16_over'].get(m), 0)}"
                )
    return verdicts


def targets_header(group: str, bandwidth: str, entry: dict[str, Any], ratio: float) -> str:
    """Where a group of targets is judged, and a better bandwidth if this one is off its definition."""
    actual = exchange_over_compute(entry)
    header = (
        f"targets of {group} at {bandwidth} (one exchange {entry['exchange_ms']:.0f} ms = {actual:.2f}x the "
        f"{entry['nocomm_ms']:.0f} ms no-comm iteration; defined at {ratio:.1f}x)"
    )
    if abs(math.log(actual / ratio)) > math.log(1.1):
        # The exchange time scales as 1 / rate: this rate makes exchange / compute = ratio.
        suggested = round(rate_bits(bandwidth) * actual / ratio / 1e7) * 10
        header += (
            f"\n  off by more than 10%: add {suggested}mbit to --bandwidths to judge them at their ratio"
        )
    return header


def judge(bandwidth: str, name: str, value: float | None, bound: float, at_most: bool) -> dict[str, Any]:
    """Print and return one target's verdict (met is None when a method it needs was not run)."""
    sign = "<=" if at_most else ">="
    met = None if value is None else (value <= bound if at_most else value >= bound)
    verdict = "not measured" if value is None else f"{value:.3f} -> {'met' if met else 'MISSED'}"
    print(f"  {name}: {verdict} ({sign} {bound})")
    return {"target": name, "bandwidth": bandwidth, "value": value, "bound": f"{sign} {bound}", "met": met}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    # 2 processes on this 2-core machine: one core each; 4 processes halve every rank's CPU
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--workers-per-node", type=int, default=1)
    parser.add_argument(
        "--bandwidths",
        nargs="+",
        default=["unlimited", "200mbit"],
        help="tc rates per link, or 'unlimited' (default: unlimited 200mbit). 200mbit: one 6.3 MB "
        "exchange is ~1.2x one iteration's compute (compressed gossip's targets); 250mbit: about 1x "
        "(uncompressed gossip's); 1gbit: a fast link. Each bandwidth takes ~3-4 minutes with the "
        "default methods: raise --max-seconds for more than two",
    )
    parser.add_argument(
        "--methods",
        nargs="+",
        default=list(DEFAULT_METHODS),
        help="nocomm (required: the baseline), ddp, ddp-bf16 (DDP with torch's bf16_compress_hook), and "
        "gossip methods topology[-module][@bf16|fp16|int8] (default: " + " ".join(DEFAULT_METHODS) + ")",
    )
    parser.add_argument(
        "--batch",
        type=int,
        default=2048,
        help="batch per rank; sets the compute per step (2048: ~205-225 ms on 2 cores, about one 6.3 MB "
        "exchange at 250mbit, 1/1.2 of one at 200mbit)",
    )
    parser.add_argument("--iters", type=int, default=15, help="timed iterations per method and round")
    parser.add_argument("--warmup", type=int, default=3, help="untimed iterations before them")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of all methods, interleaved")
    parser.add_argument("--link-check-mb", type=int, default=20, help="MB of the TCP link check; 0 skips it")
    # The default methods take ~3.5 minutes at 200mbit (10 methods x 18 steps x 3 rounds, ~0.3 s a
    # step on average, plus building and averaging each model); the deadlines leave twice that.
    parser.add_argument(
        "--run-seconds",
        type=float,
        default=420.0,
        help="deadline of one bandwidth's run; at it the rounds every rank finished are kept",
    )
    parser.add_argument("--max-seconds", type=float, default=900.0, help="deadline of the whole sweep")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    args = parser.parse_args()
    if args.nodes * args.workers_per_node > MAX_PROCESSES:
        parser.error(f"at most {MAX_PROCESSES} processes in all (the machine has {os.cpu_count()} cores)")
    if args.nodes < 2:
        parser.error("--nodes must be at least 2")
    if min(args.rounds, args.iters) < 1 or args.warmup < 0:
        parser.error("--rounds and --iters must be at least 1, --warmup at least 0")
    if "nocomm" not in args.methods:
        parser.error("--methods must include nocomm: every ratio is to its step time")
    if len(set(args.methods)) != len(args.methods):
        parser.error(f"--methods names a method twice: {' '.join(args.methods)}")
    for method in args.methods:
        if method not in BASELINES:
            try:
                parse_gossip_method(method)
            except ValueError as err:
                parser.error(str(err))
    for bandwidth in args.bandwidths:
        if bandwidth != "unlimited":
            try:
                rate_bits(bandwidth)
            except ValueError as err:
                parser.error(f"--bandwidths: {err}")
    return args


def main() -> None:
    args = parse_args()
    if not ready_to_emulate():
        return
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
    targets = check_targets(summary)
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"args": vars(args), "results": results, "summary": summary, "targets": targets}, indent=2
            )
        )
        print(f"results written to {args.json}")


if __name__ == "__main__":
    main()

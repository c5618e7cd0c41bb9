"""Low-communication gossip on an emulated slow link: a step time against DDP and periodic averaging.

    sudo uv run --group bench benchmarks/low_communication/low_comm_cluster.py [--json PATH]  # 9 min, 2 cores

Two nodes (network namespaces on a bridge, ``emulated_cluster.py``'s ``Cluster``), one worker each. The link
is shaped so that one uncompressed model exchange takes ``--exchange-steps`` (8) times one step's
compute, measured first in this process (an MLP 512-1024-1024-10, 1.59M fp32 parameters, batch
512, AdamW, one thread): per-step methods cannot hide such an exchange, and ``sync_every=8`` is
where an uncompressed exchange just fits behind the inner steps. Methods, side by side in every
round (order rotated): ``nocomm``; ``ddp``; ``ddp-bf16`` (torch's ``bf16_compress_hook``);
``avg~h8`` (torch's ``PostLocalSGDOptimizer`` + ``PeriodicModelAverager``: an all-reduce of the
parameters every 8 steps); per-step gossip ``ring``; and low-communication gossip ``ring~h8n``
(DiLoCo's outer optimizer, the exchange a whole round behind), ``ring~h8n@bf16``, ``ring~h8nd0``
(blocking) and ``ring~h32n``. Reported: mean step time (a round's exchange lands on one step in
``H``: the mean counts it, a median would hide it) relative to ``nocomm``, how many times faster
than DDP, and bytes sent per step and rank (the engine's count; DDP: a ring all-reduce's).

With the ``bench`` dependency group (``uv run --group bench ...``), torchft's ``DiLoCo`` as the
external peer, same model, inner and outer optimizers, one replica group per node and a lighthouse
on node 0: ``torchft~h8`` (blocking, as DiLoCo) and ``torchft~h8d7`` (``fragment_sync_delay=7``, its
exchange overlapped with the next 7 inner steps). Without torchft installed those two are skipped.

Targets at ``sync_every=8`` (judged on ``ring~h8n@bf16``, and reported for ``ring~h8n``): at most
1.10x the no-communication step time, at least 5x faster than DDP, and faster than ``avg~h8`` and
torchft's DiLoCo.

Needs root (network namespaces); without it, it says so and exits 0. Hold the shared lock
(``flock /tmp/dow-heavy.lock ...``): the cluster's namespaces are removed at start and exit.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks.harness.common import build_mlp
from benchmarks.harness.emulated_cluster import (
    Cluster,
    measure_link,
    node_env,
    ready_to_emulate,
    start_in_node,
    stop,
    summarize,
)

WORKER = Path(__file__).with_name("low_comm_cluster_worker.py")
METHODS = [
    "nocomm",
    "ddp",
    "ddp-bf16",
    "avg~h8",
    "ring",
    "ring~h8n",
    "ring~h8n@bf16",
    "ring~h8nd0",
    "ring~h32n",
    "torchft~h8",
    "torchft~h8d7",
]
JUDGED = ("ring~h8n@bf16", "ring~h8n")
TARGET_VS_NOCOMM, TARGET_VS_DDP = 1.10, 5.0


def compute_seconds(args: argparse.Namespace, steps: int = 30) -> tuple[float, int]:
    """Median seconds of one training step (forward, backward, AdamW) here, and the model's bytes."""
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)  # as the workers do
    torch.manual_seed(0)
    model = build_mlp(args.inputs, args.width, args.depth, 10)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(args.batch, args.inputs), torch.randint(0, 10, (args.batch,))
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2], sum(p.numel() * p.element_size() for p in model.parameters())


def start_workers(cluster: Cluster, port: int, outdir: Path, args: argparse.Namespace) -> list[Any]:
    """One worker per node, in its namespace and its own session (``stop`` kills the session)."""
    procs = []
    for rank in range(args.nodes):
        flags = {
            "--rank": rank,
            "--world-size": args.nodes,
            "--rounds": args.rounds,
            "--batch": args.batch,
            "--iters": args.iters,
            "--warmup": args.warmup,
            "--out": outdir / f"rank{rank}.json",
        }
        argv = [
            str(WORKER),
            *[str(item) for pair in flags.items() for item in pair],
            "--methods",
            *args.methods,
        ]
        procs.append(
            start_in_node(cluster, rank, argv, node_env(cluster, rank, port), outdir / f"rank{rank}.log")
        )
    return procs


def run(cluster: Cluster, args: argparse.Namespace) -> dict[str, Any] | None:
    """Every method on every rank, within ``--max-seconds``; per method the summary over all ranks."""
    outdir = Path(tempfile.mkdtemp(prefix="dow-lc-"))
    procs = start_workers(cluster, 29671, outdir, args)
    try:
        deadline = time.monotonic() + args.max_seconds
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.returncode not in (None, 0) for p in procs):
                break
            time.sleep(0.5)
        stop(procs)
        written = [outdir / f"rank{r}.json" for r in range(len(procs))]
        if not all(path.exists() for path in written):
            print(
                "workers failed or timed out; rank 0 log tail:\n" + (outdir / "rank0.log").read_text()[-1500:]
            )
            return None
        ranks = [json.loads(path.read_text()) for path in written]
    finally:
        stop(procs)
        shutil.rmtree(outdir, ignore_errors=True)
    rounds = min(len(r["round_medians"]) for r in ranks)
    return {m: summarize(m, ranks, rounds, args.iters) for m in args.methods}


def report(
    runs: dict[str, Any], step_s: float, exchange_s: float, rate: str, link: float | None
) -> dict[str, Any]:
    base = runs["nocomm"]["mean_s"]
    rel = {m: r["mean_s"] / base for m, r in runs.items()}
    print(
        f"\n2 nodes x 1 worker, link {rate} (measured {link or float('nan'):.0f} Mbit/s): one fp32 model "
        f"exchange {1e3 * exchange_s:.0f} ms = {exchange_s / step_s:.1f}x one step's compute "
        f"({1e3 * step_s:.0f} ms calibrated; no-comm step in the run {1e3 * base:.0f} ms)"
    )
    print(f"  {'method':<16} {'mean ms':>8} {'/ nocomm':>9} {'DDP / it':>9} {'MB sent/step/rank':>18}")
    for m, r in runs.items():
        sent = max(r["bytes_sent_per_step"]) if None not in r["bytes_sent_per_step"] else float("nan")
        ddp = rel["ddp"] / rel[m] if "ddp" in rel else float("nan")
        print(f"  {m:<16} {1e3 * r['mean_s']:>8.1f} {rel[m]:>9.3f} {ddp:>9.2f} {sent / 1e6:>18.3f}")
    verdicts = []
    for m in JUDGED:
        if m not in rel:
            continue
        checks = [
            (f"<= {TARGET_VS_NOCOMM}x no-comm", rel[m] <= TARGET_VS_NOCOMM),
            (f">= {TARGET_VS_DDP}x faster than DDP", "ddp" in rel and rel["ddp"] / rel[m] >= TARGET_VS_DDP),
            ("faster than avg~h8", "avg~h8" in rel and rel[m] < rel["avg~h8"]),
            *[
                (f"faster than {peer}", rel[m] < rel[peer])
                for peer in ("torchft~h8", "torchft~h8d7")
                if peer in rel
            ],
        ]
        for name, met in checks:
            verdicts.append({"method": m, "target": name, "met": met})
            print(f"  target {m}: {name}: {'met' if met else 'MISSED'}")
    return {"relative": rel, "verdicts": verdicts}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--methods", nargs="+", default=METHODS)
    parser.add_argument("--exchange-steps", type=float, default=8.0, help="one exchange / one step's compute")
    parser.add_argument("--rate", default=None, help="a tc rate (e.g. 100mbit) instead of calibrating")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--inputs", type=int, default=512)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=32)
    parser.add_argument("--iters", type=int, default=64)
    parser.add_argument("--max-seconds", type=float, default=900)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if "nocomm" not in args.methods:
        args.methods = ["nocomm", *args.methods]
    if importlib.util.find_spec("torchft") is None:
        skipped = [m for m in args.methods if m.startswith("torchft")]
        if skipped:
            print(f"torchft is not installed (uv run --group bench ...): skipping {', '.join(skipped)}")
        args.methods = [m for m in args.methods if not m.startswith("torchft")]
    return args


def main() -> None:
    args = parse_args()
    if not ready_to_emulate():
        return
    step_s, model_bytes = compute_seconds(args)
    rate = args.rate or f"{int(model_bytes * 8 / (args.exchange_steps * step_s)) // 1000}kbit"
    with Cluster(args.nodes) as cluster:
        cluster.shape(rate)
        link = measure_link(cluster, 5, 29669)
        exchange_s = model_bytes * 8 / (link * 1e6)  # over the link as measured
        runs = run(cluster, args)
    if runs is None:
        sys.exit(1)
    summary = report(runs, step_s, exchange_s, rate, link)
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"rate": rate, "step_s": step_s, "exchange_s": exchange_s, "runs": runs, **summary}, indent=1
            )
        )


if __name__ == "__main__":
    main()

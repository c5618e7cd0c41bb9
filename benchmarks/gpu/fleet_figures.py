"""GPU fleets on one GPU: host-staged gossip, the Adam rule's step, the sparse codecs, the planner.

Every figure is a ratio of numbers measured side by side in this run, on this GPU:

(a) **Host staging per step.** 2 to 4 processes share the GPU, gloo between them (each a node of
    its own), each training a GPT-2-style byte-level transformer (``--widths``/``--depths``: about
    85M and 300M parameters) with AdamW. Per process and step, interleaved (the order rotates
    every step): no communication (the bare AdamW), staged per-step gossip on a ring with the
    default ``second_moment="average"`` and with ``"local"`` (target: ``average`` at most 1.03x
    ``local``), and ``sync_every=8``. The staged bytes per step are set against the pinned-copy rate
    measured here (``torch`` copies between a pinned host buffer and the GPU, each way).
(b) **The Adam rule's step** (one process) against torch's fused and foreach AdamW on the same
    parameters and gradients, at ``--step-params`` (124M and 1B). Target: at most 1.3x fused.
(c) **The sparse codecs** at ``--codec-params`` (1B): encode and decode seconds and bytes per second
    on the GPU, and their share of a step of (a)'s model scaled to that size.
(d) **The planner**, given this run's measured compute, copy rate and loopback all-reduce rate,
    predicts (a)'s staged step times (target: within 15%), then answers the slow-link case on paper:
    a 1B-parameter model on 16 nodes joined by 100 Mbit/s (throughput against no communication,
    bytes per node and step).

Run on a GPU (about 8 minutes on an H200): ``uv run benchmarks/gpu/fleet_figures.py --json
benchmarks/results/gpu/fleet_figures.json``. ``--smoke`` runs every part on the CPU at toy sizes with
staging forced (a check that the script works, not a measurement; ``tests/test_gpu_figures_script.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.harness.common import collect_from_ranks
from benchmarks.harness.interleaved import interleave, median_seconds, ratio, rule_against_torch, timed_on
from benchmarks.harness.lm_task import CONTEXT, VOCAB, TinyGPT
from benchmarks.harness.question_args import add_defaults
from benchmarks.harness.report import titled_table
from decent_optim_wrapper import DecentOptimWrapper
from decent_optim_wrapper.engine.wire.compression import codec, parse_compression, round_seed
from decent_optim_wrapper.plan import (
    ComputeTimes,
    HostCopy,
    Link,
    Network,
    bytes_per_parameter,
    gossip_scheme,
    simulate,
)
from decent_optim_wrapper.topo import TopologyFactory

GIB = 2**30
METHODS = {
    "nocomm": None,
    "ring": {},
    "ring-local": {"second_moment": "local"},
    "ring~h8": {"sync_every": 8},
}


def device_of(args: argparse.Namespace) -> torch.device:
    return torch.device("cpu") if args.smoke else torch.device("cuda", 0)


# -- (a) host staging per step -----------------------------------------------------------------------
def pinned_copy_rate(numel: int, device: torch.device, repeats: int = 5) -> dict[str, float]:
    """Bytes per second of copies between a pinned host buffer and ``device``, each way (medians)."""
    on_device = torch.empty(numel, device=device)
    host = torch.empty(numel, pin_memory=device.type == "cuda")
    out = median_seconds(lambda: host.copy_(on_device, non_blocking=True), device, repeats)
    back = median_seconds(lambda: on_device.copy_(host, non_blocking=True), device, repeats)
    return {"to_host_bytes_s": numel * 4 / out, "to_device_bytes_s": numel * 4 / back}


def gloo_rank(rank: int, port: int, world: int, results: Any, measure: Any, *extra: Any) -> None:
    """One of the processes sharing the GPU: ``measure(rank, world, *extra)`` in a gloo group."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        results.put((rank, measure(rank, world, *extra)))
    finally:
        dist.destroy_process_group()


def on_gloo_ranks(args: argparse.Namespace, measure: Any, *extra: Any) -> dict[int, Any]:
    """``measure``'s result on each of ``args.world`` processes, by rank."""
    name = measure.__name__.replace("_", " ")
    run = lambda rank, port, out: (rank, port, args.world, out, measure, *extra)  # noqa: E731
    return collect_from_ranks(args.world, gloo_rank, run, args.max_seconds, name)


def staged_training(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    """(a)'s runs of every model on this process."""
    pairs = zip(args.widths, args.depths, strict=True)
    return {f"{w}x{d}": staging_run(rank, w, d, args, device_of(args)) for w, d in pairs}


def staging_run(rank: int, width: int, depth: int, args: argparse.Namespace, device: torch.device) -> dict:
    runs = {}
    for name, options in METHODS.items():
        torch.manual_seed(0)
        model = TinyGPT(width=width, depth=depth, heads=max(1, width // 64)).to(device)
        adamw = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
        front = adamw
        if options is not None:
            front = DecentOptimWrapper(
                adamw, topology="ring", host_staging=True if args.smoke else None, **options
            )
            assert front.engine.host_staging
        runs[name] = (model, front)
    g = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, VOCAB, (args.batch, CONTEXT + 1), generator=g).to(device)

    def step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        optimizer.zero_grad()
        logits = model(tokens[:, :-1])
        nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)).backward()
        optimizer.step()

    steps = {name: lambda _, run=run: step(*run) for name, run in runs.items()}
    times = interleave(steps, args.iters, args.warmup, partial(timed_on, device))
    params = sum(p.numel() for p in runs["nocomm"][0].parameters())
    ring = runs["ring"][1]
    assert isinstance(ring, DecentOptimWrapper)
    # staged: the fp32 sum buffer out and back per step
    sizes = {"params": params, "staged_bytes_per_step": 2 * params * 4}
    ratios = {name: ratio(times, name, "nocomm") for name in METHODS}
    sent = {"sent_bytes_per_step": ring.engine.bytes_sent_per_step()}
    return sizes | sent | ratios | {"average_vs_local": ratio(times, "ring", "ring-local")}


def loopback_all_reduce(rank: int, world: int, numel: int) -> float:
    """The seconds gloo takes to all-reduce ``numel`` floats of host memory between these processes
    (the planner's link): the median of 3 after a first."""
    buffer, seconds = torch.ones(numel), []
    for _ in range(4):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(buffer)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds[1:])


# -- (b) the Adam rule's step --------------------------------------------------------------------------
def adam_steps(args: argparse.Namespace) -> dict[str, Any]:
    device = device_of(args)
    out: dict[str, Any] = {}
    for total in args.step_params:
        chunk = min(total, 50_000_000)  # tensors of a model's layer size, not one giant tensor
        sizes = [chunk] * (total // chunk) + ([total % chunk] if total % chunk else [])
        per_impl = {}
        for impl, flags in (("foreach", {"foreach": True}), ("fused", {"fused": device.type == "cuda"})):
            torch.manual_seed(0)
            params = [torch.randn(n, device=device).requires_grad_() for n in sizes]
            for p in params:
                p.grad = torch.randn_like(p)
            times = rule_against_torch(params, flags, args.warmup, args.iters, partial(timed_on, device))
            per_impl[impl] = {
                "torch_ms": statistics.median(times["torch"]) * 1e3,
                **ratio(times, "rule", "torch"),
            }
            del params
        out[str(total)] = per_impl
    return out


# -- (c) the sparse codecs -----------------------------------------------------------------------------
def codec_throughput(args: argparse.Namespace) -> dict[str, Any]:
    device = device_of(args)
    numel = args.codec_params
    values = torch.randn(numel, device=device)
    out = {}
    for name in args.codecs:
        coder = codec(parse_compression(name).name)
        payload = torch.empty(coder.payload_bytes(numel, torch.float32), dtype=torch.uint8, device=device)
        decoded = torch.empty_like(values)
        seed = round_seed(1, 0)
        enc = median_seconds(partial(coder.encode, values, payload, seed), device, args.iters)
        dec = median_seconds(partial(coder.decode_into, payload, decoded, seed), device, args.iters)
        seconds = {"encode_s": enc, "decode_s": dec, "payload_bytes": payload.numel()}
        out[name] = seconds | {"encode_values_per_s": numel / enc, "decode_values_per_s": numel / dec}
    return out


# -- (d) the planner -----------------------------------------------------------------------------------
def planned(results: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The planner's step times for (a)'s staged runs from this run's measured rates, and the slow-link
    case on paper."""
    copy = HostCopy(min(results["copy_rate"]["to_host_bytes_s"], results["copy_rate"]["to_device_bytes_s"]))
    world = args.world
    out: dict[str, Any] = {"runs": {}}
    for key, run in results["staging"][0].items():
        numel = run["params"]
        # The processes share one host: a ring all-reduce among them moved at the measured rate.
        sent = 2 * (world - 1) / world * numel * 4
        link = Link(8 * sent / results["loopback_allreduce_s"])
        network = Network(link)
        compute = ComputeTimes(run["nocomm"]["ms"] / 1e3)
        topology = TopologyFactory.create("ring", world)
        predictions = {}
        for name, every in (("ring", 1), ("ring~h8", 8)):
            scheme = gossip_scheme(topology, numel, network, sync_every=every, host_copy=copy)
            predicted = simulate(scheme, compute, 40).iteration_s(10)
            measured = run[name]["ms"] / 1e3
            predictions[name] = {"predicted_ms": predicted * 1e3, "measured_ms": measured * 1e3}
            predictions[name]["error"] = predicted / measured - 1
        out["runs"][key] = predictions
    # On paper: a 1B-parameter model, 16 nodes, 100 Mbit/s, a second of compute per step.
    numel, compute = 1_000_000_000, ComputeTimes(1.0)
    network = Network(Link(100e6))
    topology = TopologyFactory.create("ring", 16)
    paper = {}
    for wire, every in ((None, 8), ("int8", 8), ("topk:0.01:int4", 8), ("topk:0.01:int4", 32)):
        compression = None if wire is None else parse_compression(wire)
        scheme = gossip_scheme(topology, numel, network, compression, sync_every=every, host_copy=copy)
        step_s = simulate(scheme, compute, max(40, 10 + 8 * every)).iteration_s(10)
        label = f"ring~h{every}" + (f"@{wire}" if wire else "")
        paper[label] = {
            "throughput_vs_nocomm": 1.0 / step_s,
            "bytes_per_node_step": bytes_per_parameter(topology, compression) * numel / every,
        }
    out["slow_link_1b_16_nodes_100mbit"] = paper
    return out


# -- the run -------------------------------------------------------------------------------------------
def report(results: dict[str, Any], args: argparse.Namespace) -> None:
    """The four parts' tables (rank 0's staging runs), each figure beside its target."""
    rate, paper = results["copy_rate"], results["planned"]["slow_link_1b_16_nodes_100mbit"]
    staging, adam = [], []
    for key, run in results["staging"][0].items():
        staged_s = run["staged_bytes_per_step"] / min(rate.values())
        for name in ("nocomm", "ring", "ring-local", "ring~h8", "average_vs_local"):
            staging.append([key, f"{run['params'] / 1e6:.1f}M", name, run[name]["ms"], run[name]["vs"]])
            staging[-1].append(run[name]["median_paired_ratio"])
        note = f"staged copies {run['staged_bytes_per_step'] / 1e6:.0f} MB/step: {1e3 * staged_s:.1f} ms"
        staging.append([key, "", note, None, "ring", f"{staged_s / (run['ring']['ms'] / 1e3):.1%}"])
    for total, per_impl in results["adam"].items():
        adam += [[f"{int(total) / 1e6:.0f}M", impl, r["torch_ms"], r["ms"], r["median_paired_ratio"]]
                 for impl, r in per_impl.items()]  # fmt: skip
    codecs = [[name, 1e3 * r["encode_s"], r["encode_values_per_s"], 1e3 * r["decode_s"]]
              for name, r in results["codecs"].items()]  # fmt: skip
    codecs = [[*row, results["codecs"][row[0]]["decode_values_per_s"]] for row in codecs]
    planned = [[key, name, p["predicted_ms"], p["measured_ms"], f"{p['error']:+.1%}"]
               for key, runs in results["planned"]["runs"].items() for name, p in runs.items()]  # fmt: skip
    on_paper = [[run, p["throughput_vs_nocomm"], p["bytes_per_node_step"] / 1e6] for run, p in paper.items()]
    to_host, to_device = (rate[f"to_{way}_bytes_s"] / 1e9 for way in ("host", "device"))
    print("\n\n".join([
        f"torch {torch.__version__}, {results['device']}, {args.world} processes sharing it; pinned "
        f"copies: to host {to_host:.1f} GB/s, to the device {to_device:.1f} GB/s; gloo all-reduce between "
        f"the processes {1e3 * results['loopback_allreduce_s']:.1f} ms for the first model",
        titled_table("(a) step time against no communication (rank 0, median paired ratios; target: "
                     "average_vs_local at most 1.03; the staged copies at the pinned rate, their share of a "
                     "staged step)", ["model", "parameters", "run", "ms", "against", "ratio"], staging),
        titled_table("(b) the Adam rule's step against torch's AdamW (one process; target 1.3 against fused)",
                     ["parameters", "torch", "torch ms", "rule ms", "ratio"], adam),
        titled_table(f"(c) codecs at {args.codec_params / 1e6:.0f}M values", ["codec", "encode ms",
                     "encode values/s", "decode ms", "decode values/s"], codecs, ".3g"),
        titled_table("(d) the planner (target: within 15%)",
                     ["model", "run", "predicted ms", "measured ms", "error"], planned, ".1f"),
        titled_table("on paper: 1B parameters, 16 nodes, 100 Mbit/s, 1 s of compute per step",
                     ["run", "throughput vs no communication", "MB per node and step"], on_paper),
    ]), flush=True)  # fmt: skip


#: The options (``--world``: processes sharing the GPU, 2 to 4) and, with ``--smoke``, the toy sizes.
OPTIONS = dict(world=3, widths=[768, 1024], depths=[12, 24], batch=8, iters=12, warmup=3, smoke=False)
OPTIONS |= dict(step_params=[124_000_000, 1_000_000_000], codec_params=1_000_000_000, max_seconds=420.0)
OPTIONS |= dict(codecs=["int8", "topk:0.01:int4", "randk:0.01:int4"])
SMOKE = dict(widths=[32], depths=[1], batch=2, iters=2, warmup=1, step_params=[100_000], codec_params=100_000)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_defaults(parser, OPTIONS)
    parser.add_argument("--json", default=None, help="write the results to this file")
    args = parser.parse_args(argv)
    return argparse.Namespace(**vars(args) | SMOKE | {"world": 2}) if args.smoke else args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device = device_of(args)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (or --smoke to check the script on the CPU)")
    results: dict[str, Any] = {
        "args": vars(args),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else platform.processor() or "cpu",
    }
    first = TinyGPT(width=args.widths[0], depth=args.depths[0], heads=max(1, args.widths[0] // 64))
    numel = sum(p.numel() for p in first.parameters())
    del first
    results["copy_rate"] = pinned_copy_rate(numel, device)
    results["loopback_allreduce_s"] = on_gloo_ranks(args, loopback_all_reduce, numel)[0]
    results["staging"] = on_gloo_ranks(args, staged_training, args)
    results["adam"] = adam_steps(args)
    results["codecs"] = codec_throughput(args)
    results["planned"] = planned(results, args)
    report(results, args)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
        print(f"results written to {args.json}")
    return results


if __name__ == "__main__":
    main()

"""GPU fleets on one GPU; every figure a ratio of numbers measured side by side in this run:

(a) host-staged gossip: 2 to 4 processes share the GPU (gloo between them), each training a GPT-2-style
    model (``--widths``/``--depths``: about 85M and 300M parameters) with AdamW, interleaved: no
    communication, per-step ring gossip with ``second_moment="average"`` and ``"local"`` (target:
    average at most 1.03x local), ``sync_every=8``; the staged bytes against the pinned-copy rate;
(b) the Adam rule's step against torch's fused and foreach AdamW (``--step-params``; target: 1.3x fused);
(c) the sparse codecs' encode and decode seconds at ``--codec-params`` values;
(d) the planner, from this run's rates, on (a)'s staged steps (target: within 15%), and on paper: 1B
    parameters on 16 nodes joined by 100 Mbit/s.

``uv run benchmarks/gpu/fleet_figures.py --json benchmarks/results/gpu/fleet_figures.json`` (about 8
minutes on an H200). ``--smoke``: every part on the CPU at toy sizes, staging forced (not a measurement).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.harness.common import collect_from_ranks
from benchmarks.harness.interleaved import interleave, median_seconds, ratio, rule_against_torch, timed_on
from benchmarks.harness.lm_task import CONTEXT, VOCAB, TinyGPT
from benchmarks.harness.question_args import add_defaults
from benchmarks.harness.report import titled_table
from decent_optim_wrapper import DecentOptimWrapper, plan
from decent_optim_wrapper.engine.wire.compression import codec, parse_compression, round_seed
from decent_optim_wrapper.topo import TopologyFactory

METHODS = {"nocomm": None, "ring": {}, "ring-local": {"second_moment": "local"}, "ring~h8": {"sync_every": 8}}


def device_of(args: argparse.Namespace) -> torch.device:
    return torch.device("cpu") if args.smoke else torch.device("cuda", 0)


def gpt(width: int, depth: int) -> TinyGPT:
    return TinyGPT(width=width, depth=depth, heads=max(1, width // 64))


# -- (a) host staging per step
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
        model = gpt(width, depth).to(device)
        front = adamw = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
        if options is not None:
            staging = True if args.smoke else None  # forced on the CPU; on a GPU the default must stage
            front = DecentOptimWrapper(adamw, topology="ring", host_staging=staging, **options)
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
    out = {"params": params, "staged_bytes_per_step": 2 * params * 4}  # the fp32 sum buffer out and back
    out["sent_bytes_per_step"] = runs["ring"][1].engine.bytes_sent_per_step()
    out |= {name: ratio(times, name, "nocomm") for name in METHODS}
    return out | {"average_vs_local": ratio(times, "ring", "ring-local")}


def loopback_all_reduce(rank: int, world: int, numel: int) -> float:
    """Seconds gloo takes to all-reduce ``numel`` host floats (the planner's link): the median of 3."""
    buffer, seconds = torch.ones(numel), []
    for _ in range(4):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(buffer)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds[1:])


# -- (b) the Adam rule's step
def adam_steps(args: argparse.Namespace) -> dict[str, Any]:
    device, out = device_of(args), {}
    for total in args.step_params:
        chunk = min(total, 50_000_000)  # tensors of a model layer's size, not one giant tensor
        sizes = [chunk] * (total // chunk) + ([total % chunk] if total % chunk else [])
        per_impl = {}
        for impl, flags in (("foreach", {"foreach": True}), ("fused", {"fused": device.type == "cuda"})):
            torch.manual_seed(0)
            params = [torch.randn(n, device=device).requires_grad_() for n in sizes]
            for p in params:
                p.grad = torch.randn_like(p)
            times = rule_against_torch(params, flags, args.warmup, args.iters, partial(timed_on, device))
            torch_ms = 1e3 * statistics.median(times["torch"])
            per_impl[impl] = ratio(times, "rule", "torch") | {"torch_ms": torch_ms}
            del params
        out[str(total)] = per_impl
    return out


# -- (c) the sparse codecs
def codec_throughput(args: argparse.Namespace) -> dict[str, Any]:
    device, numel, out = device_of(args), args.codec_params, {}
    values, seed = torch.randn(numel, device=device), round_seed(1, 0)
    for name in args.codecs:
        coder = codec(parse_compression(name).name)
        payload = torch.empty(coder.payload_bytes(numel, torch.float32), dtype=torch.uint8, device=device)
        decoded = torch.empty_like(values)
        enc = median_seconds(partial(coder.encode, values, payload, seed), device, args.iters)
        dec = median_seconds(partial(coder.decode_into, payload, decoded, seed), device, args.iters)
        out[name] = {"encode_s": enc, "decode_s": dec, "payload_bytes": payload.numel()}
        out[name] |= {"encode_values_per_s": numel / enc, "decode_values_per_s": numel / dec}
    return out


# -- (d) the planner
def planned(results: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The planner's step times for (a)'s staged runs from this run's measured rates, and the slow-link
    case on paper."""
    copy = plan.HostCopy(min(results["copy_rate"].values()))
    world, out = args.world, {"runs": {}}
    for key, run in results["staging"][0].items():
        numel = run["params"]
        # The processes share one host: a ring all-reduce among them moved at the measured rate.
        sent = 2 * (world - 1) / world * numel * 4
        network = plan.Network(plan.Link(8 * sent / results["loopback_allreduce_s"]))
        compute = plan.ComputeTimes(run["nocomm"]["ms"] / 1e3)
        topology, predictions = TopologyFactory.create("ring", world), {}
        for name, every in (("ring", 1), ("ring~h8", 8)):
            scheme = plan.gossip_scheme(topology, numel, network, sync_every=every, host_copy=copy)
            predicted = plan.simulate(scheme, compute, 40).iteration_s(10)
            measured = run[name]["ms"] / 1e3
            predictions[name] = {"predicted_ms": predicted * 1e3, "measured_ms": measured * 1e3}
            predictions[name]["error"] = predicted / measured - 1
        out["runs"][key] = predictions
    # On paper: a 1B-parameter model, 16 nodes, 100 Mbit/s, a second of compute per step.
    numel, compute, network = 1_000_000_000, plan.ComputeTimes(1.0), plan.Network(plan.Link(100e6))
    topology, paper = TopologyFactory.create("ring", 16), {}
    for wire, every in ((None, 8), ("int8", 8), ("topk:0.01:int4", 8), ("topk:0.01:int4", 32)):
        compression = None if wire is None else parse_compression(wire)
        scheme = plan.gossip_scheme(topology, numel, network, compression, sync_every=every, host_copy=copy)
        step_s = plan.simulate(scheme, compute, max(40, 10 + 8 * every)).iteration_s(10)
        label = f"ring~h{every}" + (f"@{wire}" if wire else "")
        paper[label] = {
            "throughput_vs_nocomm": 1.0 / step_s,
            "bytes_per_node_step": plan.bytes_per_parameter(topology, compression) * numel / every,
        }
    out["slow_link_1b_16_nodes_100mbit"] = paper
    return out


# -- the run
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
    keys = ("encode_s", "encode_values_per_s", "decode_s", "decode_values_per_s")
    codecs = [[name, *(r[k] for k in keys)] for name, r in results["codecs"].items()]
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
        titled_table(f"(c) codecs at {args.codec_params / 1e6:.0f}M values", ["codec", "encode s",
                     "encode values/s", "decode s", "decode values/s"], codecs, ".3g"),
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
    numel = sum(p.numel() for p in gpt(args.widths[0], args.depths[0]).parameters())
    results["copy_rate"] = pinned_copy_rate(numel, device)
    results["loopback_allreduce_s"] = on_gloo_ranks(args, loopback_all_reduce, numel)[0]
    results["staging"] = on_gloo_ranks(args, staged_training, args)
    results["adam"] = adam_steps(args)
    results["codecs"] = codec_throughput(args)
    results["planned"] = planned(results, args)
    report(results, args)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))
        print(f"results written to {args.json}")
    return results


if __name__ == "__main__":
    main()

"""What a compressed round costs in compute and memory, against a training step, for each wire format.

Two modes, both on the language model of ``harness/lm_task.py`` at width 512 and depth 4 (12.9M
parameters, fp32), each format measured side by side with the uncompressed round in one run:

* ``--mode engine`` (default; CPU, 2 local gloo ranks on a ring, one pair): each rank trains with
  AdamW, and after every step runs one gossip round through the engine's own ``Gossip`` over the
  wrapper's buckets: ``stage`` (compute ``x - r`` and encode it into this member's slot) and
  ``mix`` (decode every member's payload, sum them, update ``x`` and the group's reference) are
  timed; the network (``launch``, ``wait``) is not. The step (forward, backward, AdamW) is timed in
  the same loop. Each format runs in fresh processes. Memory is not reported here: the process's
  resident peak is the training step's, which hides a round's temporaries (codec mode on CUDA
  measures them exactly, on the same code).
* ``--mode codec`` (any device, one process; ``--device cuda`` on a GPU): the codec's work of one
  round of a pair on one flat tensor of the model's size, ``x - r``, ``encode``, ``decode_into``
  (own payload) and ``add_into`` (the peer's), timed with the device synchronised, against the
  training step on the same device; memory is the round's peak allocation above what was allocated
  when it started, the reference and decoding buffers included (CUDA), or not reported (CPU).

Printed per format: round time (ms), round / step (per-step gossip pays that every step) and round /
(8 steps) (low-communication gossip with ``sync_every=8`` pays one round every 8 steps), and the
extra memory in MB and in copies of the parameters. The target of the sparse formats: under 10% of
a step for the low-communication rounds on CPU.

Run: ``uv run benchmarks/costs/compression_cost.py [--formats ...] [--json PATH]`` (about 3 minutes
on 2 cores), ``uv run benchmarks/costs/compression_cost.py --mode codec --device cuda`` on a GPU.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.harness.common import collect_from_ranks
from benchmarks.harness.lm_task import CONTEXT, VOCAB, make_lm_model
from decent_optim_wrapper import DecentOptimWrapper
from decent_optim_wrapper.engine.exchange.gossip import Gossip
from decent_optim_wrapper.engine.fleet.comm import ProcessGroups, group_layout
from decent_optim_wrapper.engine.fleet.world import resolve_gossip_world
from decent_optim_wrapper.engine.wire.compression import (
    CompressionPlan,
    codec,
    resolve_compression,
    round_seed,
)

FORMATS = [
    "none",
    "bf16",
    "int8",
    "int4",
    "topk:0.01:int2",
    "topk:0.03:int2",
    "topk:0.03:int4",
    "randk:0.03:int2",
]
LOCAL_STEPS = 8  # the low-communication rounds' period the report divides by


def _batch(step: int, batch: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, VOCAB, (batch, CONTEXT + 1), generator=g)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def _train_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, step: int, batch: int, device: torch.device
):
    x, y = _batch(step, batch, device)
    optimizer.zero_grad()
    nn.functional.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1)).backward()
    optimizer.step()


def _timed(fn: Callable[[], object], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return 1e3 * (time.perf_counter() - start)


# -- engine mode ----------------------------------------------------------------------------------------
def engine_rounds(rank: int, world_size: int, args: argparse.Namespace, fmt: str) -> dict[str, Any]:
    """On this rank: median ms of a training step and of one round's stage and mix."""
    device = torch.device("cpu")
    model = make_lm_model(args.width, args.depth)
    compression = None if fmt == "none" else fmt
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # The wrapper builds the buckets and agrees on the layout; its own gossip stays idle (the loop
    # below steps the inner optimizer and drives a Gossip over the same buckets, as overhead.py does).
    wrapper = DecentOptimWrapper(inner, topology="ring", compression=compression)
    tensors = [b.data for b in wrapper.buckets]
    spec = resolve_compression(compression)
    plan = None if spec is None else CompressionPlan(wrapper.topology, spec)
    world = resolve_gossip_world(rank, world_size, None)
    groups = ProcessGroups(world, [group_layout(wrapper.topology, world)])
    gossip = Gossip(tensors, wrapper.topology, rank, groups, plan=plan)
    buckets = range(gossip.num_buckets)
    samples: dict[str, list[float]] = {"step": [], "stage": [], "mix": []}
    _train_step(model, inner, 0, args.batch, device)  # AdamW's state exists before the rounds
    with torch.no_grad():
        for step in range(args.reps + 2):
            with torch.enable_grad():
                step_ms = _timed(lambda s=step: _train_step(model, inner, s, args.batch, device), device)
            stage = sum(_timed(lambda b=b, s=step: gossip.stage(b, s), device) for b in buckets)
            for b in buckets:
                gossip.launch(b, step)
            gossip.wait_all()
            mix = sum(_timed(lambda b=b: gossip.mix(b), device) for b in buckets)
            if step >= 2:  # the first round is a group's exact one; the second faults pages in
                for key, value in zip(samples, (step_ms, stage, mix), strict=True):
                    samples[key].append(value)
    numel = sum(t.numel() for t in tensors)
    return {
        "format": fmt,
        "params": numel,
        "median_ms": {key: statistics.median(values) for key, values in samples.items()},
        "extra_mb": None,
        "model_mb": numel * 4 / 2**20,
        "wire_bytes_per_round": wrapper.engine.bytes_sent_per_step(),
    }


def _engine_worker(
    rank: int, world_size: int, port: int, args: argparse.Namespace, fmt: str, results: Any
) -> None:
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        results.put((rank, engine_rounds(rank, world_size, args, fmt)))
    finally:
        dist.destroy_process_group()


# -- codec mode ----------------------------------------------------------------------------------------
def codec_round(args: argparse.Namespace, fmt: str) -> dict[str, Any]:
    """One process: the codec work of one round of a pair, against a training step on ``--device``."""
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = make_lm_model(args.width, args.depth).to(device)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    numel = sum(p.numel() for p in model.parameters())
    x = torch.randn(numel, device=device)
    reference = x + 1e-3 * torch.randn(numel, device=device)
    total, scratch, diff = torch.empty_like(x), torch.empty_like(x), torch.empty_like(x)
    steps, rounds = [], []
    coder = None if fmt == "none" else codec(resolve_compression(fmt).name)  # type: ignore[union-attr]
    payloads = None
    if coder is not None:
        size = coder.payload_bytes(numel, torch.float32)
        payloads = torch.empty(2, size, dtype=torch.uint8, device=device)
    _train_step(model, inner, 0, args.batch, device)
    peaks = []

    def one_round(step: int) -> None:
        if coder is None or payloads is None:  # uncompressed: stage (x / 2) and mix (copy the sum)
            torch.div(x, 2, out=total)
            x.copy_(total)
            return
        seed = round_seed(step, 0)
        torch.sub(x, reference, out=diff)
        coder.encode(diff, payloads[0], seed)
        payloads[1].copy_(payloads[0])  # the peer's payload: what the network would bring
        coder.decode_into(payloads[0], total, seed)
        coder.add_into(payloads[1], total, scratch, seed)
        coder.decode_into(payloads[0], scratch, seed)
        x.add_(torch.add(total, scratch, alpha=-2, out=scratch), alpha=0.5)
        reference.add_(total.div_(2))

    for step in range(args.reps + 2):
        steps.append(_timed(lambda s=step: _train_step(model, inner, s, args.batch, device), device))
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            held = torch.cuda.memory_allocated(device)
        rounds.append(_timed(lambda s=step: one_round(s), device))
        if device.type == "cuda":
            peaks.append(torch.cuda.max_memory_allocated(device) - held)
    # what the round needs beyond the replica: its temporaries' peak, the reference, the sum and
    # decoding buffers and the payloads (the ``diff`` scratch is the engine's sum buffer, counted once)
    extra = None
    if peaks:
        # uncompressed: the sum buffer; compressed: also the reference, decoding buffer and payloads
        buffers = total.numel() * 4
        if payloads is not None:
            buffers += (reference.numel() + scratch.numel()) * 4 + payloads.numel()
        extra = (max(peaks) + buffers) / 2**20
    return {
        "format": fmt,
        "params": numel,
        "median_ms": {"step": statistics.median(steps[2:]), "round": statistics.median(rounds[2:])},
        "extra_mb": extra,
        "model_mb": numel * 4 / 2**20,
    }


# -- report ---------------------------------------------------------------------------------------------
def report(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    first = rows[0]
    print(
        f"\n{args.mode} mode on {args.device} ({platform.processor() or platform.machine()}, "
        f"{args.threads if args.device == 'cpu' else '-'} threads per process): LM width {args.width} "
        f"depth {args.depth}, "
        f"{first['params'] / 1e6:.1f}M parameters, batch {args.batch} x {CONTEXT} tokens"
    )
    header = (
        f"{'format':>16} | {'step ms':>8} | {'round ms':>9} | {'round/step':>10} | "
        f"{'round/(8 steps)':>15} | {'extra MB':>9} | {'copies':>6}"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        ms = row["median_ms"]
        round_ms = ms["round"] if "round" in ms else ms["stage"] + ms["mix"]
        extra = row["extra_mb"]
        extra_text = "-" if extra is None else f"{extra:9.1f}"
        copies = "-" if extra is None else f"{extra / row['model_mb']:6.2f}"
        print(
            f"{row['format']:>16} | {ms['step']:8.1f} | {round_ms:9.2f} | {round_ms / ms['step']:10.3f} | "
            f"{round_ms / (LOCAL_STEPS * ms['step']):15.4f} | {extra_text:>9} | {copies:>6}"
        )
    print(
        "round: stage + mix of one gossip round (network excluded); round/(8 steps): the share of a step "
        "low-communication gossip with sync_every=8 spends on it (target for sparse formats: < 0.10)."
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mode", choices=("engine", "codec"), default="engine")
    parser.add_argument("--device", default="cpu", help="codec mode only: cpu or cuda")
    parser.add_argument("--formats", nargs="+", default=FORMATS, help="'none' is the uncompressed round")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--reps", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-seconds", type=float, default=600)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.mode == "engine" and args.device != "cpu":
        parser.error("--mode engine runs on CPU (gloo on loopback); use --mode codec for --device cuda")
    for fmt in args.formats:
        if fmt != "none":
            try:
                resolve_compression(fmt)
            except ValueError as error:
                parser.error(str(error))
    return args


def main() -> None:
    args = parse_args()
    if args.mode == "codec" and args.device == "cpu":
        torch.set_num_threads(args.threads)
    rows = []
    for fmt in args.formats:
        if args.mode == "codec":
            rows.append(codec_round(args, fmt))
            continue
        by_rank = collect_from_ranks(
            2,
            _engine_worker,
            lambda rank, port, results, fmt=fmt: (rank, 2, port, args, fmt, results),
            args.max_seconds,
            f"format {fmt}",
        )
        rows.append(by_rank[0])
    report(rows, args)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

"""One rank of ``benchmarks/low_communication/low_comm_cluster.py``: time each method's steps on a slow link.

Started inside a node's network namespace (``MASTER_ADDR``, ``MASTER_PORT``, ``GLOO_SOCKET_IFNAME``
set). In each of ``--rounds`` rounds it trains a fresh MLP with every method in turn (``--warmup``
untimed steps, then ``--iters`` timed ones) and rewrites ``--out`` (JSON, the layout
``emulated_cluster.py``'s driver reads) after every round. Methods, all with AdamW on the same model and
batch:

* ``nocomm``, ``ddp``, ``ddp-bf16`` and per-step gossip (``ring``): as in ``cluster_worker.py``;
* ``avg~hH``: torch's own periodic model averaging, ``PostLocalSGDOptimizer`` with a
  ``PeriodicModelAverager`` of period ``H`` (a blocking all-reduce of the parameters every ``H``
  steps, from the first step);
* low-communication gossip in ``methods.py``'s grammar (``ring~h8n``, ``ring~h8n@bf16``,
  ``ring~h32n``, ``ring~h8nd0``): ``DecentOptimWrapper`` with ``sync_every``, DiLoCo's Nesterov outer
  optimizer and the delay the name gives;
* ``torchft~hH`` (``torchft~h8d7``: ``fragment_sync_delay=7``): torchft's ``DiLoCo`` with the same
  outer optimizer over its gloo process group, one replica group per node, a lighthouse on rank 0
  (needs the ``bench`` dependency group: ``uv run --group bench ...``).
"""

from __future__ import annotations

import argparse
import re
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
from torch.distributed.optim import PostLocalSGDOptimizer

from benchmarks.harness.cluster_worker import (
    BASELINES,
    COLLECTIVE_TIMEOUT,
    bytes_sent_per_step,
    make_training,
    write_atomically,
)
from benchmarks.harness.common import build_mlp
from benchmarks.harness.methods import parse_method
from benchmarks.harness.torchft_peer import TorchftDiLoCo
from decent_optim_wrapper import DecentOptimWrapper

AVERAGER = re.compile(r"avg~h(?P<period>[1-9][0-9]*)")
TORCHFT = re.compile(r"torchft~h(?P<every>[1-9][0-9]*)(?:d(?P<delay>[0-9]+))?")
_torchft: dict[str, object] = {}


def build(
    method: str, args: argparse.Namespace
) -> tuple[nn.Module, torch.optim.Optimizer | None, float | None]:
    """Model, optimizer (None: the module front-end) and bytes sent per step (None: not counted)."""
    torchft = TORCHFT.fullmatch(method)
    if torchft is not None:
        torch.manual_seed(0)
        model = build_mlp(args.inputs, args.width, args.depth, 10)
        every, delay = int(torchft["every"]), int(torchft["delay"] or 0)
        inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
        outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
        diloco = TorchftDiLoCo(model, inner, outer, every, delay, args.rank, args.world_size)
        _torchft["open"] = diloco
        model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        return model, diloco.inner, model_bytes * 2 * (args.world_size - 1) / args.world_size / every
    averager = AVERAGER.fullmatch(method)
    if averager is not None:
        torch.manual_seed(0)
        model = build_mlp(args.inputs, args.width, args.depth, 10)
        period = int(averager["period"])
        optimizer = PostLocalSGDOptimizer(
            torch.optim.AdamW(model.parameters(), lr=1e-3),
            PeriodicModelAverager(period=period, warmup_steps=0),
        )
        model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        sent = model_bytes * 2 * (args.world_size - 1) / args.world_size / period
        return model, optimizer, sent
    if method in BASELINES or "~" not in method:
        torch.manual_seed(0)
        model, optimizer = make_training(method, build_mlp(args.inputs, args.width, args.depth, 10), args)
        return model, optimizer, bytes_sent_per_step(method, model, optimizer, args.world_size)
    spec = parse_method(method)
    if spec.paced:  # this worker counts steps; paced ranks take different numbers of them
        raise ValueError(
            f"method {method!r}: paced rounds ('p') are not timed here; see benchmarks/uneven_fleet/"
        )
    torch.manual_seed(0)
    model = build_mlp(args.inputs, args.width, args.depth, 10)
    wrapper = DecentOptimWrapper(
        torch.optim.AdamW(model.parameters(), lr=1e-3),
        local_world_size=args.local_world_size,
        timeout=COLLECTIVE_TIMEOUT,
        **spec.engine_options(),
    )
    return model, wrapper, wrapper.engine.bytes_sent_per_step()


def run_segment(method: str, args: argparse.Namespace) -> tuple[list[float], int, float | None]:
    model, optimizer, sent = build(method, args)
    generator = torch.Generator().manual_seed(args.rank)
    times: list[float] = []
    for i in range(args.warmup + args.iters):
        # A fresh batch every step (drawn outside the timed part): a fixed batch is memorised within
        # a few dozen steps, and its vanishing gradients turn denormal and slow every kernel down.
        x = torch.randn(args.batch, args.inputs, generator=generator)
        y = torch.randint(0, 10, (args.batch,), generator=generator)
        if i == args.warmup:
            dist.barrier()
        start = time.perf_counter()
        if optimizer is not None:
            optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        if optimizer is not None:
            optimizer.step()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    if isinstance(optimizer, DecentOptimWrapper):
        optimizer.global_avg(may_revert=False)  # finishes the rounds in flight; untimed
    opened = _torchft.pop("open", None)
    if isinstance(opened, TorchftDiLoCo):
        opened.close()
    dist.barrier()
    return times, sum(p.numel() for p in model.parameters()), sent


def run_rounds(args: argparse.Namespace) -> None:
    times: dict[str, list[float]] = {m: [] for m in args.methods}
    sent: dict[str, float | None] = {}
    rounds: list[dict[str, float]] = []
    params = 0
    run_segment("nocomm", args)  # a process's first steps are slow: untimed
    for r in range(args.rounds):
        medians = {}
        for method in args.methods[r % len(args.methods) :] + args.methods[: r % len(args.methods)]:
            segment, params, sent[method] = run_segment(method, args)
            times[method].extend(segment)
            medians[method] = statistics.median(segment)
        rounds.append(medians)
        write_atomically(
            args.out,
            {
                "rank": args.rank,
                "params": params,
                "times": times,
                "round_medians": rounds,
                "bytes_sent_per_step": sent,
            },
        )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--local-world-size", type=int, default=1)
    parser.add_argument("--methods", nargs="+", required=True)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--inputs", type=int, default=512)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--warmup", type=int, default=32)
    parser.add_argument("--iters", type=int, default=64)
    parser.add_argument("--out", required=True)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)  # the same for every method: no kernel slowed down by denormals
    dist.init_process_group("gloo", rank=args.rank, world_size=args.world_size, timeout=COLLECTIVE_TIMEOUT)
    try:
        run_rounds(args)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""One rank of ``benchmarks/cluster.py``: train an MLP with each communication method, time each step.

Started by ``cluster.py`` inside a node's network namespace with ``MASTER_ADDR``, ``MASTER_PORT`` and
``GLOO_SOCKET_IFNAME`` set. In each of ``--rounds`` rounds it trains a fresh model with every method
in turn (warm-up, then ``--iters`` timed steps), and at the end writes its per-iteration times to
``--out`` as JSON. Methods:

* ``nocomm``: trains alone (the process group serves only the barriers around the timed window);
* ``ddp``: ``torch.nn.parallel.DistributedDataParallel`` (gradients all-reduced in backward);
* any topology name (``ring``, ``one-peer-exp``, ...): ``DecentOptimWrapper`` with that topology;
* a topology name + ``-module`` (``ring-module``): ``DecentralizedDataParallel`` with that topology,
  which takes each bucket's AdamW step inside backward as soon as its gradients are ready.

All methods use AdamW on the same model and batch; only the communication differs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from common import build_mlp
from torch import nn

from decent_optim_wrapper import DecentOptimWrapper, DecentralizedDataParallel

#: How long any collective may wait for a peer before raising (the driver also kills at its deadline).
COLLECTIVE_TIMEOUT = timedelta(seconds=120)


MODULE_SUFFIX = "-module"


def make_training(method: str, args: argparse.Namespace) -> tuple[nn.Module, torch.optim.Optimizer | None]:
    """A fresh model (wrapped by DDP or the module front-end) and optimizer (None: updated in backward)."""
    torch.manual_seed(0)
    model: nn.Module = build_mlp(args.inputs, args.width, args.depth, 10)
    if method.endswith(MODULE_SUFFIX):
        module = DecentralizedDataParallel(
            model,
            lambda params: torch.optim.AdamW([p for _, p in params], lr=1e-3),
            topology=method.removesuffix(MODULE_SUFFIX),
            _local_world_size=args.local_world_size,
            timeout=COLLECTIVE_TIMEOUT,
        )
        return module, None
    if method == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    optimizer: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if method not in ("nocomm", "ddp"):
        optimizer = DecentOptimWrapper(
            optimizer, local_world_size=args.local_world_size, topology=method, timeout=COLLECTIVE_TIMEOUT
        )
    return model, optimizer


def run_segment(method: str, args: argparse.Namespace) -> tuple[list[float], int]:
    """Warm-up steps, then the timed ones; returns seconds per timed step and the parameter count."""
    model, optimizer = make_training(method, args)
    generator = torch.Generator().manual_seed(args.rank)
    x = torch.randn(args.batch, args.inputs, generator=generator)
    y = torch.randint(0, 10, (args.batch,), generator=generator)
    times: list[float] = []
    for i in range(args.warmup + args.iters):
        if i == args.warmup:
            dist.barrier()  # every rank starts the timed window together
        start = time.perf_counter()
        if optimizer is not None:
            optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        if optimizer is not None:
            optimizer.step()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    if isinstance(optimizer, DecentOptimWrapper):
        optimizer.global_avg(may_revert=False)  # finishes the last gossip round; untimed
    if isinstance(model, DecentralizedDataParallel):
        model.global_avg(will_revert=False)
    dist.barrier()  # the next segment starts on every rank together
    return times, sum(p.numel() for p in model.parameters())


def run_rounds(args: argparse.Namespace) -> dict[str, object]:
    """Every method once per round, so load that drifts during the run hits all methods alike.

    Round ``r`` starts with method ``r`` (mod the number of methods), so no method is always first; a
    process's first steps are slow (lazy imports, allocator growth), so an untimed segment comes first.
    """
    times: dict[str, list[float]] = {m: [] for m in args.methods}
    rounds: list[dict[str, float]] = []
    params = 0
    run_segment("nocomm", args)
    for r in range(args.rounds):
        medians = {}
        for method in args.methods[r % len(args.methods) :] + args.methods[: r % len(args.methods)]:
            segment, params = run_segment(method, args)
            times[method].extend(segment)
            medians[method] = statistics.median(segment)
        rounds.append(medians)
    return {"rank": args.rank, "params": params, "times": times, "round_medians": rounds}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--local-world-size", type=int, default=1)
    parser.add_argument("--methods", nargs="+", required=True, help="nocomm, ddp, or topology names")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--inputs", type=int, default=512)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--out", required=True, help="JSON file for this rank's results")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)  # the driver keeps processes <= cores x 2; each gets one thread
    dist.init_process_group("gloo", rank=args.rank, world_size=args.world_size, timeout=COLLECTIVE_TIMEOUT)
    try:
        result = run_rounds(args)
    finally:
        dist.destroy_process_group()
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()

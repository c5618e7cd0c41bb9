"""One rank of ``benchmarks/cluster.py``: train an MLP with each communication method, time each step.

Started by ``cluster.py`` inside a node's network namespace with ``MASTER_ADDR``, ``MASTER_PORT`` and
``GLOO_SOCKET_IFNAME`` set. In each of ``--rounds`` rounds it trains a fresh model with every method
in turn (warm-up, then ``--iters`` timed steps), and after every round writes its per-iteration times
so far to ``--out`` as JSON. Methods:

* ``nocomm``: trains alone (the process group serves only the barriers around the timed window);
* ``ddp``: ``torch.nn.parallel.DistributedDataParallel`` (gradients all-reduced in backward);
* ``ddp-bf16``: the same with torch's ``bf16_compress_hook``, which all-reduces the gradients in
  bfloat16: half of DDP's bytes;
* ``topology[-module][@compression]``, the gossip methods:

  * a topology name (``ring``, ``one-peer-exp``, ...): ``DecentOptimWrapper`` with that topology;
  * ``-module`` (``ring-module``): ``DecentralizedDataParallel`` instead, which takes each bucket's
    AdamW step inside backward as soon as its gradients are ready;
  * ``@bf16``, ``@fp16`` or ``@int8`` (``ring@bf16``, ``ring-module@int8``): the front-end's
    ``compression=`` keyword, the parameters sent in that format.

All methods use AdamW on the same model and batch; only the communication differs. Each method's
bytes sent per step and rank are written beside its times: 0 for ``nocomm``, a ring all-reduce's
``2 (n - 1) / n`` gradients for the DDP methods, and the engine's own count for gossip.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from common import build_mlp
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

from decent_optim_wrapper import DecentOptimWrapper, DecentralizedDataParallel

#: How long any collective may wait for a peer before raising (the driver also kills at its deadline).
COLLECTIVE_TIMEOUT = timedelta(seconds=120)


BASELINES = ("nocomm", "ddp", "ddp-bf16")
MODULE_SUFFIX = "-module"
COMPRESSIONS = ("bf16", "fp16", "int8")


def parse_gossip_method(method: str) -> tuple[str, bool, str | None]:
    """``topology[-module][@compression]`` -> (topology, module front-end?, compression or None).

    The topology name itself is checked by the library when the front-end is built.
    """
    base, at, compression = method.partition("@")
    if at and compression not in COMPRESSIONS:
        raise ValueError(
            f"method {method!r}: compression {compression!r} is not one of {', '.join(COMPRESSIONS)}; "
            "write e.g. ring@bf16"
        )
    topology = base.removesuffix(MODULE_SUFFIX)
    if not topology or topology in BASELINES:
        raise ValueError(
            f"method {method!r}: {', '.join(BASELINES)} take no -module or @compression; a gossip "
            "method is topology[-module][@compression], e.g. ring-module@bf16"
        )
    return topology, base.endswith(MODULE_SUFFIX), compression or None


def make_training(method: str, args: argparse.Namespace) -> tuple[nn.Module, torch.optim.Optimizer | None]:
    """A fresh model (wrapped by DDP or the module front-end) and optimizer (None: updated in backward)."""
    torch.manual_seed(0)
    model: nn.Module = build_mlp(args.inputs, args.width, args.depth, 10)
    if method in BASELINES:
        if method != "nocomm":
            model = nn.parallel.DistributedDataParallel(model)
        if method == "ddp-bf16":
            model.register_comm_hook(None, bf16_compress_hook)  # None: the default (world) group
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)
    topology, module, compression = parse_gossip_method(method)
    # The keyword only when compressing, so that the uncompressed methods also run on a library
    # from before it had one (to compare commits).
    options = {"compression": compression} if compression else {}
    if module:
        ddp_module = DecentralizedDataParallel(
            model,
            lambda params: torch.optim.AdamW([p for _, p in params], lr=1e-3),
            topology=topology,
            _local_world_size=args.local_world_size,
            timeout=COLLECTIVE_TIMEOUT,
            **options,
        )
        return ddp_module, None
    optimizer = DecentOptimWrapper(
        torch.optim.AdamW(model.parameters(), lr=1e-3),
        local_world_size=args.local_world_size,
        topology=topology,
        timeout=COLLECTIVE_TIMEOUT,
        **options,
    )
    return model, optimizer


def bytes_sent_per_step(
    method: str, model: nn.Module, optimizer: torch.optim.Optimizer | None, world_size: int
) -> float | None:
    """Bytes this rank sends per step with ``method``; None if the library does not count them.

    Gossip's count is the engine's, averaged over one period of the topology's schedule.
    """
    if method == "nocomm":
        return 0
    if method in BASELINES:
        # What a ring all-reduce sends per rank: reduce-scatter and all-gather, (n - 1) / n each.
        # Checked on loopback at n = 2: gloo's all-reduce sent one fp32 gradient per rank and step,
        # and half of that with the bf16 hook.
        if method == "ddp-bf16":
            grad_bytes = sum(p.numel() for p in model.parameters()) * torch.bfloat16.itemsize
        else:
            grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        return grad_bytes * 2 * (world_size - 1) // world_size
    engine = model.engine if isinstance(model, DecentralizedDataParallel) else optimizer.engine
    count = getattr(engine, "bytes_sent_per_step", None)  # absent before the library counted
    return None if count is None else float(count())


def run_segment(method: str, args: argparse.Namespace) -> tuple[list[float], int, float | None]:
    """Warm-up steps, then the timed ones.

    Returns:
        Seconds per timed step, the parameter count, and the bytes sent per step (None: not counted).
    """
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
    sent = bytes_sent_per_step(method, model, optimizer, args.world_size)
    if isinstance(optimizer, DecentOptimWrapper):
        optimizer.global_avg(may_revert=False)  # finishes the last gossip round; untimed
    if isinstance(model, DecentralizedDataParallel):
        model.global_avg(will_revert=False)
    dist.barrier()  # the next segment starts on every rank together
    return times, sum(p.numel() for p in model.parameters()), sent


def run_rounds(args: argparse.Namespace) -> None:
    """Every method once per round, so load that drifts during the run hits all methods alike.

    Round ``r`` starts with method ``r`` (mod the number of methods), so no method is always first; a
    process's first steps are slow (lazy imports, allocator growth), so an untimed segment comes first.
    ``--out`` is rewritten after every round: a driver that hits its deadline keeps the rounds done.
    """
    times: dict[str, list[float]] = {m: [] for m in args.methods}
    sent: dict[str, float | None] = {}
    rounds: list[dict[str, float]] = []
    params = 0
    run_segment("nocomm", args)
    for r in range(args.rounds):
        medians = {}
        for method in args.methods[r % len(args.methods) :] + args.methods[: r % len(args.methods)]:
            segment, params, sent[method] = run_segment(method, args)
            times[method].extend(segment)
            medians[method] = statistics.median(segment)
        rounds.append(medians)
        result = {
            "rank": args.rank,
            "params": params,
            "times": times,
            "round_medians": rounds,
            "bytes_sent_per_step": sent,
        }
        write_atomically(args.out, result)


def write_atomically(path: str, result: dict[str, object]) -> None:
    """Replace ``path`` in one rename, so that a killed worker never leaves half a file."""
    partial = f"{path}.partial"
    with open(partial, "w") as f:
        json.dump(result, f)
    os.replace(partial, path)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--local-world-size", type=int, default=1)
    parser.add_argument(
        "--methods",
        nargs="+",
        required=True,
        help="nocomm, ddp, ddp-bf16, or topology[-module][@compression] (ring, ring-module@bf16, ...)",
    )
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
        run_rounds(args)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

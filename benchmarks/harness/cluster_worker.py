"""One rank of the emulated cluster: train an MLP with each communication method, time each step.

Started by ``emulated_cluster.run_workers`` (for ``cluster_speed/cluster.py`` and ``scaling/scaling.py``)
inside a node's network namespace with ``MASTER_ADDR``, ``MASTER_PORT`` and ``GLOO_SOCKET_IFNAME`` set. In
each of ``--rounds`` rounds it trains a fresh model with every method in turn (warm-up, then ``--iters`` timed
steps), and after every round writes its per-iteration times so far to ``--out`` as JSON. Methods:

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

With ``--compute emulated`` forward and backward are waits (``emulated_compute.EmulatedMLP``):
``--compute-ms`` per step on average, drawn per rank and step by ``decent_optim_wrapper.plan.ComputeTimes``
for each of ``--scenarios`` (``none``: constant; ``lognormal``: heavy-tailed with the same mean;
``straggler``: rank 0 is ``--slow-factor`` times slower). Every method then runs once per scenario, and its
results are keyed ``scenario/method``. Beside the times each rank writes the CPU seconds its process used in
each timed window, and rank 0 the whole machine's busy CPU seconds in it (``/proc/stat``), so that
the cost of the emulation itself can be judged.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

from benchmarks.harness.common import build_mlp
from benchmarks.harness.emulated_compute import ROWS, EmulatedMLP
from benchmarks.harness.methods import check_compression
from decent_optim_wrapper import DecentOptimWrapper, DecentralizedDataParallel
from decent_optim_wrapper.plan import JITTERS, ComputeTimes

#: How long any collective may wait for a peer before raising (the driver also kills at its deadline).
COLLECTIVE_TIMEOUT = timedelta(seconds=120)


BASELINES = ("nocomm", "ddp", "ddp-bf16")
MODULE_SUFFIX = "-module"


def parse_gossip_method(method: str) -> tuple[str, bool, str | None]:
    """``topology[-module][@compression]`` -> (topology, module front-end?, compression or None).

    The topology name itself is checked by the library when the front-end is built.
    """
    base, at, compression = method.partition("@")
    if at:
        check_compression(method, compression)
    topology = base.removesuffix(MODULE_SUFFIX)
    if not topology or topology in BASELINES:
        raise ValueError(
            f"method {method!r}: {', '.join(BASELINES)} take no -module or @compression; a gossip "
            "method is topology[-module][@compression], e.g. ring-module@bf16"
        )
    return topology, base.endswith(MODULE_SUFFIX), compression or None


def make_model(args: argparse.Namespace) -> nn.Module:
    """The MLP, computing for real or sleeping its compute (``--compute emulated``)."""
    torch.manual_seed(0)
    if args.compute == "emulated":
        return EmulatedMLP(args.inputs, args.width, args.depth, 10, args.forward_fraction)
    return build_mlp(args.inputs, args.width, args.depth, 10)


def make_training(
    method: str, model: nn.Module, args: argparse.Namespace
) -> tuple[nn.Module, torch.optim.Optimizer | None]:
    """``model`` wrapped by DDP or the module front-end, and its optimizer (None: updated in backward)."""
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


def busy_cpu_seconds() -> float:
    """Seconds all cores of the machine spent busy since boot (``/proc/stat``: all but idle and iowait)."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    """CPU seconds of this process, all its threads (gloo's included), user and system."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run_segment(
    method: str, scenario: str | None, args: argparse.Namespace, round_: int = 0
) -> dict[str, object]:
    """Warm-up steps, then the timed ones; compute times drawn with seed ``--seed + round_``.

    Returns:
        ``times``: seconds per timed step; ``params``: the parameter count; ``sent``: bytes sent per
        step (None: not counted); ``cpu_s``: this process's CPU seconds in the timed window; rank 0's
        also ``busy_s``, the machine's busy CPU seconds in it; with real compute ``compute_s``, the
        seconds of forward + backward of each timed step and ``forward_s`` of the forward alone.
    """
    net = make_model(args)
    model, optimizer = make_training(method, net, args)
    generator = torch.Generator().manual_seed(args.rank)
    rows = ROWS if args.compute == "emulated" else args.batch
    x = torch.randn(rows, args.inputs, generator=generator)
    y = torch.randint(0, 10, (rows,), generator=generator)
    compute = ComputeTimes(
        args.compute_ms / 1e3,
        scenario or "none",
        args.sigma,
        slow_factor=args.slow_factor,
        seed=args.seed + round_,
    ).draws(args.rank, args.warmup + args.iters)
    times: list[float] = []
    forward_s: list[float] = []
    compute_s: list[float] = []
    cpu = busy = 0.0
    for i in range(args.warmup + args.iters):
        if i == args.warmup:
            dist.barrier()  # every rank starts the timed window together
            cpu, busy = own_cpu_seconds(), busy_cpu_seconds()
        if isinstance(net, EmulatedMLP):
            net.compute_s = compute[i]
        start = time.perf_counter()
        if optimizer is not None:
            optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        forward = time.perf_counter()
        loss.backward()
        backward = time.perf_counter()
        if optimizer is not None:
            optimizer.step()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
            forward_s.append(forward - start)
            compute_s.append(backward - start)
    segment: dict[str, object] = {
        "times": times,
        "cpu_s": own_cpu_seconds() - cpu,
        "params": sum(p.numel() for p in net.parameters()),
        "sent": bytes_sent_per_step(method, model, optimizer, args.world_size),
    }
    if args.rank == 0:
        segment["busy_s"] = busy_cpu_seconds() - busy
    if args.compute == "real":
        segment["compute_s"], segment["forward_s"] = compute_s, forward_s
    if isinstance(optimizer, DecentOptimWrapper):
        optimizer.global_avg(may_revert=False)  # finishes the last gossip round; untimed
    if isinstance(model, DecentralizedDataParallel):
        model.global_avg(will_revert=False)
    dist.barrier()  # the next segment starts on every rank together
    return segment


def run_rounds(args: argparse.Namespace) -> None:
    """Every method (under every scenario) once per round, so load that drifts hits all alike.

    Round ``r`` starts with segment ``r`` (mod the number of segments), so no method is always first;
    a process's first steps are slow (lazy imports, allocator growth), so an untimed segment comes
    first. ``--out`` is rewritten after every round: a driver that hits its deadline keeps the rounds
    done.
    """
    segments = [(s, m) for s in args.scenarios or [None] for m in args.methods]
    keys = [m if s is None else f"{s}/{m}" for s, m in segments]
    times: dict[str, list[float]] = {k: [] for k in keys}
    extra: dict[str, dict[str, list[object]]] = {k: {} for k in keys}
    sent: dict[str, object] = {}
    rounds: list[dict[str, float]] = []
    params: object = 0
    run_segment("nocomm", None, args)
    for r in range(args.rounds):
        medians = {}
        start = r % len(segments)
        for (scenario, method), key in (
            list(zip(segments, keys, strict=True))[start:] + list(zip(segments, keys, strict=True))[:start]
        ):
            segment = run_segment(method, scenario, args, r)
            times[key].extend(segment.pop("times"))  # type: ignore[arg-type]
            params, sent[key] = segment.pop("params"), segment.pop("sent")
            medians[key] = statistics.median(times[key][-args.iters :])
            for name, value in segment.items():  # per round: CPU seconds; per step: compute times
                extra[key].setdefault(name, []).append(value)
        rounds.append(medians)
        result = {
            "rank": args.rank,
            "params": params,
            "times": times,
            "round_medians": rounds,
            "bytes_sent_per_step": sent,
            "measured": extra,
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
    parser.add_argument("--compute", choices=("real", "emulated"), default="real")
    parser.add_argument("--compute-ms", type=float, default=200.0, help="emulated: mean compute per step")
    parser.add_argument(
        "--forward-fraction", type=float, default=1 / 3, help="emulated: share of the compute in forward"
    )
    parser.add_argument(
        "--scenarios", nargs="+", choices=JITTERS, default=None, help="emulated: compute-time scenarios"
    )
    parser.add_argument("--sigma", type=float, default=0.5, help="lognormal scenario's shape")
    parser.add_argument(
        "--slow-factor", type=float, default=1.5, help="straggler scenario: rank 0's slowdown"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the compute-time draws")
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

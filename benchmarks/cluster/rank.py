"""One rank of ``benchmarks/cluster/run.py``: trains each method in turn and writes what it measured.

``mode`` (in ``--config``, the question's options): ``timed`` (every method under every scenario, once
per round, from one seed), ``fleet`` (the uneven fleet's step ends and pace reports), ``sharing`` (two
groups' all-reduces) or ``memory`` (``hsdp.py``'s). Methods: ``nocomm``, ``ddp``, ``ddp-bf16``,
``avg~hH`` (``PostLocalSGDOptimizer``), ``torchft~hH[dD]`` (DiLoCo), gossip in ``harness/methods.py``'s
grammar, the Accelerate loop's (``loop: accelerate``) and ``hsdp.py``'s (``shards``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.cluster import hsdp
from benchmarks.harness import emulated_cluster as emu
from benchmarks.harness.common import build_mlp
from benchmarks.harness.emulated_compute import ROWS, EmulatedMLP
from benchmarks.harness.methods import nesterov_outer, parse_method
from benchmarks.harness.uneven import speed_factor
from decent_optim_wrapper import DecentOptimWrapper, DecentralizedDataParallel
from decent_optim_wrapper.plan import ComputeTimes


@dataclass
class Training:
    """A method ready to step (``optimizer`` None: it steps inside backward); ``sent()``: bytes per step."""

    model: nn.Module
    optimizer: Any
    sent: Callable[[], Any]
    backward: Callable[[torch.Tensor], None] = torch.Tensor.backward
    after_step: Callable[[], None] = lambda: None
    context: Any = dataclasses.field(default_factory=contextlib.nullcontext)
    finish: Callable[[], None] = lambda: None


def ring_all_reduce_bytes(numel: int, itemsize: int, world_size: int, every: int = 1) -> float:
    """What a ring all-reduce sends per rank (reduce-scatter and all-gather, ``(n - 1) / n`` each)."""
    return numel * itemsize * 2 * (world_size - 1) // world_size / every


def engine_count(engine: Any) -> Callable[[], float | None]:
    count = getattr(engine, "bytes_sent_per_step", None)  # absent before the library counted
    return lambda: None if count is None else float(count())


def build(method: str, net: nn.Module, cfg: Any) -> Training:
    """``net`` trained by ``method`` (see the module docstring)."""
    numel = sum(p.numel() for p in net.parameters())
    adamw = lambda params: torch.optim.AdamW(params, lr=1e-3)  # noqa: E731
    if getattr(cfg, "loop", None) == "accelerate":
        return accelerate_training(method, net, cfg)
    if getattr(cfg, "shards", 0):
        model, optimizer, sent = hsdp.build(method, net, cfg)
        return Training(model, optimizer, sent)
    if method in ("nocomm", "ddp", "ddp-bf16"):
        model = net if method == "nocomm" else nn.parallel.DistributedDataParallel(net)
        if method == "ddp-bf16":
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

            model.register_comm_hook(None, bf16_compress_hook)  # None: the default (world) group
        itemsize = 2 if method == "ddp-bf16" else 4
        sent = 0.0 if method == "nocomm" else ring_all_reduce_bytes(numel, itemsize, cfg.world_size)
        return Training(model, adamw(model.parameters()), lambda: sent)
    if method.startswith("avg~h"):
        from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
        from torch.distributed.optim import PostLocalSGDOptimizer

        period = int(method.removeprefix("avg~h"))
        averager = PeriodicModelAverager(period=period, warmup_steps=0)
        sent = ring_all_reduce_bytes(numel, 4, cfg.world_size, period)
        return Training(net, PostLocalSGDOptimizer(adamw(net.parameters()), averager), lambda: sent)
    if method.startswith("torchft~h"):
        from benchmarks.harness.torchft_peer import TorchftDiLoCo

        every, _, delay = method.removeprefix("torchft~h").partition("d")
        outer = nesterov_outer(list(net.parameters()))
        peers = (int(every), int(delay or 0), cfg.rank, cfg.world_size)
        diloco = TorchftDiLoCo(net, adamw(net.parameters()), outer, *peers)
        sent = ring_all_reduce_bytes(numel, 4, cfg.world_size, int(every))
        return Training(net, diloco.inner, lambda: sent, finish=diloco.close)
    spec = parse_method(method)
    if spec.topology is None or spec.paced or spec.optimizer:
        raise ValueError(f"method {method!r}: not timed here (paced rounds: the uneven question)")
    # Only the keywords a method turns on: plain methods also run on an older library (to compare commits).
    turned_on = lambda v: not (v is None or v is False or v == "average")  # noqa: E731
    options = {k: v for k, v in spec.engine_options().items() if turned_on(v)}
    options["timeout"] = emu.COLLECTIVE_TIMEOUT
    if spec.module:
        inner = lambda params: adamw([p for _, p in params])  # noqa: E731
        module = DecentralizedDataParallel(net, inner, _local_world_size=cfg.local_world_size, **options)
        average = lambda: module.global_avg(will_revert=False)  # noqa: E731
        return Training(module, None, engine_count(module.engine), finish=average)
    wrapper = DecentOptimWrapper(adamw(net.parameters()), local_world_size=cfg.local_world_size, **options)
    finish = lambda: wrapper.global_avg(may_revert=False)  # noqa: E731
    return Training(net, wrapper, engine_count(wrapper.engine), finish=finish)


def accelerate_training(method: str, net: nn.Module, cfg: Any) -> Training:
    """The Accelerate loop's ``method``: the same loop, only the accelerator differs."""
    from accelerate import Accelerator
    from accelerate.local_sgd import LocalSGD

    from decent_optim_wrapper.integrations.accelerate import DecentralizedAccelerator

    optimizer: Any = torch.optim.AdamW(net.parameters(), lr=1e-3)
    if method.startswith("gossip-"):
        topology = method.removeprefix("gossip-")
        accelerator = DecentralizedAccelerator(cpu=True, topology=topology, sync_every=cfg.every)
    else:
        accelerator = Accelerator(cpu=True)
    model = net
    if method != "nocomm":
        model, optimizer = accelerator.prepare(net, optimizer)
    full = ring_all_reduce_bytes(sum(p.numel() for p in net.parameters()), 4, cfg.world_size)
    if method.startswith("gossip-"):
        count = engine_count(accelerator.replicas.wrappers[0].engine)
        finish = lambda: accelerator.global_avg(may_revert=False)  # noqa: E731
        return Training(model, optimizer, count, accelerator.backward, finish=finish)
    sent = {"nocomm": 0.0, "ddp": full, "local-sgd": full / cfg.every}[method]
    if method != "local-sgd":
        return Training(model, optimizer, lambda: sent, accelerator.backward)
    synced = LocalSGD(accelerator=accelerator, model=model, local_sgd_steps=cfg.every)
    return Training(model, optimizer, lambda: sent, accelerator.backward, synced.step, synced)


def segment(method: str, scenario: str | None, cfg: Any, round_: int = 0) -> dict[str, Any]:
    """Warm-up steps, then the timed ones (compute times drawn with seed ``seed + round_``)."""
    torch.manual_seed(0)
    emulated = cfg.compute == "emulated"
    shape = (cfg.inputs, cfg.width, cfg.depth, 10)
    net: nn.Module = EmulatedMLP(*shape, cfg.forward_fraction) if emulated else build_mlp(*shape)
    run = build(method, net, cfg)
    generator = torch.Generator().manual_seed(cfg.rank)
    rows = ROWS if emulated else cfg.batch
    steps = cfg.warmup + cfg.iters
    slow = {"slow_factor": cfg.slow_factor, "seed": cfg.seed + round_}
    compute = ComputeTimes(cfg.compute_ms / 1e3, scenario or "none", cfg.sigma, **slow).draws(cfg.rank, steps)
    times, forward_s, compute_s = [], [], []
    with run.context:
        for i in range(steps):
            if i == 0 or cfg.fresh_batches:
                # A fresh batch every step (low_comm): a fixed one is memorised within a few dozen
                # steps, and its vanishing gradients turn denormal and slow every kernel down.
                x = torch.randn(rows, cfg.inputs, generator=generator)
                y = torch.randint(0, 10, (rows,), generator=generator)
            if i == cfg.warmup:
                dist.barrier()  # every rank starts the timed window together
            if isinstance(net, EmulatedMLP):
                net.compute_s = compute[i]
            start = time.perf_counter()
            if run.optimizer is not None:
                run.optimizer.zero_grad()
            loss = nn.functional.cross_entropy(run.model(x), y)
            forward = time.perf_counter()
            run.backward(loss)
            compute_s.append(time.perf_counter() - start)
            forward_s.append(forward - start)
            if run.optimizer is not None:
                run.optimizer.step()
            run.after_step()
            if i >= cfg.warmup:
                times.append(time.perf_counter() - start)
    result = {"times": times, "sent": run.sent(), "params": sum(p.numel() for p in net.parameters())}
    if not emulated:  # what --compute emulated's sleeps stand for: the mean timed forward and backward
        result |= {"compute_s": statistics.fmean(compute_s[cfg.warmup :])}
        result |= {"forward_s": statistics.fmean(forward_s[cfg.warmup :])}
    run.finish()  # finishes the last gossip round, closes torchft's manager; untimed
    dist.barrier()  # the next segment starts on every rank together
    return result


def timed(cfg: Any) -> None:
    """Every method (under every scenario) once per round, so that load that drifts hits all alike."""
    segments = [(s, m) for s in cfg.scenarios or [None] for m in cfg.methods]
    keys = [m if s is None else f"{s}/{m}" for s, m in segments]
    times: dict[str, list[float]] = {k: [] for k in keys}
    sent: dict[str, Any] = {}
    extra: dict[str, dict[str, list[float]]] = {k: {} for k in keys}
    rounds, params = [], 0
    segment("nocomm", None, cfg)  # a process's first steps are slow (lazy imports, allocator): untimed
    for r in range(cfg.rounds):
        medians = {}
        order = list(zip(segments, keys, strict=True))
        for (scenario, method), key in order[r % len(order) :] + order[: r % len(order)]:
            result = segment(method, scenario, cfg, r)
            times[key].extend(result.pop("times"))
            params, sent[key] = result.pop("params"), result.pop("sent")
            medians[key] = statistics.median(times[key][-cfg.iters :])
            for name, value in result.items():  # real compute: its mean forward and backward per round
                extra[key].setdefault(name, []).append(value)
        rounds.append(medians)
        record = {"rank": cfg.rank, "params": params, "times": times, "round_medians": rounds}
        emu.write_atomically(cfg.out, record | {"bytes_sent_per_step": sent, "measured": extra})


def fleet_segment(scenario: str, method: str, cfg: Any) -> dict[str, Any]:
    """Train ``method`` under ``scenario``; the wall-clock end of every step, and the pace report."""
    torch.manual_seed(0)
    net = EmulatedMLP(cfg.inputs, cfg.width, cfg.depth, 10, 1 / 3)
    model: nn.Module = nn.parallel.DistributedDataParallel(net) if method == "ddp" else net
    optimizer: Any = torch.optim.AdamW(model.parameters(), lr=1e-3)
    wrapper = None
    if method in ("sync", "paced"):
        pacing = "measured" if method == "paced" else None
        ring = {"topology": "ring", "sync_every": cfg.sync_every, "outer_optimizer": nesterov_outer}
        ring |= {"pacing": pacing, "timeout": emu.COLLECTIVE_TIMEOUT}
        optimizer = wrapper = DecentOptimWrapper(optimizer, **ring)
    generator = torch.Generator().manual_seed(cfg.rank)
    x = torch.randn(ROWS, cfg.inputs, generator=generator)
    y = torch.randint(0, 10, (ROWS,), generator=generator)

    def running() -> bool:
        if wrapper is not None:
            return wrapper.round_count < cfg.rounds
        if method == "nocomm":
            return time.time() - start < cfg.nocomm_s
        return len(ends) < cfg.rounds * cfg.sync_every

    dist.barrier()  # every rank starts together
    start, ends, round_ends = time.time(), [], []
    while running():
        factor = speed_factor(scenario, cfg.rank, cfg.world_size, time.time() - start, cfg.shift_s)
        net.compute_s = cfg.compute_ms / 1e3 * factor
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        ends.append(time.time())
        if wrapper is not None and wrapper.round_ended:
            round_ends.append(ends[-1])
    result: dict[str, Any] = {"start": start, "ends": ends, "round_ends": round_ends}
    if wrapper is not None:
        pace = wrapper.pace_report()
        if pace is not None:
            seconds = (pace.round_seconds, pace.step_seconds, pace.waited_seconds)
            result["pace"] = dict(zip(("round_s", "step_s", "waited_s"), seconds, strict=True))
        wrapper.global_avg(may_revert=False)  # finishes the last round; untimed
    dist.barrier()
    return result


def fleet(cfg: Any) -> None:
    results = {}
    for scenario in cfg.scenarios:
        for method in cfg.methods:
            results[f"{scenario}/{method}"] = fleet_segment(scenario, method, cfg)
            emu.write_atomically(cfg.out, results)


#: link_sharing's two groups: both cross node 0's outgoing and node 1's incoming link.
SHARING_GROUPS = {"A": (0, 3), "B": (1, 2)}


def sharing(cfg: Any) -> None:
    """Per delta, ``reps`` timed all-reduces of this rank's group (B's ``delta`` after A's; -1: A alone)."""
    groups = {name: dist.new_group(list(ranks)) for name, ranks in SHARING_GROUPS.items()}
    mine = next(name for name, ranks in SHARING_GROUPS.items() if cfg.rank in ranks)
    x = torch.ones(cfg.numel)
    for _ in range(2):  # connections and buffers set up
        dist.all_reduce(x, group=groups[mine])
    times: dict[str, list[float]] = {}
    for delta in cfg.deltas:
        times[str(delta)] = []
        for _ in range(cfg.reps):
            dist.barrier()
            time.sleep(0.3)  # the links idle, as between two steps' exchanges
            if mine == "B":
                if delta < 0:
                    continue
                time.sleep(delta)
            start = time.perf_counter()
            dist.all_reduce(x, group=groups[mine])
            times[str(delta)].append(time.perf_counter() - start)
    dist.barrier()
    emu.write_atomically(cfg.out, times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for flag in ("--rank", "--world-size", "--local-world-size"):
        parser.add_argument(flag, type=int, required=True)
    parser.add_argument("--out", required=True, help="JSON file for this rank's results")
    parser.add_argument("--config", required=True, help="the question's options, as JSON")
    args = parser.parse_args(argv)
    cfg = SimpleNamespace(**json.loads(args.config) | {k: v for k, v in vars(args).items() if k != "config"})
    ranks = {"RANK": cfg.rank, "LOCAL_RANK": cfg.rank % cfg.local_world_size, "WORLD_SIZE": cfg.world_size}
    ranks["LOCAL_WORLD_SIZE"] = cfg.local_world_size
    os.environ.update({k: str(v) for k, v in ranks.items()})  # as torchrun and `accelerate launch` set them
    torch.set_num_threads(1)  # the drivers keep processes <= cores x 2; each gets one thread
    if getattr(cfg, "flush_denormal", False):
        torch.set_flush_denormal(True)  # the same for every method: no kernel slowed by denormals
    dist.init_process_group("gloo", rank=cfg.rank, world_size=cfg.world_size, timeout=emu.COLLECTIVE_TIMEOUT)
    try:
        {"timed": timed, "fleet": fleet, "sharing": sharing, "memory": hsdp.memory_rank}[cfg.mode](cfg)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""The cost questions: each a measurement (``measure(args)``: its results, its tables under ``tables``)
and its options' defaults (``QUESTIONS``)."""

from __future__ import annotations

import copy
import ctypes
import importlib
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
import timeit
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.harness.common import build_mlp, collect_from_ranks
from benchmarks.harness.interleaved import Variant, interleave, ratio, rule_against_torch, timed, timed_on
from benchmarks.harness.lm_task import CONTEXT, VOCAB, make_lm_model
from benchmarks.harness.report import titled_table
from decent_optim_wrapper import AccumAdamW, DecentOptimWrapper, DecentralizedDataParallel, init_elastic
from decent_optim_wrapper.engine import RECORD_S, RECORDS_ENV, Seal
from decent_optim_wrapper.engine.counters import WaitClock
from decent_optim_wrapper.engine.exchange.gossip import Gossip
from decent_optim_wrapper.engine.exchange.guard import GuardLog
from decent_optim_wrapper.engine.fleet.comm import ProcessGroups, group_layout
from decent_optim_wrapper.engine.fleet.status import MAX_EVENTS, StatusBoard, status_key
from decent_optim_wrapper.engine.fleet.world import resolve_gossip_world
from decent_optim_wrapper.engine.wire.compression import (
    CompressionPlan,
    codec,
    resolve_compression,
    round_seed,
)

MIB = 2**20
SECRET = "the-secret-of-the-cost-benchmark-0123"
RATIO_COLUMNS = ("ms", "ratio_of_medians", "median_paired_ratio")  # of ``ratio``'s result, in a table


def table(title: str, header: str, rows: list[list[Any]], spec: str = ".3f") -> dict[str, Any]:
    """A report's table: its columns ``"a|b|c"``, numbers shown with ``spec``."""
    return {"title": title, "header": header.split("|"), "rows": rows, "spec": spec}


def render(tables: list[dict[str, Any]]) -> str:
    return "\n\n".join(titled_table(t["title"], t["header"], t["rows"], t["spec"]) for t in tables)


def environment() -> str:
    """A report's first line: torch, the machine, the checkout's commit."""
    git = ["git", "describe", "--always", "--dirty=+dirty"]
    commit = subprocess.run(git, cwd=os.path.dirname(__file__), capture_output=True, text=True).stdout.strip()
    return f"torch {torch.__version__}, {platform.machine()}, {os.cpu_count()} CPUs, commit {commit or '-'}"


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer | None, x: torch.Tensor, y: Any) -> None:
    """Forward, backward, step (``optimizer`` None: a module front-end, which steps inside backward)."""
    if optimizer is not None:
        optimizer.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    if optimizer is not None:
        optimizer.step()


def step_ratios(
    steps: Mapping[str, Callable[[], object]], pairs: str, iters: int, warmup: int
) -> dict[str, Any]:
    """Training steps timed interleaved: each one's median ms, the ratios of ``pairs`` (``"a/b c/d"``)."""
    times = interleave({name: lambda _, s=step: s() for name, step in steps.items()}, iters, warmup)
    wanted = [pair.split("/") for pair in pairs.split() if set(pair.split("/")) <= set(times)]
    ms = {name: 1e3 * statistics.median(seconds) for name, seconds in times.items()}
    return {"ms": ms, "ratios": {f"{a}/{b}": ratio(times, a, b) for a, b in wanted}}


def step_table(title: str, result: Mapping[str, Any]) -> dict[str, Any]:
    """:func:`step_ratios`' result as a table: a row per ratio, then those of the runs compared with."""
    rows = [[*p.split("/"), *(r[c] for c in RATIO_COLUMNS)] for p, r in result["ratios"].items()]
    compared = {row[0] for row in rows}
    rows += [[name, None, ms, None, None] for name, ms in result["ms"].items() if name not in compared]
    return table(title, "run|against|ms per step (median)|ratio of medians|median paired ratio", rows)


def mlp_adamw(args: Any, lr: float) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = build_mlp(args.width, args.width, args.depth, 10)
    return model, torch.optim.AdamW(model.parameters(), lr=lr)


def mlp_batch(args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(args.batch, args.width), torch.randint(0, 10, (args.batch,))


def on_ranks(world: int, measure: Callable[..., Any], args: Any, *extra: Any, **start: Any) -> dict[int, Any]:
    """``measure(rank, world, args, *extra)`` on ``world`` local ranks, by rank: a gloo group, or (``job=``)
    an elastic job around a store hosted here; ``before=fn`` runs first in each rank."""
    job, before = start.get("job"), start.get("before")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) if job else None

    def args_for(rank: int, port: int, results: Any) -> tuple[Any, ...]:
        return (rank, world, store.port if store else port, job, before, measure, args, extra, results)

    return collect_from_ranks(world, _rank, args_for, args.max_seconds, job or measure.__name__)


def _rank(rank, world, port, job, before, measure, args, extra, results) -> None:  # type: ignore[no-untyped-def]
    torch.set_num_threads(getattr(args, "threads", 1))
    if before is not None:
        before()
    if job is None:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    else:
        timeout = timedelta(seconds=120)
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
        init_elastic(store, rank, world, job=job, secret=SECRET, timeout=timeout)
    try:
        results.put((rank, measure(rank, world, args, *extra)))
    finally:
        dist.destroy_process_group()


def gossip_round(
    wrapper: DecentOptimWrapper, rank: int, world: int, wire: str | None, guard: bool
) -> Variant:
    """A variant timing a round's ``stage`` and ``mix`` (the network untimed) over the wrapper's buckets,
    through a ``Gossip`` built as the engine builds its own (``guard=False``: ``nonfinite_guard=False``)."""
    spec = resolve_compression(wire)
    plan = None if spec is None else CompressionPlan(wrapper.topology, spec)
    gossip_world = resolve_gossip_world(rank, world, None)  # the whole job, as the wrapper's
    groups = ProcessGroups(gossip_world, [group_layout(wrapper.topology, gossip_world)])
    extra = {} if guard else {"guard": GuardLog(rank, enabled=False)}
    tensors = [b.data for b in wrapper.buckets]
    gossip = Gossip(tensors, wrapper.topology, rank, groups, plan=plan, **extra)
    buckets = range(gossip.num_buckets)

    def one_round(step: int) -> dict[str, float]:
        stage = sum(timed(lambda b=b: gossip.stage(b, step)) for b in buckets)
        for b in buckets:
            gossip.launch(b, step)
        gossip.wait_all()
        return {"stage": stage, "mix": sum(timed(lambda b=b: gossip.mix(b)) for b in buckets)}

    return one_round


#: Overhead (c): each row's wrapper options (``accum``: AccumAdamW, ``accum_iter=4``) and its reference;
#: ``ring-again``, the reference again, is the control: its distance from 1 is the spread.
LOCAL: dict[str, Any] = {"second_moment": "local"}
RING_ROWS: dict[str, tuple[dict[str, Any], str]] = {
    "ring": (LOCAL, "ring"), "ring-again": (LOCAL, "ring"), "ring-average": ({}, "ring"),
    "ring-unguarded": (LOCAL | {"nonfinite_guard": False}, "ring"),
    "ring-gt": (LOCAL | {"gradient_tracking": True}, "ring"),
    "ring@bf16": (LOCAL | {"compression": "bf16"}, "ring"),
    "ring-accum": (LOCAL | {"accum": True}, "ring"), "ring-accum-average": ({"accum": True}, "ring-accum"),
}  # fmt: skip


def copy_equivalents(rank: int, world: int, args: Any, wire: str | None) -> dict[str, Any]:
    """Overhead (a) on this rank: a round's stage and mix (guard on and off) against a copy of it all."""
    torch.manual_seed(0)
    model = build_mlp(args.width, args.width, args.depth, args.width)
    sgd = torch.optim.SGD(model.parameters(), lr=0.0)
    wrapper = DecentOptimWrapper(sgd, topology="ring", compression=wire)
    tensors = [b.data for b in wrapper.buckets]
    src = torch.randn(sum(t.numel() for t in tensors))
    dst = torch.empty_like(src)
    variants = {
        "copy": lambda _: dst.copy_(src),
        "engine": gossip_round(wrapper, rank, world, wire, guard=True),
        "unguarded": gossip_round(wrapper, rank, world, wire, guard=False),
    }
    with torch.no_grad():
        times = interleave(variants, args.reps, 3)  # the first rounds allocate and fault pages in
    out: dict[str, Any] = {"params": src.numel(), "buckets": len(tensors)}
    for name in ("engine", "unguarded"):  # the median over repetitions of (stage + mix) / copy
        first, second = (times[k] for k in times if k.startswith(name + "."))
        out[name] = statistics.median(map(lambda a, b, c: (a + b) / c, first, second, times["copy"]))
    return out | {"median_ms": {k: 1e3 * statistics.median(v) for k, v in times.items()}}


def training_steps(world: int, args: Any) -> dict[str, Any]:
    """Overhead (b) and (c): a step of one MLP (512-1024-1024-10, AdamW) each way, interleaved."""
    torch.manual_seed(0)
    reference = build_mlp(512, 1024, 3, 10)
    twin = partial(copy.deepcopy, reference)
    adamw = partial(torch.optim.AdamW, lr=1e-3)
    runs: dict[str, tuple[nn.Module, torch.optim.Optimizer | None]] = {}
    if world == 1:
        wrapped = twin()
        module = DecentralizedDataParallel(twin(), lambda ps: adamw([p for _, p in ps]), topology="ring")
        runs["bare"] = (reference, adamw(reference.parameters()))
        runs["wrapped"] = (wrapped, DecentOptimWrapper(adamw(wrapped.parameters()), topology="ring"))
        runs["module"] = (module, None)  # one AdamW per bucket, stepped inside backward
    for name, (options, _) in RING_ROWS.items() if world > 1 else ():
        model, opts = twin(), dict(options)
        accum = opts.pop("accum", False)
        inner = AccumAdamW(model.parameters(), lr=1e-3, accum_iter=4) if accum else adamw(model.parameters())
        runs[name] = (model, DecentOptimWrapper(inner, topology="ring", **opts))
    pairs = " ".join(f"{name}/{against}" for name, (_, against) in RING_ROWS.items() if name != against)
    x, y = torch.randn(args.batch, 512), torch.randint(0, 10, (args.batch,))
    steps = {name: partial(train_step, model, opt, x, y) for name, (model, opt) in runs.items()}
    params = sum(p.numel() for p in reference.parameters())
    return {"params": params, **step_ratios(steps, "wrapped/bare module/bare " + pairs, args.iters, 20)}


def overhead_rank(rank: int, world: int, args: Any) -> dict[str, Any]:
    wires = [None, *(args.formats if world > 1 else [])]
    out = {"gossip": {wire or "none": copy_equivalents(rank, world, args, wire) for wire in wires}}
    return out | ({"train_step": training_steps(world, args)} if world <= 2 else {})


def overhead(args: Any) -> dict[str, Any]:
    """(a) The engine's own work per round in copy-equivalents ((staging + mix) / one copy of all
    parameters), uncompressed, with the guard off and with each of --formats; (b) a training step at world
    size 1 with each front-end; (c) one on a 2-rank ring with each feature (``RING_ROWS``)."""
    by_world = {str(w): on_ranks(w, overhead_rank, args) for w in sorted({1, *args.worlds})}
    rows = []
    for world, ranks in by_world.items():
        plain = ranks[0]["gossip"]["none"]["engine"]
        for wire, g in ranks[0]["gossip"].items():
            m, own = g["median_ms"], [g["engine"], g["engine"] - plain, g["unguarded"]]
            others = ", ".join(f"{ranks[r]['gossip'][wire]['engine']:.2f}" for r in sorted(ranks) if r)
            rows.append([world, wire, g["params"] / 1e6, *(m[k] for k in m), *own, others or None])
    ms = "|".join(f"{k} ms" for k in g["median_ms"])
    head = f"world|wire|M params|{ms}|c-eq|c-eq over none|guard off c-eq|other ranks' c-eq"
    tables = [table("(a) a round's own work (rank 0)", head, rows, ".2f")]
    for world, what in (("1", "(b) world size 1"), ("2", "(c) world size 2, a ring on loopback")):
        if world in by_world:
            t = by_world[world][0]["train_step"]
            tables.append(step_table(f"{what}: MLP {t['params'] / 1e6:.2f}M params (rank 0)", t))
    return {"by_world": by_world, "tables": tables}


#: second_moment's methods: wrapper options (None: the bare AdamW); with ``--seed-path``, also ``seed``.
SECOND_MOMENT: dict[str, dict[str, Any] | None] = {
    "bare": None, "local": {"second_moment": "local"}, "average": {}, "guard_off": {"nonfinite_guard": False}
}  # fmt: skip
ADAMW_KINDS = {"single": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}
SEED_INSTALL = "uv pip install --no-deps --python-version 3.12 --target DIR decent-optim-wrapper==0.1.1"


def load_seed_wrapper(path: str | Path) -> Any:
    """The seed release's ``DecentOptimWrapper`` from ``path``, this library's modules set aside meanwhile."""
    package = "decent_optim_wrapper"
    if not (Path(path) / package / "wrapper.py").is_file():
        raise FileNotFoundError(f"--seed-path {str(path)!r} holds no {package}/wrapper.py: {SEED_INSTALL}")

    def ours() -> list[str]:
        return [name for name in sys.modules if name == package or name.startswith(package + ".")]

    kept = {name: sys.modules.pop(name) for name in ours()}
    sys.path.insert(0, str(path))
    try:
        return importlib.import_module(f"{package}.wrapper").DecentOptimWrapper
    finally:
        sys.path.remove(str(path))
        for name in ours():
            del sys.modules[name]
        sys.modules.update(kept)


def second_moment_method(args: Any, method: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    model, adamw = mlp_adamw(args, 1e-4)
    if method == "seed":  # one process per node, as the release's README starts it on CPUs
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        return model, load_seed_wrapper(args.seed_path)(adamw, rank, world, 1, "ring")
    options = SECOND_MOMENT[method]
    return model, adamw if options is None else DecentOptimWrapper(adamw, topology="ring", **options)


def second_moment_steps(rank: int, world: int, args: Any) -> dict[str, Any]:
    runs = {m: second_moment_method(args, m) for m in [*SECOND_MOMENT, *(["seed"] if args.seed_path else [])]}
    x, y = mlp_batch(args)
    steps = {name: partial(train_step, model, opt, x, y) for name, (model, opt) in runs.items()}
    pairs = "local/bare average/local average/seed local/seed guard_off/average"
    params = sum(p.numel() for p in runs["bare"][0].parameters())
    return {"params": params, **step_ratios(steps, pairs, args.iters, args.warmup)}


def map_large_allocations() -> None:
    """glibc maps every allocation of 64 KiB or more on its own: the high-water mark follows live tensors."""
    if ctypes.CDLL(None).mallopt(-3, 64 * 1024) != 1:  # M_MMAP_THRESHOLD, <malloc.h>
        raise RuntimeError("mallopt(M_MMAP_THRESHOLD) failed: glibc is required for the memory part")


def second_moment_memory(rank: int, world: int, args: Any, method: str) -> dict[str, float]:
    """The growth of this process's resident-set high-water mark over ``--memory-steps``, and the state."""
    model, optimizer = second_moment_method(args, method)
    x, y = mlp_batch(args)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB: what the steps add to model and data
    for _ in range(args.memory_steps):
        train_step(model, optimizer, x, y)
    growth = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    return {"peak_growth_mib": growth, "state_mib": sum(v.nbytes for v in state) / MIB}


def second_moment(args: Any) -> dict[str, Any]:
    """What Adam's second-moment rule costs: (a) a training step with each rule (``SECOND_MOMENT``; with
    --seed-path the seed release 0.1.1 too) on a 2-rank ring, interleaved; (b) the optimizer step alone,
    the rule's against torch's single-tensor, foreach and fused AdamW; (c) the memory high-water mark's
    growth in fresh ranks, and the optimizer state."""
    if args.seed_path:
        load_seed_wrapper(args.seed_path)  # a wrong folder fails here, before any rank starts
    t, steps = on_ranks(2, second_moment_steps, args)[0], {}
    torch.set_num_threads(1)
    for kind, flags in ADAMW_KINDS.items():
        model, _ = mlp_adamw(args, 0.0)
        params = [p.detach().requires_grad_() for p in model.parameters()]
        for p in params:
            p.grad = torch.randn_like(p)
        times = rule_against_torch(params, flags, args.warmup, args.iters)
        steps[kind] = {"torch_ms": 1e3 * statistics.median(times["torch"]), **ratio(times, "rule", "torch")}
    start = {"before": map_large_allocations}
    mem = {m: on_ranks(2, second_moment_memory, args, m, **start)[0] for m in ("bare", "local", "average")}
    growth, model_mib = {k: m["peak_growth_mib"] for k, m in mem.items()}, t["params"] * 4 / MIB
    columns = ("torch_ms", "ms", "ratio_of_medians", "median_paired_ratio")
    rows = [[kind, *(r[c] for c in columns)] for kind, r in steps.items()]
    memory = [
        [k, g, mem[k]["state_mib"], g - growth["bare"], (g - growth["local"]) / model_mib]
        for k, g in growth.items()
    ]
    alone = "AdamW|torch ms|rule ms (n=2)|ratio of medians|median paired ratio"
    head = "method|high-water growth|optimizer state|over bare|over local, model copies"
    tables = [
        step_table(f"(a) 2 ranks, ring, AdamW, MLP {t['params'] / 1e6:.2f}M params (rank 0)", t),
        table("(b) the optimizer step alone", alone, rows),
        table("(c) memory in fresh ranks (rank 0; MiB)", head, memory, ".2f"),
    ]
    return {"time": t, "step": steps, "memory": mem, "tables": tables}


SPARSE = ["topk:0.01:int2", "topk:0.03:int2", "topk:0.03:int4", "randk:0.03:int2"]
FORMATS = ["none", "bf16", "int8", "int4", *SPARSE]


def lm_step(model: nn.Module, optimizer: torch.optim.Optimizer, step: int, batch: int, device: Any) -> None:
    tokens = torch.randint(0, VOCAB, (batch, CONTEXT + 1), generator=torch.Generator().manual_seed(step))
    x, y = tokens[:, :-1].to(device), tokens[:, 1:].to(device)
    optimizer.zero_grad()
    nn.functional.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1)).backward()
    optimizer.step()


def engine_round(rank: int, world: int, args: Any, fmt: str) -> dict[str, Any]:
    """A training step (AdamW) and one round through the engine's ``Gossip``, interleaved, on this rank."""
    model, wire = make_lm_model(args.width, args.depth), None if fmt == "none" else fmt
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    wrapper = DecentOptimWrapper(inner, topology="ring", compression=wire)  # its own gossip stays idle
    lm_step(model, inner, 0, args.batch, "cpu")  # AdamW's state exists before the rounds
    step = torch.enable_grad()(partial(lm_step, model, inner, batch=args.batch, device="cpu"))
    variants = {"step": step, "round": gossip_round(wrapper, rank, world, wire, guard=True)}
    with torch.no_grad():  # the first round is a group's exact one; the second faults pages in
        times = interleave(variants, args.reps, 2)
    ms = {k.removeprefix("round."): 1e3 * statistics.median(v) for k, v in times.items()}
    params, wire_bytes = sum(b.data.numel() for b in wrapper.buckets), wrapper.engine.bytes_sent_per_step()
    ms["round"] = ms["stage"] + ms["mix"]
    return {"format": fmt, "params": params, "median_ms": ms, "wire_bytes": wire_bytes}


def codec_round(args: Any, fmt: str) -> dict[str, Any]:
    """One process: a pair's round of codec calls on a flat tensor of the model's size, against a step."""
    device = torch.device(args.device)
    model = make_lm_model(args.width, args.depth).to(device)  # seeded
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    numel = sum(p.numel() for p in model.parameters())
    x = torch.randn(numel, device=device)
    reference = x + 1e-3 * torch.randn(numel, device=device)
    total, scratch, diff = torch.empty_like(x), torch.empty_like(x), torch.empty_like(x)
    coder = None if fmt == "none" else codec(resolve_compression(fmt).name)  # type: ignore[union-attr]
    size = coder.payload_bytes(numel, x.dtype) if coder else 0
    payloads, peaks = torch.empty(2, size, dtype=torch.uint8, device=device), []

    def one_round(step: int) -> None:
        if coder is None:  # uncompressed: stage (x / 2) and mix (copy the sum)
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

    def measured_round(step: int) -> float:  # on CUDA, the peak allocated above what was held before
        cuda = device.type == "cuda"
        held = (
            torch.cuda.reset_peak_memory_stats(device) or torch.cuda.memory_allocated(device) if cuda else 0
        )
        seconds = timed_on(device, lambda: one_round(step))
        peaks.extend([torch.cuda.max_memory_allocated(device) - held] if cuda else [])
        return seconds

    lm_step(model, inner, 0, args.batch, device)
    step = partial(lm_step, model, inner, batch=args.batch, device=device)
    times = interleave({"step": step, "round": measured_round}, args.reps, 2, partial(timed_on, device))
    # the round's buffers beyond the replica: the sum (compressed: also reference, decoding buffer, payloads)
    buffers = 4 * numel + (0 if coder is None else 8 * numel + payloads.numel())
    ms = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    extra = (max(peaks) + buffers) / MIB if peaks else None
    return {"format": fmt, "params": numel, "median_ms": ms, "extra_mb": extra}


def compression(args: Any) -> dict[str, Any]:
    """A gossip round (stage + mix) per wire format (--formats) against a training step of a 12.8M-parameter
    language model: on 2 CPU ranks through the engine (--mode engine), or the codec's calls on one device
    with the round's peak memory on CUDA (--mode codec --device cuda)."""
    if args.mode == "engine" and args.device != "cpu":
        raise SystemExit("--mode engine runs on CPU (gloo on loopback); use --mode codec for --device cuda")
    for fmt in set(args.formats) - {"none"}:
        resolve_compression(fmt)  # a wrong format fails here, before any rank starts
    torch.set_num_threads(args.threads)
    on_cpu_ranks = partial(on_ranks, 2, engine_round, args)
    rows = [codec_round(args, f) if args.mode == "codec" else on_cpu_ranks(f)[0] for f in args.formats]
    cells = []
    for row in rows:
        step, round_ms, extra = row["median_ms"]["step"], row["median_ms"]["round"], row.get("extra_mb")
        copies, share = None if extra is None else extra / (row["params"] * 4 / MIB), round_ms / step
        cells.append([row["format"], row["params"] / 1e6, step, round_ms, share, share / 8, extra, copies])
    head = "format|M params|step ms|round ms|round/step|round/(8 steps)|extra MB|copies"
    return {"rows": rows, "tables": [table(f"{args.mode} mode on {args.device}", head, cells, ".4g")]}


def per_call_us(fn: Callable[[], object], calls: int = 2000) -> float:
    return min(timeit.repeat(fn, number=calls, repeat=5)) / calls * 1e6  # the best of 5 runs


def metrics_rank(rank: int, world: int, args: Any) -> dict[str, Any]:
    runs, untimed = {}, mock.patch.object(WaitClock, "timed", lambda self, waiter: waiter)
    for name in ("uncounted", "counted", "counted_control", "read_every_step"):
        model, adamw = mlp_adamw(args, 1e-4)
        with untimed if name == "uncounted" else nullcontext():  # uncounted: the wait clock left out
            runs[name] = (model, DecentOptimWrapper(adamw, topology="ring"))
    x, y = mlp_batch(args)

    def step(name: str) -> None:
        train_step(*runs[name], x, y)
        if name == "read_every_step":
            runs[name][1].metrics()

    pairs = "counted/uncounted counted_control/uncounted read_every_step/counted"
    out = step_ratios({name: partial(step, name) for name in runs}, pairs, args.iters, args.warmup)
    waiter, no_wait, cpu = WaitClock().timed(lambda *_: None), lambda *_: None, torch.device("cpu")
    out |= {"read_us": per_call_us(runs["counted"][1].metrics), "buckets": len(runs["counted"][1].buckets)}
    out |= {"timed_wait_us": per_call_us(lambda: waiter([], cpu, None, RuntimeError))}
    return out | {"bare_wait_us": per_call_us(lambda: no_wait([], cpu, None, RuntimeError))}


def metrics(args: Any) -> dict[str, Any]:
    """The counters of metrics() in a training step on a 2-rank ring: (a) the waits not timed (uncounted),
    counted (the default, never read; again as the control) and read every step; (b) one call alone."""
    t = on_ranks(2, metrics_rank, args)[0]
    calls = [["metrics()", t["read_us"]], ["a wait that returns at once", t["bare_wait_us"]]]
    calls.append(["the same wait, timed by the counters", t["timed_wait_us"]])
    tables = [step_table(f"(a) MLP width {args.width}, {t['buckets']} bucket(s) (rank 0)", t)]
    tables.append(table("(b) one call alone (best of 5 runs)", "call|us", calls, ".2f"))
    return {"time": t, "tables": tables}


def one_record(members: int, repeats: int) -> dict[str, float]:
    """A full record (its last changes of members) of a job of ``members``, sealed, into a TCPStore."""
    store, step = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False), [0]

    class Engine:  # the board holds its source weakly, by a bound method, as it holds the engine's
        def status_fields(self) -> dict[str, Any]:  # a member's fields, as ``GossipEngine``'s
            step[0] += 100
            return {
                "rank": 1, "world_size": members, "step": step[0], "round": step[0], "topology": "ring",
                "bytes_per_step": 6.3e6, "compression": None, "wait_s": 12.5, "losses": 1, "joins": 2,
                "guard": {"withheld": 0, "refused": 0, "healed": 0}, "pace_round_s": None,
                "pace_step_s": None, "consensus": 0.0123, "consensus_step": step[0],
            }  # fmt: skip

    engine, board = Engine(), StatusBoard("cost")
    board.attach(engine.status_fields)
    board.placed("decent-optim-wrapper/cost", 1, 3, list(range(members)), Seal(SECRET.encode()))
    for k in range(MAX_EVENTS):
        board.event("lost", step=k, generation=k, members=[k % members], world_size=members - 1)
    median = statistics.median(timed(lambda: board.publish(store)) for _ in range(repeats))
    size, share = len(store.get(status_key("decent-optim-wrapper/cost", 1))), median / RECORD_S
    return {"members": members, "median_us": median * 1e6, "bytes": size, "share_of_a_core": share}


def set_records(state: str) -> None:
    os.environ[RECORDS_ENV] = "1" if state == "on" else "0"


def records_rank(rank: int, world: int, args: Any) -> dict[str, float]:
    """A member of a 2-rank elastic job (``on_peer_failure="continue"``): its step times."""
    model, adamw = mlp_adamw(args, 1e-3)
    opt = DecentOptimWrapper(adamw, topology="ring", on_peer_failure="continue")
    x = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(rank))
    step = {"step": lambda _: [opt.zero_grad(), model(x).square().mean().backward(), opt.step()]}
    times = interleave(step, args.iters, args.warmup)["step"]
    return {"median_ms": 1e3 * statistics.median(times), "mean_ms": 1e3 * statistics.fmean(times)}


def status_records(args: Any) -> dict[str, Any]:
    """The status records: (a) one record's time and size (jobs of 4, 64, 512 members); (b) a 2-rank
    elastic job's step with the records on and off, alternating over --rounds, the order swapped each time."""
    records, rounds, rows = [one_record(members, args.reps) for members in (4, 64, 512)], [], []
    elastic_job = partial(on_ranks, 2, records_rank, args)
    for k in range(args.rounds):
        order, run = ("on", "off") if k % 2 == 0 else ("off", "on"), {}
        for state in order:
            run[state] = elastic_job(job=f"cost-{k}-{state}", before=partial(set_records, state))[0]
        ms = [run["on"]["median_ms"], run["off"]["median_ms"]]
        rounds.append(run | {"ratio": ms[0] / ms[1], "first": order[0]})
        rows.append([str(k), order[0], *ms, ms[0] / ms[1]])
    ratios = [r["ratio"] for r in rounds]
    spread = f"spread {min(ratios):.4f} to {max(ratios):.4f}"
    rows.append(["median", spread, None, None, statistics.median(ratios)])
    cells = [
        [str(r["members"]), r["median_us"], str(r["bytes"]), 100 * r["share_of_a_core"]] for r in records
    ]
    title = f"(a) one record, sealed, into a TCPStore, one every {RECORD_S:g} s"
    tables = [table(title, "members|us a record|bytes|% of a core", cells, ".4g")]
    title = "(b) median step of a job (rank 0), records on and off"
    tables.append(table(title, "round|first|on ms|off ms|on/off", rows, ".4f"))
    return {"one_record": records, "rounds": rounds, "tables": tables}


#: Timed in fresh interpreters; ``library`` also prints its import's wall and CPU seconds after torch's, the
#: cost (a difference of two whole start-ups would carry the noise of both on a busy machine).
STATEMENTS = {
    "torch": "import torch",
    "torch.distributed": "import torch; import torch.distributed",
    "decent_optim_wrapper": "import torch; import decent_optim_wrapper",
    "library": "import time, torch; wall, cpu = time.perf_counter(), time.process_time(); "
    "import decent_optim_wrapper; print(time.perf_counter() - wall, time.process_time() - cpu)",
}


def fresh_interpreter(statement: str) -> tuple[float, str]:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", statement], check=True, capture_output=True, text=True)
    return time.perf_counter() - start, done.stdout


def import_time(args: Any) -> dict[str, Any]:
    """What `import decent_optim_wrapper` adds to `import torch`, best of --reps fresh interpreters,
    interleaved; the run exits 1 when it is over --budget seconds."""
    fresh_interpreter("import torch")  # warm the file cache: the first interpreter reads torch from disk
    times: dict[str, list[float]] = {name: [] for name in [*STATEMENTS, "library, CPU"]}
    for _ in range(args.reps):
        for name, statement in STATEMENTS.items():
            took, printed = fresh_interpreter(statement)
            times[name].append(took)
        times["library"][-1], cpu = (float(s) for s in printed.split())
        times["library, CPU"].append(cpu)
    cost = min(times["library"])
    rows = [[k, min(t), ", ".join(f"{s:.2f}" for s in t)] for k, t in times.items()]
    difference = min(times["decent_optim_wrapper"]) - min(times["torch"])
    rows.append(["decent_optim_wrapper - torch", difference, None])
    over = cost > args.budget
    title = f"the library's import after torch's: {cost:.2f} s, {'over' if over else 'within'}"
    tables = [table(f"{title} the budget of {args.budget} s", "seconds|best|runs", rows, ".2f")]
    return {"times_s": times, "cost_s": cost, "budget_s": args.budget, "over_budget": over, "tables": tables}


#: Each question: its measurement (its docstring's first paragraph: the question's help), its defaults.
STEP = {"width": 2048, "depth": 3, "batch": 64, "threads": 1, "max_seconds": 600.0}
QUESTIONS: dict[str, tuple[Callable[[Any], dict[str, Any]], dict[str, Any]]] = {
    "overhead": (overhead, STEP | dict(depth=6, reps=40, iters=200, worlds=[1, 2], formats=["bf16", "int8"])),
    "second_moment": (second_moment, STEP | dict(iters=40, warmup=5, memory_steps=5, seed_path=None)),
    "compression": (compression, STEP | dict(width=512, depth=4, batch=16, reps=8, formats=FORMATS,
                                             mode="engine", device="cpu")),
    "metrics": (metrics, STEP | dict(width=1024, iters=200, warmup=5)),
    "status_records": (status_records, STEP | dict(width=256, batch=32, iters=1000, warmup=50, reps=200,
                                                   rounds=4)),
    "import_time": (import_time, dict(reps=3, budget=0.5)),
}  # fmt: skip

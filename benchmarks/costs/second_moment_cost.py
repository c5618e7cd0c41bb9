"""What Adam's second-moment rule costs: time per step and memory, side by side.

Three measurements on an MLP of about 8.4M parameters (``--width 2048 --depth 3``) with AdamW, each
printed as ratios of numbers taken in the same run:

(a) **Training step**, 2 gloo ranks on loopback, one torch thread each (as ``torchrun`` sets):
    forward + backward + step with the bare AdamW (no gossip), and with ``DecentOptimWrapper`` on a
    ring with ``second_moment="local"``, with the default ``"average"`` and with the default and
    this rank's non-finite guard off (``nonfinite_guard=False``), interleaved (the order rotates
    every step). With ``--seed-path`` the seed release (decent-optim-wrapper 0.1.1, whose ranks each
    run their own AdamW: ``"local"``'s rule, without a guard) runs in the same loop
    (``benchmarks/harness/seed_release.py`` says how to install it). Targets (median paired
    ratios): the default at most 1.0x the seed's step and at most 1.08x ``"local"``.
(b) **Optimizer step alone**, one process: torch's AdamW step against the rule's step for n = 2 on
    the same parameters and gradients, interleaved; for torch's single-tensor, foreach and fused
    AdamW.
(c) **Memory**: for each of bare / local / average, a fresh pair of ranks trains ``--memory-steps``
    steps; each reports the growth of its resident set's high-water mark (``VmHWM``) over the
    model and data alone, and the bytes of the optimizer state. glibc is told to map every
    allocation of 64 KiB or more on its own, so the mark follows the tensors alive at once
    (temporaries included), not the allocator's cache. Target: ``average`` at most one state
    tensor (the model's size) over ``local``.

Run: ``uv run benchmarks/costs/second_moment_cost.py`` (about two minutes on 2 cores); ``--json PATH``
saves the results.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing as mp
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.harness.common import build_mlp, collect_from_ranks
from benchmarks.harness.seed_release import load_seed_wrapper, seed_wrapper
from decent_optim_wrapper import DecentOptimWrapper
from decent_optim_wrapper.engine.rules.second_moment import SecondMomentRule

#: The wrappers part (c) measures (``None``: the bare optimizer) ...
METHODS: dict[str, dict[str, Any] | None] = {
    "bare": None,
    "local": {"second_moment": "local"},
    "average": {},
}
#: ... and part (a) times, with the guard's own cost and, given ``--seed-path``, the seed release.
TIMED = {**METHODS, "guard_off": {"nonfinite_guard": False}}
SEED = "seed"
#: (method, the method it is compared with) for part (a)'s ratios.
RATIOS = (
    ("local", "bare"),
    ("average", "local"),
    ("average", SEED),
    ("local", SEED),
    ("guard_off", "average"),
)
MIB = 2**20


def build(args: argparse.Namespace, method: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = build_mlp(args.width, args.width, args.depth, 10)
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if method == SEED:
        return model, seed_wrapper(load_seed_wrapper(args.seed_path), adamw, "ring")
    options = TIMED[method]
    return model, adamw if options is None else DecentOptimWrapper(adamw, topology="ring", **options)


def train_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, batch: tuple[torch.Tensor, torch.Tensor]
) -> None:
    optimizer.zero_grad()
    nn.functional.cross_entropy(model(batch[0]), batch[1]).backward()
    optimizer.step()


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def paired(times: dict[str, list[float]], name: str, against: str) -> dict[str, float]:
    ratios = [a / b for a, b in zip(times[name], times[against], strict=True)]
    return {
        "ms": statistics.median(times[name]) * 1e3,
        "ratio_of_medians": statistics.median(times[name]) / statistics.median(times[against]),
        "median_paired_ratio": statistics.median(ratios),
    }


def training_steps(args: argparse.Namespace) -> dict[str, Any]:
    """Part (a) on one rank: every timed method interleaved."""
    runs = {name: build(args, name) for name in [*TIMED, *([SEED] if args.seed_path else [])]}
    batch = (torch.randn(args.batch, args.width), torch.randint(0, 10, (args.batch,)))
    names = list(runs)
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(args.warmup + args.iters):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            seconds = timed(lambda name=name: train_step(*runs[name], batch))
            if i >= args.warmup:
                times[name].append(seconds)
    return {
        "params": sum(p.numel() for p in runs["bare"][0].parameters()),
        "ms": {name: statistics.median(seconds) * 1e3 for name, seconds in times.items()},
        "ratios": {
            f"{name}/{against}": paired(times, name, against)
            for name, against in RATIOS
            if name in times and against in times
        },
    }


def high_water_bytes() -> int:
    """This process's resident-set high-water mark (``VmHWM``), read after the model is built and after
    the steps: their difference is what the steps added (a forked rank starts from the fork server's
    mark, its imports, below the built model's)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


def memory(args: argparse.Namespace, method: str) -> dict[str, float]:
    """Part (c) on one rank: high-water growth over the model and data, and optimizer-state bytes."""
    model, optimizer = build(args, method)
    batch = (torch.randn(args.batch, args.width), torch.randint(0, 10, (args.batch,)))
    before = high_water_bytes()
    for _ in range(args.memory_steps):
        train_step(model, optimizer, batch)
    peak = high_water_bytes()
    state = sum(
        v.numel() * v.element_size()
        for s in optimizer.state.values()
        for v in s.values()
        if torch.is_tensor(v)
    )
    return {"peak_growth_mib": (peak - before) / MIB, "state_mib": state / MIB}


def rule_against_torch(
    params: list[torch.Tensor],
    flags: dict[str, bool],
    warmup: int,
    iters: int,
    timer: Callable[[Callable[[], object]], float] = timed,
) -> dict[str, list[float]]:
    """Seconds of torch's AdamW step (``"torch"``) and of the rule's step for n = 2 (``"rule"``) on the
    same parameters and gradients, interleaved (the order alternates), after ``warmup`` untimed ones."""
    torch_opt = torch.optim.AdamW(params, lr=1e-4, **flags)
    rule_opt = torch.optim.AdamW(params, lr=1e-4, **flags)
    rule = SecondMomentRule("average")
    steps = {"torch": torch_opt.step, "rule": lambda: rule.step(rule_opt, 2)}
    times: dict[str, list[float]] = {name: [] for name in steps}
    for i in range(warmup + iters):
        for name in ("torch", "rule") if i % 2 else ("rule", "torch"):
            seconds = timer(steps[name])
            if i >= warmup:
                times[name].append(seconds)
    return times


def optimizer_steps(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Part (b): torch's step against the rule's, same parameters and gradients, interleaved."""
    torch.set_num_threads(1)
    out = {}
    for impl, flags in (
        ("single", {"foreach": False}),
        ("foreach", {"foreach": True}),
        ("fused", {"fused": True}),
    ):
        torch.manual_seed(0)
        params = [
            p.detach().requires_grad_()
            for p in build_mlp(args.width, args.width, args.depth, 10).parameters()
        ]
        for p in params:
            p.grad = torch.randn_like(p)
        times = rule_against_torch(params, flags, args.warmup, args.iters)
        out[impl] = {"torch_ms": statistics.median(times["torch"]) * 1e3, **paired(times, "rule", "torch")}
    return out


def map_large_allocations() -> None:
    """Have glibc map every allocation of 64 KiB or more on its own and unmap it when freed, so that the
    high-water mark follows the tensors alive at once, not what glibc's heap keeps cached.

    ``mallopt(M_MMAP_THRESHOLD)``, what ``MALLOC_MMAP_THRESHOLD_`` sets at start-up: a rank forked from
    the fork server (``collect_from_ranks``) starts with the server's allocator, not a new environment.
    """
    m_mmap_threshold = -3  # <malloc.h>
    if ctypes.CDLL(None).mallopt(m_mmap_threshold, 64 * 1024) != 1:
        raise RuntimeError("mallopt(M_MMAP_THRESHOLD) failed: glibc is required for the memory part")


def worker(rank: int, port: int, part: str, args: argparse.Namespace, results: Any) -> None:
    torch.set_num_threads(1)
    if part != "time":
        map_large_allocations()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        results.put((rank, training_steps(args) if part == "time" else memory(args, part)))
    finally:
        dist.destroy_process_group()


def on_two_ranks(part: str, args: argparse.Namespace) -> dict[int, Any]:
    return collect_from_ranks(
        2, worker, lambda rank, port, results: (rank, port, part, args, results), args.max_seconds, part
    )


def report(results: dict[str, Any]) -> None:
    t = results["time"][0]
    print(
        f"commit {results['commit']}, torch {torch.__version__}, {platform.machine()}, "
        f"{results['cpus']} CPUs, 1 thread per rank"
    )
    print(
        f"(a) 2 ranks, ring, AdamW, MLP {t['params'] / 1e6:.2f}M params, batch {results['args']['batch']}, "
        f"{results['args']['iters']} interleaved steps each (rank 0)"
    )
    labels = {
        "bare": "bare AdamW (no gossip)",
        "local": "second_moment='local'",
        "average": "second_moment='average' (default)",
        "guard_off": "default, nonfinite_guard=False",
        SEED: "seed release 0.1.1",
    }
    for name, ms in t["ms"].items():
        print(f"    {labels[name]:<36} {ms:8.2f} ms")
    for pair, r in t["ratios"].items():
        print(
            f"    {pair:<18} ratio of medians {r['ratio_of_medians']:.3f}, "
            f"median paired ratio {r['median_paired_ratio']:.3f}"
        )
    print("    targets: average/seed at most 1.0, average/local at most 1.08 (median paired)")
    print("(b) optimizer step alone (one process): the rule's step (n=2) against torch's AdamW step")
    for impl, r in results["step"].items():
        print(
            f"    {impl:<8} torch {r['torch_ms']:7.2f} ms   rule {r['ms']:7.2f} ms   "
            f"ratio of medians {r['ratio_of_medians']:.3f}, median paired {r['median_paired_ratio']:.3f}"
        )
    print(f"(c) memory, {results['args']['memory_steps']} steps in fresh ranks (rank 0; MiB)")
    mem = {name: results["memory"][name][0] for name in METHODS}
    model_mib = t["params"] * 4 / MIB
    for name, m in mem.items():
        print(
            f"    {name:<8} high-water growth {m['peak_growth_mib']:7.1f}   "
            f"optimizer state {m['state_mib']:7.1f}   "
            f"over bare {m['peak_growth_mib'] - mem['bare']['peak_growth_mib']:7.1f}"
        )
    extra = mem["average"]["peak_growth_mib"] - mem["local"]["peak_growth_mib"]
    print(
        f"    'average' over 'local': {extra:.1f} MiB = {extra / model_mib:.2f} model copies "
        f"({model_mib:.1f} MiB each); target: at most 1"
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--iters", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--memory-steps", type=int, default=5)
    parser.add_argument("--max-seconds", type=float, default=600.0)
    parser.add_argument(
        "--seed-path",
        default=None,
        help="a folder holding decent-optim-wrapper 0.1.1, to time beside the others "
        "(benchmarks/harness/seed_release.py)",
    )
    parser.add_argument("--json", default=None, help="write the results to this file")
    return parser.parse_args()


def commit() -> str | None:
    """The checkout's commit (with ``+dirty`` for uncommitted changes), recorded with the figures."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+dirty" if dirty.strip() else "")


def main() -> None:
    args = parse_args()
    if args.seed_path:
        load_seed_wrapper(args.seed_path)  # a wrong folder fails here, before any rank starts
    results: dict[str, Any] = {
        "args": vars(args),
        "cpus": mp.cpu_count(),
        "torch": torch.__version__,
        "commit": commit(),
    }
    results["time"] = on_two_ranks("time", args)
    results["step"] = optimizer_steps(args)
    results["memory"] = {name: on_two_ranks(name, args) for name in METHODS}
    report(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
        print(f"results written to {args.json}")


if __name__ == "__main__":
    main()

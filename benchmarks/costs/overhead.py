"""The wrapper's own per-step work, measured against memory traffic, and its cost in a training step.

Two measurements, each printed as a ratio of numbers taken side by side in the same run:

(a) **Copy-equivalents.** Per step the engine does two memory passes over the parameters that are
    not network time: the *staging* inside ``Gossip.launch`` (``torch.div(x, k, out=buffer)``: read
    ``x``, write the send buffer) and the *mix* inside ``Gossip.mix`` (uniform groups:
    ``x.copy_(buffer)``; weighted groups: ``x <- own * x + buffer``). Both are timed on the real
    bucket tensors of a ~25M-parameter fp32 model and divided by the time of one plain
    ``dst.copy_(src)`` over a flat tensor of the same size, timed in the same loop. Two ways:

    * ``engine``: the library's own calls, on a ``Gossip`` over the wrapper's buckets built from the
      engine's public parts (as the engine builds its own): ``stage(bucket, step)`` (what
      ``launch`` does before it starts the all-reduce) is timed for every bucket; ``launch`` then
      runs untimed (it stages again and starts the collective), ``wait`` runs untimed (that is the
      network), and ``mix(bucket)`` is timed with nothing left to wait for.
    * ``ops``: the same torch ops the engine runs (``torch.div(x, k, out=buf)`` then
      ``x.copy_(buf)``), on the same bucket tensors, with no communication in flight.

    At world size 1 (a gloo group of one) the topology's group has one rank, so ``launch`` and
    ``mix`` return at once: the engine rows show what that costs, the ops rows what a group would.
    With 2 local gloo processes on a ring every step exchanges with the other rank.

    Guarded mixing (``nonfinite_guard``, on by default: a sum of what is sent and one of what
    arrived) is inside those calls; the same calls on a ``Gossip`` with this rank's guard off run in
    the same loop, and their difference is the guard's own work.

    With ``--compressions`` (default ``bf16 int8``), the 2-rank ring is measured again with each
    compressed wire format: staging then computes ``x - r`` and encodes it into this member's slot
    of the gathered payload, and the mix decodes both members' payloads, sums them, updates ``x``
    and the group's reference ``r``. The compression's own work per step is the difference between
    its copy-equivalents and the uncompressed ring's.

(b) **Training step at world size 1.** Forward + backward + AdamW step of a modest MLP with the bare
    optimizer, with the same optimizer wrapped (``DecentOptimWrapper``), and with the module
    front-end (``DecentralizedDataParallel``, one AdamW per bucket, stepped inside backward),
    interleaved (the order rotates every step) so drift affects all alike. Targets: 1.02 and 1.03.

(c) **Training step at world size 2, by feature.** The same step on a 2-rank ring with
    ``DecentOptimWrapper``: plain (``second_moment="local"``), with Adam's second moment of the
    average gradient (``second_moment="average"``, the default: the rule's own Adam step),
    with this rank's non-finite guard off (``nonfinite_guard=False``: below 1 by what the guard costs),
    a second plain ring (the control: identical to the reference, so its distance from 1 is the
    measurement's own spread, what a feature's cost must exceed to be measurable),
    with gradient tracking (``gradient_tracking=True``: the tracker's own gossip and its update,
    ``y <- W y + g - g_prev``) and with bf16 compression, interleaved the same way; reported
    relative to the plain ring. AccumAdamW (``accum_iter=4``) is timed with ``"local"`` (against the
    plain ring) and with the rule it takes in its own step (against AccumAdamW with ``"local"``).
    Loopback is fast here, so this is the features' compute and memory traffic, not their bytes.

Each process uses ``--threads`` torch threads (default 1). On a small shared VM a multi-threaded
memory pass waits for its slowest thread at every kernel, so with more threads than idle cores the
numbers measure the scheduler; the copy it is compared with always uses the same threads.

Run: ``uv run benchmarks/costs/overhead.py`` (about a minute on 2 cores); ``--json PATH`` saves results.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.harness.common import build_mlp, collect_from_ranks
from decent_optim_wrapper import AccumAdamW, DecentOptimWrapper, DecentralizedDataParallel
from decent_optim_wrapper.engine.exchange.gossip import Gossip
from decent_optim_wrapper.engine.exchange.guard import GuardLog
from decent_optim_wrapper.engine.fleet.comm import ProcessGroups, group_layout
from decent_optim_wrapper.engine.fleet.world import resolve_gossip_world
from decent_optim_wrapper.engine.wire.compression import CompressionPlan, resolve_compression

#: Part (c) rows timed against another row than the plain ring (each against its own optimizer).
COMPARED_WITH = {"ring-accum": "ring", "ring-accum-average": "ring-accum"}


def timed(fn: Callable[[], object]) -> float:
    """Seconds ``fn()`` took."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def median_ms(samples: list[float]) -> float:
    return 1e3 * statistics.median(samples)


def measure_gossip(
    rank: int, world_size: int, width: int, depth: int, reps: int, compression: str | None = None
) -> dict[str, Any]:
    """Part (a) on this rank: median ms of staging, mix and a plain copy; their ratio."""
    torch.manual_seed(0)
    model = build_mlp(width, width, depth, width)
    wrapper = DecentOptimWrapper(
        torch.optim.SGD(model.parameters(), lr=0.0), topology="ring", compression=compression
    )
    tensors = [b.data for b in wrapper.buckets]
    spec = resolve_compression(compression)
    plan = None if spec is None else CompressionPlan(wrapper.topology, spec)
    world = resolve_gossip_world(rank, world_size, None)  # the whole job, as the wrapper's
    groups = ProcessGroups(world, [group_layout(wrapper.topology, world)])
    gossip = Gossip(tensors, wrapper.topology, rank, groups, plan=plan)
    # the same engine calls with this rank's guard off (nonfinite_guard=False): the guard's own reads
    unguarded = Gossip(
        tensors, wrapper.topology, rank, groups, plan=plan, guard=GuardLog(rank, enabled=False)
    )
    buckets = range(gossip.num_buckets)
    numel = sum(t.numel() for t in tensors)
    src, dst = torch.randn(numel), torch.empty(numel)
    send = [torch.empty_like(t) for t in tensors]
    received = [t.clone() for t in tensors]  # x.copy_(received) leaves x as it was, rep after rep
    samples: dict[str, list[float]] = {
        k: []
        for k in (
            "copy",
            "engine_stage",
            "engine_mix",
            "op_div",
            "op_copy",
            "unguarded_stage",
            "unguarded_mix",
        )
    }
    with torch.no_grad():
        for step in range(reps + 3):
            copy = timed(lambda: dst.copy_(src))
            stage = sum(timed(lambda b=b, s=step: gossip.stage(b, s)) for b in buckets)
            for b in buckets:
                gossip.launch(b, step)
            gossip.wait_all()  # network time: not the wrapper's own work
            mix = sum(timed(lambda b=b: gossip.mix(b)) for b in buckets)
            bare_stage = sum(timed(lambda b=b, s=step: unguarded.stage(b, s)) for b in buckets)
            for b in buckets:
                unguarded.launch(b, step)
            unguarded.wait_all()
            bare_mix = sum(timed(lambda b=b: unguarded.mix(b)) for b in buckets)
            div = sum(
                timed(lambda x=x, b=b: torch.div(x, 2, out=b)) for x, b in zip(tensors, send, strict=True)
            )
            back = sum(timed(lambda x=x, b=b: x.copy_(b)) for x, b in zip(tensors, received, strict=True))
            if step >= 3:  # first rounds allocate buffers and fault pages in
                values = (copy, stage, mix, div, back, bare_stage, bare_mix)
                for key, value in zip(samples, values, strict=True):
                    samples[key].append(value)
    med = {key: median_ms(values) for key, values in samples.items()}
    copies = samples["copy"]
    engine = [
        (s + m) / c for s, m, c in zip(samples["engine_stage"], samples["engine_mix"], copies, strict=True)
    ]
    ops = [(d + b) / c for d, b, c in zip(samples["op_div"], samples["op_copy"], copies, strict=True)]
    bare = [
        (s + m) / c
        for s, m, c in zip(samples["unguarded_stage"], samples["unguarded_mix"], copies, strict=True)
    ]
    return {
        "world_size": world_size,
        "rank": rank,
        "params": numel,
        "buckets": len(tensors),
        "threads": torch.get_num_threads(),
        "median_ms": med,
        # the median over repetitions of (staging + mix) / copy, each ratio from one repetition
        "engine_copy_equivalents": statistics.median(engine),
        "ops_copy_equivalents": statistics.median(ops),
        "unguarded_copy_equivalents": statistics.median(bare),
    }


def measure_training_step(iters: int, batch: int, world_size: int = 1) -> dict[str, Any]:
    """Parts (b) and (c): median seconds per step of each way of training the same MLP, interleaved
    (the order rotates every step) so drift affects all alike.

    World size 1: the bare model + AdamW, the optimizer front-end and the module front-end. Larger
    world sizes: the optimizer front-end on a ring, plain, with gradient tracking and with bf16
    compression (the first is the reference of the ratios).
    """
    torch.manual_seed(0)
    reference = build_mlp(512, 1024, 3, 10)

    def copy_of_model() -> nn.Module:
        model = build_mlp(512, 1024, 3, 10)
        model.load_state_dict(reference.state_dict())
        return model

    def adamw(model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(model.parameters(), lr=1e-3)

    def accum_adamw(model: nn.Module) -> torch.optim.Optimizer:
        return AccumAdamW(model.parameters(), lr=1e-3, accum_iter=4)

    runs: dict[str, tuple[nn.Module, torch.optim.Optimizer | None]] = {}
    if world_size == 1:
        runs["bare"] = (reference, adamw(reference))
        wrapped_model = copy_of_model()
        runs["wrapped"] = (wrapped_model, DecentOptimWrapper(adamw(wrapped_model), topology="ring"))
        module = DecentralizedDataParallel(
            copy_of_model(),
            lambda params: torch.optim.AdamW([p for _, p in params], lr=1e-3),
            topology="ring",
        )
        runs["module"] = (module, None)
    else:
        # The reference is the plain ring: every feature, the second-moment rule included, is off.
        for name, options in (
            ("ring", {"second_moment": "local"}),
            ("ring-again", {"second_moment": "local"}),  # the control: what the spread alone gives
            ("ring-average", {}),
            ("ring-unguarded", {"nonfinite_guard": False, "second_moment": "local"}),
            ("ring-gt", {"gradient_tracking": True, "second_moment": "local"}),
            ("ring@bf16", {"compression": "bf16", "second_moment": "local"}),
        ):
            model = copy_of_model()
            runs[name] = (model, DecentOptimWrapper(adamw(model), topology="ring", **options))
        # AccumAdamW takes the rule in its own step: its cost against AccumAdamW without it
        for name, options in (("ring-accum", {"second_moment": "local"}), ("ring-accum-average", {})):
            model = copy_of_model()
            runs[name] = (model, DecentOptimWrapper(accum_adamw(model), topology="ring", **options))
    x, y = torch.randn(batch, 512), torch.randint(0, 10, (batch,))

    def train_step(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        if optimizer is not None:
            optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()  # the module front-end steps in here
        if optimizer is not None:
            optimizer.step()

    names = list(runs)
    base = names[0]
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(iters + 20):
        order = names[i % len(names) :] + names[: i % len(names)]
        for name in order:
            seconds = timed(lambda name=name: train_step(*runs[name]))
            if i >= 20:
                times[name].append(seconds)
    out: dict[str, Any] = {
        "params": sum(p.numel() for p in reference.parameters()),
        "batch": batch,
        "iters": iters,
        "world_size": world_size,
        "reference": base,
        f"{base}_ms": median_ms(times[base]),
    }
    if world_size == 1:
        out["bare_ms"] = median_ms(times["bare"])
    for name in names[1:]:
        against = COMPARED_WITH.get(name, base)
        ratios = [w / b for w, b in zip(times[name], times[against], strict=True)]
        out[name] = {
            "ms": median_ms(times[name]),
            "against": against,
            "ratio_of_medians": statistics.median(times[name]) / statistics.median(times[against]),
            "median_paired_ratio": statistics.median(ratios),
        }
    return out


def worker(rank: int, world_size: int, port: int, args: argparse.Namespace, results: Any) -> None:
    """One gloo rank on loopback: part (a), and part (b) when alone."""
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        out: dict[str, Any] = {"gossip": measure_gossip(rank, world_size, args.width, args.depth, args.reps)}
        if world_size > 1:
            out["compressed"] = {
                wire: measure_gossip(rank, world_size, args.width, args.depth, args.reps, wire)
                for wire in args.compressions
            }
        if world_size <= 2:
            out["train_step"] = measure_training_step(args.train_iters, args.batch, world_size)
        results.put((rank, out))
    finally:
        dist.destroy_process_group()


def run_world(world_size: int, args: argparse.Namespace) -> dict[int, dict[str, Any]]:
    """Spawn ``world_size`` local ranks, return each rank's results; kill them at the deadline."""
    return collect_from_ranks(
        world_size,
        worker,
        lambda rank, port, results: (rank, world_size, port, args, results),
        args.max_seconds,
        f"world size {world_size}",
    )


def print_report(by_world: dict[int, dict[int, dict[str, Any]]]) -> None:
    """The table of part (a) for rank 0 of each world size, then part (b)."""
    first = by_world[min(by_world)][0]["gossip"]
    print(
        f"(a) wrapper's own work per step, {first['params'] / 1e6:.1f}M fp32 params "
        f"in {first['buckets']} buckets, medians over the repetitions (rank 0)"
    )
    header = f"{'world':>5} {'thr':>3} {'copy ms':>8} {'stage ms':>9} {'mix ms':>7} {'engine c-eq':>11}"
    print(header + f" {'op div ms':>10} {'op copy ms':>11} {'ops c-eq':>9}")
    for world_size, ranks in sorted(by_world.items()):
        g = ranks[0]["gossip"]
        m = g["median_ms"]
        print(
            f"{world_size:>5} {g['threads']:>3} {m['copy']:>8.2f} {m['engine_stage']:>9.2f} "
            f"{m['engine_mix']:>7.2f} {g['engine_copy_equivalents']:>11.2f} {m['op_div']:>10.2f} "
            f"{m['op_copy']:>11.2f} {g['ops_copy_equivalents']:>9.2f}"
        )
        if "unguarded_copy_equivalents" in g:
            own = g["engine_copy_equivalents"] - g["unguarded_copy_equivalents"]
            print(
                f"{'':>5} the same with nonfinite_guard=False: {g['unguarded_copy_equivalents']:.2f} "
                f"copy-equivalents; the guard's own work: {own:+.2f}"
            )
        for rank, other in sorted(ranks.items())[1:]:
            print(
                f"{'':>5} rank {rank}: engine {other['gossip']['engine_copy_equivalents']:.2f}, "
                f"ops {other['gossip']['ops_copy_equivalents']:.2f} copy-equivalents"
            )
        for wire, c in sorted(ranks[0].get("compressed", {}).items()):
            m = c["median_ms"]
            own = c["engine_copy_equivalents"] - g["engine_copy_equivalents"]
            print(
                f"{'@' + wire:>5} {c['threads']:>3} {m['copy']:>8.2f} {m['engine_stage']:>9.2f} "
                f"{m['engine_mix']:>7.2f} {c['engine_copy_equivalents']:>11.2f}   "
                f"compression's own work: {own:+.2f} copy-equivalents"
            )
    print("copy-equivalents = (staging + mix) / one dst.copy_(src) of all parameters; target <= 3")
    print("(floor: 2.0 for uniform groups, copy_ from the buffer; 2.5 for weighted groups, add)")
    t = by_world[1][0]["train_step"]
    print(
        f"\n(b) world size 1, forward+backward+AdamW, MLP {t['params'] / 1e6:.2f}M params, batch "
        f"{t['batch']}, {t['iters']} interleaved steps each"
    )
    print(f"    bare model + AdamW {t['bare_ms']:.3f} ms")
    for name, label, target in (
        ("wrapped", "DecentOptimWrapper", 1.02),
        ("module", "DecentralizedDataParallel", 1.03),
    ):
        r = t[name]
        print(
            f"    {label:<26} {r['ms']:.3f} ms   ratio of medians {r['ratio_of_medians']:.4f}   "
            f"median paired ratio {r['median_paired_ratio']:.4f}   (target <= {target})"
        )
    if 2 in by_world and "train_step" in by_world[2][0]:
        t = by_world[2][0]["train_step"]
        print(
            f"\n(c) world size 2 (ring on loopback), forward+backward+AdamW, same MLP and batch, "
            f"{t['iters']} interleaved steps each, relative to the plain ring ({t['ring_ms']:.3f} ms)"
        )
        for name, label in (
            ("ring-again", "the plain ring again"),
            ("ring-average", "second_moment='average'"),
            ("ring-unguarded", "nonfinite_guard=False"),
            ("ring-gt", "gradient_tracking=True"),
            ("ring@bf16", "compression='bf16'"),
            ("ring-accum", "AccumAdamW, 'local'"),
            ("ring-accum-average", "AccumAdamW, 'average'"),
        ):
            if name not in t:  # results from before the row existed
                continue
            r = t[name]
            against = "" if r.get("against", "ring") == "ring" else f"   (against {r['against']})"
            print(
                f"    {label:<26} {r['ms']:.3f} ms   ratio of medians {r['ratio_of_medians']:.4f}   "
                f"median paired ratio {r['median_paired_ratio']:.4f}{against}"
            )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=2048, help="Linear width (default 2048)")
    parser.add_argument("--depth", type=int, default=6, help="Linear layers (default 6: ~25M params)")
    parser.add_argument("--reps", type=int, default=40, help="timed repetitions of part (a)")
    parser.add_argument("--train-iters", type=int, default=200, help="timed steps of each kind in (b)")
    parser.add_argument("--batch", type=int, default=64, help="batch size of the training step in (b)")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads per process (default 1: see the module docstring)",
    )
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2], help="world sizes for (a)")
    parser.add_argument(
        "--compressions",
        nargs="*",
        default=["bf16", "int8"],
        help="wire formats measured again on the ring at world sizes > 1 (default: bf16 int8)",
    )
    parser.add_argument("--max-seconds", type=float, default=300.0, help="deadline per world size")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if 1 not in args.worlds:
        args.worlds = [1, *args.worlds]  # part (b) runs at world size 1
    print(f"torch {torch.__version__}, {platform.machine()}, {os.cpu_count()} CPUs, gloo on loopback")
    by_world = {w: run_world(w, args) for w in args.worlds}
    print_report(by_world)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {str(w): {str(r): v for r, v in ranks.items()} for w, ranks in by_world.items()}, f, indent=2
            )
        print(f"results written to {args.json}")


if __name__ == "__main__":
    main()

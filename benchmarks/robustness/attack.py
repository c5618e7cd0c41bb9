"""One Byzantine worker among 8: what DDP, plain gossip and clipped gossip reach under its attack.

    uv run benchmarks/robustness/attack.py                 # 8 local gloo workers, ~5 minutes on 2 cores
    uv run benchmarks/robustness/attack.py --json benchmarks/results/robustness/attack.json
    uv run benchmarks/robustness/attack.py --task lm        # the language model, ~45 minutes on 2 cores

Trains the main job's classification task (``synthetic_task.py``: 10 overlapping Gaussian clusters,
the MLP, the iid split) on 8 workers with SGD (lr 0.05, momentum 0.9, batch 32), every method the same
steps, seeds and data, with no attacker and with worker 3 attacking in one of three ways:

- ``scaled``: after each local step its model is multiplied by 100 (DDP: its gradient by 100);
- ``random``: its model is replaced by Gaussian noise of standard deviation 10 (DDP: its gradient);
- ``negated``: its model is negated (DDP: its gradient).

With ``--task lm``: the byte-level language model of ``lm_task.py`` (iid split, AdamW lr 3e-3, batch 16
windows of 64 bytes), the validation loss in place of the test loss (no accuracy).

Methods: ``ddp`` (an all-reduce of the gradients, by hand so that the attacker's gradient enters
it), ``ring`` (plain gossip: the non-finite guard is on, but these values are finite) and
``ring-clipped`` (``clipped_gossip=True``). Reported per method and attack: the honest workers' test
loss and accuracy (each honest worker's own replica, the worst of them: the attacker's replica is
not averaged in), and the ratio of the loss to the same method's without the attacker; a job the
attack stopped (its values overflowed until no replica around it was finite:
``NonFiniteReplicaError``) counts as an infinite loss. Target,
marked met or MISSED: ``ring-clipped`` under every attack within 5% of its own loss without one.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.harness.common import collect_from_ranks
from benchmarks.harness.lm_task import make_lm_data, make_lm_model, validation_loss, windows
from benchmarks.harness.synthetic_task import make_data, make_model, split_data
from decent_optim_wrapper import ClippedGossip, DecentOptimWrapper

ATTACKER = 3
ATTACKS = (None, "scaled", "random", "negated")
METHODS = ("ddp", "ring", "ring-clipped")
TARGET_RATIO = 1.05


def _corrupt(tensors: list[torch.Tensor], attack: str, generator: torch.Generator) -> None:
    with torch.no_grad():
        for t in tensors:
            if attack == "scaled":
                t.mul_(100.0)
            elif attack == "random":
                t.copy_(torch.randn(t.shape, generator=generator, dtype=t.dtype) * 10)
            else:
                t.neg_()


def _evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    with torch.no_grad():
        logits = model(x)
        loss = float(nn.functional.cross_entropy(logits, y))
        return loss, float((logits.argmax(1) == y).float().mean())


def _task(task: str, rank: int, world: int) -> tuple[nn.Module, Any, Any, Any]:
    """The model, its optimizer's factory, a batch drawer and the evaluation of ``task``."""
    draws = torch.Generator().manual_seed(100 + rank)
    if task == "lm":
        tokens, validation = make_lm_data(world, rank, "iid")
        lm = make_lm_model()

        def lm_batch() -> tuple[torch.Tensor, torch.Tensor]:
            x, y = windows(tokens, torch.randint(0, len(tokens) - 65, (16,), generator=draws))
            return x, y.reshape(-1)

        return (
            lm,
            lambda params: torch.optim.AdamW(params, lr=3e-3),
            lm_batch,
            lambda: (validation_loss(lm, validation), math.nan),
        )
    x_train, y_train, x_test, y_test = make_data()
    mine = split_data(y_train, world)[rank]
    model = make_model()

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        pick = mine[torch.randint(0, len(mine), (32,), generator=draws)]
        return x_train[pick], y_train[pick]

    return (
        model,
        lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
        batch,
        lambda: _evaluate(model, x_test, y_test),
    )


def worker(
    rank: int,
    port: int,
    world: int,
    method: str,
    attack: str | None,
    steps: int,
    task: str,
    clipping: ClippedGossip,
    results: Any,
) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        model, make_optimizer, next_batch, evaluate = _task(task, rank, world)
        inner = make_optimizer(model.parameters())
        attacker = attack is not None and rank == ATTACKER
        generator = torch.Generator().manual_seed(11)
        optimizer: torch.optim.Optimizer = inner
        if method != "ddp":
            if attacker:
                assert attack is not None
                inner.register_step_post_hook(
                    lambda opt, args, kwargs: _corrupt(list(model.parameters()), attack, generator)
                )
            optimizer = DecentOptimWrapper(
                inner, topology="ring", clipped_gossip=clipping if method == "ring-clipped" else None
            )
        start = time.perf_counter()
        for _ in range(steps):
            x, y = next_batch()
            optimizer.zero_grad()
            logits = model(x)
            nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y).backward()
            if method == "ddp":
                grads = [p.grad for p in model.parameters() if p.grad is not None]
                if attacker:
                    assert attack is not None
                    _corrupt(grads, attack, generator)
                for g in grads:
                    dist.all_reduce(g)
                    g.div_(world)
            optimizer.step()
        seconds = time.perf_counter() - start
        loss, accuracy = evaluate()
        results.put((rank, {"loss": loss, "accuracy": accuracy, "attacker": attacker, "seconds": seconds}))
    except BaseException:
        # A lost job's rounds never complete, and tearing the group down would wait for them: report the
        # failure and leave at once (the parent kills the ranks still waiting on this one).
        traceback.print_exc()
        os._exit(1)
    dist.destroy_process_group()


def run(
    method: str,
    attack: str | None,
    world: int,
    steps: int,
    task: str = "classification",
    clipping: ClippedGossip | None = None,
) -> dict[str, Any]:
    clipping = clipping or ClippedGossip()
    try:
        by_rank = collect_from_ranks(
            world,
            worker,
            lambda rank, port, results: (rank, port, world, method, attack, steps, task, clipping, results),
            900,
            f"{method} under {attack}",
        )
    except RuntimeError as err:  # the job was lost (e.g. NonFiniteReplicaError once the attack overflowed)
        return {"method": method, "attack": attack, "loss": math.inf, "accuracy": 0.0, "failed": str(err)}
    honest = [r for r in by_rank.values() if not r["attacker"]]
    losses = [r["loss"] for r in honest]
    return {
        "method": method,
        "attack": attack,
        "loss": max(losses) if all(math.isfinite(v) for v in losses) else math.inf,
        "accuracy": min(r["accuracy"] for r in honest),
        "seconds": max(r["seconds"] for r in by_rank.values()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument(
        "--attacks", nargs="+", default=["none", *ATTACKS[1:]], choices=["none", *ATTACKS[1:]]
    )
    parser.add_argument("--task", choices=("classification", "lm"), default="classification")
    parser.add_argument(
        "--clip-factor", type=float, default=ClippedGossip.factor, help="ring-clipped's radius factor"
    )
    parser.add_argument(
        "--clip-quantile", type=float, default=ClippedGossip.quantile, help="ring-clipped's quantile"
    )
    parser.add_argument(
        "--clip-drop",
        type=lambda text: None if text.lower() == "none" else float(text),
        default=ClippedGossip.drop_beyond,
        help="ring-clipped's drop_beyond: leave out differences longer than this many radii (default "
        f"{ClippedGossip.drop_beyond}; none: clip them all)",
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows = []
    for method in args.methods:
        for attack in (None if name == "none" else name for name in args.attacks):
            clipping = ClippedGossip(
                factor=args.clip_factor, quantile=args.clip_quantile, drop_beyond=args.clip_drop
            )
            row = run(method, attack, args.workers, args.steps, args.task, clipping)
            rows.append(row)
            print(
                f"[{method} / {attack or 'no attack'}] loss {row['loss']:.4f} accuracy {row['accuracy']:.4f}"
            )
    print(
        f"\nOne attacker (worker {ATTACKER}) among {args.workers} workers, {args.steps} steps, "
        + ("the language model (validation loss)" if args.task == "lm" else "the main job's task (test loss)")
        + f"; the worst honest worker's own replica; ring-clipped: ClippedGossip(factor={args.clip_factor}, "
        + f"quantile={args.clip_quantile}, drop_beyond={args.clip_drop})"
    )
    header = (
        f"{'method':>13} | {'attack':>9} | {'test loss':>9} | {'accuracy':>8} | {'vs no attack':>12} | target"
    )
    print(header)
    print("-" * len(header))
    clean = {r["method"]: r["loss"] for r in rows if r["attack"] is None}
    for row in rows:
        ratio = row["loss"] / clean.get(row["method"], math.nan)
        row["ratio"] = ratio
        judged = row["method"] == "ring-clipped" and row["attack"] is not None
        mark = (
            ("met" if ratio <= TARGET_RATIO else "MISSED")
            if judged
            else ("job lost" if "failed" in row else "-")
        )
        print(
            f"{row['method']:>13} | {row['attack'] or 'none':>9} | {row['loss']:9.4f} | "
            f"{row['accuracy']:8.4f} | {ratio:12.3f} | {mark}"
        )
    print(f"Target: ring-clipped under every attack within {TARGET_RATIO}x its own loss without one.")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "task": args.task,
                    "workers": args.workers,
                    "steps": args.steps,
                    "clip_factor": args.clip_factor,
                    "clip_quantile": args.clip_quantile,
                    "clip_drop": args.clip_drop,
                    "rows": rows,
                },
                f,
                indent=2,
            )
        print(f"results written to {args.json}")


if __name__ == "__main__":
    main()

"""One Byzantine worker among 8: what DDP, plain gossip and clipped gossip reach under its attack.

    uv run benchmarks/robustness/attack.py                 # 8 local gloo workers, ~8 minutes on 2 cores
    uv run benchmarks/robustness/attack.py --json benchmarks/results/robustness/attack.json
    uv run benchmarks/robustness/attack.py --task digits --steps 200 --seeds 0 1 2
    uv run benchmarks/robustness/attack.py --task lm        # the language model, ~70 minutes on 2 cores

Trains the main job's classification task (``synthetic_task.py``: 10 overlapping Gaussian clusters,
the MLP, the iid split) on 8 workers with SGD (lr 0.05, momentum 0.9, batch 32), every method the same
steps, seeds and data, with no attacker and with worker 3 attacking in one of five ways:

- ``scaled``: after each local step its model is multiplied by 100 (DDP: its gradient by 100);
- ``random``: its model is replaced by Gaussian noise of standard deviation 10 (DDP: its gradient);
- ``negated``: it trains as an honest worker (its replica restored before each step) and sends the
  negation of its replica every round (DDP: its gradient negated);
- ``alternating``: the same, sending its replica in even rounds and its negation in odd ones (DDP:
  its gradient negated every other step);
- ``flipping``: its model is negated in place after each step, so its sign flips every round and
  every other round it sends a stale, near-honest replica (DDP: its gradient negated).

With ``--task lm``: the byte-level language model of ``lm_task.py`` (iid split, AdamW lr 3e-3, batch 16
windows of 64 bytes), the validation loss in place of the test loss (no accuracy). With ``--task
digits``: scikit-learn's handwritten digits (``digits_task.py``), a 64-64-10 MLP, SGD as above.
``--seeds``: each seed draws the initial model and the batches (seed 0: the runs before seeds).

Methods: ``ddp`` (an all-reduce of the gradients, by hand so that the attacker's gradient enters
it), ``ring`` (plain gossip: the non-finite guard is on, but these values are finite) and
``ring-clipped`` (``clipped_gossip=True``). Reported per method, attack and seed: the honest workers'
test loss and accuracy (each honest worker's own replica, the worst of them: the attacker's replica is
not averaged in), and the ratio of the loss to the same method's and seed's without the attacker; a
job the attack stopped (its values overflowed until no replica around it was finite:
``NonFiniteReplicaError``) counts as an infinite loss. Target, marked met or MISSED:
``ring-clipped`` under every attack and seed within 5% of its own loss without one.
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
from benchmarks.harness.digits_task import make_digits, make_digits_model
from benchmarks.harness.lm_task import make_lm_data, make_lm_model, validation_loss, windows
from benchmarks.harness.synthetic_task import make_data, make_model, split_data
from decent_optim_wrapper import ClippedGossip, DecentOptimWrapper

ATTACKER = 3
ATTACKS = (None, "scaled", "random", "negated", "alternating", "flipping")
#: Attacks that send a corruption of an honest replica: the attacker's own is restored before each step.
HONEST_UNDERNEATH = ("negated", "alternating")
TASKS = ("classification", "digits", "lm")
METHODS = ("ddp", "ring", "ring-clipped")
TARGET_RATIO = 1.05


class _Attack:
    """What worker ``ATTACKER`` does to the tensors it sends (its parameters, or under DDP its
    gradients) after each of its steps."""

    def __init__(self, attack: str, seed: int) -> None:
        self.attack, self.steps = attack, 0
        self.generator = torch.Generator().manual_seed(11 + seed)
        self.honest: list[torch.Tensor] | None = None  # its own replica, for HONEST_UNDERNEATH

    @torch.no_grad()
    def corrupt(self, tensors: list[torch.Tensor], keep_honest: bool) -> None:
        if keep_honest and self.attack in HONEST_UNDERNEATH:
            self.honest = [t.detach().clone() for t in tensors]
        odd = self.steps % 2 == 1
        self.steps += 1
        for t in tensors:
            if self.attack == "scaled":
                t.mul_(100.0)
            elif self.attack == "random":
                t.copy_(torch.randn(t.shape, generator=self.generator, dtype=t.dtype) * 10)
            elif self.attack != "alternating" or odd:
                t.neg_()

    @torch.no_grad()
    def restore(self, tensors: list[torch.Tensor]) -> None:
        """Before a step: back to its honest replica (the neighbours' values it mixed in are kept)."""
        if self.honest is not None:
            for t, honest in zip(tensors, self.honest, strict=True):
                t.copy_(honest)


def _evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    with torch.no_grad():
        logits = model(x)
        loss = float(nn.functional.cross_entropy(logits, y))
        return loss, float((logits.argmax(1) == y).float().mean())


def _task(task: str, rank: int, world: int, seed: int) -> tuple[nn.Module, Any, Any, Any]:
    """The model, its optimizer's factory, a batch drawer and the evaluation of ``task``."""
    draws = torch.Generator().manual_seed(100 + rank + 1000 * seed)
    if task == "lm":
        tokens, validation = make_lm_data(world, rank, "iid")
        lm = make_lm_model(seed=seed)

        def lm_batch() -> tuple[torch.Tensor, torch.Tensor]:
            x, y = windows(tokens, torch.randint(0, len(tokens) - 65, (16,), generator=draws))
            return x, y.reshape(-1)

        return (
            lm,
            lambda params: torch.optim.AdamW(params, lr=3e-3),
            lm_batch,
            lambda: (validation_loss(lm, validation), math.nan),
        )
    if task == "digits":
        x_train, y_train, x_test, y_test = make_digits()
        model = make_digits_model(seed, hidden=(64,))
    else:
        x_train, y_train, x_test, y_test = make_data()
        model = make_model(seed)
    mine = split_data(y_train, world)[rank]

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
    seed: int,
    clipping: ClippedGossip,
    results: Any,
) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        model, make_optimizer, next_batch, evaluate = _task(task, rank, world, seed)
        params = list(model.parameters())
        inner = make_optimizer(params)
        attacker = _Attack(attack, seed) if attack is not None and rank == ATTACKER else None
        optimizer: torch.optim.Optimizer = inner
        if method != "ddp":
            if attacker is not None:  # after the local step, before the round is sent
                inner.register_step_post_hook(lambda opt, args, kwargs: attacker.corrupt(params, True))
            optimizer = DecentOptimWrapper(
                inner, topology="ring", clipped_gossip=clipping if method == "ring-clipped" else None
            )
        start = time.perf_counter()
        for _ in range(steps):
            if attacker is not None:
                attacker.restore(params)
            x, y = next_batch()
            optimizer.zero_grad()
            logits = model(x)
            nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y).backward()
            if method == "ddp":
                grads = [p.grad for p in params if p.grad is not None]
                if attacker is not None:
                    attacker.corrupt(grads, False)
                for g in grads:
                    dist.all_reduce(g)
                    g.div_(world)
            optimizer.step()
        seconds = time.perf_counter() - start
        if attacker is not None:
            attacker.restore(params)
        loss, accuracy = evaluate()
        # The honest workers' average model too: whether the fleet as a whole lost ground.
        with torch.no_grad():
            own = torch.nn.utils.parameters_to_vector(params)
            replicas = torch.empty(world * own.numel(), dtype=own.dtype)
            dist.all_gather_into_tensor(replicas, own)
            replicas = replicas.view(world, -1)
            honest = [r for r in range(world) if attack is None or r != ATTACKER]
            torch.nn.utils.vector_to_parameters(replicas[honest].mean(0), params)
        average_loss, _ = evaluate()
        results.put(
            (
                rank,
                {
                    "loss": loss,
                    "accuracy": accuracy,
                    "average_loss": average_loss,
                    "attacker": attacker is not None,
                    "seconds": seconds,
                },
            )
        )
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
    seed: int = 0,
) -> dict[str, Any]:
    clipping = clipping or ClippedGossip()
    row: dict[str, Any] = {"method": method, "attack": attack, "seed": seed}
    try:
        by_rank = collect_from_ranks(
            world,
            worker,
            lambda rank, port, results: (
                rank,
                port,
                world,
                method,
                attack,
                steps,
                task,
                seed,
                clipping,
                results,
            ),
            1800,
            f"{method} under {attack}, seed {seed}",
        )
    except RuntimeError as err:  # the job was lost (e.g. NonFiniteReplicaError once the attack overflowed)
        return {**row, "loss": math.inf, "accuracy": 0.0, "failed": str(err)}
    honest = [r for r in by_rank.values() if not r["attacker"]]
    losses = [r["loss"] for r in honest]
    return {
        **row,
        "loss": max(losses) if all(math.isfinite(v) for v in losses) else math.inf,
        "mean_loss": sum(losses) / len(losses),
        "average_loss": honest[0]["average_loss"],
        "accuracy": min(r["accuracy"] for r in honest),
        "seconds": max(r["seconds"] for r in by_rank.values()),
    }


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument(
        "--attacks", nargs="+", default=["none", *ATTACKS[1:]], choices=["none", *ATTACKS[1:]]
    )
    parser.add_argument("--task", choices=TASKS, default="classification")
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
    return parser


def main() -> None:
    args = _parser().parse_args()
    clipping = ClippedGossip(factor=args.clip_factor, quantile=args.clip_quantile, drop_beyond=args.clip_drop)
    attacks = [None if name == "none" else name for name in args.attacks]
    rows = []
    for seed in args.seeds:
        for method in args.methods:
            for attack in attacks:
                row = run(method, attack, args.workers, args.steps, args.task, clipping, seed)
                rows.append(row)
                print(
                    f"[{method} / {attack or 'no attack'} / seed {seed}] loss {row['loss']:.4f} "
                    f"(mean {row.get('mean_loss', math.inf):.4f}, honest average's "
                    f"{row.get('average_loss', math.inf):.4f}) accuracy {row['accuracy']:.4f}",
                    flush=True,
                )
    clean = {(r["method"], r["seed"]): r["loss"] for r in rows if r["attack"] is None}
    for row in rows:
        row["ratio"] = row["loss"] / clean.get((row["method"], row["seed"]), math.nan)
    print(
        f"\nOne attacker (worker {ATTACKER}) among {args.workers} workers, {args.steps} steps, seeds "
        f"{args.seeds}, task {args.task} ("
        + ("validation loss" if args.task == "lm" else "test loss")
        + f"); the worst honest worker's own replica; ring-clipped: ClippedGossip(factor={args.clip_factor}, "
        + f"quantile={args.clip_quantile}, drop_beyond={args.clip_drop}). Loss: the mean over seeds; "
        + "vs no attack: the mean and the worst of the seeds' ratios."
    )
    header = (
        f"{'method':>13} | {'attack':>11} | {'loss':>9} | {'accuracy':>8} | {'vs no attack':>17} | target"
    )
    print(header)
    print("-" * len(header))
    for method in args.methods:
        for attack in attacks:
            mine = [r for r in rows if r["method"] == method and r["attack"] == attack]
            ratios = [r["ratio"] for r in mine]
            worst = max(ratios)
            judged = method == "ring-clipped" and attack is not None
            lost = any("failed" in r for r in mine)
            mark = ("met" if worst <= TARGET_RATIO else "MISSED") if judged else ("job lost" if lost else "-")
            loss = sum(r["loss"] for r in mine) / len(mine)
            accuracy = sum(r["accuracy"] for r in mine) / len(mine)
            spread = f"{sum(ratios) / len(ratios):.3f} ({worst:.3f})"
            print(
                f"{method:>13} | {attack or 'none':>11} | {loss:9.4f} | {accuracy:8.4f} | "
                f"{spread:>17} | {mark}"
            )
    print(
        f"Target: ring-clipped under every attack and seed within {TARGET_RATIO}x its own loss without one."
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "task": args.task,
                    "workers": args.workers,
                    "steps": args.steps,
                    "seeds": args.seeds,
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

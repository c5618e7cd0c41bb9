"""Second-moment rules for Adam under averaging, simulated in one process (no process group).

``n`` replicas of ``lm_task.py``'s model, each with its own AdamW (written out here) and data, averaged
exactly after every step or, with ``gossip``, mixed by its matrices one step late as the engine does;
``ddp`` is one model stepped with the average gradient. The rules differ only in what each step divides
by: ``local`` s_t; ``oracle`` the exact average gradient's; ``-floor``: s_t fed g_t^2 / n + (1 - 1/n) g_t x
(x: g_{t-1} for ``lag1``, m_hat_{t-1} for ``momentum``), floored; ``lag1``, ``momentum`` and their ``-abs``
(the engine's rule): s_t / n + (1 - 1/n) max(c_t, 0) (or |c_t|), c_t = b2 c + (1 - b2) g_t x.
"""

from __future__ import annotations

import argparse
import math
import time
from typing import Any

import torch
from torch.func import functional_call

from benchmarks.harness.lm_task import CONTEXT, VOCAB, make_lm_data, make_lm_model, validation_loss, windows
from benchmarks.harness.report import markdown_table
from decent_optim_wrapper import TopologyFactory

BETAS, EPS = (0.9, 0.999), 1e-8


class _Replica:
    """One replica's parameters and AdamW state (m, s), plus what the rules keep (c, g_{t-1})."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params = [p.clone() for p in params]
        self.m, self.s, self.c = ([torch.zeros_like(p) for p in params] for _ in range(3))
        self.previous: list[torch.Tensor | None] = [None for _ in params]


def _divisor(rule: str, r: _Replica, k: int, g: torch.Tensor, t: int, n: int, mean: torch.Tensor | None):
    """Update replica ``r``'s moments of tensor ``k`` with gradient ``g``; return what step t divides by."""
    b1, b2 = BETAS
    m_prev_hat = r.m[k] / (1 - b1 ** (t - 1)) if t > 1 else g
    previous = r.previous[k] if r.previous[k] is not None else g
    r.previous[k] = g
    r.m[k].mul_(b1).add_(g, alpha=1 - b1)
    m_hat = r.m[k] / (1 - b1**t)
    other, s = previous if rule.startswith("lag1") else m_prev_hat, r.s[k].mul_(b2)
    if rule.startswith("oracle"):
        assert mean is not None
    if rule == "oracle":
        return s.addcmul_(mean, mean, value=1 - b2)
    if rule == "oracle-per-tensor":
        return s.add_(g * g * ((mean * mean).sum() / (g * g).sum()).clamp(1 / n, 1.0), alpha=1 - b2)
    if rule.endswith("-floor"):
        s.add_(g * g / n + (1 - 1 / n) * g * other, alpha=1 - b2)
        return torch.maximum(s, (1 - b2**t) * m_hat * m_hat, out=s)
    s.addcmul_(g, g, value=1 - b2)
    if rule in ("ddp", "local"):
        return s
    r.c[k].mul_(b2).add_(g * other, alpha=1 - b2)
    signal = r.c[k].abs() if rule.endswith("-abs") else r.c[k].clamp(min=0)
    return r.s[k] / n + (1 - 1 / n) * signal


def simulate(
    rule: str, n: int, steps: int, batch: int, lr: float, split: str, gossip: str | None, width: int = 64,
    depth: int = 2, seed: int = 0,
) -> float:  # fmt: skip
    """Train ``n`` replicas with ``rule``; the validation loss of their average."""
    model = make_lm_model(width, depth, seed)
    names = [name for name, _ in model.named_parameters()]
    start = [p.detach().clone() for p in model.parameters()]
    replicas = [_Replica(start) for _ in range(1 if rule == "ddp" else n)]
    data = [make_lm_data(n, rank, split)[0] for rank in range(n)]
    validation = make_lm_data(n, 0, split)[1]
    samplers = [torch.Generator().manual_seed(100 + rank + 1000 * seed) for rank in range(n)]
    topology = TopologyFactory.create(gossip, n) if gossip and rule != "ddp" else None
    sent: list[list[torch.Tensor]] = []
    tensors = range(len(start))

    def gradient(params: list[torch.Tensor], rank: int) -> list[torch.Tensor]:
        starts = torch.randint(0, len(data[rank]) - CONTEXT - 1, (batch,), generator=samplers[rank])
        x, y = windows(data[rank], starts)
        leaves = [p.detach().requires_grad_(True) for p in params]
        logits = functional_call(model, dict(zip(names, leaves, strict=True)), (x,))
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
        return list(torch.autograd.grad(loss, leaves))

    b1, b2 = BETAS
    for t in range(1, steps + 1):
        lr_t = lr * (1 + math.cos(math.pi * (t - 1) / steps)) / 2
        if rule == "ddp":
            per_rank = [gradient(replicas[0].params, rank) for rank in range(n)]
            grads = [[sum(g[k] for g in per_rank) / n for k in tensors]]
        else:
            grads = [gradient(r.params, rank) for rank, r in enumerate(replicas)]
        if topology is not None and t > 1:  # the round launched at step t - 1: what each replica sent
            w = topology.mixing_matrix(t - 2).double()
            for i, r in enumerate(replicas):
                r.params = [
                    sum(float(w[i, j]) * sent[j][k] for j in range(n) if w[i, j] != 0) for k in tensors
                ]
        means = [sum(g[k] for g in grads) / len(grads) for k in tensors]
        for r, g in zip(replicas, grads, strict=True):
            for k in tensors:
                divisor = _divisor(rule, r, k, g[k], t, n, means[k] if rule.startswith("oracle") else None)
                denominator = (divisor / (1 - b2**t)).sqrt().add_(EPS)
                r.params[k] = r.params[k].addcdiv(r.m[k] / (1 - b1**t), denominator, value=-lr_t)
        if topology is not None:
            sent = [[p.clone() for p in r.params] for r in replicas]
        elif len(replicas) > 1:
            for k in tensors:
                average = sum(r.params[k] for r in replicas) / len(replicas)
                for r in replicas:
                    r.params[k] = average.clone()
    final = sent if topology is not None else [r.params for r in replicas]
    with torch.no_grad():
        for k, p in enumerate(model.parameters()):
            p.copy_(sum(params[k] for params in final) / len(final))
    return validation_loss(model, validation)


def answer(args: argparse.Namespace) -> tuple[Any, str]:
    """Every rule in turn (``ddp`` first unless ``--ddp-loss`` gives its loss)."""
    rules = args.rules if "ddp" in args.rules or args.ddp_loss else ["ddp", *args.rules]
    mixing = f"gossip ({args.gossip})" if args.gossip else "exact average"
    torch.set_num_threads(1)
    results = []
    for rule in rules:
        began = time.perf_counter()
        loss = simulate(
            rule, args.workers, args.steps, args.batch_size, args.adam_lr, args.split, args.gossip,
            args.width, args.depth, args.seed,
        )  # fmt: skip
        seconds = time.perf_counter() - began
        results.append(
            dict(rule=rule, workers=args.workers, mixing=mixing, validation_loss=loss, seconds=seconds)
        )
        print(f"{rule:>18}: validation loss {loss:.4f} ({seconds:.0f} s)", flush=True)
    reference = next((r["validation_loss"] for r in results if r["rule"] == "ddp"), args.ddp_loss)
    rows = [[r["rule"], f"{r['validation_loss']:.4f}", r["validation_loss"] / reference] for r in results]
    title = (
        f"{args.workers} replicas, {mixing} after every AdamW step, {args.steps} steps, "
        f"batch {args.batch_size}, lr {args.adam_lr}, {args.split} split, width {args.width}, "
        f"depth {args.depth}, seed {args.seed}"
    )
    return results, f"{title}\n\n{markdown_table(['rule', 'val loss', '/ ddp'], rows)}"

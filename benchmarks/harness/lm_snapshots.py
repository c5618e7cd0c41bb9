"""What the language model's time-to-loss drivers share: the model's own step time here, the replicas'
average evaluated from the parameters the ranks wrote (``lm_worker.py``), and when a curve reaches a loss.

Used by ``low_communication/time_to_loss_cluster.py`` and ``uneven_fleet/time_to_loss.py``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks.harness.lm_task import CONTEXT, VOCAB, make_lm_data, make_lm_model, validation_loss, windows


def real_step_seconds(args: argparse.Namespace, steps: int = 30) -> float:
    """Median seconds of the model's own forward, backward and AdamW step here, one thread."""
    torch.set_num_threads(1)
    tokens, _ = make_lm_data(1, 0, "iid")
    model = make_lm_model(args.width, args.depth)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.adam_lr)
    sampler = torch.Generator().manual_seed(0)
    times = []
    for _ in range(steps):
        x, y = windows(tokens, torch.randint(0, len(tokens) - CONTEXT - 1, (args.batch,), generator=sampler))
        start = time.perf_counter()
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1)).backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2]


def evaluate(outdir: Path, nodes: int, args: argparse.Namespace) -> dict[str, Any]:
    """The average model's validation loss at every written step, and when every rank had passed it."""
    ranks = [json.loads((outdir / f"rank{r}.json").read_text()) for r in range(nodes)]
    _, validation = make_lm_data(1, 0, "iid")
    model = make_lm_model(args.width, args.depth)
    curve = []
    for i, (step, _) in enumerate(ranks[0]["points"]):
        flats = [torch.load(outdir / f"rank{r}-step{step}.pt") for r in range(nodes)]
        torch.nn.utils.vector_to_parameters(torch.stack(flats).mean(0), model.parameters())
        seconds = max(r["points"][i][1] for r in ranks)
        curve.append((step, seconds, validation_loss(model, validation)))
    steps, seconds = curve[-1][0], curve[-1][1]
    return {
        "curve": curve,
        "steps": steps,
        "step_ms": 1e3 * seconds / steps,
        "bytes_sent_per_step": max(r["bytes_sent_per_step"] for r in ranks),
    }


def reached(curve: list[tuple[int, float, float]], target: float) -> tuple[int, float] | None:
    """The first (step, seconds) at which the average's validation loss is at most ``target``."""
    return next(((s, t) for s, t, loss in curve if loss <= target), None)

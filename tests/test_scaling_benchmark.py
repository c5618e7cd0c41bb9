"""The scaling benchmark's pieces that need no cluster: the emulated model, and the simulator's check.

``benchmarks/emulated.py`` must keep the real model's parameters (so DDP and the engine bucket and
send the same bytes) and sleep the compute it is given; ``benchmarks/scaling_report.py`` must
reproduce every committed run of the emulated cluster within the 15% the simulator promises.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
# The benchmark scripts import their siblings by plain name, with benchmarks/ on sys.path (as
# `uv run benchmarks/scaling.py` runs them); nothing else on sys.path has these names.
sys.path.append(str(ROOT / "benchmarks"))

import scaling_report  # noqa: E402
from common import build_mlp  # noqa: E402
from emulated import ROWS, EmulatedMLP  # noqa: E402

pytestmark = pytest.mark.pure


def test_emulated_mlp_has_the_real_parameters_and_sleeps_its_compute():
    model = EmulatedMLP(32, 16, 3, 10, forward_fraction=0.4)
    real = build_mlp(32, 16, 3, 10)
    assert [p.shape for p in model.parameters()] == [p.shape for p in real.parameters()]
    model.compute_s = 0.06
    start = time.perf_counter()
    loss = torch.nn.functional.cross_entropy(model(torch.randn(ROWS, 32)), torch.randint(0, 10, (ROWS,)))
    forward = time.perf_counter()
    loss.backward()
    end = time.perf_counter()
    # sleeps last at least what they are asked; the upper side is left alone (a loaded machine)
    assert forward - start >= 0.4 * 0.06 and end - forward >= 0.6 * 0.06
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


RECORDS = scaling_report.load(scaling_report.RESULTS, "emulated")


@pytest.mark.skipif(not RECORDS, reason="no committed runs of benchmarks/scaling.py")
def test_simulator_reproduces_every_committed_run_within_15_percent():
    rows = scaling_report.validate(RECORDS)
    worst = max(rows, key=lambda row: abs(row["error"]))
    assert abs(worst["error"]) <= 0.15, worst

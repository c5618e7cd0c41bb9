"""The scaling benchmark's pieces that need no cluster: the worker, the emulated model, the simulator's check.

``benchmarks/harness/cluster_worker.py`` must run every method under every scenario (two ranks on loopback,
the ``examples`` tier); ``benchmarks/harness/emulated_compute.py`` must keep the real model's parameters (so
DDP and the engine bucket and send the same bytes) and sleep the compute it is given;
``benchmarks/scaling/scaling_report.py`` must reproduce the committed runs of the emulated cluster within the
errors docs/scaling.md states.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
from helpers import run_ranks

from benchmarks.harness.common import build_mlp
from benchmarks.harness.emulated_compute import ROWS, EmulatedMLP
from benchmarks.scaling import scaling_report

ROOT = Path(__file__).resolve().parents[1]

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


@pytest.mark.skipif(not RECORDS, reason="no committed runs of benchmarks/scaling/scaling.py")
def test_simulator_reproduces_every_committed_run_with_one_rank_per_node_within_15_percent():
    rows = scaling_report.validate([r for r in RECORDS if r["args"]["workers_per_node"] == 1])
    worst = max(rows, key=lambda row: abs(row["error"]))
    assert abs(worst["error"]) <= 0.15, worst


@pytest.mark.skipif(not RECORDS, reason="no committed runs of benchmarks/scaling/scaling.py")
def test_simulator_reproduces_every_committed_run_with_two_ranks_per_node_within_15_percent():
    rows = scaling_report.validate([r for r in RECORDS if r["args"]["workers_per_node"] == 2])
    worst = max(rows, key=lambda row: abs(row["error"]))
    assert abs(worst["error"]) <= 0.15, worst


@pytest.mark.examples
def test_worker_runs_every_method_and_scenario_on_loopback(tmp_path):
    """Two ranks of ``cluster_worker.py`` on 127.0.0.1 (no namespaces, no root): the keys and counts."""
    from benchmarks.harness.common import free_port

    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
    flags = ["--world-size", "2", "--rounds", "1", "--iters", "2", "--warmup", "1", "--inputs", "16"]
    flags += [
        "--width",
        "16",
        "--compute",
        "emulated",
        "--compute-ms",
        "5",
        "--scenarios",
        "none",
        "lognormal",
    ]
    flags += ["--methods", "nocomm", "ddp", "ring@bf16"]
    paths = run_ranks(
        ROOT / "benchmarks" / "harness" / "cluster_worker.py", 2, flags, tmp_path, env, deadline_s=90
    )
    result = json.loads(paths[0].read_text())
    keys = [f"{s}/{m}" for s in ("none", "lognormal") for m in ("nocomm", "ddp", "ring@bf16")]
    assert sorted(result["times"]) == sorted(keys)
    assert all(len(result["times"][k]) == 2 for k in keys)
    assert all(t >= 0.005 for k in keys for t in result["times"][k])  # each step slept its compute
    assert result["bytes_sent_per_step"]["none/nocomm"] == 0
    assert "busy_s" in result["measured"]["none/ddp"]  # rank 0 reads the machine's CPU

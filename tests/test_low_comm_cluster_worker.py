"""``benchmarks/low_communication/low_comm_cluster_worker.py`` without a cluster, every kind of method.

The emulated slow link (``benchmarks/low_communication/low_comm_cluster.py``) needs root; its worker does not.
Two ranks on 127.0.0.1 train a tiny MLP with the no-communication baseline, DDP, torch's periodic model
averaging, and low-communication gossip, plus torchft's DiLoCo where the ``bench`` group is installed; the
output must hold every method's timed steps and the bytes each sends per step.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
from helpers import run_ranks

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.examples

ITERS = 4
METHODS = ["nocomm", "ddp", "avg~h2", "ring~h2n@bf16"]
if importlib.util.find_spec("torchft") is not None:  # `uv run --group bench pytest ...`
    METHODS += ["torchft~h2", "torchft~h2d1"]


@pytest.mark.timeout(150)
def test_worker_runs_every_kind_of_method_on_loopback(tmp_path):
    from benchmarks.harness.common import free_port

    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "NODE_ADDR": "127.0.0.1",
        "TORCHFT_PORT_BASE": str(free_port()),
        "OMP_NUM_THREADS": "1",
    }
    flags = ["--world-size", "2", "--rounds", "1", "--iters", str(ITERS), "--warmup", "2"]
    flags += ["--inputs", "16", "--width", "16", "--batch", "8", "--methods", *METHODS]
    paths = run_ranks(
        ROOT / "benchmarks" / "low_communication" / "low_comm_cluster_worker.py", 2, flags, tmp_path, env
    )
    for path in paths:
        result = json.loads(path.read_text())
        assert sorted(result["times"]) == sorted(METHODS)
        assert all(len(result["times"][m]) == ITERS for m in METHODS)
        sent = result["bytes_sent_per_step"]
        model_bytes = 4 * result["params"]
        assert sent["nocomm"] == 0
        assert sent["ddp"] == pytest.approx(model_bytes)  # a ring all-reduce at 2 ranks: one model
        assert sent["avg~h2"] == pytest.approx(model_bytes / 2)  # the same, every other step
        # bf16 halves the bytes, and a round every 2 steps halves them again.
        assert 0 < sent["ring~h2n@bf16"] <= model_bytes / 4 * 1.01

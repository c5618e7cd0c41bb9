"""The Accelerate cluster benchmark at a toy size: its rank on loopback (the loss at equal steps is the
convergence driver's ``accelerate`` question, tested in ``test_bench_convergence.py``).

``benchmarks/accelerate/accelerate_cluster.py`` builds the emulated cluster (root, namespaces); here
two of its ranks run on 127.0.0.1, as ``run_workers`` would start them inside the nodes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.helpers import ROOT, run_ranks

pytestmark = pytest.mark.examples

BENCHMARKS = ROOT / "benchmarks" / "accelerate"


def test_cluster_rank_times_every_method_on_loopback(tmp_path: Path) -> None:
    pytest.importorskip("accelerate", reason="the [accelerate] extra is not installed")
    from benchmarks.harness.common import free_port

    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
    methods = ["nocomm", "ddp", "local-sgd", "gossip-complete", "gossip-ring"]
    flags = ["--world-size", "2", "--rounds", "1", "--iters", "4", "--warmup", "0", "--every", "2"]
    flags += ["--inputs", "16", "--width", "16", "--batch", "8", "--methods", *methods]
    paths = run_ranks(BENCHMARKS / "accelerate_cluster.py", 2, flags, tmp_path, env, deadline_s=240)
    result = json.loads(paths[0].read_text())
    assert sorted(result["times"]) == sorted(methods)
    assert all(len(result["times"][m]) == 4 for m in methods)
    sent = result["bytes_sent_per_step"]
    assert sent["nocomm"] == 0
    # DDP all-reduces one model's gradients a step, LocalSGD one model every K = 2 steps; gossip with
    # sync_every=2 sends one model every 2 steps in a pair.
    assert sent["ddp"] == pytest.approx(2 * sent["local-sgd"])
    assert sent["gossip-ring"] == pytest.approx(sent["gossip-complete"]) and sent["gossip-ring"] > 0

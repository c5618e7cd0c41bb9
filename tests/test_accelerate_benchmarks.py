"""The Accelerate benchmarks at a toy size: the loss driver end to end, the cluster's rank on loopback.

``benchmarks/accelerate/accelerate_cluster.py`` builds the emulated cluster (root, namespaces); here
two of its ranks run on 127.0.0.1, as ``run_workers`` would start them inside the nodes.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from tests.helpers import ROOT, run_ranks, run_script

pytestmark = pytest.mark.examples

BENCHMARKS = ROOT / "benchmarks" / "accelerate"


def test_loss_driver_trains_every_kind_of_method(tmp_path: Path) -> None:
    pytest.importorskip("accelerate", reason="the [accelerate] extra is not installed")
    records = tmp_path / "records.json"
    flags = ["--workers", "2", "--seeds", "0", "--tasks", "classification", "--classification-steps", "8"]
    flags += ["--every", "4", "--methods", "ddp", "local-sgd", "gossip-ring-d1", "--json", str(records)]
    output = run_script(str(BENCHMARKS / "accelerate_vs_local_sgd.py"), *flags, deadline_s=300)
    assert "| classification | gossip-ring-d1 |" in output
    by_method = {r["method"]: r for r in json.loads(records.read_text())}
    assert sorted(by_method) == ["ddp", "gossip-ring-d1", "local-sgd"]
    for method, record in by_method.items():
        assert record["steps"] == 8 and math.isfinite(record["val_loss"]), method
        # DDP's replicas are equal, LocalSGD's after its last mean (step 8 of K = 4), gossip's after
        # global_avg: every rank evaluates the same model.
        assert len(set(record["val_loss_all_ranks"])) == 1, (method, record["val_loss_all_ranks"])


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

"""The Accelerate loss benchmark at a toy size, end to end (its step time on the emulated cluster is
``benchmarks/cluster/run.py accelerate``, tested in ``test_bench_cluster.py``)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.helpers import ROOT, run_script

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

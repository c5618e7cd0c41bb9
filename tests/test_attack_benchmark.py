"""The attack benchmark end to end on a small fleet, so that it cannot rot unnoticed.

``benchmarks/robustness/attack.py`` at full size takes minutes (classification) to most of an hour
(the language model) on 2 cores. Here: 4 workers, 40 steps, worker 3 multiplying its model by 100
after each step. Plain gossip loses the job (the attacker's values overflow until nobody around it can
heal) and the benchmark must report that promptly instead of waiting for the lost rounds; clipped
gossip keeps the honest workers within the benchmark's own 5% target of its run without the attacker.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.examples
@pytest.mark.timeout(420)
def test_attack_benchmark_reports_a_lost_plain_job_and_a_held_clipped_one(tmp_path):
    out = tmp_path / "attack.json"
    flags = ["--workers", "4", "--steps", "40", "--methods", "ring", "ring-clipped"]
    flags += ["--attacks", "none", "scaled", "--json", str(out)]
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "robustness" / "attack.py"), *flags],
        capture_output=True,
        text=True,
        timeout=400,
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = {(r["method"], r["attack"]): r for r in json.loads(out.read_text())["rows"]}
    assert sorted(rows, key=str) == sorted(
        [("ring", None), ("ring", "scaled"), ("ring-clipped", None), ("ring-clipped", "scaled")], key=str
    )
    assert all(math.isfinite(rows[(m, None)]["loss"]) for m in ("ring", "ring-clipped"))
    # Plain gossip: the job is lost (an infinite loss) rather than hanging or reporting garbage.
    assert "failed" in rows[("ring", "scaled")] and rows[("ring", "scaled")]["loss"] == math.inf
    # Clipped gossip: the honest workers' worst loss within the target of its own clean run.
    assert rows[("ring-clipped", "scaled")]["ratio"] <= 1.05
    assert "met" in run.stdout and "job lost" in run.stdout

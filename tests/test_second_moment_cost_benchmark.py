"""``benchmarks/costs/second_moment_cost.py`` runs end to end at a tiny size, and measures what it says."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.examples

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(300)
def test_second_moment_cost_benchmark_runs_every_part(tmp_path):
    out = tmp_path / "cost.json"
    run = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "costs" / "second_moment_cost.py"),
            *("--width", "256", "--depth", "2", "--iters", "2", "--warmup", "1", "--memory-steps", "2"),
            *("--json", str(out)),
        ],
        capture_output=True,
        text=True,
        timeout=280,
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    for part in ("(a)", "(b)", "(c)"):
        assert part in run.stdout
    results = json.loads(out.read_text())
    memory = {name: ranks["0"] for name, ranks in results["memory"].items()}
    params = results["time"]["0"]["params"]
    # AdamW's state: exp_avg and exp_avg_sq (and the step counters); the rule adds one signal tensor
    assert memory["average"]["state_mib"] - memory["local"]["state_mib"] == pytest.approx(
        params * 4 / 2**20, rel=1e-3
    )
    assert set(results["step"]) == {"single", "foreach", "fused"}

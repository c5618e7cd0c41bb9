"""``benchmarks/costs/status_records.py`` runs end to end at a tiny size (both parts, one round)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.examples  # a benchmark end to end, in subprocesses

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(400)
def test_status_records_benchmark_runs_both_parts(tmp_path):
    out = tmp_path / "status_records.json"
    run = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "costs" / "status_records.py"),
            *("--rounds", "1", "--steps", "20", "--warmup", "2", "--width", "16", "--repeats", "3"),
            *("--json", str(out)),
        ],
        capture_output=True,
        text=True,
        timeout=360,
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "(a) one record" in run.stdout and "median ratio on/off" in run.stdout
    results = json.loads(out.read_text())
    assert [row["world"] for row in results["one_record"]] == [4, 64, 512]
    assert all(0 < row["bytes"] < 16_000 for row in results["one_record"])
    assert len(results["rounds"]) == 1 and results["rounds"][0]["ratio"] > 0

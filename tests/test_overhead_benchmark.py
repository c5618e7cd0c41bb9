"""``benchmarks/costs/overhead.py`` runs end to end at a tiny size.

The benchmark builds the engine's gossip from its public parts (process groups, layouts), so a
change to those parts breaks it; this runs every part once, small, so the break shows here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.examples  # a benchmark end to end, in subprocesses (about 80 s)

ROOT = Path(__file__).resolve().parents[1]


def test_overhead_benchmark_runs_every_part(tmp_path):
    out = tmp_path / "overhead.json"
    run = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "costs" / "overhead.py"),
            *("--width", "64", "--depth", "2", "--reps", "1", "--train-iters", "2"),
            *("--worlds", "1", "2", "--compressions", "bf16", "--json", str(out)),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    for part in ("(a)", "(b)", "(c)"):
        assert part in run.stdout
    assert "AccumAdamW, 'average'" in run.stdout and "(against ring-accum)" in run.stdout
    assert json.loads(out.read_text())


def test_metrics_cost_benchmark_times_every_run(tmp_path):
    out = tmp_path / "metrics-cost.json"
    run = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "costs" / "metrics_cost.py"),
            *("--width", "32", "--iters", "4", "--warmup", "1", "--json", str(out)),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "counted/uncounted" in run.stdout and "one metrics() read" in run.stdout
    timing = json.loads(out.read_text())["time"]["0"]
    assert set(timing["ms"]) == {"uncounted", "counted", "counted_control", "read_every_step"}
    assert timing["read_us"] > 0

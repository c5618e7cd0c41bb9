"""``benchmarks/language_model/lm_time_to_loss.py`` on hand-made results of the language model runs.

(The convergence driver's own tests are in ``test_bench_convergence.py``.)
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

from benchmarks.convergence.lm import LMResult

ROOT = Path(__file__).resolve().parents[1]


def _result(method: str, loss: float, curve: list[tuple[int, float]]) -> LMResult:
    return LMResult(method, "iid", loss, loss, 1.0, 1.0, curve, 4, 3e-3, 100)


@pytest.mark.pure
def test_time_to_loss_multiplies_steps_by_the_planners_step_time(tmp_path):
    results = [
        _result("ddp+adamw", 2.0, [(10, 2.5), (20, 2.0)]),
        _result("ring+adamw", 2.03, [(10, 2.4), (20, 2.03)]),  # within 2% at step 20
        _result("ring+adamw-local", 2.2, [(10, 2.6), (20, 2.2)]),  # never
        _result("ring~h1d0+adamw", 2.0, [(10, 2.03), (20, 2.0)]),  # blocking, within 2% at step 10
    ]
    # two files of one run (the second reuses the first's DDP result): merged into one table
    first, second = tmp_path / "lm.json", tmp_path / "lm-blocking.json"
    first.write_text(json.dumps([asdict(r) for r in results[:3]]))
    second.write_text(json.dumps([asdict(r) for r in (results[0], results[3])]))
    script = str(ROOT / "benchmarks" / "language_model" / "lm_time_to_loss.py")
    run = subprocess.run(
        [sys.executable, script, str(first), str(second), "--compute-ms", "10"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    rows = {
        line.split("|")[0].strip(): [c.strip() for c in line.split("|")] for line in run.stdout.splitlines()
    }
    ddp, ring = rows["ddp+adamw"], rows["ring+adamw"]
    assert ddp[1] == ring[1] == "20"
    assert float(ring[3]) == pytest.approx(20 * float(ring[2]) / 1000, rel=1e-2)  # steps x step time
    assert float(ring[4]) < 1.0  # gossip's step is shorter than DDP's on links this slow
    assert rows["ring+adamw-local"][1] == "never"
    # blocking: the round is not hidden behind the 10 ms of compute, so its step is longer
    blocking = rows["ring~h1d0+adamw"]
    assert blocking[1] == "10" and float(blocking[2]) > max(10.0, float(ring[2]))
    assert float(blocking[3]) == pytest.approx(10 * float(blocking[2]) / 1000, rel=1e-2)
    assert run.stdout.count("DDP's final validation loss") == 1

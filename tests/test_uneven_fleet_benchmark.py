"""The uneven-fleet benchmark: its rates and planner columns, its worker on loopback.

``benchmarks/uneven_fleet/uneven_fleet.py`` needs root and network namespaces; here its analysis runs on
hand-made step times with known answers, and its worker trains on loopback (two gloo ranks, a few rounds,
rank 0 slower), so that none of it can rot unnoticed. (The time to DDP's loss of the language model is
``benchmarks/time_to_loss/run.py uneven``: ``tests/test_bench_time_to_loss.py``.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks.harness.common import free_port
from benchmarks.uneven_fleet import uneven_fleet as driver
from benchmarks.uneven_fleet.uneven_fleet_worker import speed_factor

ROOT = Path(__file__).resolve().parents[1]
ARGS = SimpleNamespace(
    compute_ms=40.0, shift_s=6.0, sync_every=8, rounds=30, inputs=256, width=512, depth=2, nocomm_s=5.0
)


@pytest.mark.pure
def test_speed_factors_of_the_scenarios():
    assert [speed_factor("half2x", r, 4, 0.0, 6.0) for r in range(4)] == [2.0, 2.0, 1.0, 1.0]
    assert [speed_factor("one3x", r, 4, 0.0, 6.0) for r in range(4)] == [3.0, 1.0, 1.0, 1.0]
    assert [speed_factor("shift", r, 4, 5.9, 6.0) for r in range(4)] == [3.0, 1.0, 1.0, 1.0]
    assert [speed_factor("shift", r, 4, 6.1, 6.0) for r in range(4)] == [1.0, 1.0, 1.0, 3.0]


@pytest.mark.pure
def test_own_rates_and_todays_bound():
    # one3x on 4 ranks, 40 ms and o = 10 ms: rates 1/0.13 + 3/0.05; today 4 / 0.13
    total, today = driver.own_rates("one3x", 4, (1.0, 3.0), 0.010, ARGS)
    assert total == pytest.approx(1 / 0.13 + 3 / 0.05)
    assert today == pytest.approx(4 / 0.13)
    # shift over a window half before, half after the change: the same sums (one slow rank each time)
    assert driver.own_rates("shift", 4, (5.0, 7.0), 0.010, ARGS) == pytest.approx((total, today))


def _rank(start: float, step_s: float, steps: int, per_round: int) -> dict:
    ends = [start + step_s * (k + 1) for k in range(steps)]
    return {"start": start, "ends": ends, "round_ends": ends[per_round - 1 :: per_round]}


@pytest.mark.pure
def test_fleet_rate_counts_every_rank_in_the_common_window():
    # paced: rank 0 takes 4 steps of 0.2 s per round, rank 1 12 of 0.0667 s: 5 + 15 steps/s together
    ranks = [
        {"one3x/paced": _rank(100.0, 0.2, 4 * 20, 4)},
        {"one3x/paced": _rank(100.0, 0.2 / 3, 12 * 20, 12)},
    ]
    entry = driver.fleet_rate(ranks, "one3x/paced", "paced", ARGS)  # type: ignore[arg-type]
    assert entry["steps_per_s"] == pytest.approx(20.0, rel=0.02)
    assert entry["window_s"][0] == pytest.approx(0.2 * 4 * 5)  # after 5 rounds
    assert entry["steps"] == [80, 240]


@pytest.mark.pure
def test_overhead_is_the_step_time_beyond_compute():
    ranks = [{"half2x/nocomm": _rank(0.0, 0.080 + 0.005, 50, 8)}, {"half2x/nocomm": _rank(0.0, 0.045, 90, 8)}]
    assert driver.overhead_seconds(ranks, "half2x", ARGS) == pytest.approx(0.005)  # type: ignore[arg-type]


@pytest.mark.pure
def test_the_planner_column_ranks_the_methods_as_measured():
    planned = driver.planned_rates("one3x", 8, 190.0, 0.004, ARGS)  # type: ignore[arg-type]
    assert set(planned) == {"ddp", "sync", "paced"}
    # sync moves at the slow rank's pace (8 / 0.124 s); paced approaches the sum of own rates
    assert planned["sync"] == pytest.approx(8 / 0.124, rel=0.05)
    assert planned["paced"] > 2 * planned["sync"]
    assert planned["paced"] <= 1 / 0.124 + 7 / 0.044
    assert driver.planned_rates("shift", 8, 190.0, 0.004, ARGS) == {}  # type: ignore[arg-type]


@pytest.mark.examples
@pytest.mark.timeout(240)
def test_worker_runs_every_method_on_loopback(tmp_path):
    port = free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        cmd = [sys.executable, str(driver.WORKER), "--rank", str(rank), "--world-size", "2"]
        cmd += ["--scenarios", "one3x", "--rounds", "8", "--sync-every", "4", "--compute-ms", "10"]
        cmd += [
            "--nocomm-s",
            "0.5",
            "--width",
            "32",
            "--inputs",
            "16",
            "--out",
            str(tmp_path / f"rank{rank}.json"),
        ]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True))
    for proc in procs:
        _, err = proc.communicate(timeout=200)
        assert proc.returncode == 0, err[-2000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert set(ranks[0]) == {f"one3x/{m}" for m in ("nocomm", "ddp", "sync", "paced")}
    assert [len(r["one3x/ddp"]["ends"]) for r in ranks] == [32, 32]
    assert [len(r["one3x/sync"]["round_ends"]) for r in ranks] == [8, 8]
    paced = [r["one3x/paced"] for r in ranks]
    assert [len(p["round_ends"]) for p in paced] == [8, 8]
    assert len(paced[1]["ends"]) > len(paced[0]["ends"])  # the fast rank took more steps
    assert paced[0]["pace"]["round_s"] == paced[1]["pace"]["round_s"]  # one agreed round length

"""The uneven-fleet benchmarks: their rates, planner columns and times to loss, their workers on loopback.

``benchmarks/uneven_fleet/time_to_loss.py`` needs root and network namespaces;
here their analysis runs on hand-made step times and loss curves with known answers, and their workers
train on loopback (two gloo ranks, a few rounds, rank 0 slower; the language model's worker by rounds,
synchronous and paced, its written parameters evaluated by the driver's code), so that none of it can
rot unnoticed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks.harness import lm_worker
from benchmarks.harness.common import free_port
from benchmarks.uneven_fleet import time_to_loss as ttl

ROOT = Path(__file__).resolve().parents[1]


def _rank(start: float, step_s: float, steps: int, per_round: int) -> dict:
    ends = [start + step_s * (k + 1) for k in range(steps)]
    return {"start": start, "ends": ends, "round_ends": ends[per_round - 1 :: per_round]}


# The time to DDP's loss (benchmarks/uneven_fleet/time_to_loss.py): its analysis on hand-made curves and
# step times, its workers' command lines, and the shared language-model worker by rounds on loopback.

TTL_ARGS = SimpleNamespace(
    compute_ms=100.0,
    shift_s=0.0,
    sync_every=8,
    steps=240,
    budget=2.0,
    eval_every=16,
    nocomm_steps=24,
    batch=8,
    adam_lr=3e-3,
    width=64,
    depth=2,
    gossip="ring~h8d1",
)


def _curve(points: list[tuple[int, float, float]]) -> dict:
    return {"curve": points, "steps": points[-1][0]}


@pytest.mark.pure
def test_time_to_ddps_loss_and_the_ratio():
    runs = {
        "ddp": _curve([(100, 50.0, 2.5), (240, 120.0, 2.0)]),
        "sync": _curve([(240, 100.0, 2.1), (320, 150.0, 1.99), (480, 220.0, 1.9)]),
        "paced": _curve([(240, 40.0, 2.1), (320, 60.0, 2.0), (480, 90.0, 1.9)]),
    }
    row = ttl.time_to_target(runs)
    assert row["target"] == 2.0
    assert row["hits"] == {"ddp": (240, 120.0), "sync": (320, 150.0), "paced": (320, 60.0)}
    assert row["sync_over_paced"] == pytest.approx(2.5)
    assert row["sync_reached"] is True
    # synchronous gossip never gets there: the ratio is a lower bound, from its last evaluation
    runs["sync"] = _curve([(240, 100.0, 2.2), (480, 220.0, 2.05)])
    row = ttl.time_to_target(runs)
    assert row["hits"]["sync"] is None
    assert row["sync_over_paced"] == pytest.approx(220.0 / 60.0)
    assert row["sync_reached"] is False
    # paced never gets there: no ratio, and the target is missed
    runs["paced"] = _curve([(480, 90.0, 2.01)])
    row = ttl.time_to_target(runs)
    assert row["sync_over_paced"] is None
    row.update(planner_error={"ddp": 0.05, "sync": -0.1, "paced": 0.02})
    assert ttl.verdicts(row) == {"sooner": False, "planner": True}
    row.update(sync_over_paced=1.6, planner_error={"ddp": 0.2})
    assert ttl.verdicts(row) == {"sooner": True, "planner": False}


@pytest.mark.pure
def test_time_to_loss_workers_command_lines(tmp_path):
    args = SimpleNamespace(**vars(TTL_ARGS))
    assert ttl.gossip_rounds(args) == 60  # 2 x 240 steps' samples, 8 steps a round

    def flags(method: str, rank: int) -> dict[str, str]:
        argv = ttl.worker_argv(method, rank, 4, "one3x", 12.0, tmp_path, args)  # type: ignore[arg-type]
        assert argv[0] == str(ttl.WORKER)
        return dict(zip(argv[1::2], argv[2::2], strict=True))

    slow, fast = flags("paced", 0), flags("paced", 1)
    assert float(slow["--pad-ms"]) == pytest.approx(3 * 100.0 - 12.0)  # the factor tops up the sleep
    assert float(fast["--pad-ms"]) == pytest.approx(100.0 - 12.0)
    assert (slow["--method"], slow["--rounds"], slow["--eval-rounds"], slow["--pacing"]) == (
        "ring~h8d1",
        "60",
        "2",
        "measured",
    )
    assert flags("sync", 1)["--pacing"] == "none"
    ddp = flags("ddp", 2)
    assert (ddp["--method"], ddp["--stop-at"]) == ("ddp", "240") and "--rounds" not in ddp
    assert flags("nocomm", 0)["--stop-at"] == "24"
    assert ttl.parse_args(["--gossip", "ring~h4d1", "--methods", "paced"]).methods == [
        "nocomm",
        "ddp",
        "paced",
    ]
    with pytest.raises(SystemExit):
        ttl.parse_args(["--gossip", "ring~h8d1p"])  # a fixed schedule: measured pacing is the point


@pytest.mark.pure
def test_time_to_loss_rates_beside_the_planner():
    # one3x on 4 ranks, 100 ms: sync moves at the slow rank's 0.3 s a step, paced at the sum of own rates
    def rank(start: float, step_s: float, steps: int, per_round: int, overhead: float = 0.0) -> dict:
        return _rank(start, step_s + overhead, steps, per_round)

    timing = []
    for r in range(4):
        slow = r == 0
        timing.append(
            {
                "one3x/nocomm": rank(0.0, 0.3 if slow else 0.1, 24, 8, overhead=0.002),
                "one3x/ddp": rank(0.0, 0.33, 240, 8),
                "one3x/sync": rank(0.0, 0.3, 480, 8),
                "one3x/paced": rank(0.0, 0.3 if slow else 0.1, 160 if slow else 480, 4 if slow else 12),
            }
        )
    got = ttl.rates(timing, "one3x", 4, 190.0, 4.0 * 120_576, TTL_ARGS)  # type: ignore[arg-type]
    assert got["overhead_s"] == pytest.approx(0.002)
    assert got["measured"]["sync"] == pytest.approx(4 / 0.3, rel=0.01)
    assert got["measured"]["paced"] == pytest.approx(1 / 0.3 + 3 / 0.1, rel=0.01)
    assert set(got["planned"]) == {"ddp", "sync", "paced"}
    assert got["planned"]["paced"] > 2 * got["planned"]["sync"]
    for method, error in got["planner_error"].items():
        assert error == pytest.approx(got["planned"][method] / got["measured"][method] - 1)


@pytest.mark.pure
def test_round_learning_rate_is_a_cosine_over_the_rounds():
    assert lm_worker.round_lr(3e-3, 0, 60) == pytest.approx(3e-3)
    assert lm_worker.round_lr(3e-3, 30, 60) == pytest.approx(1.5e-3)
    assert lm_worker.round_lr(3e-3, 60, 60) == pytest.approx(0.0)


@pytest.mark.examples
@pytest.mark.timeout(300)
def test_lm_worker_trains_by_rounds_on_loopback_and_the_average_is_evaluated(tmp_path):
    """Two ranks, rank 0 slower (a longer sleep): synchronous and paced rounds each write their
    parameters at the same rounds on both ranks; the driver's evaluation and analysis read them."""
    runs = {}
    records = {}
    for method in ("ddp", "sync", "paced"):
        outdir = tmp_path / method
        outdir.mkdir()
        port = free_port()
        procs = []
        for rank in range(2):
            env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
            cmd = [sys.executable, str(ttl.WORKER), "--rank", str(rank), "--world-size", "2"]
            cmd += ["--batch", "4", "--width", "32", "--depth", "1", "--outdir", str(outdir)]
            cmd += ["--pad-ms", "45" if rank == 0 else "5"]
            if method == "ddp":
                cmd += ["--method", "ddp", "--steps", "32", "--stop-at", "32", "--eval-every", "16"]
            else:
                cmd += ["--method", "ring~h4d1", "--rounds", "12", "--eval-rounds", "4"]
                cmd += ["--pacing", "measured" if method == "paced" else "none"]
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True))
        for proc in procs:
            _, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, err[-2000:]
        records[method] = [json.loads((outdir / f"rank{r}.json").read_text()) for r in range(2)]
        runs[method] = ttl.evaluate(outdir, 2, SimpleNamespace(width=32, depth=1))
    assert [step for step, _, _ in runs["ddp"]["curve"]] == [16, 32]
    for method in ("sync", "paced"):
        ranks = records[method]
        # written at rounds 4, 8 and 12 on both ranks, labelled with the samples: round x H steps
        assert [[p[0] for p in r["points"]] for r in ranks] == [[16, 32, 48]] * 2
        assert [len(r["round_ends"]) for r in ranks] == [12, 12]
        assert [step for step, _, _ in runs[method]["curve"]] == [16, 32, 48]
    assert [len(r["ends"]) for r in records["sync"]] == [48, 48]
    paced = records["paced"]
    assert len(paced[1]["ends"]) > len(paced[0]["ends"])  # the fast rank took more steps
    assert paced[0]["pace"]["round_s"] == paced[1]["pace"]["round_s"]
    row = ttl.time_to_target(runs)
    assert row["target"] == runs["ddp"]["curve"][-1][2]
    assert set(row["hits"]) == {"ddp", "sync", "paced"}

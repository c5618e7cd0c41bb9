"""``benchmarks/cluster/``: the emulated cluster's driver, its rank script and their analysis.

The cluster itself needs root and network namespaces; here its ranks (``rank.py``) run every kind of
method on loopback (two gloo ranks), the ``hsdp`` question's memory part and the ``report`` question
run end to end through ``run.py``, the ``speed`` question runs end to end on the emulated cluster where
this process may build one, and the analysis runs on hand-made inputs with known answers.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import run_ranks

from benchmarks.cluster import hsdp, run, scaling_report
from benchmarks.harness import uneven
from benchmarks.harness.common import build_mlp, free_port
from benchmarks.harness.emulated_compute import ROWS, EmulatedMLP
from decent_optim_wrapper.plan import ComputeTimes

ROOT = Path(__file__).resolve().parents[1]
RANK = ROOT / "benchmarks" / "cluster" / "rank.py"
ARGS = SimpleNamespace(
    compute_ms=40.0, shift_s=6.0, sync_every=8, rounds=30, inputs=256, width=512, depth=2, nocomm_s=5.0
)


def loopback() -> dict[str, str]:
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "NODE_ADDR": "127.0.0.1"}
    return {**os.environ, **env, "TORCHFT_PORT_BASE": str(free_port()), "OMP_NUM_THREADS": "1"}


def rank_flags(question: str, *argv: str, **mode: object) -> list[str]:
    """The ``--config`` flags ``run.py QUESTION argv...`` hands its ranks, world size 2."""
    return [
        "--world-size",
        "2",
        "--local-world-size",
        "1",
        *run.config(run.parse_args([question, *argv]), **mode),
    ]


# -- pure: the emulated model, the analysis, the arguments ---------------------------------------------


@pytest.mark.pure
def test_emulated_mlp_has_the_real_parameters_and_sleeps_its_compute():
    model = EmulatedMLP(32, 16, 3, 10, forward_fraction=0.4)
    assert [p.shape for p in model.parameters()] == [p.shape for p in build_mlp(32, 16, 3, 10).parameters()]
    model.compute_s = 0.06
    start = time.perf_counter()
    loss = torch.nn.functional.cross_entropy(model(torch.randn(ROWS, 32)), torch.randint(0, 10, (ROWS,)))
    forward = time.perf_counter()
    loss.backward()
    # sleeps last at least what they are asked; the upper side is left alone (a loaded machine)
    assert forward - start >= 0.4 * 0.06 and time.perf_counter() - forward >= 0.6 * 0.06
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


@pytest.mark.pure
@pytest.mark.parametrize(
    "argv",
    [
        ["speed", "--methods", "ddp", "ring"],  # every ratio is to nocomm
        ["scaling", "--methods", "nocomm", "ring", "ring"],
        ["hsdp", "--bandwidth", "fast"],
        ["accelerate", "--every", "5"],  # the timed window must be whole rounds of K
    ],
)
def test_rejects_what_it_cannot_run(argv, capsys):
    with pytest.raises(SystemExit):
        run.parse_args(argv)
    assert "error" in capsys.readouterr().err


@pytest.mark.pure
def test_uneven_fleet_rates_bounds_and_planner():
    assert [uneven.speed_factor("half2x", r, 4, 0.0, 6.0) for r in range(4)] == [2.0, 2.0, 1.0, 1.0]
    assert [uneven.speed_factor("one3x", r, 4, 0.0, 6.0) for r in range(4)] == [3.0, 1.0, 1.0, 1.0]
    assert [uneven.speed_factor("shift", r, 4, 6.1, 6.0) for r in range(4)] == [1.0, 1.0, 1.0, 3.0]
    # one3x on 4 ranks, 40 ms and o = 10 ms: rates 1/0.13 + 3/0.05; today 4 / 0.13
    total, today = uneven.own_rates("one3x", 4, (1.0, 3.0), 0.010, ARGS)
    assert (total, today) == pytest.approx((1 / 0.13 + 3 / 0.05, 4 / 0.13))
    # shift over a window half before, half after the change: the same sums (one slow rank each time)
    assert uneven.own_rates("shift", 4, (5.0, 7.0), 0.010, ARGS) == pytest.approx((total, today))

    def rank(start: float, step_s: float, steps: int, per_round: int) -> dict:
        ends = [start + step_s * (k + 1) for k in range(steps)]
        return {"start": start, "ends": ends, "round_ends": ends[per_round - 1 :: per_round]}

    # paced: rank 0 takes 4 steps of 0.2 s per round, rank 1 12 of 0.0667 s: 5 + 15 steps/s together
    ranks = [{"one3x/paced": rank(100.0, 0.2, 80, 4)}, {"one3x/paced": rank(100.0, 0.2 / 3, 240, 12)}]
    entry = uneven.fleet_rate(ranks, "one3x/paced", "paced", ARGS)
    assert entry["steps_per_s"] == pytest.approx(20.0, rel=0.02) and entry["steps"] == [80, 240]
    assert entry["window_s"][0] == pytest.approx(0.2 * 4 * 5)  # after 5 rounds
    alone = [{"half2x/nocomm": rank(0.0, 0.085, 50, 8)}, {"half2x/nocomm": rank(0.0, 0.045, 90, 8)}]
    assert uneven.overhead_seconds(alone, "half2x", ARGS) == pytest.approx(0.005)
    planned = uneven.planned_rates("one3x", 8, 190.0, 0.004, ARGS)
    # sync moves at the slow rank's pace (8 / 0.124 s); paced approaches the sum of own rates
    assert set(planned) == {"ddp", "sync", "paced"} and planned["sync"] == pytest.approx(8 / 0.124, rel=0.05)
    assert 2 * planned["sync"] < planned["paced"] <= 1 / 0.124 + 7 / 0.044
    assert uneven.planned_rates("shift", 8, 190.0, 0.004, ARGS) == {}


@pytest.mark.pure
def test_hsdp_rows_count_each_node_link_once_per_rank_and_the_planner_takes_the_rank_share():
    def memory(total: int, growth: int) -> dict:
        held = dict.fromkeys(hsdp.HELD_COLUMNS, 0) | {"params": total, "total": total}
        return {"held": held, "peak_rss_growth": growth}

    rows = hsdp.memory_rows({"whole": [memory(100, 10), memory(80, 8)], "gossip-hsdp": [memory(60, 6)] * 4})
    assert rows["whole"]["total"] == 100 and rows["gossip-hsdp"]["ranks"] == 4
    # ranks 0, 1 share node 0's counter (read a moment apart), ranks 2, 3 node 1's
    sent = [
        {"counted": 1e6, "shard_bytes": 1e6, "link_tx_per_step": tx} for tx in (2.0e6, 2.2e6, 1.8e6, 1.8e6)
    ]
    row = hsdp.cluster_rows({"ring": {"median_s": 0.5, "bytes_sent_per_step": sent}}, shards=2)["ring"]
    assert row["link_bytes"] == pytest.approx((2.1e6 / 2 + 1.8e6 / 2) / 2) and row["median_ms"] == 500.0
    args = run.parse_args(["hsdp"])
    predicted = run.planner_predictions(["fsdp", "torch-hsdp", "ring", "ring@bf16"], 1e6, args)
    assert predicted["fsdp"] == pytest.approx(400.0)  # the planner's no-comm step: the compute
    # one shard at 20 Mbit/s (two ranks share the 40 Mbit/s link) takes 400 ms: gossip overlaps it
    assert 400.0 <= predicted["ring"] <= 450.0 and predicted["ring@bf16"] <= predicted["ring"]
    assert predicted["torch-hsdp"] > 400.0 + 0.5 * 1.5 * 400.0  # DDP on the shard: not hidden
    # a storage counts once however many views point into it; a plain optimizer has no engine
    base, seen = torch.zeros(100), set()
    assert (
        hsdp.storage_bytes([base[:10], base[50:], None], seen) == 400
        and hsdp.storage_bytes([base], seen) == 0
    )
    model = torch.nn.Linear(10, 10)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 10)).sum().backward()
    optimizer.step()
    held = hsdp.held_tensor_bytes(model, optimizer)
    assert held["params"] == held["grads"] == 440 and held["engine_copy"] == held["gossip_buffers"] == 0


@pytest.mark.pure
@pytest.mark.skipif(
    not list(scaling_report.RESULTS.glob("emulated-*.json")), reason="no committed scaling runs"
)
def test_report_replays_every_committed_scaling_run_within_15_percent(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # predictions at 32 nodes only: the simulator's cost grows with the nodes (~70 s for 1024 here)
    argv = ["--results", str(scaling_report.RESULTS), "--figure", "f.png", "--predict-nodes", "32"]
    run.main(["report", *argv, "--json", "r.json"])
    results = json.loads((tmp_path / "r.json").read_text())["results"]
    rows = results["validation"]
    for local in (1, 2):
        worst = max((r for r in rows if r["workers_per_node"] == local), key=lambda r: abs(r["error"]))
        assert abs(worst["error"]) <= 0.15, worst
    assert (tmp_path / "f.png").stat().st_size > 0
    predicted = results["predictions"]  # each model on each link, DDP above per-step gossip
    assert len(predicted) == len(scaling_report.MODELS) * len(scaling_report.LINKS)
    assert all(p["nodes"] == 32 and p["ms"]["ddp"] > p["ms"]["ring"] > 0 for p in predicted), predicted


# -- examples: the ranks and the questions end to end at a toy size ------------------------------------


@pytest.mark.examples
@pytest.mark.timeout(240)
def test_rank_times_every_kind_of_method_on_loopback(tmp_path):
    """speed's, low_comm's and scaling's ranks: baselines, periodic averaging, torchft, gossip of both
    front-ends, low-communication and compressed, under two scenarios of sleeping compute."""
    methods = ["nocomm", "ddp", "ddp-bf16", "avg~h2", "ring-module", "ring~h2n@bf16"]
    torchft = importlib.util.find_spec("torchft") is not None  # the `bench` group: `uv run --group bench`
    methods += ["torchft~h2"] if torchft else []
    argv = ["--compute", "emulated", "--compute-ms", "5", "--scenarios", "none", "lognormal", "--rounds", "1"]
    argv += ["--iters", "4", "--warmup", "2", "--inputs", "16", "--width", "16", "--methods", *methods]
    paths = run_ranks(RANK, 2, rank_flags("low_comm", *argv), tmp_path, loopback(), deadline_s=200)
    result = json.loads(paths[0].read_text())
    keys = [f"{s}/{m}" for s in ("none", "lognormal") for m in methods]
    assert sorted(result["times"]) == sorted(keys) and all(len(result["times"][k]) == 4 for k in keys)
    # Each step slept at least its compute: 5 ms flat, or rank 0's log-normal draws (mean 5 ms, most below).
    args = run.parse_args(["low_comm", *argv])
    draws = ComputeTimes(0.005, "lognormal", args.sigma, slow_factor=args.slow_factor, seed=args.seed)
    slept = {"none": [0.005] * 4, "lognormal": draws.draws(0, 6)[2:]}  # warm-up 2, then 4 timed
    assert all(t >= s for k in keys for t, s in zip(result["times"][k], slept[k.split("/")[0]], strict=True))
    sent, model_bytes = result["bytes_sent_per_step"], 4 * result["params"]
    assert sent["none/nocomm"] == 0 and sent["none/ddp"] == pytest.approx(model_bytes)  # a ring at 2 ranks
    assert sent["none/ddp-bf16"] == pytest.approx(model_bytes / 2)
    assert sent["none/avg~h2"] == pytest.approx(model_bytes / 2)
    assert not torchft or sent["none/torchft~h2"] == sent["none/avg~h2"]  # DiLoCo's outer round, as ours
    assert 0 < sent["none/ring~h2n@bf16"] <= model_bytes / 4 * 1.01  # bf16, a round every 2 steps


@pytest.mark.examples
@pytest.mark.timeout(300)
def test_accelerate_and_fleet_ranks_on_loopback(tmp_path):
    """accelerate's ranks (the Accelerate loop) and uneven's (step ends, paced rounds)."""
    pytest.importorskip("accelerate", reason="the [accelerate] extra is not installed")
    argv = ["--rounds", "1", "--iters", "4", "--warmup", "0", "--every", "2", "--inputs", "16"]
    argv += ["--width", "16"]
    paths = run_ranks(RANK, 2, rank_flags("accelerate", *argv, "--batch", "8"), tmp_path, loopback(), 240)
    result = json.loads(paths[0].read_text())
    assert all(
        len(result["times"][m]) == 4 for m in ("nocomm", "ddp", "local-sgd", "gossip-complete", "gossip-ring")
    )
    sent = result["bytes_sent_per_step"]
    # DDP all-reduces one model a step, LocalSGD one every K = 2 steps; gossip one every 2 in a pair
    assert sent["nocomm"] == 0 and sent["ddp"] == pytest.approx(2 * sent["local-sgd"])
    assert sent["gossip-ring"] == pytest.approx(sent["gossip-complete"]) and sent["gossip-ring"] > 0
    argv = ["--scenarios", "one3x", "--rounds", "8", "--sync-every", "4", "--compute-ms", "10"]
    argv += ["--nocomm-s", "0.5", "--width", "32", "--inputs", "16"]
    fleet = tmp_path / "fleet"
    fleet.mkdir()
    paths = run_ranks(RANK, 2, rank_flags("uneven", *argv, mode="fleet"), fleet, loopback(), 200)
    ranks = [json.loads(p.read_text()) for p in paths]
    assert set(ranks[0]) == {f"one3x/{m}" for m in ("nocomm", "ddp", "sync", "paced")}
    assert [len(r["one3x/ddp"]["ends"]) for r in ranks] == [32, 32]
    paced = [r["one3x/paced"] for r in ranks]
    assert [len(p["round_ends"]) for p in paced] == [8, 8] and len(paced[1]["ends"]) > len(paced[0]["ends"])
    assert paced[0]["pace"]["round_s"] == paced[1]["pace"]["round_s"]  # one agreed round length


@pytest.mark.examples
@pytest.mark.timeout(300)
def test_hsdp_memory_part_end_to_end(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = ["hsdp", "--part", "memory", "--mem-inputs", "64", "--mem-width", "64", "--mem-depth", "3"]
    run.main([*argv, "--mem-steps", "2", "--memory-configs", "whole", "gossip-hsdp@bf16", "--json", "m.json"])
    rows = json.loads((tmp_path / "m.json").read_text())["results"]["memory"]["rows"]
    assert rows["whole"]["ranks"] == 2 and rows["gossip-hsdp@bf16"]["ranks"] == 4
    # a shard holds half the parameters of a whole replica; the sharded engine copies them
    assert rows["gossip-hsdp@bf16"]["params"] < 0.6 * rows["whole"]["params"]
    assert rows["gossip-hsdp@bf16"]["engine_copy"] > 0 == rows["whole"]["engine_copy"]


@pytest.mark.examples
@pytest.mark.timeout(300)
@pytest.mark.skipif(os.geteuid() != 0, reason="the emulated cluster needs root")
def test_speed_question_end_to_end_on_the_emulated_cluster(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = ["speed", "--bandwidths", "unlimited", "200mbit", "--methods", "nocomm", "ddp", "ring"]
    argv += ["ring-module", "--batch", "64", "--iters", "2", "--warmup", "1", "--rounds", "1"]
    argv += ["--link-check-mb", "1"]
    run.main([*argv, "--json", "s.json", "--table", "s.md"])
    results = json.loads((tmp_path / "s.json").read_text())["results"]
    assert set(results["summary"]) == {"unlimited", "200mbit"}
    assert set(results["summary"]["200mbit"]["relative"]) == {"nocomm", "ddp", "ring", "ring-module"}
    assert (tmp_path / "s.md").read_text().startswith("$ uv run")
    assert not [n for n in os.popen("ip netns list").read().split() if n.startswith("dow-")]


@pytest.mark.pure
def test_link_sharing_fits_the_committed_run(tmp_path, capsys):
    """``link_sharing --fit``: the sharing model fitted again to the committed run (no root, no cluster)
    picks the fit its printed result names (the planner's grid and seeds are fixed: exact)."""
    results = Path(__file__).parents[1] / "benchmarks" / "results" / "scaling"
    run.main(
        ["link_sharing", "--fit", str(results / "link-sharing.json"), "--json", str(tmp_path / "fit.json")]
    )
    best = [line for line in capsys.readouterr().out.splitlines() if line.startswith("best fit:")]
    assert best and best[0] in (results / "link-sharing.txt").read_text()
    refit = json.loads((tmp_path / "fit.json").read_text())["results"]
    assert refit["A"] == json.loads((results / "link-sharing.json").read_text())["A"]

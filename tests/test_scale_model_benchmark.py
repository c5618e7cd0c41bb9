"""The scale-model run's driver (``benchmarks/low_communication/scale_model.py``): its step timing, its
choice of our method, its extrapolation and its verdicts; and the warmup schedule its workers use.

The run itself needs root and 16 network namespaces; here what it computes from the workers' files is
checked on files written by hand, and the schedule against torch's own schedulers stepped by hand.
"""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from benchmarks.harness.runner import warmup_cosine
from benchmarks.low_communication import scale_model as driver
from decent_optim_wrapper.plan import ComputeTimes, Link, Network, predict


@pytest.mark.pure
def test_warmup_then_cosine_is_linear_then_torchs_cosine():
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=0.5)
    schedule = warmup_cosine(optimizer, steps=20, warmup=4)
    seen = []
    for _ in range(20):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    # linear from lr / warmup to lr over the warmup (LinearLR), then 0.5 lr (1 + cos(pi t / 16))
    expected = [0.5 * (1 + 3 * t / 4) / 4 for t in range(4)]
    expected += [0.25 * (1 + math.cos(math.pi * t / 16)) for t in range(16)]
    assert seen == pytest.approx(expected, rel=1e-12, abs=1e-15)  # float rounding of torch's recurrences
    with pytest.raises(ValueError, match="warmup=20 must be shorter"):
        warmup_cosine(optimizer, steps=20, warmup=20)
    cosine = warmup_cosine(torch.optim.SGD([param], lr=0.5), steps=20)
    assert isinstance(cosine, torch.optim.lr_scheduler.CosineAnnealingLR)  # 0: every earlier benchmark's


@pytest.mark.pure
def test_baselines_are_timed_past_their_start_and_over_whole_periods():
    args = SimpleNamespace(timed_steps=3)
    assert driver.timed_steps("ddp", args) == (3, 0)
    assert driver.timed_steps("ddp-psgd4", args) == (5, 2)  # torch all-reduces two steps in full
    assert driver.timed_steps("torchft~h32", args) == (32, 0)  # a period holds its one exchange


@pytest.mark.pure
def test_step_seconds_is_the_slowest_ranks_mean_after_the_skipped_steps(tmp_path):
    starts_and_ends = {0: (100.0, [101.0, 101.5, 102.0, 102.5]), 1: (100.0, [100.5, 101.0, 102.0, 103.0])}
    for rank, (start, ends) in starts_and_ends.items():
        (tmp_path / f"rank{rank}.json").write_text(json.dumps({"start": start, "ends": ends}))
    assert driver.step_seconds(tmp_path, 2, skip=0) == pytest.approx(0.75)  # both: 3 s over 4 steps
    assert driver.step_seconds(tmp_path, 2, skip=2) == pytest.approx(1.0)  # rank 1's last two steps


@pytest.mark.pure
def test_the_recommended_method_hides_the_exchange_on_the_scaled_link_and_at_full_size():
    model_bytes, step_s, nodes = 482_304.0, 0.15, 16
    megabits = model_bytes * 8 / (320 * step_s) / 1e6  # one fp32 model per 320 steps
    method = driver.recommended(model_bytes, step_s, megabits, 0.0, nodes, "one-peer-exp")
    assert method.startswith("one-peer-exp~h") and "@" in method
    args = SimpleNamespace(full_size=["4G", "1000", "100mbit", "16"])
    full = driver.full_size(driver.planner_label(method), args)
    assert full["throughput"] >= 0.9 and full["ddp_throughput"] < 0.01
    # the same figure straight from the planner: the driver only translates names
    found = predict(4e9, ComputeTimes(1.0), Network(Link(1e8)), 16, ["one-peer-exp"], compressions=[])
    assert full["ddp_throughput"] == pytest.approx(found[0].step_s / found[1].step_s)
    assert [p.method for p in found[:2]] == ["nocomm", "ddp"]
    with pytest.raises(RuntimeError, match="pass --ours"):
        driver.recommended(model_bytes, step_s, megabits / 1e4, 0.0, nodes, "one-peer-exp")
    # what each message costs beyond its payload makes rounds of the same bytes dearer: fewer of them
    costly = driver.recommended(model_bytes, step_s, megabits, 900.0, nodes, "one-peer-exp")
    assert driver.parse_method(costly).sync_every > driver.parse_method(method).sync_every


def _run(step_ms: float, curve: list[tuple[int, float, float]], sent: float, shaped_s: float | None = None):
    run = {"curve": curve, "steps": curve[-1][0], "step_ms": step_ms, "bytes_sent_per_step": sent}
    if shaped_s is not None:
        run["shaped_step_s"] = shaped_s
    return run


@pytest.mark.pure
def test_verdicts_compare_throughput_loss_and_time_to_ddps_loss():
    args = SimpleNamespace(link_steps=320, steps=300, batch=8, adam_lr=3e-3, warmup=30, width=64, depth=2)
    ours = "one-peer-exp~h2d2@topk:0.01:int2"
    full = {"model_bytes": 4e9, "step_s": 1.0, "link_bits": 1e8, "nodes": 16}
    full |= {"throughput": 1.0, "ddp_throughput": 0.002}

    def verdicts(ours_ms: float, ours_curve: list[tuple[int, float, float]]) -> tuple[dict[str, bool], dict]:
        runs = {
            "nocomm": _run(150.0, [(100, 15.0, 2.9)], 0.0),
            "ddp": _run(160.0, [(200, 32.0, 2.3), (300, 48.0, 2.0)], 9e5, shaped_s=90.0),
            "ddp-psgd4": _run(160.0, [(200, 32.0, 2.2), (300, 48.0, 1.99)], 9e4, shaped_s=9.0),
            "torchft~h8": _run(155.0, [(300, 46.0, 2.1)], 1e5, shaped_s=11.0),  # never reaches 2.0
            ours: _run(ours_ms, ours_curve, 1.3e3),
        }
        result = {"runs": runs, "ours": ours, "nodes": 16, "parameters": 120_576, "megabits": 0.08}
        result |= {"planned_s": 0.150, "full_size": full}
        found = {v["target"].split(" (")[0]: v["met"] for v in driver.report(result, args)}
        return found, {row["method"]: row for row in result["rows"]}

    found, rows = verdicts(160.0, [(200, 32.0, 2.1), (300, 48.0, 1.99)])
    assert rows["ddp"]["seconds_to_ddp"] == pytest.approx(300 * 90.0)  # its steps at its shaped pace
    assert rows["ddp-psgd4"]["seconds_to_ddp"] == pytest.approx(300 * 9.0)
    assert rows["torchft~h8"]["seconds_to_ddp"] is None
    assert rows[ours]["seconds_to_ddp"] == 48.0  # ours: the run's own clock on the shaped links
    assert rows[ours]["throughput"] == pytest.approx(150 / 160)
    # throughput, loss, two baselines to DDP's loss and to 2.1 (torchft's, the highest final), the planner
    assert all(found.values()) and len(found) == 7
    assert rows[ours]["seconds_to_common"] == 32.0  # 2.1 at step 200 of its own clock
    assert rows["ddp-psgd4"]["seconds_to_common"] == pytest.approx(300 * 9.0)  # 2.2 at 200, 1.99 at 300
    assert rows["torchft~h8"]["seconds_to_common"] == pytest.approx(300 * 11.0)

    found, rows = verdicts(170.0, [(200, 34.0, 2.1), (300, 51.0, 2.05)])  # slower, 1.025x DDP's loss
    assert not found[f"{ours} at least 0.90 of no communication"]  # 150 / 170 = 0.88
    assert not found[f"{ours} final loss at most 1.02x DDP's"]
    assert not found[f"{ours} reaches DDP's loss before the best ddp-psgd run"]  # it never does
    assert not found[f"{ours} reaches DDP's loss before the best torchft run"]  # neither did torchft
    # but it is first to the loss every method reaches: 2.1 at its step 200, 34 s against 2700 and 3300
    assert found[f"{ours} reaches every method's final loss, 2.1000, before the best ddp-psgd run"]
    assert found[f"{ours} reaches every method's final loss, 2.1000, before the best torchft run"]
    assert found[f"{ours} step time predicted within 15%"]  # 150 ms planned for 170: -11.8%


@pytest.mark.pure
def test_a_reused_curve_needs_the_same_training_flags_and_keeps_its_times_only_in_the_same_units(tmp_path):
    earlier = vars(driver.parse_args(["--compute-ms", "150", "--baselines"]))
    ddp = _run(480.0, [(550, 266.0, 1.7252), (600, 290.0, 1.7223)], 904_320.0, shaped_s=247.6)
    path = tmp_path / "earlier.json"
    path.write_text(json.dumps({"args": earlier, "runs": {"ddp": ddp}}, default=str))
    # another step length (400 ms by default): the loss curve carries over, the times do not
    args = driver.parse_args(["--baselines", "--reuse", str(path), "ddp"])
    reused = args.reused["ddp"]
    assert (
        reused["curve"] == [list(point) for point in ddp["curve"]]
        and reused["bytes_sent_per_step"] == 904_320.0
    )
    assert "shaped_step_s" not in reused and "step_ms" not in reused
    assert reused["reused_from"] == str(path)
    same = driver.parse_args(["--compute-ms", "150", "--baselines", "--reuse", str(path), "ddp"])
    assert same.reused["ddp"]["shaped_step_s"] == 247.6
    # the report takes a run without times: its loss counts, its time to DDP's loss is unknown
    ours = "one-peer-exp~h4d4@topk:0.01:int2"
    full = {"model_bytes": 4e9, "step_s": 1.0, "link_bits": 1e8, "nodes": 16, "throughput": 1.0}
    runs = {"nocomm": _run(440.0, [(100, 44.0, 2.9)], 0.0), "ddp": reused}
    runs[ours] = _run(456.0, [(550, 250.0, 2.36), (600, 273.0, 2.3478)], 678.0)
    result = {"runs": runs, "ours": ours, "nodes": 16, "parameters": 120_576, "megabits": 0.0275}
    result |= {"planned_s": 0.44, "full_size": full | {"ddp_throughput": 0.002}}
    found = {v["target"].split(" (")[0]: v["met"] for v in driver.report(result, args)}
    rows = {row["method"]: row for row in result["rows"]}
    assert math.isnan(rows["ddp"]["step_ms"]) and rows["ddp"]["seconds_to_ddp"] is None
    assert rows[ours]["vs_ddp"] == pytest.approx(2.3478 / 1.7223)
    assert not found[f"{ours} final loss at most 1.02x DDP's"]
    # another training flag: refused, naming the flag and both values
    with pytest.raises(SystemExit):
        driver.parse_args(["--steps", "300", "--baselines", "--reuse", str(path), "ddp"])
    with pytest.raises(ValueError, match=r"--steps 600 \(here 300\)"):
        driver.reused_run(path, "ddp", driver.parse_args(["--steps", "300", "--baselines"]))
    with pytest.raises(ValueError, match="no run of 'ddp-psgd4'; it has ddp"):
        driver.reused_run(path, "ddp-psgd4", args)

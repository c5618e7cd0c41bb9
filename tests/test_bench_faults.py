"""The fault driver (``benchmarks/faults/run.py``): every question end to end at a toy size.

Each runs as a user runs it, with a hard deadline, and its JSON results are checked:

- ``kills``: 5 forked workers down to 3; one is killed with SIGKILL inside global_avg(), another
  hangs (seed 5's draw). Every injected failure survived, no step lost, no corruption.
- ``rejoins``: 4 workers, three failures drawn by seed 3, each victim restarted as a fresh process
  that joins the running job. Every failure recorded once, every restart admitted, the world whole at
  the end, no step lost, no corruption.
- ``lost-worker``: one seed, 8 workers of which one is killed, against 7: both arms finish.
- ``joining``: the members' pause, the joiner's time line (its parts add up) and the per-step costs.
- ``grow-back``: the restart resumes from a checkpoint bit for bit, so its final loss equals the run
  without a failure exactly; grow back restarts only the two lost workers, which join.
- ``node-check``: both jobs train, and the figures add up.

The options a question refuses are refused before any worker starts (``pure``).
"""

from __future__ import annotations

import json
import math

import helpers
import pytest

from benchmarks.faults.run import parse_args

DRIVER = "benchmarks/faults/run.py"
KILLS_DEADLINE_S = 150  # 20 s on an idle 2-core VM; a loaded CI machine has taken 75 s
REJOINS_DEADLINE_S = 240  # about 60 s on an idle 2-core VM: each restart imports torch afresh


def results(path):
    payload = json.loads(path.read_text())
    assert payload["command"].startswith("uv run ")  # the result file says how to make it again
    return payload["results"]


@pytest.mark.pure
@pytest.mark.parametrize(
    ("argv", "refusal"),
    [
        (["kills", "--floor", "8"], "--floor must be between 2"),
        (["rejoins", "--workers", "4", "--floor", "1"], "--floor must be between 2"),
        (["lost-worker", "--steps", "10", "--kill-at", "10"], "--kill-at must be inside the run"),
        (["grow-back", "--steps", "10", "--lose-at", "9"], "--lose-at must be a step before the last"),
        (["node-check", "--steps", "5", "--warmup", "5"], "--warmup must be below --steps"),
        (["joining", "--timeout-s", "3"], "unrecognized arguments"),  # another question's option
    ],
)
def test_the_driver_refuses_options_that_make_no_run(argv, refusal, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert refusal in capsys.readouterr().err


@pytest.mark.examples
@pytest.mark.timeout(KILLS_DEADLINE_S + 30)
def test_kills_one_short_run_survives_every_failure_without_corruption(tmp_path):
    path = tmp_path / "soak.json"
    argv = ["kills", "--workers", "5", "--floor", "3", "--runs", "1", "--seed", "5", "--json", str(path)]
    output = helpers.run_script(DRIVER, *argv, deadline_s=KILLS_DEADLINE_S)
    summary = results(path)["summary"]
    assert summary["runs"] == 1, output
    assert summary["injected_by_mode"]["kill-in-global-avg"] == 1, output
    assert summary["injected_by_mode"]["hang"] == 1, output
    assert summary["injected"] == summary["survived"] == 2, output
    assert summary["not_injected"] == summary["dropped_alive"] == 0, output
    assert summary["survivors"] == summary["survivors_finished"] == 3, output
    assert summary["steps_lost"] == summary["scheduler_behind"] == 0, output
    assert summary["recoveries"] >= 1, output  # two failures close together may be one recovery
    assert set(summary["corruption"].values()) == {0}, output
    assert "corruption" in output and "survived by mode" in output  # the printed report


@pytest.mark.examples
@pytest.mark.timeout(REJOINS_DEADLINE_S + 30)
def test_rejoins_killed_workers_come_back_and_the_world_is_whole_again_without_corruption(tmp_path):
    path = tmp_path / "rejoin.json"
    argv = ["rejoins", "--workers", "4", "--floor", "2", "--cycles", "3", "--seed", "3"]
    argv += ["--spacing", "20", "--json", str(path), "--deadline-s", "200"]
    output = helpers.run_script(DRIVER, *argv, deadline_s=REJOINS_DEADLINE_S)
    summary = results(path)["summary"]
    assert summary["failures_fired"] == summary["injected"] == 3, output
    assert summary["restarts"] == summary["joins"] == 3, output
    # a joiner noted its join time after its first step, unless it was the next victim in that step
    assert 1 <= summary["joiners_recorded"] <= 3 and summary["join_s"]["n"] == summary["joiners_recorded"], (
        output
    )
    assert summary["losses"] == 3, output  # every victim dropped once, no live rank dropped
    assert summary["finishers"] == 4 and not summary["errors"] and not summary["ends_disagree"], output
    assert summary["world_whole_again"] >= 1, output
    assert summary["steps_lost"] == summary["scheduler_behind"] == 0, output
    assert set(summary["corruption"].values()) == {0}, output
    assert summary["admission_pause_s"]["n"] >= 3, output
    assert "corruption" in output and "joins: 3" in output  # the printed report


@pytest.mark.examples
@pytest.mark.timeout(200)
def test_lost_worker_trains_both_arms_and_judges_them(tmp_path):
    path = tmp_path / "lost.json"
    argv = ["lost-worker", "--seeds", "0", "--steps", "40", "--kill-at", "20", "--json", str(path)]
    output = helpers.run_script(DRIVER, *argv, deadline_s=180)
    found = results(path)
    whole, lost = sorted(found["runs"], key=lambda run: run["arm"])  # "7" before "8 -> 7"
    assert (lost["arm"], lost["workers"], whole["arm"], whole["workers"]) == ("8 -> 7", 8, "7", 7), output
    assert lost["world_size_at_end"] == whole["world_size_at_end"] == 7, output
    assert len(lost["failures"]) == 1 and not whole["failures"], output  # the victim, lost once
    assert found["summary"]["verdict"] in ("met", "MISSED") and "8 -> 7 vs 7 workers" in output


@pytest.mark.examples
@pytest.mark.timeout(300)
def test_joining_measures_the_pause_the_joiner_and_the_per_step_cost(tmp_path):
    out = tmp_path / "joining.json"
    argv = ["joining", "--ranks", "3", "--params", "1e4", "--steps", "40", "--join-after", "5"]
    printed = helpers.run_script(
        DRIVER, *argv, "--overhead-ranks", "2", "--rounds", "1", "--json", str(out), deadline_s=280
    )
    assert "3 ranks: members' pause" in printed and "step time over on_peer_failure='raise'" in printed
    figures = results(out)
    (entry,) = figures["pause"]
    joiner = entry["joiner"]
    assert entry["world_size"] == 3 and entry["pause_s"] > 0
    parts = ("start_up_s", "admission_s", "group_s", "transfer_s", "verify_s", "construct_s", "first_step_s")
    assert all(joiner[part] >= 0 for part in parts)
    # the parts add up to the joiner's time from its process start to the end of its first step
    assert sum(joiner[part] for part in parts) == pytest.approx(joiner["total_s"], abs=0.05)
    assert joiner["bytes"] > 3 * 4 * 1e4  # parameters and AdamW's two moments, at least
    overhead = figures["overhead"]
    assert {"raise", "continue", "elastic"} <= set(overhead) and overhead["raise"] == 1.0
    # The job with a secret, alone and beside an outsider's forged applications (rank 0's refusals of
    # them counted per forged job: how many depends on how long this tiny job runs)
    assert {"sealed", "forged", "forged/sealed"} <= set(overhead)
    assert len(overhead["forged_refused"]) == 1 and overhead["forged_refused"][0] >= 0


@pytest.mark.examples
@pytest.mark.timeout(330)
def test_grow_back_against_no_failure_and_a_restart_from_checkpoint(tmp_path):
    out = tmp_path / "grow-back.json"
    argv = ["grow-back", "--local", "--workers", "4", "--steps", "150", "--lose-at", "25"]
    argv += ["--checkpoint-every", "10", "--params", "4000", "--step-time", "0.05", "--json", str(out)]
    printed = helpers.run_script(DRIVER, *argv, deadline_s=300)
    steady, grow_back, restart = results(out)["runs"]
    assert [steady["scenario"], grow_back["scenario"], restart["scenario"]] == [
        "steady",
        "grow-back",
        "restart",
    ]
    assert all(run["losses_identical"] for run in (steady, grow_back, restart)), printed
    assert restart["final_loss"] == steady["final_loss"], printed  # resumed bit for bit
    assert restart["processes_restarted"] == 4 and restart["steps_recomputed"] == 6, printed  # from step 20
    assert grow_back["processes_restarted"] == grow_back["joiners"] == 2, printed
    assert grow_back["steps_recomputed"] == 0 and math.isfinite(grow_back["final_loss"]), printed
    assert grow_back["final_world_size"] == 4, printed  # the world is whole again at the end
    assert "steps_recomputed" in printed


@pytest.mark.examples
@pytest.mark.timeout(300)
def test_node_check_runs_both_jobs_and_reports_the_check(tmp_path):
    out = tmp_path / "node-check.json"
    argv = ["node-check", "--width", "64", "--steps", "8", "--warmup", "2"]
    argv += ["--rounds", "1", "--checks", "20", "--step-time", "0", "--json", str(out)]
    printed = helpers.run_script(DRIVER, *argv, deadline_s=280)
    figures = results(out)
    assert figures["buckets"] >= 2, printed  # --buckets cuts the shards into several buckets
    assert set(figures["step_s"]) == {"raise", "continue"} and all(t > 0 for t in figures["step_s"].values())
    assert figures["check_s"] > 0
    expected = figures["buckets"] * figures["check_s"] / figures["step_s"]["continue"]
    assert figures["checks_over_step"] == pytest.approx(expected)
    assert "one node check" in printed

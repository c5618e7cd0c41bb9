"""The kill and restart soak (benchmarks/survival/rejoin_soak.py) end to end on a short run.

4 workers, three failures drawn by seed 3 (see the assertions for the modes), each victim restarted
as a fresh process that joins the running job. The script runs as a user runs it, with a hard
deadline; its JSON summary must show every failure recorded once, every restart admitted, the
world whole at the end, no step lost and no corruption.
"""

from __future__ import annotations

import json

import helpers
import pytest

pytestmark = pytest.mark.examples

DEADLINE_S = 240  # about 60 s on an idle 2-core VM: each restart imports torch afresh


@pytest.mark.timeout(DEADLINE_S + 30)
def test_killed_workers_come_back_and_the_world_is_whole_again_without_corruption(tmp_path):
    path = tmp_path / "rejoin.json"
    argv = ["--workers", "4", "--floor", "2", "--cycles", "3", "--seed", "3", "--spacing", "20"]
    output = helpers.run_script(
        "benchmarks/survival/rejoin_soak.py",
        *argv,
        "--json",
        str(path),
        "--deadline-s",
        "200",
        deadline_s=DEADLINE_S,
    )
    summary = json.loads(path.read_text())["summary"]
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
    assert "corruption" in output and "joins admitted" in output  # the printed table

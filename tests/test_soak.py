"""The fault-injection soak (benchmarks/survival/soak.py) end to end on one short run.

5 forked workers down to 3: one is killed with SIGKILL inside global_avg(), another hangs (seed 5's
draw). The script runs as a user runs it, with a hard deadline; its JSON summary must show every
injected failure survived, no step lost and no corruption.
"""

from __future__ import annotations

import json

import helpers
import pytest

pytestmark = pytest.mark.examples

DEADLINE_S = 150  # 20 s on an idle 2-core VM; a loaded CI machine has taken 75 s


@pytest.mark.timeout(DEADLINE_S + 30)
def test_one_short_soak_run_survives_every_failure_without_corruption(tmp_path):
    path = tmp_path / "soak.json"
    argv = ["--workers", "5", "--floor", "3", "--runs", "1", "--seed", "5", "--json", str(path)]
    output = helpers.run_script("benchmarks/survival/soak.py", *argv, deadline_s=DEADLINE_S)
    summary = json.loads(path.read_text())["summary"]
    assert summary["runs"] == 1, output
    assert summary["injected_by_mode"]["kill-in-global-avg"] == 1, output
    assert summary["injected_by_mode"]["hang"] == 1, output
    assert summary["injected"] == summary["survived"] == 2, output
    assert summary["not_injected"] == summary["dropped_alive"] == 0, output
    assert summary["survivors"] == summary["survivors_finished"] == 3, output
    assert summary["steps_lost"] == summary["scheduler_behind"] == 0, output
    assert summary["recoveries"] >= 1, output  # two failures close together may be one recovery
    assert set(summary["corruption"].values()) == {0}, output
    assert "corruption" in output and "failures survived" in output  # the printed table

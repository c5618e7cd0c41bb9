"""``benchmarks/joining/grow_back.py`` on loopback at a tiny size: the three runs and what they must show.

The restart run resumes from a checkpoint bit for bit, so its final loss equals the run without a
failure exactly; the grow-back run restarts only the two lost workers, which join.
"""

from __future__ import annotations

import json
import math

import helpers
import pytest

pytestmark = pytest.mark.examples


@pytest.mark.timeout(330)
def test_grow_back_against_no_failure_and_a_restart_from_checkpoint(tmp_path):
    out = tmp_path / "grow-back.json"
    argv = [
        "benchmarks/joining/grow_back.py",
        "--local",
        "--workers",
        "4",
        "--steps",
        "150",
        "--lose-at",
        "25",
    ]
    argv += ["--checkpoint-every", "10", "--params", "4000", "--step-time", "0.05", "--json", str(out)]
    printed = helpers.run_script(*argv, deadline_s=300)
    steady, grow_back, restart = json.loads(out.read_text())["runs"]
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
    assert "to the last step" in printed

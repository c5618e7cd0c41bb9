"""``benchmarks/joining/joining.py`` runs end to end at a tiny size (local workers); its figures add up."""

from __future__ import annotations

import json

import helpers
import pytest

pytestmark = pytest.mark.examples


@pytest.mark.timeout(300)
def test_joining_benchmark_measures_the_pause_the_joiner_and_the_per_step_cost(tmp_path):
    out = tmp_path / "joining.json"
    script = "benchmarks/joining/joining.py"
    argv = [script, "--ranks", "3", "--params", "1e4", "--steps", "40", "--join-after", "5"]
    printed = helpers.run_script(
        *argv, "--overhead-ranks", "2", "--rounds", "1", "--json", str(out), deadline_s=280
    )
    assert "3 ranks: members' pause" in printed and "step time over on_peer_failure='raise'" in printed
    figures = json.loads(out.read_text())
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

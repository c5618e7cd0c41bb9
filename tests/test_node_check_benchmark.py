"""``benchmarks/hsdp/node_check.py`` at a tiny size: both jobs train, and the figures add up."""

from __future__ import annotations

import json

import helpers
import pytest

pytestmark = pytest.mark.examples


@pytest.mark.timeout(300)
def test_the_node_check_benchmark_runs_both_jobs_and_reports_the_check(tmp_path):
    out = tmp_path / "node-check.json"
    argv = ["benchmarks/hsdp/node_check.py", "--width", "64", "--steps", "8", "--warmup", "2"]
    argv += ["--rounds", "1", "--checks", "20", "--step-time", "0", "--json", str(out)]
    printed = helpers.run_script(*argv, deadline_s=280)
    figures = json.loads(out.read_text())
    assert figures["buckets"] >= 2, printed  # --buckets cuts the shards into several buckets
    assert set(figures["step_s"]) == {"raise", "continue"} and all(t > 0 for t in figures["step_s"].values())
    assert figures["check_s"] > 0
    expected = figures["buckets"] * figures["check_s"] / figures["step_s"]["continue"]
    assert figures["checks_over_step"] == pytest.approx(expected)
    assert "one node check" in printed

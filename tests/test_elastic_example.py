"""examples/elastic.py under torchrun: a crash restarts the group from the newest complete checkpoint,
and a later start with fewer workers resumes the checkpoint the larger group wrote."""

from __future__ import annotations

import json
import os
import re

import helpers
import pytest

pytestmark = pytest.mark.examples

RUN_DEADLINE_S = 150  # one torchrun: starting 3 workers twice (seconds each on 2 cores) and 40 short steps


def torchrun(workers: int, *argv: str, restarts: int = 0) -> str:
    """What ``torchrun --standalone`` of examples/elastic.py prints, with the deadline above."""
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # as the example's docstring says
    launch = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={workers}"]
    launch += [f"--max-restarts={restarts}", "examples/elastic.py", *argv]
    return helpers.run_script(*launch, env=env, deadline_s=RUN_DEADLINE_S)


@pytest.mark.timeout(2 * RUN_DEADLINE_S + 30)
def test_elastic_example_survives_a_crash_and_resumes_at_another_world_size(tmp_path):
    common = ["--ckpt-dir", str(tmp_path), "--every", "10", "--batch-size", "16"]
    first = torchrun(3, *common, "--steps", "40", "--crash", "1:25", restarts=1)
    assert "starting from scratch on 3 workers (attempt 0)" in first
    assert "injected failure: rank 1 exits at step 25" in first
    # torchrun restarted every worker; they went on from the newest complete checkpoint, step 20
    assert "resumed from step_00000020: step 20, written by 3 workers, now 3 workers (attempt 1)" in first
    assert "finished 40 steps on 3 workers" in first

    second = torchrun(2, *common, "--steps", "60")
    assert "resumed from step_00000040: step 40, written by 3 workers, now 2 workers (attempt 0)" in second
    assert "finished 60 steps on 2 workers" in second
    accuracy = float(re.search(r"averaged model's accuracy ([0-9.]+)", second).group(1))
    assert accuracy > 0.2  # it learns: chance is 0.1 on 10 balanced classes, 40 steps reach about 0.6

    kept = sorted(p.name for p in tmp_path.iterdir())
    assert kept == ["step_00000050", "step_00000060"]  # --keep 2: older checkpoints are pruned
    newest = tmp_path / "step_00000060"
    assert json.loads((newest / "COMPLETE").read_text()) == {"step": 60, "world_size": 2}
    assert sorted(p.name for p in newest.iterdir()) == ["COMPLETE", "rank_0.pt", "rank_1.pt"]

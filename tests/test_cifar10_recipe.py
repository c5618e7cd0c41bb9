"""Examples tier: examples/cifar10.py trains, evaluates, checkpoints and resumes (CPU, gloo, FakeData)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import load_script
from workers import WorkerError

pytestmark = pytest.mark.examples

RECIPE = Path(__file__).resolve().parents[1] / "examples" / "cifar10.py"
# Two ranks, two steps of 16 random images per epoch and 16 test images per rank: a ResNet-18 step
# takes about a second on one core.
SMOKE = ["--device", "cpu", "--fake-data", "64", "--batch-size", "16", "--max-steps", "2", "--epochs", "2"]
SMOKE += ["--num-workers", "0"]  # pool workers are daemons, which may not start loader processes


def _main(*argv: str) -> dict[str, object]:
    return load_script(RECIPE).main([*SMOKE, *argv])


def _checkpoint(directory: Path, rank: int) -> dict[str, object]:
    return torch.load(directory / f"rank{rank}.pt", weights_only=True, mmap=True)


# Per front-end: an argument whose change a resume refuses (it would be silently overridden by the
# saved optimizer state), the refusal it gets, and where the engine's state sits in a checkpoint.
FRONT_ENDS = {
    "optimizer": (["--lr", "0.2"], r"--lr 0.1 \(now 0.2\)", ("optimizer", "decent")),
    "module": (["--accum-iter", "2"], r"--accum-iter 4 \(now 2\)", ("training_state", "decent")),
}


@pytest.mark.timeout(200)
@pytest.mark.parametrize("front_end", FRONT_ENDS)
def test_train_checkpoint_resume(pool, resume_pool, tmp_path, front_end):
    changed, refusal, engine_state = FRONT_ENDS[front_end]
    directory = tmp_path / "ckpt"
    args = ("--front-end", front_end, "--checkpoint-dir", str(directory))

    # Epoch 0 of 2, then stop as if the job had been cut off after saving.
    first = pool(2).run(_main, *args, "--stop-after", "1", timeout=100)
    for metrics in first:
        assert metrics["start_epoch"] == 0 and metrics["epochs_done"] == 1 and metrics["steps"] == 2
        assert 0.0 <= metrics["test_accuracy"] <= 1.0
        assert metrics["train_loss"] > 0
    assert first[0]["train_loss"] == first[1]["train_loss"]  # all-reduced: the same on every rank
    assert first[0]["test_accuracy"] == first[1]["test_accuracy"]
    assert sorted(p.name for p in directory.iterdir()) == ["rank0.pt", "rank1.pt"]  # no temporaries left
    for rank in range(2):
        state = _checkpoint(directory, rank)  # loads with weights_only=True
        assert state["epoch"] == 1 and state["sampler_epoch"] == 0
        assert state[engine_state[0]][engine_state[1]]["rank"] == rank
        assert state["config"]["front_end"] == front_end

    # A resume that would change the optimizer or schedule is refused on every rank, before any training.
    with pytest.raises(WorkerError, match=refusal) as refused:
        pool(2).run(_main, *args, "--resume", *changed, timeout=100)
    assert "raised on rank(s) [0, 1]" in str(refused.value)

    # Build everything afresh, load the files, run the remaining epoch in other processes (those of
    # the resume pool, which never ran the first epoch).
    resumed = resume_pool(2).run(_main, *args, "--resume", timeout=100)
    for metrics in resumed:
        assert metrics["start_epoch"] == 1 and metrics["epochs_done"] == 2
        assert metrics["steps"] == 4  # the front-end's step count came back from the checkpoint
        assert [h["epoch"] for h in metrics["history"]] == [1]
    assert all(_checkpoint(directory, rank)["epoch"] == 2 for rank in range(2))

    # The resumed run ends exactly where an uninterrupted one does (CPU and FakeData are deterministic).
    whole_args = ("--front-end", front_end, "--checkpoint-dir", str(tmp_path / "whole"))
    whole = pool(2).run(_main, *whole_args, timeout=100)
    for uninterrupted, continued in zip(whole, resumed, strict=True):
        assert continued["train_loss"] == uninterrupted["train_loss"]
        assert continued["test_accuracy"] == uninterrupted["test_accuracy"]
    for rank in range(2):  # the replicas themselves, bit for bit
        part, entry = engine_state
        saved = _checkpoint(directory, rank)[part][entry]["params"]
        reference = _checkpoint(tmp_path / "whole", rank)[part][entry]["params"]
        assert all(torch.equal(a, b) for a, b in zip(saved, reference, strict=True))

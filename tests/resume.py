"""Resume a run from per-rank checkpoints in fresh processes; it must end where the uninterrupted run ends.

A test describes its run as a ``Resumable``: a module-level class (so the pool can send an instance
to its workers) that builds the training objects from a seed, trains them, saves and loads their
state, and names the result to compare. ``assert_resume_is_bitwise`` then runs it three times:
uninterrupted, then cut off after ``save_at`` steps with one checkpoint per rank, then rebuilt from
another seed (the checkpoint must win) in the processes of ``resume_pool``, which never ran the
part that saved. A run that loads every rank's file (a resume at any world size) overrides
``Resumable.resume``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

RESUME_SEED = 123  # the resumed run's initialisation, other than the saved run's (0)


class Resumable:
    """One training run that a test interrupts and resumes; runs on every rank."""

    def build(self, seed: int) -> Any:
        """The training objects (model, optimizer, ...) of a run initialised with ``seed``."""
        raise NotImplementedError

    def train(self, run: Any, steps: range) -> None:
        raise NotImplementedError

    def state_dict(self, run: Any) -> dict[str, Any]:
        """What the run saves (a test may assert here what the state holds, e.g. gossip in flight)."""
        raise NotImplementedError

    def load_state_dict(self, run: Any, state: dict[str, Any]) -> None:
        raise NotImplementedError

    def result(self, run: Any) -> torch.Tensor:
        """What must match bit for bit, e.g. the flat parameters."""
        raise NotImplementedError

    def resume(self, run: Any, directory: str) -> None:
        """Load the checkpoint in ``directory``: by default this rank's own file."""
        self.load_state_dict(run, torch.load(_checkpoint(directory), weights_only=True))


def checkpoint_files(directory: str | Path, world_size: int) -> list[Path]:
    """The per-rank files a checkpoint of ``world_size`` ranks consists of, in rank order."""
    return [Path(directory) / f"rank{rank}.pt" for rank in range(world_size)]


def _checkpoint(directory: str) -> Path:
    return checkpoint_files(directory, dist.get_world_size())[dist.get_rank()]


def _uninterrupted(case: Resumable, total: int) -> torch.Tensor:
    run = case.build(0)
    case.train(run, range(total))
    return case.result(run)


def _save(case: Resumable, save_at: int, directory: str) -> None:
    run = case.build(0)
    case.train(run, range(save_at))
    torch.save(case.state_dict(run), _checkpoint(directory))


def _resume(case: Resumable, save_at: int, total: int, directory: str) -> torch.Tensor:
    run = case.build(RESUME_SEED)
    case.resume(run, directory)
    case.train(run, range(save_at, total))
    return case.result(run)


def assert_resume_is_bitwise(
    pool: Any, resume_pool: Any, world_size: int, case: Resumable, directory: Path, total: int, save_at: int
) -> None:
    """``case`` saved after ``save_at`` of ``total`` steps and resumed in fresh processes ends, on
    every rank, exactly (``torch.equal``) where the uninterrupted run ends."""
    reference = pool(world_size).run(_uninterrupted, case, total)
    save_checkpoint(pool, world_size, case, directory, save_at)
    resumed = resume_pool(world_size).run(_resume, case, save_at, total, str(directory))
    for rank in range(world_size):
        assert torch.equal(resumed[rank], reference[rank]), f"{case}: rank {rank} diverged after the resume"


def save_checkpoint(pool: Any, world_size: int, case: Resumable, directory: Path, save_at: int) -> None:
    """Train ``case`` for ``save_at`` steps on ``world_size`` ranks and save one file per rank."""
    pool(world_size).run(_save, case, save_at, str(directory))

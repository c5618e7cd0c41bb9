"""The harness itself: processes a test spawns of its own fail fast, with the traceback or the stacks."""

from __future__ import annotations

import time

import pytest
from workers import WorkerError, spawn


def _sleeps_on_rank_1(rank: int, seconds: float) -> None:
    if rank == 1:
        time.sleep(seconds)


def _raises_on_rank_0(rank: int) -> None:
    if rank == 0:
        raise ValueError("injected")
    time.sleep(60)  # as if waiting in a collective for rank 0


def test_a_hung_spawned_rank_is_killed_at_the_deadline_with_its_stack():
    # The fork server must be up first: started by the first process, it imports torch and FSDP2
    # (seconds, tens on a loaded CI machine), which a short deadline would then have to cover.
    spawn(_sleeps_on_rank_1, (0.0,), nprocs=2, timeout=120)
    start = time.monotonic()
    # 15 s: rank 0, a fork of the running server, starts and finishes in well under a second; the
    # margin is for a loaded CI machine, and it is still far from rank 1's sleep.
    with pytest.raises(TimeoutError, match=r"(?s)within 15 s on ranks \[1\].*rank 1 ---.*_sleeps_on_rank_1"):
        spawn(_sleeps_on_rank_1, (600.0,), nprocs=2, timeout=15)
    assert time.monotonic() - start < 60  # not the 600 s sleep


def test_an_error_on_a_spawned_rank_is_reported_with_its_traceback():
    start = time.monotonic()
    with pytest.raises(WorkerError, match=r"(?s)rank\(s\) \[0\].*ValueError: injected.*ranks \[1\] hung"):
        spawn(_raises_on_rank_0, nprocs=2, timeout=60)
    assert time.monotonic() - start < 30  # 5 s of grace for the others, not the deadline

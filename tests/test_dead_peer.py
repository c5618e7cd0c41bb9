"""Multi-process: a peer that hangs or dies makes the others fail fast with a named error."""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from helpers import tiny_model, train_steps
from workers import WorkerPool

from decent_optim_wrapper import DecentOptimWrapper, GlobalAverageError, GossipError

TIMEOUT = timedelta(seconds=3)


def _peer_fails(how: str) -> tuple[str, float]:
    rank = dist.get_rank()
    model = tiny_model()
    opt = DecentOptimWrapper(
        torch.optim.SGD(model.parameters(), lr=0.1), topology="complete", timeout=TIMEOUT
    )
    train_steps(model, opt, rank, range(2))  # rounds 0 and 1 launched by everyone
    if rank == 2:
        if how == "dies":
            threading.Timer(0.5, os._exit, (1,)).start()  # the process vanishes mid-run
        else:
            time.sleep(8)  # alive, but stops taking steps
        return "stopped", 0.0
    start = time.monotonic()
    try:
        train_steps(model, opt, rank, range(2, 6))  # step 3 waits for rank 2's round 2: never comes
    except GossipError as err:
        return str(err), time.monotonic() - start
    return "no error", time.monotonic() - start


@pytest.mark.timeout(120)
def test_hung_and_dead_peers_fail_the_survivors_fast():
    pool = WorkerPool(3)
    try:
        for how in ("hangs", "dies"):
            results = pool.run(3, _peer_fails, how, timeout=60)
            for rank in (0, 1):
                message, elapsed = results[rank]
                assert "launched at step 2 in group [0, 1, 2]" in message, f"{how}: rank {rank}: {message}"
                assert "peer died or did not answer" in message
                # the timeout (3 s) bounds the wait, far below gloo's default 30 minutes
                assert elapsed < 3 * TIMEOUT.total_seconds(), f"{how}: rank {rank} took {elapsed:.1f} s"
    finally:
        pool.close(kill=True)


def _peer_skips_global_avg() -> tuple[str, float]:
    rank = dist.get_rank()
    model = tiny_model()
    opt = DecentOptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1), topology="ring", timeout=TIMEOUT)
    train_steps(model, opt, rank, range(2))
    if rank == 2:
        time.sleep(8)  # alive, but never joins the global average
        return "stopped", 0.0
    start = time.monotonic()
    try:
        opt.global_avg()
    except GlobalAverageError as err:
        return str(err), time.monotonic() - start
    return "no error", time.monotonic() - start


@pytest.mark.timeout(120)
def test_stuck_peer_during_global_avg_fails_the_others_with_a_named_error():
    pool = WorkerPool(3)
    try:
        results = pool.run(3, _peer_skips_global_avg, timeout=60)
        for rank in (0, 1):
            message, elapsed = results[rank]
            assert message.startswith(f"rank {rank}: global_avg() at step 2: the all-reduce over all 3 ranks")
            assert "did not answer within 0:00:03" in message
            assert elapsed < 3 * TIMEOUT.total_seconds(), f"rank {rank} took {elapsed:.1f} s"
    finally:
        pool.close(kill=True)

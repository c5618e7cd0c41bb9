"""A live elastic job seen through ``python -m decent_optim_wrapper.monitor --json``.

Four workers start a job with a secret (``init_elastic``, ``on_peer_failure="continue"``). The test
runs the monitor as a user would, in a process of its own against the job's store, until its view
shows the four members; then worker 3 kills itself (told through the store), and the monitor runs
until its view shows worker 3 lost and the job at three members; only then does the test start a
worker again (as a launcher brings a node back), and runs the monitor until the view shows that
worker joined, with its donor, and the job at four members again. Then it tells the workers to stop:
worker 0 picks a step well ahead of every member and all stop there.

Every wait polls for a condition (the monitor's view, a key in the store) up to a generous deadline.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from failures import inject, request_worker, run_elastic
from torch import nn

from decent_optim_wrapper import DecentOptimWrapper, init_elastic

pytestmark = pytest.mark.fleet

JOB = "watched"
SECRET = "the-secret-of-the-watched-job-0123"
WORKERS = 4
KILLED = 3
TIMEOUT = timedelta(seconds=5)
WAIT_S = 240.0  # per thing awaited: each run of the monitor imports torch on a loaded machine
PACE_S = 0.02  # a pause per step, leaving the CPUs some room for the monitor's processes
KILL = "watch-test/kill"  # set by the test: the monitor saw the four members
STOP = "watch-test/stop"  # set by the test: the monitor saw what it waited for
STOP_AT = "watch-test/stop-at"  # set by worker 0: the step every worker stops at
STOP_AHEAD = 40  # steps: members are at most a few steps apart (each round waits for its peers)
REPO = Path(__file__).resolve().parents[1]


def _train(index: int, world_size: int, port: int, workdir: str) -> dict[str, Any]:
    del workdir
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    joining = init_elastic(store, index, world_size, job=JOB, secret=SECRET, timeout=timedelta(seconds=60))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    inner = torch.optim.SGD(model.parameters(), lr=0.02)
    opt = DecentOptimWrapper(inner, topology="ring", timeout=TIMEOUT, on_peer_failure="continue")
    stop_at: int | None = None
    t = opt.step_count
    while stop_at is None or t < stop_at:
        x = torch.randn(16, 6, generator=torch.Generator().manual_seed(1000 * index + t), dtype=torch.float64)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        t += 1
        time.sleep(PACE_S)
        if index == KILLED and not joining and store.check([KILL]):
            inject("kill")
        if t % 5 == 0:
            opt.consensus_distance()  # a collective at the same step on every member: the records report it
        if index == 0 and not joining and stop_at is None and store.check([STOP]):
            store.set(STOP_AT, str(t + STOP_AHEAD))
        if stop_at is None and store.check([STOP_AT]):
            stop_at = int(store.get(STOP_AT))
    return {"index": index, "joining": joining, "member": opt.engine.survival.membership.member, "step": t}


def _monitor(port: int) -> dict[str, Any]:
    """The job's view from ``python -m decent_optim_wrapper.monitor --json`` (a process of its own)."""
    env = {**os.environ, "DECENT_JOB_SECRET": SECRET}
    command = [sys.executable, "-m", "decent_optim_wrapper.monitor", "--store", f"127.0.0.1:{port}"]
    done = subprocess.run(
        [*command, "--job", JOB, "--json"], capture_output=True, text=True, timeout=120, env=env, cwd=REPO
    )
    if done.returncode != 0:
        return {"error": done.stderr.strip()}  # e.g. no record yet: the job is starting
    view: dict[str, Any] = json.loads(done.stdout)
    return view


def _watch_until(port: int, what: str, condition: Any, seen: list[dict[str, Any]]) -> dict[str, Any]:
    deadline = time.monotonic() + WAIT_S
    while True:
        view = _monitor(port)
        seen.append(view)
        if "error" not in view and condition(view):
            return view
        assert time.monotonic() < deadline, f"the monitor never showed {what}; last views: {seen[-3:]}"


def _client(port: int) -> dist.Store:
    """A client of the job's store, for the test's own keys."""
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))


def _states(view: dict[str, Any]) -> dict[int, str]:
    return {row["member"]: row["state"] for row in view["members"]}


@pytest.mark.timeout(900)
def test_the_monitor_shows_a_worker_lost_and_then_joined_again_with_its_donor():
    where: dict[str, Any] = {}
    started = threading.Event()

    def note(port: int, workdir: str) -> None:
        where.update(port=port, workdir=workdir)
        started.set()

    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["done"] = run_elastic(_train, WORKERS, deadline_s=840, started=note)
        except BaseException as err:  # re-raised by the test's thread
            outcome["error"] = err
        finally:
            started.set()

    job = threading.Thread(target=run, name="elastic-job", daemon=True)
    job.start()
    seen: list[dict[str, Any]] = []
    try:
        assert started.wait(60) and "port" in where, outcome
        port = where["port"]
        everyone = _watch_until(
            port,
            "the four members",
            lambda v: v["world_size"] == WORKERS and list(_states(v).values()) == ["member"] * WORKERS,
            seen,
        )
        assert everyone["events"] == [] and everyone["current"] == list(range(WORKERS))
        _client(port).set(KILL, "1")
        lost = _watch_until(
            port,
            f"worker {KILLED} lost",
            lambda v: _states(v).get(KILLED) == "lost" and v["world_size"] == WORKERS - 1,
            seen,
        )
        assert [e["kind"] for e in lost["events"]] == ["lost"] and lost["events"][0]["members"] == [KILLED]
        assert sorted(lost["current"]) == [m for m in range(WORKERS) if m != KILLED]
        request_worker(where["workdir"], "again")  # a launcher starts the lost worker again

        def rejoined(view: dict[str, Any]) -> bool:
            joins = [e for e in view["events"] if e["kind"] == "joined"]
            return (
                bool(joins)
                and view["world_size"] == WORKERS
                and all(_states(view).get(m) == "member" for m in joins[-1]["members"])
            )

        joined = _watch_until(port, "the worker joined again", rejoined, seen)
        assert [e["kind"] for e in joined["events"]] == ["lost", "joined"]
        join = joined["events"][-1]
        (newcomer,) = join["members"]
        assert join["donors"] and set(join["donors"]) <= set(joined["current"]) - {newcomer}
        assert join["world_size"] == WORKERS and newcomer in joined["current"]
        assert _states(joined)[KILLED] in ("lost", "member")  # a killed worker's last record stays
        rows = {row["member"]: row for row in joined["members"]}
        assert rows[newcomer]["pid"] != rows[0]["pid"] and rows[newcomer]["step"] is not None
        consensus = _watch_until(port, "a consensus distance", lambda v: v["consensus"] is not None, seen)
        assert consensus["consensus"] >= 0.0
    finally:
        if "port" in where:  # seen or not, the workers stop (a failed watch does not wait out the job)
            _client(where["port"]).set(STOP, "1")
        job.join(timeout=860)
    assert not job.is_alive()
    if "error" in outcome:
        raise outcome["error"]
    done = outcome["done"]
    assert not done.errors, done.errors
    assert done.exitcodes[KILLED] == -9 and len(done.results) == WORKERS
    results = sorted(done.results.values(), key=lambda r: r["index"])
    assert len({r["step"] for r in results}) == 1, results  # every worker stopped at the same step
    assert results[-1]["joining"] and results[-1]["member"] == newcomer

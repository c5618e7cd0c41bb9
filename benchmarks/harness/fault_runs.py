"""Runs of gloo workers that may die on purpose: forked from a parent that hosts the job's store.

``run_workers(fn, world_size, args, deadline_s)`` forks workers running ``fn(rank, world_size, store,
*args)`` in a gloo group joined through the parent's ``TCPStore`` (outside the workers, as torchrun's
agent keeps it, so any worker may die) and returns their JSON results. A worker fails itself through
:func:`injected`, so the parent knows whom not to wait for; past ``deadline_s`` the parent raises
``TimeoutError`` with the running workers' stacks. Forking starts a run in about a second (the store's
master is made after the fork: the parent runs no torch op nor thread before it). With
``restart_after`` the job is elastic and every failed worker comes back after ``restart_after(record)``
seconds as a *spawned* process (a real restart's start-up) that joins.
"""

from __future__ import annotations

import faulthandler
import itertools
import json
import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from benchmarks.harness.common import free_port

__all__ = ["Outcome", "injected", "note", "process_started", "run_workers"]

_workdir: Path | None = None  # set in each worker
_rank = -1
_started = 0.0


@dataclass
class Outcome:
    """What a run left: per rank, the exit code, the result of ``fn`` (if it returned), the error (if it
    raised), and what it recorded when it failed itself (if it did)."""

    exitcodes: dict[int, int | None]
    results: dict[int, Any]
    errors: dict[int, str]
    injected: dict[int, dict[str, Any]]
    seconds: float
    workdir: Path  # each worker's output (log-RANK.txt) is kept there

    def notes(self, rank: int) -> list[dict[str, Any]]:
        """What the worker wrote with :func:`note`, in order."""
        path = self.workdir / f"notes-{rank}.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def injected(record: dict[str, Any]) -> None:
    """Record, in this worker, that it fails itself now (``record`` plus the wall-clock ``time``): before
    the failure (a SIGKILL leaves no chance after), from any thread."""
    assert _workdir is not None, "injected() is for workers started by run_workers()"
    path = _workdir / f"injected-{_rank}.json"
    partial = path.with_suffix(".part")
    partial.write_text(json.dumps({**record, "time": time.time()}))
    partial.replace(path)  # atomic: the parent never reads half a record


def note(record: dict[str, Any]) -> None:
    """Append ``record`` to this worker's notes at once (they outlive a later kill)."""
    assert _workdir is not None, "note() is for workers started by run_workers()"
    with open(_workdir / f"notes-{_rank}.jsonl", "a") as notes:
        notes.write(json.dumps(record) + "\n")


def process_started() -> float:
    """The wall-clock time at which the parent started this worker's process."""
    return _started


def _main(
    rank: int,
    workdir: str,
    world_size: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple,
    elastic: dict[str, Any] | None,
    started: float,
) -> None:
    global _workdir, _rank, _started
    _workdir, _rank, _started = Path(workdir), rank, started
    log = open(_workdir / f"log-{rank}.txt", "w")  # noqa: SIM115 - lives as long as the process
    os.dup2(log.fileno(), 1)  # the worker's prints, logs and stacks go to its own file
    os.dup2(log.fileno(), 2)
    faulthandler.register(signal.SIGUSR1, file=log, all_threads=True)
    try:
        import torch

        torch.set_num_threads(1)  # 8 workers on 2 cores: one thread each
        # The client retries until the parent's master (created after the fork) listens.
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
        if elastic is None:
            dist.init_process_group(
                "gloo", store=dist.PrefixStore("start", store), rank=rank, world_size=world_size
            )
        else:  # a replacement (rank >= world_size) finds the job running and joins it in fn
            from decent_optim_wrapper import init_elastic

            init_elastic(store, rank % world_size, world_size, timeout=timedelta(seconds=60), **elastic)
        result = fn(rank, world_size, store, *args)
        (_workdir / f"result-{rank}.json").write_text(json.dumps(result))
    except BaseException:
        (_workdir / f"error-{rank}.txt").write_text(traceback.format_exc())
        log.flush()
        os._exit(1)
    log.flush()
    os._exit(0)  # no atexit handlers inherited from the parent, no teardown of a group others left


def run_workers(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple[Any, ...] = (),
    deadline_s: float = 120.0,
    *,
    restart_after: Callable[[dict[str, Any]], float] | None = None,
    elastic: dict[str, Any] | None = None,
) -> Outcome:
    """Run ``fn(rank, world_size, store, *args)`` on ``world_size`` forked workers (see module doc);
    with ``restart_after``, bring back every worker that failed itself, ``restart_after(record)``
    seconds after it did. With ``elastic`` (``init_elastic``'s keywords) the workers form an elastic job."""
    if threading.active_count() != 1:
        raise RuntimeError(
            f"run_workers forks: the parent must have no Python thread but the main one, it has "
            f"{threading.enumerate()}"
        )
    workdir = Path(tempfile.mkdtemp(prefix="dow-survival-"))
    port = free_port()
    if restart_after is not None:
        elastic = {"job": "soak", **(elastic or {})}
    procs: list[Any] = []

    def start(context: str) -> None:
        proc = mp.get_context(context).Process(
            target=_main,
            args=(len(procs), str(workdir), world_size, port, fn, args, elastic, time.time()),
            daemon=True,
        )
        procs.append(proc)
        proc.start()

    start_time = time.monotonic()
    for _ in range(world_size):
        start("fork")
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    deadline = start_time + deadline_s
    restarts: dict[int, float] = {}  # a worker that failed itself -> when its replacement starts

    def failed_itself(rank: int) -> bool:
        return (workdir / f"injected-{rank}.json").exists()

    try:
        while True:
            if restart_after is not None:
                for rank in range(len(procs)):
                    if rank in restarts:
                        continue
                    if failed_itself(rank):
                        record = json.loads((workdir / f"injected-{rank}.json").read_text())
                        restarts[rank] = time.monotonic() + restart_after(record)
                    elif procs[rank].exitcode not in (None, 0):  # it raised: a launcher restarts it too
                        restarts[rank] = time.monotonic() + 1.0
                for rank, due in sorted(restarts.items()):
                    if due <= time.monotonic():
                        if procs[rank].is_alive():
                            procs[rank].kill()  # a stopped or hung worker: the launcher ends it
                        restarts[rank] = float("inf")
                        start("spawn")
            pending = [due for due in restarts.values() if due != float("inf")]
            running = [r for r, p in enumerate(procs) if p.is_alive() and not failed_itself(r)]
            remaining = deadline - time.monotonic()
            if (not running and not pending) or remaining <= 0:
                break
            wait = min([remaining, 0.5, *(due - time.monotonic() for due in pending)])
            multiprocessing.connection.wait([procs[r].sentinel for r in running], timeout=max(wait, 0.0))
        if running or pending:
            alive = [r for r, p in enumerate(procs) if p.is_alive()]
            for r in alive:
                os.kill(procs[r].pid, signal.SIGCONT)  # a stopped worker dumps its stacks too
                os.kill(procs[r].pid, signal.SIGUSR1)
            time.sleep(1.0)
            logs = "\n".join(
                f"--- rank {r} ---\n{_read(workdir, 'log', r, '(no output yet)')[-6000:]}" for r in alive
            )
            raise TimeoutError(
                f"{fn.__name__}: ranks {running} did not finish within {deadline_s:.0f} s; "
                f"logs and stacks of the running ones (workdir {workdir}):\n{logs}"
            )
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()  # SIGKILL: hung and stopped (SIGSTOP) workers included
        for proc in procs:
            proc.join(timeout=10)
        del store
    seconds = time.monotonic() - start_time
    outcome = Outcome({r: p.exitcode for r, p in enumerate(procs)}, {}, {}, {}, seconds, workdir)
    tables = {"result": outcome.results, "error": outcome.errors, "injected": outcome.injected}
    for rank, (name, table) in itertools.product(range(len(procs)), tables.items()):
        if (value := _read(workdir, name, rank)) is not None:
            table[rank] = value
    return outcome


def _read(workdir: Path, name: str, rank: int, missing: Any = None) -> Any:
    """What worker ``rank`` wrote to ``name`` (logs and errors as text, the rest as JSON), or ``missing``
    (a worker started late may not have written it yet)."""
    path = workdir / f"{name}-{rank}.{'txt' if name in ('log', 'error') else 'json'}"
    if not path.exists():
        return missing
    return json.loads(path.read_text()) if path.suffix == ".json" else path.read_text()

"""Runs in which workers die or hang on purpose: fresh processes, a store hosted by the parent.

The store lives in the test process, as torchrun's agent hosts it outside the workers, so any
worker may die. ``run_with_faults(fn, world_size, ...)`` starts ``world_size`` fresh processes,
each running ``fn(rank, world_size, port, *args)`` (``fn`` joins the process group through
:func:`join`); a worker that is to fail calls :func:`inject` at the chosen point. The parent waits
until every process has exited or the deadline passes, then returns what each survivor's ``fn``
returned and each process's exit code. On the deadline it dumps the stacks of the processes still
running into a ``TimeoutError``, and no process outlives the call.
"""

from __future__ import annotations

import multiprocessing.connection
import os
import pickle
import signal
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
from workers import dump_stacks, fresh_processes, register_stack_dump

__all__ = ["Outcome", "inject", "join", "request_worker", "run_elastic", "run_with_faults"]


def join(rank: int, world_size: int, port: int) -> dist.Store:
    """Join the gloo process group through the parent's store; returns the store (a client)."""
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=dist.PrefixStore("start", store), rank=rank, world_size=world_size)
    return store


def inject(how: str) -> None:
    """Fail this worker now: ``"kill"`` (SIGKILL, no goodbye) or ``"hang"`` (alive, silent)."""
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif how == "hang":
        time.sleep(3600)
    else:
        raise ValueError(how)


class Outcome:
    """Exit codes by rank and what the ranks that finished returned."""

    def __init__(self, exitcodes: dict[int, int | None], results: dict[int, Any], errors: dict[int, str]):
        self.exitcodes = exitcodes
        self.results = results
        self.errors = errors

    def __repr__(self) -> str:
        return f"Outcome(exitcodes={self.exitcodes}, errors={self.errors})"


def _main(rank: int, workdir: str, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    register_stack_dump(workdir, rank)
    try:
        result = fn(rank, *args)
    except BaseException:
        (Path(workdir) / f"error-{rank}.txt").write_text(traceback.format_exc())
        raise
    (Path(workdir) / f"result-{rank}.pkl").write_bytes(pickle.dumps(result))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_with_faults(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple[Any, ...] = (),
    deadline_s: float = 90.0,
    expect_hung: tuple[int, ...] = (),
) -> Outcome:
    """Run ``fn(rank, world_size, port, *args)`` on ``world_size`` fresh processes (see module doc).

    Ranks in ``expect_hung`` are killed once every other process has exited; any other process still
    running at the deadline fails the call with the stacks of all running processes.
    """
    return _supervise(
        fn, world_size, lambda port, workdir: (world_size, port, *args), deadline_s, expect_hung
    )


def request_worker(workdir: str, tag: str) -> None:
    """Ask the parent of :func:`run_elastic` to start one more worker (it runs the same ``fn``)."""
    (Path(workdir) / f"spawn-{tag}.req").write_text(tag)


def note_losses(front_end: Any, workdir: str, index: int) -> None:
    """Tell the parent of :func:`run_elastic` of every loss this worker records (``restart_after_noted``)."""

    def note(failure: Any) -> None:
        (Path(workdir) / f"lost-{index}-{failure.step}.note").write_text(str(failure.world_size))

    front_end.register_peer_failure_hook(note)


def run_elastic(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple[Any, ...] = (),
    deadline_s: float = 120.0,
    restart_killed: int = 0,
    restart_delay_s: float = 0.0,
    started: Callable[[int, str], None] | None = None,
    restart_after_noted: int = 0,
) -> Outcome:
    """Like :func:`run_with_faults`, but the job may grow: ``fn(index, world_size, port, workdir, *args)``.

    Workers ``0..world_size-1`` start the job. A worker that calls :func:`request_worker` (or, up to
    ``restart_killed`` times, one killed by a signal) makes the parent start another process running
    ``fn`` with the next index, as a launcher brings a node back: it finds the job running and joins.
    A killed worker is restarted ``restart_delay_s`` after the parent sees it dead, as a launcher takes
    a while to notice; a test that wants the loss settled before the join waits longer than the
    survivors' timeout (a worker forked from the preloaded server starts in well under a second, so
    otherwise it may apply while the survivors are still agreeing on the loss, and both are settled
    in one change of membership). A test that needs the loss settled first passes
    ``restart_after_noted``, the number of survivors that must have recorded it (their
    :func:`note_losses`) before the restart: an event, not a wait, so a loaded machine that takes
    longer to agree on the loss cannot merge the two. ``started(port, workdir)`` is called once the
    store is up, before the workers start (a test watching the job from outside learns where it is).
    """
    handled: set[str] = set()
    restarted: set[int] = set()
    dead_since: dict[int, float] = {}

    def grow(procs: list[Any], workdir: str, start: Callable[[], None]) -> None:
        for request in sorted(Path(workdir).glob("spawn-*.req")):
            if request.name not in handled:
                handled.add(request.name)
                start()
        for index, proc in enumerate(list(procs)):
            killed = proc.exitcode is not None and proc.exitcode < 0
            if killed and index not in restarted and len(restarted) < restart_killed:
                seen = dead_since.setdefault(index, time.monotonic())
                noted = {path.name.split("-")[1] for path in Path(workdir).glob("lost-*.note")}
                if time.monotonic() - seen >= restart_delay_s and len(noted) >= restart_after_noted:
                    restarted.add(index)
                    start()

    def arguments(port: int, workdir: str) -> tuple[Any, ...]:
        return (world_size, port, workdir, *args)

    return _supervise(fn, world_size, arguments, deadline_s, (), grow, started)


def _supervise(
    fn: Callable[..., Any],
    world_size: int,
    arguments: Callable[[int, str], tuple[Any, ...]],
    deadline_s: float,
    expect_hung: tuple[int, ...],
    poll: Callable[[list[Any], str, Callable[[], None]], None] | None = None,
    started: Callable[[int, str], None] | None = None,
) -> Outcome:
    """Start ``world_size`` processes running ``fn(index, *arguments(port, workdir))`` around a store
    hosted here; call ``poll(processes, workdir, start)`` between waits (it may start more); wait for
    all but ``expect_hung`` to exit, up to ``deadline_s``; collect what they returned."""
    workdir = tempfile.mkdtemp(prefix="dow-faults-")
    port = _free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    ctx = fresh_processes()
    procs: list[Any] = []

    def start() -> None:
        index = len(procs)
        proc = ctx.Process(target=_main, args=(index, workdir, fn, arguments(port, workdir)), daemon=True)
        proc.start()
        procs.append(proc)

    if started is not None:
        started(port, workdir)
    for _ in range(world_size):
        start()
    deadline = time.monotonic() + deadline_s
    try:
        while True:
            if poll is not None:
                poll(procs, workdir, start)
            running = [r for r, p in enumerate(procs) if p.is_alive() and r not in expect_hung]
            remaining = deadline - time.monotonic()
            if not running or remaining <= 0:
                break
            multiprocessing.connection.wait([procs[r].sentinel for r in running], timeout=min(remaining, 0.2))
        hung = [r for r, p in enumerate(procs) if p.is_alive() and r not in expect_hung]
        if hung:
            stacks = dump_stacks(procs, workdir, hung)
            raise TimeoutError(
                f"{fn.__name__}: ranks {hung} did not finish within {deadline_s:.0f} s:\n{stacks}"
            )
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=5)
        del store
    results, errors = {}, {}
    for index in range(len(procs)):
        result, error = Path(workdir) / f"result-{index}.pkl", Path(workdir) / f"error-{index}.txt"
        if result.exists():
            results[index] = pickle.loads(result.read_bytes())
        if error.exists():
            errors[index] = error.read_text()
    return Outcome({r: p.exitcode for r, p in enumerate(procs)}, results, errors)

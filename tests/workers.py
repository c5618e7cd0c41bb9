"""A pool of gloo worker processes shared across tests.

Starting a worker costs time (a fork, its process group, a warm-up step), so one pool of the
largest world size serves the whole session: a run at a smaller world size re-forms the default
process group among the first ranks (milliseconds), and the others sit it out. A test sends a
module-level function; every rank of the requested world runs it and the parent gets the results.
Every run has a deadline: on a hang the pool dumps each rank's Python stacks, is killed, and the
test fails with those stacks, instead of the suite hanging.

``spawn`` is the same for a test that needs processes of its own (e.g. one per GPU): fresh processes,
one deadline, the stacks of hung ranks, every process killed before it returns.

Fresh processes come from :func:`fresh_processes`: forked from a server that imported torch and the
package once, so each costs a fork instead of an import of torch (seconds each, tens when a test
starts eight at once on two cores), while still sharing nothing with the pytest process.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import queue
import signal
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

DEFAULT_TIMEOUT_S = 60.0

#: What the fork server imports once, before it forks any worker: the expensive part of a start
#: (torch._dynamo: what a first optimizer step would import; FSDP2 and DTensor: sympy among others).
#: Installed modules only: the server does not see the tests' directory on its path.
PRELOAD = [
    "torch",
    "torch._dynamo",
    "torch.distributed",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "decent_optim_wrapper",
]


def fresh_processes() -> Any:
    """The multiprocessing context for workers: ``forkserver`` with torch preloaded.

    A forked child of the server starts with torch imported but no process group, no threads of the
    pytest process and no CUDA context (importing torch creates none), so it is as fresh as a spawned
    one; it inherits the environment the server started with, so a worker sets its own variables.
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # takes effect when the server starts (the first process)
    return ctx


class WorkerError(RuntimeError):
    """A function raised on one or more ranks."""


def _forget_meshes() -> None:
    """Drop DTensor's cached sharding propagations after the default group is replaced.

    The cache is keyed by device meshes, which compare equal by shape and names whatever their
    process groups: a mesh built in the new world would be answered with one of the old world,
    whose groups no longer exist ("Could not resolve the process group registered under the
    name ..."), as soon as the two worlds name their groups differently (a test that created groups
    before its mesh). torch's own DTensor tests start each test in a fresh process instead.
    """
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()


def _worker_main(rank: int, workdir: str, inbox: Any, outbox: Any) -> None:
    register_stack_dump(workdir, rank)
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    # A process's first optimizer step pays for torch's lazy imports (seconds): pay it at start-up.
    warm = torch.nn.Linear(2, 1)
    warm(torch.ones(1, 2)).sum().backward()
    torch.optim.SGD(warm.parameters(), lr=0.1).step()
    outbox.put(("ready", rank, True, None))
    world = (0, 0)  # (world size, generation) of the current process group; generations start at 1
    while True:
        task = inbox.get()
        if task is None:
            break
        task_id, world_size, generation, fn, args, kwargs = task
        try:
            if world != (world_size, generation):
                if dist.is_initialized():
                    dist.destroy_process_group()
                    _forget_meshes()
                dist.init_process_group(
                    "gloo",
                    init_method=f"file://{workdir}/rendezvous-{generation}",
                    rank=rank,
                    world_size=world_size,
                )
                world = (world_size, generation)
            result = fn(*args, **kwargs)
            pickle.dumps(result)  # fail here, visibly, rather than in the queue's feeder thread
            outbox.put((task_id, rank, True, result))
        except BaseException as err:  # report everything; the parent decides
            outbox.put((task_id, rank, False, f"{type(err).__name__}: {err}\n{traceback.format_exc()}"))
    if dist.is_initialized():
        dist.destroy_process_group()


class WorkerPool:
    """Up to ``max_world_size`` spawned processes; each run joins the first ``world_size`` in gloo."""

    def __init__(self, max_world_size: int, start_timeout_s: float = 120.0) -> None:
        self.max_world_size = max_world_size
        self.world_size = max_world_size
        self._world: tuple[int, int] = (0, 0)
        self._workdir = tempfile.mkdtemp(prefix="dow-pool-")
        ctx = fresh_processes()
        self._outbox = ctx.Queue()
        self._inboxes = [ctx.Queue() for _ in range(max_world_size)]
        self._procs = [
            ctx.Process(
                target=_worker_main,
                args=(rank, self._workdir, self._inboxes[rank], self._outbox),
                daemon=True,
            )
            for rank in range(max_world_size)
        ]
        for proc in self._procs:
            proc.start()
        self._next_task = 0
        self.broken = False
        self._collect("ready", start_timeout_s, what="starting the pool")

    def run(
        self,
        world_size: int,
        fn: Callable[..., Any],
        *args: Any,
        timeout: float = DEFAULT_TIMEOUT_S,
        **kwargs: Any,
    ) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on ranks ``0..world_size-1``; return their results in rank order."""
        if self.broken:
            raise RuntimeError("worker pool is broken by an earlier failure")
        if not 1 <= world_size <= self.max_world_size:
            raise ValueError(f"world_size={world_size} outside 1..{self.max_world_size}")
        if self._world[0] != world_size:
            self._world = (world_size, self._world[1] + 1)
        self.world_size = world_size
        self._next_task += 1
        task_id = self._next_task
        for inbox in self._inboxes[:world_size]:
            inbox.put((task_id, *self._world, fn, args, kwargs))
        try:
            return self._collect(task_id, timeout, what=f"{fn.__name__}")
        except Exception:
            raise
        except BaseException:
            # Interrupted (Ctrl-C, pytest-timeout): the ranks may still be busy with this task.
            self.close(kill=True)
            raise

    def _collect(self, task_id: Any, timeout: float, what: str) -> list[Any]:
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        while len(results) + len(errors) < self.world_size:
            remaining = deadline - time.monotonic()
            if errors:
                # Others may be stuck in a collective the failed rank never joined: short grace.
                remaining = min(remaining, 5.0)
            # a rank may end its process after answering (a test that kills a peer does)
            dead = [
                r
                for r, p in enumerate(self._procs[: self.world_size])
                if not p.is_alive() and r not in results and r not in errors
            ]
            if dead and not errors:
                self.close(kill=True)
                raise RuntimeError(f"{what}: worker rank(s) {dead} died")
            try:
                got_id, rank, ok, value = self._outbox.get(timeout=max(0.05, min(remaining, 1.0)))
            except queue.Empty:
                if time.monotonic() < deadline and not (errors and remaining <= 0.05):
                    continue
                missing = sorted(set(range(self.world_size)) - results.keys() - errors.keys())
                stacks = self._dump_stacks()
                self.close(kill=True)
                if errors:
                    raise WorkerError(_format(what, errors) + f"\nranks {missing} hung afterwards.") from None
                raise TimeoutError(
                    f"{what} did not finish within {timeout:.0f} s on ranks {missing}. Stacks:\n{stacks}"
                ) from None
            if got_id != task_id:
                continue  # a late answer of an earlier, failed task
            (results if ok else errors)[rank] = value
        if errors:
            raise WorkerError(_format(what, errors))
        return [results[r] for r in range(self.world_size)]

    def _dump_stacks(self) -> str:
        return dump_stacks(self._procs[: self.world_size], self._workdir)

    def close(self, kill: bool = False) -> None:
        self.broken = True
        if not kill:
            for inbox in self._inboxes:
                inbox.put(None)
            for proc in self._procs:
                proc.join(timeout=10)
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)


def _format(what: str, errors: dict[int, str]) -> str:
    return f"{what} raised on rank(s) {sorted(errors)}:\n" + "\n".join(
        f"--- rank {rank} ---\n{message}" for rank, message in sorted(errors.items())
    )


_STACK_FILES: list[Any] = []  # open for as long as the process lives: faulthandler writes to them


def register_stack_dump(workdir: str, rank: int) -> None:
    """On SIGUSR1, this process writes every thread's Python stack to ``workdir/stacks-{rank}.txt``."""
    dump = open(Path(workdir) / f"stacks-{rank}.txt", "w")  # noqa: SIM115 - closed at process exit
    _STACK_FILES.append(dump)
    faulthandler.register(signal.SIGUSR1, file=dump, all_threads=True)


def dump_stacks(procs: list[Any], workdir: str, ranks: list[int] | None = None) -> str:
    """The Python stacks of ``ranks`` (default: all) of the processes still alive, each having called
    :func:`register_stack_dump`."""
    for proc in procs:
        if proc.is_alive() and proc.pid is not None:
            os.kill(proc.pid, signal.SIGUSR1)
    time.sleep(1.0)
    parts = []
    for rank in range(len(procs)) if ranks is None else ranks:
        path = Path(workdir) / f"stacks-{rank}.txt"
        text = path.read_text() if path.exists() else ""
        parts.append(f"--- rank {rank} ---\n{text[-4000:]}")
    return "\n".join(parts)


def _spawned_main(rank: int, workdir: str, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    register_stack_dump(workdir, rank)
    try:
        fn(rank, *args)
    except BaseException:
        (Path(workdir) / f"error-{rank}.txt").write_text(traceback.format_exc())
        raise


def spawn(fn: Callable[..., Any], args: tuple[Any, ...] = (), nprocs: int = 2, timeout: float = 90.0) -> None:
    """Run ``fn(rank, *args)`` in ``nprocs`` fresh spawned processes and wait at most ``timeout`` s.

    Like ``torch.multiprocessing.spawn`` (``fn`` sets up its own process group), with the pool's
    guarantees: an error on a rank is a ``WorkerError`` with its traceback (the others get 5 s to
    finish, as they may wait for it forever), a hang a ``TimeoutError`` with the stacks of the ranks
    still running, and no process outlives the call.
    """
    workdir = tempfile.mkdtemp(prefix="dow-spawn-")
    ctx = fresh_processes()
    procs = [
        ctx.Process(target=_spawned_main, args=(rank, workdir, fn, args), daemon=True)
        for rank in range(nprocs)
    ]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + timeout
    try:
        while any(proc.is_alive() for proc in procs):
            if any(proc.exitcode not in (None, 0) for proc in procs):
                deadline = min(deadline, time.monotonic() + 5.0)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            running = [proc.sentinel for proc in procs if proc.is_alive()]
            multiprocessing.connection.wait(running, timeout=min(remaining, 1.0))
        errors = {}
        for rank, proc in enumerate(procs):
            if proc.exitcode not in (None, 0):
                path = Path(workdir) / f"error-{rank}.txt"
                errors[rank] = path.read_text() if path.exists() else f"exit code {proc.exitcode}"
        hung = [rank for rank, proc in enumerate(procs) if proc.is_alive()]
        if errors:
            raise WorkerError(
                _format(fn.__name__, errors) + (f"\nranks {hung} hung afterwards." if hung else "")
            )
        if hung:
            stacks = dump_stacks(procs, workdir)
            raise TimeoutError(
                f"{fn.__name__} did not finish within {timeout:.0f} s on ranks {hung}. Stacks:\n{stacks}"
            )
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=5)

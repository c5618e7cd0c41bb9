"""Runs of gloo workers that may die on purpose, around a store this process hosts (as torchrun's agent
does, so any worker may die). A :class:`Launch` forks workers (a second to start) or spawns them as a
real restart does, on loopback or in a node of the emulated cluster; a worker that fails itself says so
with :func:`injected`, so the launcher does not wait for it."""

from __future__ import annotations

import faulthandler
import json
import multiprocessing as mp
import os
import pickle
import signal
import subprocess
import sys
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

__all__ = ["Launch", "Outcome", "injected", "note", "process_started", "run_workers", "shown", "workdir"]

_workdir: Path | None = None  # set in each worker
_index = -1
_started = 0.0


@dataclass
class Outcome:
    """Per launch index: exit code, ``fn``'s result, its error, what it recorded when it failed itself."""

    exitcodes: dict[int, int | None]
    results: dict[int, Any]
    errors: dict[int, str]
    injected: dict[int, dict[str, Any]]
    seconds: float
    workdir: Path  # each worker's output (log-INDEX.txt) is kept there

    def notes(self, index: int) -> list[dict[str, Any]]:
        path = self.workdir / f"notes-{index}.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def workdir() -> Path:
    """In a worker: the run's folder, shared by its workers."""
    assert _workdir is not None, "workdir() is for workers started by a Launch"
    return _workdir


def injected(record: dict[str, Any]) -> None:
    """Record that this worker fails itself now, before it does (a SIGKILL leaves no chance after)."""
    path = workdir() / f"injected-{_index}.json"
    path.with_suffix(".part").write_text(json.dumps({**record, "time": time.time()}))
    path.with_suffix(".part").replace(path)  # atomic: the parent never reads half a record


def note(record: dict[str, Any]) -> None:
    """Append ``record`` to this worker's notes at once (they outlive a later kill)."""
    with open(workdir() / f"notes-{_index}.jsonl", "a") as notes:
        notes.write(json.dumps(record) + "\n")


def process_started() -> float:
    """The wall-clock time at which the launcher started this worker's process."""
    return _started


def _main(spec: dict[str, Any]) -> None:
    global _workdir, _index, _started
    _workdir, _index, _started = Path(spec["workdir"]), spec["index"], spec["started"]
    log = open(_workdir / f"log-{_index}.txt", "a")  # noqa: SIM115 - lives as long as the process
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    faulthandler.register(signal.SIGUSR1, file=log, all_threads=True)
    try:
        import torch

        torch.set_num_threads(1)  # 8 workers on 2 cores: one thread each
        # The client retries until the launcher's master (created after a fork) listens.
        store = dist.TCPStore(spec["host"], spec["port"], is_master=False, timeout=timedelta(seconds=60))
        rank, world_size, elastic = spec["rank"], spec["world_size"], spec["elastic"]
        if elastic is None:  # each attempt of a job forms its group anew
            prefix = dist.PrefixStore(f"start-{spec['attempt']}", store)
            dist.init_process_group("gloo", store=prefix, rank=rank, world_size=world_size)
        else:  # a replacement finds the job running and joins it in fn
            from decent_optim_wrapper import init_elastic

            init_elastic(store, rank, world_size, **{"timeout": timedelta(seconds=60), **elastic})
        result = spec["fn"](_index, world_size, store, *spec["args"])
        (_workdir / f"result-{_index}.json").write_text(json.dumps(result))
    except BaseException:
        (_workdir / f"error-{_index}.txt").write_text(traceback.format_exc())
        log.flush()
        os._exit(1)
    log.flush()
    os._exit(0)  # no atexit handlers inherited from the parent, no teardown of a group others left


def _exitcode(proc: Any) -> int | None:
    return proc.poll() if isinstance(proc, subprocess.Popen) else proc.exitcode


class Launch:
    """The workers of one run, each running ``fn(index, world_size, store, *args)`` in a gloo group or
    an elastic job (``elastic``: ``init_elastic``'s keywords); with ``cluster``
    (``harness/emulated_cluster.py``) worker ``node`` runs in that node's namespace."""

    def __init__(
        self,
        fn: Callable[..., Any],
        world_size: int,
        args: tuple[Any, ...] = (),
        *,
        elastic: dict[str, Any] | None = None,
        cluster: Any = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.fn, self.world_size, self.args, self.elastic = fn, world_size, args, elastic
        self.cluster, self.env = cluster, env or {}
        self.workdir = Path(tempfile.mkdtemp(prefix="dow-faults-"))
        self.host = "127.0.0.1" if cluster is None else cluster.address(0)
        self.port = free_port()
        self.procs: list[Any] = []  # per launch index, an mp.Process (forked) or a Popen (spawned)
        self.ranks: list[int] = []  # per launch index, the rank it started with
        self.began = time.monotonic()

    def start(
        self, *, rank: int | None = None, node: int | None = None, fork: bool = False, **overrides: Any
    ) -> None:
        """Start the next launch index (rank: the index modulo the world, node: the rank); ``overrides``:
        ``attempt`` (its group's) or ``args`` (instead of the run's)."""
        index = len(self.procs)
        rank = index % self.world_size if rank is None else rank
        node = rank if node is None else node
        spec = {"fn": self.fn, "args": self.args, "elastic": self.elastic, "attempt": 0, **overrides}
        spec |= {"index": index, "rank": rank, "world_size": self.world_size, "workdir": str(self.workdir)}
        spec |= {"host": self.host, "port": self.port, "started": time.time()}
        if fork:  # the parent has run no torch op nor thread yet, and makes the store's master after
            if threading.active_count() != 1 or self.cluster is not None:
                raise RuntimeError(f"a fork needs one thread and loopback: {threading.enumerate()}")
            proc: Any = mp.get_context("fork").Process(target=_main, args=(spec,), daemon=True)
            proc.start()
        else:
            (path := self.workdir / f"spec-{index}.pkl").write_bytes(pickle.dumps(spec))
            env = dict(os.environ, OMP_NUM_THREADS="1", **self.env)
            netns = [] if self.cluster is None else ["ip", "netns", "exec", self.cluster.namespace(node)]
            if self.cluster is not None:
                env["GLOO_SOCKET_IFNAME"] = self.cluster.ifname(node)
            with open(self.workdir / f"log-{index}.txt", "w") as log:  # the child keeps its own copy
                command = [*netns, sys.executable, "-m", __name__, str(path)]
                proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        self.procs.append(proc)
        self.ranks.append(rank)

    def exitcodes(self) -> list[int | None]:
        return [_exitcode(proc) for proc in self.procs]

    def failed_itself(self, index: int) -> dict[str, Any] | None:
        return self._read("injected", index)

    def kill(self, indices: list[int] | None = None) -> None:
        """SIGKILL these workers (default: all; hung and stopped ones included) and reap them."""
        for index in range(len(self.procs)) if indices is None else indices:
            if _exitcode(proc := self.procs[index]) is None:
                proc.kill()
            if isinstance(proc, subprocess.Popen):
                proc.wait()
            else:
                proc.join(timeout=10)

    def wait(self, deadline_s: float, tick: Callable[[Launch], bool] | None = None) -> Outcome:
        """Wait for the workers that did not fail themselves, calling ``tick(self)`` between looks (it
        may start workers, and says whether it will start more); past the deadline raise TimeoutError
        with the running workers' stacks; at the end, end them all."""
        if self.cluster is not None:  # in node 0: the root namespace has no address on the bridge
            hosting = f"import time, torch.distributed as d; s = d.TCPStore({self.host!r}, {self.port}, "
            hosting += "is_master=True, wait_for_workers=False); time.sleep(3600)"
            netns = ["ip", "netns", "exec", self.cluster.namespace(0)]
            store: Any = subprocess.Popen([*netns, sys.executable, "-c", hosting])
        else:
            store = dist.TCPStore(self.host, self.port, is_master=True, wait_for_workers=False)
        try:
            while (tick is not None and tick(self)) or self._running():
                if time.monotonic() > self.began + deadline_s:
                    self._time_out(deadline_s)
                time.sleep(0.05)
        finally:
            self.kill()
            if isinstance(store, subprocess.Popen):
                store.kill()
                store.wait()
        codes = dict(enumerate(self.exitcodes()))
        outcome = Outcome(codes, {}, {}, {}, time.monotonic() - self.began, self.workdir)
        tables = {"result": outcome.results, "error": outcome.errors, "injected": outcome.injected}
        for name, table in tables.items():
            table.update({i: value for i in codes if (value := self._read(name, i)) is not None})
        return outcome

    def _running(self) -> list[int]:
        return [i for i, code in enumerate(self.exitcodes()) if code is None and not self.failed_itself(i)]

    def _time_out(self, deadline_s: float) -> None:
        alive = [i for i, code in enumerate(self.exitcodes()) if code is None]
        for i in alive:
            os.kill(self.procs[i].pid, signal.SIGCONT)  # a stopped worker dumps its stacks too
            os.kill(self.procs[i].pid, signal.SIGUSR1)
        time.sleep(1.0)
        logs = "\n".join(f"--- {i} ---\n{self._read('log', i, '(no output yet)')[-6000:]}" for i in alive)
        raise TimeoutError(
            f"{self.fn.__name__}: workers {self._running()} did not finish within {deadline_s:.0f} s; "
            f"logs and stacks of the running ones (workdir {self.workdir}):\n{logs}"
        )

    def _read(self, name: str, index: int, missing: Any = None) -> Any:
        """What worker ``index`` wrote to ``name`` (logs and errors as text, the rest as JSON)."""
        text = name in ("log", "error")
        path = self.workdir / f"{name}-{index}.{'txt' if text else 'json'}"
        if not path.exists():
            return missing
        return path.read_text() if text else json.loads(path.read_text())


def run_workers(fn: Callable[..., Any], world: int, args: tuple, deadline_s: float, **launch: Any) -> Outcome:
    """Run ``fn(rank, world, store, *args)`` on ``world`` forked workers (``launch``: the
    :class:`Launch`'s keywords) and wait for them."""
    job = Launch(fn, world, args, **launch)
    for _ in range(world):
        job.start(fork=True)
    return job.wait(deadline_s)


def shown(value: Any) -> str:
    """A figure as the fault reports print it: floats to 4 digits, dicts as ``key value, ...``."""
    if isinstance(value, dict):
        return ", ".join(
            f"{k} ({shown(v)})" if isinstance(v, dict) else f"{k} {shown(v)}" for k, v in value.items()
        )
    if isinstance(value, list):
        return f"[{', '.join(map(shown, value))}]"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


if __name__ == "__main__":  # a spawned worker: run it in the module its functions import
    from benchmarks.harness import fault_runs

    fault_runs._main(pickle.loads(Path(sys.argv[1]).read_bytes()))

"""Heartbeats: each member (and each applicant) bumps a counter in the store from a thread of its own,
and a counter standing still means its process is gone.

A member's thread also bumps the run's shared counter, which says the job is alive to a worker that
looks for it (:func:`~.jobs.job_running`), and refreshes what the member knows of applicants
(:class:`~.admission.JoinerWatch`).
"""

from __future__ import annotations

import atexit
import contextlib
import threading
from typing import Protocol

from torch.distributed import Store  # type: ignore[attr-defined]

__all__ = ["HEARTBEAT_S", "POLL_S", "STALE_AFTER_S", "Record", "Watch", "beat", "start_heartbeat"]

#: How often the heartbeat thread of a member (and of an applicant) bumps its counter, in seconds.
HEARTBEAT_S = 0.2
#: A counter standing still this long means its process is gone.
STALE_AFTER_S = 3.0
#: How often a wait on the store looks again, in seconds.
POLL_S = 0.05
#: A member's status record is published every this many beats (every 2 s).
RECORD_EVERY = 10


class Watch(Protocol):
    """What a member's heartbeat refreshes on every beat while ``open``."""

    open: bool

    def refresh(self, store: Store, prefix: str) -> None: ...


class Record(Protocol):
    """What a member's heartbeat publishes every :data:`RECORD_EVERY` beats (:mod:`~.status`), and
    withdraws when it stops."""

    def publish(self, store: Store) -> None: ...

    def withdraw(self, store: Store) -> None: ...


#: The heartbeat threads of this process and their stop events: stopped and joined when the
#: interpreter exits, before C++ tears the store client down under a thread still inside a call to
#: it (the process would abort with "terminate called without an active exception").
_HEARTBEATS: list[tuple[threading.Event, threading.Thread]] = []


def start_heartbeat(
    store: Store,
    key: str,
    prefix: str,
    stopped: threading.Event,
    watch: Watch | None = None,
    record: Record | None = None,
) -> None:
    """Run :func:`beat` on a daemon thread until ``stopped`` is set (at the latest at exit)."""
    thread = threading.Thread(
        target=beat, args=(store, key, prefix, stopped, watch, record), name="decent-heartbeat", daemon=True
    )
    if not _HEARTBEATS:
        atexit.register(_stop_heartbeats)
    _HEARTBEATS[:] = [(e, t) for e, t in _HEARTBEATS if t.is_alive()]
    _HEARTBEATS.append((stopped, thread))
    thread.start()


def _stop_heartbeats() -> None:
    for stopped, _ in _HEARTBEATS:
        stopped.set()
    for _, thread in _HEARTBEATS:
        thread.join(timeout=2 * HEARTBEAT_S)


def beat(
    store: Store,
    key: str,
    prefix: str,
    stopped: threading.Event,
    watch: Watch | None = None,
    record: Record | None = None,
) -> None:
    """Bump ``key`` every :data:`HEARTBEAT_S` until ``stopped``. A member of a job open to joiners
    (its ``watch`` open) also bumps the run's shared counter (the job is alive) and refreshes the watch;
    a member with a status ``record`` publishes it every :data:`RECORD_EVERY` beats (the first at the
    first beat) and withdraws it when stopped."""
    alive = f"{prefix}/alive"
    beats = 0
    while not stopped.wait(HEARTBEAT_S):
        try:
            store.add(key, 1)
            if watch is not None and watch.open:
                store.add(alive, 1)
                watch.refresh(store, prefix)
            if record is not None and beats % RECORD_EVERY == 0:
                record.publish(store)
        except Exception:  # the store is gone: recovery will say so; the heartbeat just stops
            return
        beats += 1
    if record is not None:
        with contextlib.suppress(Exception):  # the store went first (the job's end): so did the record
            record.withdraw(store)

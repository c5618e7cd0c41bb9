"""Status records: what each member of an elastic job publishes about itself, for a monitor to read.

Every :data:`RECORD_S` seconds a member's heartbeat thread (:mod:`~.heartbeats`) writes one record
under ``decent-optim-wrapper/<run>/status/<member>``: who it is (member, rank, host, pid), where it
stands (step, round, steps per second, world size, the membership's generation and members), what it
did (bytes sent, seconds spent waiting for peers, guard events, joins and losses seen) and its last
:data:`MAX_EVENTS` changes of members. It also points the job's name at itself
(``decent-optim-wrapper/jobs/<job>/status``), so a reader finds the run from the name alone.

Off the step's critical path: the training loop writes nothing per step; the thread reads the engine's
counters (plain attributes) when it publishes, and the rate is the step count's change between two
records. A record is JSON of plain numbers and strings, bounded in size (a fixed set of fields, at
most :data:`MAX_EVENTS` events, the member list of the job), sealed with the job secret when set
(:meth:`~.sealing.Seal.seal_bytes`): a reader opens it without unpickling anything. A member that
stops cleanly deletes its record; a killed one's record stays until the store goes with the job, and
the survivors' records say it was lost.

A job started by ``init_elastic`` is named as it says; one started by ``torchrun`` alone (with
``on_peer_failure="continue"``, whose members meet in torchrun's store) by ``$TORCHELASTIC_RUN_ID``
(:func:`default_job`). ``DECENT_STATUS_RECORDS=0`` in the workers' environment turns the records off.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from loguru import logger
from torch.distributed import Store  # type: ignore[attr-defined]

from decent_optim_wrapper.engine.fleet.sealing import Seal

__all__ = [
    "MAX_EVENTS",
    "RECORDS_ENV",
    "RECORD_S",
    "STATUS_VERSION",
    "FleetRecords",
    "StatusBoard",
    "default_job",
    "pointer_key",
    "read_fleet",
    "status_key",
]

#: How often a member publishes its record, in seconds.
RECORD_S = 2.0
#: How many of its latest changes of members a record carries.
MAX_EVENTS = 16
#: The records' format (a reader refuses another).
STATUS_VERSION = 1

#: The environment variable that turns the records off ("0"); on by default.
RECORDS_ENV = "DECENT_STATUS_RECORDS"

# What an engine adds to its records: plain numbers, strings, None, or dicts of numbers.
StatusFields = dict[str, Any]


def default_job() -> str:
    """The job's name when ``init_elastic`` gives none: ``$TORCHELASTIC_RUN_ID`` (torchrun's
    ``--rdzv-id``, the node launcher's ``--job``), else ``"default"``, as ``init_elastic`` takes it."""
    return os.environ.get("TORCHELASTIC_RUN_ID") or "default"


def status_key(prefix: str, member: int) -> str:
    """Where member ``member`` of the run at ``prefix`` keeps its record."""
    return f"{prefix}/status/{member}"


def pointer_key(job: str) -> str:
    """Where the job's name points at its run and the latest member to publish."""
    return f"decent-optim-wrapper/jobs/{job}/status"


class StatusBoard:
    """One member's record, published by its heartbeat thread.

    The engine gives it ``source`` (held weakly, so that the thread never keeps an engine alive): a
    callable returning the engine's fields. The membership places it (``placed``) when it joins or
    re-forms the job; survival and growth add the changes of members it sees (``event``).

    Args:
        job: the job's name in the store (``init_elastic(job=...)``), or None (no pointer is written).
        enabled: publish at all; default: unless ``$DECENT_STATUS_RECORDS`` is ``"0"``.
    """

    def __init__(self, job: str | None = None, enabled: bool | None = None) -> None:
        self.job = job
        self.enabled = os.environ.get(RECORDS_ENV, "1").strip() != "0" if enabled is None else enabled
        self._source: Callable[[], Callable[[], StatusFields] | None] = lambda: None
        self._lock = threading.Lock()  # the main thread adds events, the heartbeat thread reads them
        self._events: deque[dict[str, Any]] = deque(maxlen=MAX_EVENTS)
        #: (prefix, member, generation, members) of the membership now
        self._place: tuple[str, int, int, tuple[int, ...]] | None = None
        self._seal = Seal()
        self._last: tuple[float, int] | None = None  # (monotonic time, step) at the previous record
        self._bytes = 0.0
        self._failed = False
        self.published = 0

    def attach(self, source: Callable[[], StatusFields]) -> None:
        """Read the engine's fields from ``source`` (a bound method, held weakly)."""
        self._source = weakref.WeakMethod(source)

    def placed(
        self, prefix: str, member: int, generation: int, members: list[int] | tuple[int, ...], seal: Seal
    ) -> None:
        """This member's place in the job now (its run's prefix, its id, the generation, the members),
        and the seal of the job's secret its records carry."""
        self._place, self._seal = (prefix, member, generation, tuple(members)), seal

    def event(self, kind: str, **facts: Any) -> None:
        """Note a change of members (``"lost"``, ``"joined"``): member ids, steps, world sizes."""
        with self._lock:
            self._events.append({"kind": kind, "time": time.time(), **facts})

    @property
    def events(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._events)

    def record(self) -> dict[str, Any] | None:
        """The record to publish now, or None if not placed or the engine is gone."""
        place, source = self._place, self._source()
        if place is None or source is None:
            return None
        _, member, generation, members = place
        fields = source()
        now, step = time.monotonic(), int(fields.get("step", 0))
        rate = None
        if self._last is not None and now > self._last[0]:
            rate = max(0, step - self._last[1]) / (now - self._last[0])
            self._bytes += max(0, step - self._last[1]) * float(fields.get("bytes_per_step", 0.0))
        self._last = (now, step)
        return {
            "version": STATUS_VERSION,
            "member": member,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "time": time.time(),
            "generation": generation,
            "members": list(members),
            "steps_per_s": rate,
            "bytes_sent": self._bytes,
            **fields,
            "events": self.events,
        }

    def publish(self, store: Store) -> None:
        """Write the record (and the job's pointer at it); a failure other than the store's is logged
        once and the heartbeat goes on."""
        if not self.enabled:
            return
        try:
            record = self.record()
            payload = None if record is None else json.dumps(record).encode()
        except Exception as err:  # e.g. read mid-rewire: the next record will do
            if not self._failed:
                self._failed = True
                logger.warning("a status record could not be built (the heartbeat goes on): {!r}", err)
            return
        if payload is None or self._place is None:
            return
        prefix, member, seal = self._place[0], self._place[1], self._seal
        key = status_key(prefix, member)
        store.set(key, seal.seal_bytes(payload, key))
        if self.job is not None:
            where = pointer_key(self.job)
            pointer = {"version": STATUS_VERSION, "prefix": prefix, "member": member}
            store.set(where, seal.seal_bytes(json.dumps(pointer).encode(), where))
        self.published += 1

    def withdraw(self, store: Store) -> None:
        """Delete the record (this member stops cleanly)."""
        place = self._place
        if place is not None:
            store.delete_key(status_key(place[0], place[1]))


@dataclass
class FleetRecords:
    """What a reader found in the store: the run's prefix, each member's record (None: forged or
    unreadable, with the reason in ``refused``), and each member's heartbeat counter."""

    prefix: str
    records: dict[int, dict[str, Any]] = field(default_factory=dict)
    beats: dict[int, int] = field(default_factory=dict)
    refused: dict[int, str] = field(default_factory=dict)


def _open_json(store: Store, key: str, seal: Seal) -> Any:
    return json.loads(seal.open_bytes(store.get(key), key).decode())


def read_fleet(store: Store, job: str, seal: Seal, limit: int = 4096) -> FleetRecords | None:
    """Every record of job ``job`` reachable from its pointer: the pointed member's, then those of
    every member and every member named by an event in the records read (at most ``limit``).

    None if the job has no pointer (no member of a job of that name published a record). Raises
    :class:`~.sealing.ForgedEntryError` if the pointer does not verify with ``seal``.
    """
    where = pointer_key(job)
    if not store.check([where]):
        return None
    pointer = _open_json(store, where, seal)
    prefix = str(pointer["prefix"])
    found = FleetRecords(prefix)
    todo, seen = [int(pointer["member"])], set[int]()
    while todo and len(seen) < limit:
        member = todo.pop()
        if member in seen:
            continue
        seen.add(member)
        beat = f"{prefix}/beat/{member}"
        if store.check([beat]):
            found.beats[member] = int(store.add(beat, 0))
        key = status_key(prefix, member)
        if not store.check([key]):
            continue
        try:
            record = _open_json(store, key, seal)
        except Exception as err:  # a forged or corrupted record is shown as such, not trusted
            found.refused[member] = str(err)
            continue
        found.records[member] = record
        named = list(record.get("members", []))
        for event in record.get("events", []):
            named += list(event.get("members", [])) + list(event.get("donors", []))
        todo.extend(int(m) for m in named if int(m) not in seen)
    return found

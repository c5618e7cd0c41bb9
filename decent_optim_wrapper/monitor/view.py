"""The fleet as one view: the members' status records merged into a table of workers and a timeline.

:func:`fleet_view` is pure (records in, a dict of plain values out), so the terminal view, ``--json``
and the web page show the same thing, and tests build it from recorded data. :func:`read_view` reads
the records from the store, and each member's heartbeat twice, :data:`BEAT_SAMPLE_S` apart.

Who is in the job comes from the newest record (highest membership generation, then latest): its
member list is what the members agreed on. A member outside it is ``lost`` if a record's events say
the members went on without it, else ``left``; a member in it whose heartbeat did not move while the
view was read is ``silent`` (its process stopped, or its machine is starved: the members decide).
"""

from __future__ import annotations

import time
from typing import Any

from torch.distributed import Store  # type: ignore[attr-defined]

from decent_optim_wrapper.engine import FleetRecords, Seal, read_fleet

__all__ = ["BEAT_SAMPLE_S", "fleet_view", "read_view"]

#: How long apart the two readings of the heartbeats are (a live member beats every 0.2 s).
BEAT_SAMPLE_S = 1.0

#: The fields of a member's row, in the order the terminal shows them.
ROW_FIELDS = (
    "member",
    "state",
    "rank",
    "host",
    "pid",
    "step",
    "round",
    "steps_per_s",
    "world_size",
    "generation",
    "bytes_sent",
    "bytes_per_step",
    "compression",
    "wait_s",
    "joins",
    "losses",
    "guard",
    "topology",
    "pace_round_s",
    "pace_step_s",
    "consensus",
    "consensus_step",
    "age_s",
)


def _event_key(event: dict[str, Any]) -> tuple[object, ...]:
    return (event.get("kind"), event.get("generation"), tuple(event.get("members", ())))


def fleet_view(
    found: FleetRecords,
    *,
    job: str,
    address: str,
    moved: dict[int, bool] | None = None,
    now: float | None = None,
) -> dict[str, Any]:
    """The job as plain values: ``members`` (a row per worker with a record), ``events`` (the changes
    of members every record saw, each once, oldest first), the job's generation, world size and
    current members, and the latest consensus distance a member reported (``consensus``, at
    ``consensus_step``; None until the training loop calls ``consensus_distance()``). ``moved[m]``
    says whether member ``m``'s heartbeat moved while it was read."""
    now = time.time() if now is None else now
    records = found.records
    latest = max(records.values(), key=lambda r: (r.get("generation", 0), r.get("time", 0.0)), default=None)
    current = [] if latest is None else [int(m) for m in latest.get("members", [])]
    events: dict[tuple[object, ...], dict[str, Any]] = {}
    for record in records.values():
        for event in record.get("events", []):
            key = _event_key(event)
            if key not in events or event.get("time", 0.0) < events[key].get("time", 0.0):
                events[key] = dict(event)
    timeline = sorted(events.values(), key=lambda e: (e.get("generation", 0), e.get("time", 0.0)))
    lost = {int(m) for e in timeline if e.get("kind") == "lost" for m in e.get("members", [])}
    rows = []
    # A member an event names has a row even without a record (lost before its first one, 2 s in).
    named = {int(m) for e in timeline for m in e.get("members", [])}
    for member in sorted(set(records) | set(current) | set(found.refused) | named):
        record = records.get(member, {})
        if member in current:
            state = "silent" if moved is not None and not moved.get(member, False) else "member"
        elif member in lost:
            state = "lost"
        else:
            state = "left"
        if member in found.refused:
            state = "unverified"
        row = {name: record.get(name) for name in ROW_FIELDS}
        row.update(member=member, state=state)
        row["age_s"] = None if "time" not in record else max(0.0, now - float(record["time"]))
        rows.append(row)
    # The consensus distance is a collective's result, the same on every rank: the newest one reported.
    measured = [r for r in records.values() if r.get("consensus") is not None]
    newest = max(measured, key=lambda r: int(r.get("consensus_step") or 0), default=None)
    return {
        "job": job,
        "store": address,
        "prefix": found.prefix,
        "generation": None if latest is None else latest.get("generation"),
        "world_size": len(current),
        "current": current,
        "members": rows,
        "events": timeline,
        "consensus": None if newest is None else newest["consensus"],
        "consensus_step": None if newest is None else newest.get("consensus_step"),
        "refused": {str(m): why for m, why in found.refused.items()},
        "time": now,
    }


def read_view(store: Store, job: str, seal: Seal, address: str) -> dict[str, Any] | None:
    """The view of job ``job`` read from ``store`` now (None if no record of it is there), the
    heartbeats sampled twice, :data:`BEAT_SAMPLE_S` apart."""
    found = read_fleet(store, job, seal)
    if found is None:
        return None
    time.sleep(BEAT_SAMPLE_S)
    again = read_fleet(store, job, seal)
    if again is not None and again.prefix == found.prefix:
        moved = {m: again.beats.get(m, b) != b for m, b in found.beats.items()}
        found = again
    else:
        moved = None
    return fleet_view(found, job=job, address=address, moved=moved)

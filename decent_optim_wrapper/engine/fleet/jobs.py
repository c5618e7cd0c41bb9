"""The elastic job a process is in: the record :func:`~decent_optim_wrapper.launch.init_elastic` leaves
for the engine, and the running job as the store publishes it under its name (where joiners find it).

The job's name maps to its run under ``decent-optim-wrapper/jobs/<job>``; the run's keys live under
``decent-optim-wrapper/<run>`` (:func:`~decent_optim_wrapper.engine.fleet.jobs.run_prefix`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from torch.distributed import Store  # type: ignore[attr-defined]

from decent_optim_wrapper.engine.errors import DecentError
from decent_optim_wrapper.engine.fleet.heartbeats import POLL_S, STALE_AFTER_S
from decent_optim_wrapper.engine.fleet.replicas import ReplicaWorld
from decent_optim_wrapper.engine.fleet.sealing import ForgedEntryError, Seal, resolve_secret

__all__ = [
    "ElasticJob",
    "JobInfo",
    "JoinRejectedError",
    "current_job",
    "enter_job",
    "job_running",
    "process_seal",
    "publish_job",
    "run_prefix",
]


class JoinRejectedError(DecentError, ValueError):
    """The running job refused this worker: its model or options differ from the members'."""


@dataclass(frozen=True)
class JobInfo:
    """What the store says of a running job: its run (the key prefix) and its size at launch."""

    run: str
    launch_world_size: int
    signature: tuple[tuple[str, object], ...] = ()  # what an applicant must match (checked before applying)
    shards: int = 1  # processes per replica (a job of nodes, ``init_elastic(..., shards=k)``)


@dataclass
class ElasticJob:
    """This process's elastic job: the store it meets the others in, the job's name, and the running
    job it found at start if it is a joiner (set by :func:`enter_job`, read by the engine)."""

    store: Store
    job: str
    found: JobInfo | None  # None: this process started the job
    #: In a decentralized-HSDP job (``init_elastic(..., shards=k)``): this rank's shard world.
    replicas: ReplicaWorld | None = None
    #: The store prefix a joining node's ranks coordinate under (on a node started to join a job of nodes).
    node_key: str | None = None
    #: Seals the job's store entries and replica digests with its secret (:mod:`~.sealing`).
    seal: Seal = field(default_factory=Seal)

    @property
    def joining(self) -> bool:
        return self.found is not None


_context: ElasticJob | None = None


def enter_job(
    store: Store,
    job: str,
    found: JobInfo | None,
    replicas: ReplicaWorld | None = None,
    node_key: str | None = None,
    seal: Seal | None = None,
) -> None:
    """Record this process's elastic job, the running job it found, if any, its shard world in a
    decentralized-HSDP job, where a joining node's ranks coordinate, and the seal of its secret
    (:func:`~decent_optim_wrapper.launch.init_elastic` calls it)."""
    global _context
    _context = ElasticJob(store, job, found, replicas, node_key, Seal() if seal is None else seal)


def current_job() -> ElasticJob | None:
    """The elastic job this process entered, or None (survival only, no joins)."""
    return _context


def process_seal() -> Seal:
    """The seal of this process's job secret: its elastic job's, else ``$DECENT_JOB_SECRET``'s (survival
    without joins), else none (plain entries)."""
    return _context.seal if _context is not None else Seal(resolve_secret())


def _job_key(job: str) -> str:
    return f"decent-optim-wrapper/jobs/{job}"


def run_prefix(run: str) -> str:
    """Where run ``run``'s keys live in the store."""
    return f"decent-optim-wrapper/{run}"


def publish_job(store: Store, job: str, info: JobInfo, seal: Seal) -> None:
    """Make ``job`` findable by joiners (rank 0 of the members, once the engine is built)."""
    key = _job_key(job)
    store.set(key, seal.seal(info, key))


def job_running(store: Store, job: str, seal: Seal) -> JobInfo | None:
    """The job's info if ``job`` is published and its members are alive, else None.

    Alive: the run's shared heartbeat counter moves within :data:`STALE_AFTER_S` (a job that ended,
    or a store left over from an earlier job, has a counter standing still). A published entry that
    does not verify with ``seal`` (:mod:`~.sealing`) raises :class:`JoinRejectedError`.
    """
    key = _job_key(job)
    if not store.check([key]):
        return None
    try:
        info: JobInfo = seal.open(store.get(key), key)
    except ForgedEntryError as err:
        raise JoinRejectedError(
            f"job {job!r} is in the store, but this worker cannot verify it: {err} If that job is over, "
            "start the new one under another name or with a fresh store."
        ) from err
    alive = f"{run_prefix(info.run)}/alive"
    first = int(store.add(alive, 0))
    deadline = time.monotonic() + STALE_AFTER_S
    while time.monotonic() < deadline:
        time.sleep(POLL_S)
        if int(store.add(alive, 0)) != first:
            return info
    return None

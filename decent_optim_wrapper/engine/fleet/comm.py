"""Thin helpers over ``torch.distributed``: cross-rank agreement, process groups,
the dtype collectives sum in, and how to wait for a collective without a host sync on accelerators.

Every function here that communicates is a collective: all ranks must call it, in the same order.
"All ranks" are those of the job's group (:func:`job_group`): the default process group, or in a
decentralized-HSDP elastic job this rank's shard world (:mod:`~.replicas`).
"""

from __future__ import annotations

import atexit
import pickle
import secrets
import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist
from loguru import logger

from decent_optim_wrapper.engine.fleet.jobs import current_job
from decent_optim_wrapper.engine.fleet.world import GossipWorld
from decent_optim_wrapper.topo import Topology

__all__ = [
    "GroupLayout",
    "ProcessGroups",
    "agree",
    "all_gather_pickled",
    "check_identical",
    "group_layout",
    "job_group",
    "run_token",
    "reduction_dtype",
    "wait_all",
]

T = TypeVar("T")

# Summing n fp16/bf16 values in their own dtype rounds after every addition; summing in fp32 and
# rounding once at the end keeps an average within one rounding of the exact value.
_REDUCE_IN_FP32 = {torch.float16: torch.float32, torch.bfloat16: torch.float32}


def reduction_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a tensor of ``dtype`` travels and is summed in (fp32 for fp16/bf16, else itself)."""
    return _REDUCE_IN_FP32.get(dtype, dtype)


def wait_all(
    works: Sequence[dist.Work],
    device: torch.device,
    timeout: timedelta | None,
    failure: Callable[[BaseException | None], Exception],
) -> None:
    """Wait for ``works`` (collectives on tensors of ``device``); raise ``failure(cause)`` if one fails.

    How to wait depends on where the tensors live:

    * CPU (gloo): ``Work.wait(timeout)`` blocks this thread for at most ``timeout``, and is what turns
      a dead or stuck peer into an error instead of a hang.
    * CUDA and other accelerators (NCCL): ``Work.wait()`` without a timeout only makes the current
      stream wait for the collective (stream-ordered, no host sync). Given a timeout, NCCL's
      ``wait`` instead busy-waits the CPU until the collective completes, a host sync in every
      ``step()``. A stuck peer is then caught by the process group's own timeout (set from ours when
      the groups are created) and NCCL's watchdog, which abort the communicator.
    """
    timed = timeout if device.type == "cpu" else None  # None: a stream-ordered wait, no timeout
    for work in works:
        try:
            done = work.wait(timed) if timed is not None else work.wait()
        except RuntimeError as err:
            raise failure(err) from err
        if done is False:
            raise failure(None)


def job_group() -> dist.ProcessGroup | None:
    """The group the engine agrees over: None (the default group), or in a job started with
    ``init_elastic(..., shards=k)`` this rank's shard world, the default group being its node."""
    job = current_job()
    return None if job is None or job.replicas is None else job.replicas.group


def run_token() -> str:
    """A token every rank of the job shares, unique to this run (it names the run's keys in the
    store): drawn by rank 0, or in a job of nodes the job's start.

    .. warning:: This is a collective: all ranks must call it.
    """
    job = current_job()
    if job is not None and job.replicas is not None:
        return job.replicas.token
    token: str = all_gather_pickled(secrets.token_hex(8))[0]
    return token


def agree(what: str, build_report: Callable[[], T]) -> list[T]:
    """Run ``build_report`` on every rank and gather all reports, failing together.

    A rank whose ``build_report`` raises still joins the gather, carrying its error, so that a
    local mistake (bad input on one rank) becomes an error on every rank instead of a hang of the
    others in the next collective. The raising rank re-raises its own exception; the others raise a
    ``ValueError`` that names it.

    .. warning:: This is a collective: all ranks must call it.
    """
    error: BaseException | None = None
    try:
        report: Any = build_report()
    except (ValueError, TypeError, RuntimeError) as err:
        error, report = err, None
    gathered = all_gather_pickled((None if error is None else f"{type(error).__name__}: {error}", report))
    if error is not None:
        raise error
    failed = {rank: message for rank, (message, _) in enumerate(gathered) if message is not None}
    if failed:
        details = "; ".join(f"rank {rank}: {message}" for rank, message in failed.items())
        raise ValueError(f"{what} failed on other ranks, so it stops here too. {details}")
    return [report for _, report in gathered]


def all_gather_pickled(obj: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank's ``obj`` (picklable), in rank order, over ``group`` (default: the job's group,
    :func:`job_group`).

    ``torch.distributed.all_gather_object`` needs NumPy, which this library does not depend on, so
    the bytes travel as uint8 tensors: first the lengths, then the payloads padded to the longest.

    .. warning:: This is a collective: all ranks must call it.
    """
    group = job_group() if group is None else group
    device = torch.device("cpu")
    if group is None and dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)
    world = dist.get_world_size() if group is None else group.size()
    lengths = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(lengths, torch.tensor([payload.numel()], dtype=torch.int64, device=device), group=group)
    longest = max(int(n.item()) for n in lengths)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: payload.numel()] = payload
    chunks = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(world)]
    dist.all_gather(chunks, padded, group=group)
    # Reports are a few kB (shapes and schedules), so a Python list round trip is cheap enough.
    return [
        pickle.loads(bytes(chunk[: int(n.item())].cpu().tolist()))
        for chunk, n in zip(chunks, lengths, strict=True)
    ]


def check_identical(what: str, values: list[Any], fix: str) -> None:
    """Raise a ValueError on every rank if ranks gathered different ``values``."""
    reference = values[0]
    differ = [rank for rank, value in enumerate(values) if value != reference]
    if differ:
        raise ValueError(f"{what} differs between rank 0 and rank(s) {differ}. {fix}")


#: The process groups one gossip world needs, as its members' global ranks followed by each distinct
#: multi-rank group of its topology's schedule (in global ranks).
GroupLayout = tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]


def group_layout(topology: Topology, world: GossipWorld) -> GroupLayout:
    """The process groups ``world``'s topology needs, in global ranks."""
    groups = tuple(world.global_ranks(g.ranks) for g in topology.distinct_groups())
    return world.ranks, groups


class ProcessGroups:
    """The process groups gossip needs, created once and in the same order on every rank of the job.

    Holds one group per distinct multi-rank group of this rank's schedule, plus one spanning its
    gossip world for exact global averaging, so that gossip never shares a communicator with the
    user's collectives. Creating a group is a collective of the whole job (``torch.distributed.new_group``),
    so every rank creates every gossip world's groups (``layouts``, the same list on every rank, as
    :func:`group_layout` gives them), and keeps its own world's. Groups are looked up by the ranks of
    the gossip world (the topology's).

    In a decentralized-HSDP elastic job (``world.replicas``) the groups are built from the store
    instead (:mod:`~.replicas`), by their members only, and only this rank's gossip world's.

    With ``separate=True`` no gossip group shares its communicator with the group spanning the
    world, even where their members are the same: gossip issued from another thread (host staging)
    then never interleaves with the world's collectives, whose order every member must share.

    .. warning:: Construction is a collective: all ranks must build it with the same ``layouts`` and
        ``separate``.
    """

    def __init__(
        self,
        world: GossipWorld,
        layouts: Sequence[GroupLayout],
        timeout: timedelta | None = None,
        separate: bool = False,
    ) -> None:
        self._by_ranks: dict[tuple[int, ...], dist.ProcessGroup] = {}
        kwargs: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
        self.world: dist.ProcessGroup | None = None
        position = {g: r for r, g in enumerate(world.ranks)}
        if world.replicas is not None:
            self._form_from_store(world, layouts, position, timeout, separate)
            return
        for members, groups in layouts:
            mine = members == world.ranks
            # new_group returns GroupMember.NON_GROUP_MEMBER only to ranks outside the group.
            spanning = dist.new_group(list(members), **kwargs) if len(members) > 1 else None
            if mine:
                self.world = cast(dist.ProcessGroup | None, spanning)
            for ranks in groups:
                shared = ranks == members and not separate
                handle = spanning if shared else dist.new_group(list(ranks), **kwargs)
                if mine:
                    # Groups have 2+ ranks, so one spanning the world exists only when self.world does.
                    self._by_ranks[tuple(position[g] for g in ranks)] = cast(dist.ProcessGroup, handle)
        logger.debug("created {} gossip process groups: {}", len(self._by_ranks), list(self._by_ranks))

    def _form_from_store(
        self,
        world: GossipWorld,
        layouts: Sequence[GroupLayout],
        position: dict[int, int],
        timeout: timedelta | None,
        separate: bool,
    ) -> None:
        """This gossip world's groups, formed by their members in ascending order of ranks (with
        ``separate``, the world's own group right after a gossip group over the same ranks)."""
        replicas = world.replicas
        assert replicas is not None
        (groups,) = [groups for members, groups in layouts if members == world.ranks]
        me = world.ranks[world.rank]
        needed = sorted({world.ranks, *groups} if world.world_size > 1 else set(groups))
        formed = {ranks: replicas.new_group(ranks, timeout) for ranks in needed if me in ranks}
        self.world = formed.get(world.ranks)
        if separate and world.ranks in groups:
            self.world = replicas.new_group(world.ranks, timeout)
        for ranks in groups:
            if me in ranks:
                self._by_ranks[tuple(position[g] for g in ranks)] = formed[ranks]

    def __getitem__(self, ranks: tuple[int, ...]) -> dist.ProcessGroup:
        return self._by_ranks[ranks]

    def retire(self, after: timedelta) -> None:
        """Let go of these groups ``after`` from now, on a background thread (after a lost peer).

        Destroying a gloo group joins its worker threads, which wait for any collective still
        stuck on a lost peer until the group's timeout: done on the training thread, that would
        stall the survivors. Held until then, and released off the training thread.
        """
        handles = [*self._by_ranks.values(), self.world]
        self._by_ranks, self.world = {}, None
        if not _RETIRED:  # the first retirement of this process: release them all at exit at the latest
            atexit.register(_release_retired)
        _RETIRED.append(handles)
        timer = threading.Timer(after.total_seconds(), handles.clear)
        timer.daemon = True
        timer.start()


#: Groups let go of by :meth:`ProcessGroups.retire` and not yet released. Released at the latest when
#: the interpreter exits, on the main thread: gloo groups left alive until C++ tears the process down
#: still have their worker threads, and the process aborts ("terminate called without an active
#: exception"). Releasing a group whose collective waits for a peer ends when the peer's side is
#: released too (its connection closes) or at the group's timeout.
_RETIRED: list[list[Any]] = []


def _release_retired() -> None:
    for handles in _RETIRED:
        handles.clear()

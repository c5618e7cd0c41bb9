"""Thin helpers over ``torch.distributed``: checked world info, cross-rank agreement, process groups,
the dtype collectives sum in, and how to wait for a collective without a host sync on accelerators.

Every function here that communicates is a collective: all ranks must call it, in the same order.
"""

from __future__ import annotations

import os
import pickle
import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist
from loguru import logger

from decent_optim_wrapper.topo import Topology

__all__ = [
    "ProcessGroups",
    "agree",
    "all_gather_pickled",
    "check_identical",
    "reduction_dtype",
    "resolve_world",
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


def resolve_world(
    rank: int | None, world_size: int | None, local_world_size: int | None
) -> tuple[int, int, int]:
    """Rank, world size and ranks per node, checked against ``torch.distributed``.

    ``rank`` and ``world_size`` default to the process group's; ``local_world_size`` defaults to the
    ``LOCAL_WORLD_SIZE`` variable that torchrun sets, else 1.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "torch.distributed is not initialized. Call torch.distributed.init_process_group() first "
            "(launch with torchrun, or set MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE)."
        )
    actual_rank, actual_world = dist.get_rank(), dist.get_world_size()
    for name, given, actual in (("rank", rank, actual_rank), ("world_size", world_size, actual_world)):
        if given is None:
            continue
        if isinstance(given, bool) or not isinstance(given, int):
            raise TypeError(f"{name} must be an int or None, got {given!r}.")
        if given != actual:
            raise ValueError(
                f"{name}={given} disagrees with torch.distributed, which reports {name}={actual}. "
                f"Pass {name}={actual} or leave it out."
            )
    if local_world_size is None:
        env = os.environ.get("LOCAL_WORLD_SIZE")
        if env is None:
            local_world_size = 1
        else:
            try:
                local_world_size = int(env)
            except ValueError:
                raise ValueError(
                    f"LOCAL_WORLD_SIZE={env!r} is not an integer; set it to the number of processes per "
                    "node, or pass local_world_size."
                ) from None
    if isinstance(local_world_size, bool) or not isinstance(local_world_size, int):
        raise TypeError(f"local_world_size must be an int or None, got {local_world_size!r}.")
    if local_world_size < 1 or actual_world % local_world_size != 0:
        raise ValueError(
            f"local_world_size={local_world_size} must be a positive divisor of world_size={actual_world} "
            "(processes per node, the same on every node)."
        )
    return actual_rank, actual_world, local_world_size


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


def all_gather_pickled(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (picklable), in rank order, over the default process group.

    ``torch.distributed.all_gather_object`` needs NumPy, which this library does not depend on, so
    the bytes travel as uint8 tensors: first the lengths, then the payloads padded to the longest.

    .. warning:: This is a collective: all ranks must call it.
    """
    device = torch.device("cpu")
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)
    world = dist.get_world_size()
    lengths = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(lengths, torch.tensor([payload.numel()], dtype=torch.int64, device=device))
    longest = max(int(n.item()) for n in lengths)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: payload.numel()] = payload
    chunks = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(world)]
    dist.all_gather(chunks, padded)
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


class ProcessGroups:
    """The process groups a topology needs, created once and in the same order on every rank.

    Holds one group per distinct multi-rank group of the schedule, plus one spanning the world for
    exact global averaging, so that gossip never shares a communicator with the user's collectives.

    .. warning:: Construction is a collective: all ranks must build it with the same topology.
    """

    def __init__(self, topology: Topology, timeout: timedelta | None = None) -> None:
        self._by_ranks: dict[tuple[int, ...], dist.ProcessGroup] = {}
        kwargs: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
        world = list(range(topology.world_size))
        self.world: dist.ProcessGroup | None = None
        if topology.world_size > 1:
            # new_group returns GroupMember.NON_GROUP_MEMBER only to ranks outside the group.
            self.world = cast(dist.ProcessGroup, dist.new_group(world, **kwargs))
        for group in topology.distinct_groups():
            handle = self.world if list(group.ranks) == world else dist.new_group(list(group.ranks), **kwargs)
            # Groups have 2+ ranks, so one spanning the world exists only when self.world does. A rank
            # outside a group holds GroupMember.NON_GROUP_MEMBER for it, but only looks up its own groups.
            self._by_ranks[group.ranks] = cast(dist.ProcessGroup, handle)
        logger.debug("created {} gossip process groups: {}", len(self._by_ranks), list(self._by_ranks))

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
        timer = threading.Timer(after.total_seconds(), handles.clear)
        timer.daemon = True
        timer.start()

"""How a round's collective reaches the peers, chosen once when the groups are wired.

:class:`DirectTransport` runs the collective on the bucket's own buffers; :class:`HostStagedTransport`
runs it on pinned host copies, launched in order from a thread of its own (:mod:`~.staging`: GPU
buckets over gloo), and copies the result back before the mix. Either gathers a pair of members over
gloo as a bitwise-XOR all-reduce (:func:`gather_payloads`).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist

from decent_optim_wrapper.engine.exchange.staging import HostStaging, host_buffer

__all__ = ["DirectTransport", "HostStagedTransport", "Transport", "gather_payloads", "transport_for"]


class Transport(Protocol):
    """Starts a bucket's collectives; where their results arrive."""

    #: Whether results arrive in host copies (read from :meth:`sums`, not the bucket's buffer).
    staged: bool

    def wait_device(self, device: torch.device) -> torch.device:
        """The device a round of a bucket on ``device`` is waited for on."""
        ...

    def all_reduce(self, bucket: int, buffer: torch.Tensor, handle: dist.ProcessGroup) -> dist.Work | None:
        """Start summing ``buffer`` over ``handle``'s members."""
        ...

    def gather(
        self,
        bucket: int,
        gathered: torch.Tensor,
        slot: int,
        members: int,
        handle: dist.ProcessGroup,
        pair: bool,
    ) -> dist.Work | None:
        """Start gathering ``members`` payloads into ``gathered``; slot ``slot`` holds this one's."""
        ...

    def sums(self, bucket: int, buffer: torch.Tensor) -> torch.Tensor:
        """Where the sums of ``bucket``'s round arrived (read without a device sync)."""
        ...

    def forget(self, bucket: int) -> None:
        """Drop ``bucket``'s copies: a collective that failed may still write them."""
        ...


class DirectTransport:
    """Collectives on the buckets' own buffers."""

    staged = False

    def wait_device(self, device: torch.device) -> torch.device:
        return device

    def all_reduce(self, bucket: int, buffer: torch.Tensor, handle: dist.ProcessGroup) -> dist.Work | None:
        return dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=handle, async_op=True)

    def gather(
        self,
        bucket: int,
        gathered: torch.Tensor,
        slot: int,
        members: int,
        handle: dist.ProcessGroup,
        pair: bool,
    ) -> dist.Work | None:
        return gather_payloads(gathered, slot, members, handle, pair)

    def sums(self, bucket: int, buffer: torch.Tensor) -> torch.Tensor:
        return buffer

    def forget(self, bucket: int) -> None:
        pass


class HostStagedTransport:
    """Collectives on pinned host copies of the buffers (one pair per bucket, allocated at first use),
    launched by ``staging``'s thread in order; results copied back to the buffers before the mix."""

    staged = True

    def __init__(self, staging: HostStaging) -> None:
        self._staging = staging
        self._sums: dict[int, torch.Tensor] = {}
        self._gathered: dict[int, torch.Tensor] = {}

    def wait_device(self, device: torch.device) -> torch.device:
        return torch.device(
            "cpu"
        )  # a host-side wait (timed, like gloo's on CPU), whatever the bucket's device

    def all_reduce(self, bucket: int, buffer: torch.Tensor, handle: dist.ProcessGroup) -> dist.Work | None:
        host = _host_copy(self._sums, bucket, buffer)
        return self._staging.start(
            [(host, buffer)],
            lambda: dist.all_reduce(host, op=dist.ReduceOp.SUM, group=handle, async_op=True),
            copy_back=(buffer, host),
        )

    def gather(
        self,
        bucket: int,
        gathered: torch.Tensor,
        slot: int,
        members: int,
        handle: dist.ProcessGroup,
        pair: bool,
    ) -> dist.Work | None:
        host = _host_copy(self._gathered, bucket, gathered)
        size = gathered.numel() // members
        own = slice(slot * size, (slot + 1) * size)
        return self._staging.start(
            [(host[own], gathered[own])],
            lambda: gather_payloads(host, slot, members, handle, pair),
            copy_back=(gathered, host),
        )

    def sums(self, bucket: int, buffer: torch.Tensor) -> torch.Tensor:
        return self._sums.get(bucket, buffer)

    def forget(self, bucket: int) -> None:
        self._sums.pop(bucket, None)
        self._gathered.pop(bucket, None)


def transport_for(staging: HostStaging | None) -> Transport:
    """Host-staged collectives with ``staging``, else direct ones."""
    return DirectTransport() if staging is None else HostStagedTransport(staging)


def _host_copy(copies: dict[int, torch.Tensor], bucket: int, like: torch.Tensor) -> torch.Tensor:
    host = copies.get(bucket)
    if host is None or host.numel() != like.numel():
        host = copies[bucket] = host_buffer(like)
    return host


def gather_payloads(
    gathered: torch.Tensor, slot: int, members: int, handle: dist.ProcessGroup, pair: bool
) -> dist.Work | None:
    """Start gathering every member's payload into ``gathered``, whose slot ``slot`` holds this member's
    (in place: its input is its own slot of the output)."""
    size = gathered.numel() // members
    own = gathered[slot * size : (slot + 1) * size]
    if not pair:
        return dist.all_gather_into_tensor(gathered, own, group=handle, async_op=True)
    # gloo sends an all-gather's two directions one after the other but pipelines an all-reduce
    # (3.2 MB at 200 Mbit/s: 197 ms vs 132 ms), so a pair gathers with a bitwise-XOR all-reduce of
    # the other slot, seeded with its own payload: it ends as own ^ peer, and the wait XORs its own
    # payload out again. Exact, same bytes.
    other = gathered[(1 - slot) * size : (2 - slot) * size]
    other.copy_(own)
    return dist.all_reduce(_as_words(other), op=dist.ReduceOp.BXOR, group=handle, async_op=True)


def _as_words(payload: torch.Tensor) -> torch.Tensor:
    """A uint8 payload as int32 words where its size allows (a quarter of the elements to reduce)."""
    if payload.numel() % 4 == 0 and payload.storage_offset() % 4 == 0:
        return payload.view(torch.int32)
    return payload

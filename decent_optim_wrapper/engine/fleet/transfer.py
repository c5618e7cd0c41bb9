r"""Handing a replica to a joiner: the donor's state, serialized once, sent point to point, verified.

The payload is whatever the engine and its front-end need to resume the donor's replica on another
rank: the engine's part of a checkpoint (parameters, step count, low-communication anchors and outer
optimizer state, the mixing factor), the front-end's (the inner optimizer's state: Adam's moments and
step, the second-moment rule's state; the module front-end's model, schedulers and scaler) and the
user's objects registered for joiners (an LR scheduler, a sampler). It is serialized with
``torch.save`` into one byte tensor, and its SHA-256 digest (with a job secret, its HMAC-SHA256 under
the secret's key, :mod:`~.sealing`) travels ahead of it in a fixed-size header. The joiner recomputes
the digest of what arrived; a mismatch raises :class:`TransferCorruptedError` (the joiner then applies
again). What the joiner loads is therefore
the donor's state bit for bit. Tensors on a GPU travel through the host: ``torch.save`` copies them
out, and the joiner loads them onto the host and from there onto its own devices.

Transfers use the new default group's point-to-point operations (gloo ``send``/``recv``; in a job of
nodes, those of the shard world's group, rank ``s`` of the donor node sending shard ``s``) in chunks of
:data:`CHUNK_BYTES`, each waited on with the engine's ``timeout`` (gloo's point-to-point works report
completion only to ``wait``), so a donor or joiner that dies during the transfer is a lost peer like
any other, however large the replica.
"""

from __future__ import annotations

import hmac
import io
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from decent_optim_wrapper.engine.errors import DecentError
from decent_optim_wrapper.engine.fleet.sealing import Seal

__all__ = ["TransferCorruptedError", "pack", "receive_header", "receive_payload", "send_replica", "unpack"]

#: Header: the payload's length (8 bytes, little-endian) and its SHA-256 digest (32 bytes).
_HEADER_BYTES = 40
#: Each chunk must arrive within the timeout; the transfer as a whole takes what the link needs.
CHUNK_BYTES = 16 * 2**20

#: Waits for a list of point-to-point works, raising a lost peer if one fails or times out.
Wait = Callable[[Sequence[dist.Work | None]], None]


class TransferCorruptedError(DecentError):
    """The replica a joiner received does not match its donor's digest."""


def pack(payload: dict[str, Any], seal: Seal) -> tuple[torch.Tensor, bytes]:
    """``payload`` as one uint8 tensor and its digest (SHA-256, or with a job secret its HMAC)."""
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    raw = buffer.getbuffer()
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8), seal.digest(bytes(raw))


def unpack(data: torch.Tensor, digest: bytes, seal: Seal) -> dict[str, Any]:
    """The payload of ``data``, after checking its digest (:class:`TransferCorruptedError` if it differs:
    a corrupted transfer, or with a job secret a replica not sent by a member)."""
    raw = data.numpy().tobytes()
    got = seal.digest(raw)
    if not hmac.compare_digest(got, digest):
        kind = "HMAC" if seal.enabled else "SHA-256"
        raise TransferCorruptedError(
            f"the replica received ({len(raw)} bytes) has {kind} {got.hex()[:16]}..., but its donor sent "
            f"{digest.hex()[:16]}...; the transfer is discarded and this worker applies again."
        )
    # Onto the host: a donor's cuda:3 tensors must load where the joiner has no cuda:3. The engine and the
    # optimizers copy them onto the joiner's own devices as they load them.
    loaded: dict[str, Any] = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=False)
    return loaded


def send_replica(
    data: torch.Tensor,
    digest: bytes,
    joiners: Sequence[int],
    wait: Wait,
    group: dist.ProcessGroup | None = None,
) -> None:
    """Send a packed payload to each rank of ``joiners`` (ranks of ``group``, default: the default group)."""
    header = torch.zeros(_HEADER_BYTES, dtype=torch.uint8)
    header[:8] = torch.tensor(list(len(data).to_bytes(8, "little")), dtype=torch.uint8)
    header[8:] = torch.tensor(list(digest), dtype=torch.uint8)
    wait([dist.isend(header, group=group, group_dst=joiner) for joiner in joiners])
    for start in range(0, len(data), CHUNK_BYTES):
        chunk = data[start : start + CHUNK_BYTES]
        wait([dist.isend(chunk, group=group, group_dst=joiner) for joiner in joiners])


def receive_header(donor: int, wait: Wait, group: dist.ProcessGroup | None = None) -> tuple[int, bytes]:
    """Wait for rank ``donor``'s header (it comes once the donor has packed its replica): the
    payload's length and the digest its donor computed."""
    header = torch.empty(_HEADER_BYTES, dtype=torch.uint8)
    wait([dist.irecv(header, group=group, group_src=donor)])
    return int.from_bytes(bytes(header[:8].tolist()), "little"), bytes(header[8:].tolist())


def receive_payload(
    donor: int, length: int, wait: Wait, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Receive the ``length`` bytes of payload that follow rank ``donor``'s header."""
    data = torch.empty(length, dtype=torch.uint8)
    for start in range(0, length, CHUNK_BYTES):
        wait([dist.irecv(data[start : start + CHUNK_BYTES], group=group, group_src=donor)])
    return data

r"""Compressed gossip: what travels on the wire, and which groups may compress.

A round sends each member's difference to a reference its group shares, ``q_i = Q(x_i - r_G)``, in a
16-bit or 8-bit wire format; every member mixes ``x_i <- x_i + a c (sum_j q_j - k q_i)`` and moves the
reference by ``sum_j q_j / k``, so the quantization error stays in the replica (error feedback) and
the mean of the replicas moves only by rounding in the parameters' dtype. This module holds the
option (:class:`GossipCompression`), the codecs, and the plan of which groups compress. The
algorithm, its guarantees, costs and figures: the compressed gossip page of the docs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import torch

from decent_optim_wrapper.topo import Group, Topology
from decent_optim_wrapper.topo.mixing import allreduce_models_sent

__all__ = [
    "WIRE_FORMATS",
    "Codec",
    "CompressionPlan",
    "CompressionSpec",
    "GossipCompression",
    "codec",
    "resolve_compression",
]

#: The wire formats a compressed round may use, by name.
WIRE_FORMATS = ("bf16", "fp16", "int8")

#: The bucket dtypes that compress.
COMPRESSIBLE_DTYPES = (torch.float32, torch.float64)

#: Elements sharing one int8 scale, small enough to follow the local magnitude, large enough that
#: the fp32 scale costs 1.6% of the payload.
INT8_BLOCK = 256


@dataclass(frozen=True)
class GossipCompression:
    """Opt-in compressed gossip (the compressed gossip page of the docs explains the algorithm).

    Args:
        wire: ``"bf16"``, ``"fp16"`` (16 bits per element; fp16 is 8x more precise than bf16 but
            saturates at 65504, beyond which the excess simply waits for the next round), or
            ``"int8"`` (8 bits per element plus one fp32 scale per 256 elements).
        max_references: the most groups a rank keeps a reference for, i.e. the most extra copies of
            its gossiped parameters that compression may hold.
    """

    wire: str = "bf16"
    max_references: int = 4

    def __post_init__(self) -> None:
        if self.wire not in WIRE_FORMATS:
            raise ValueError(
                f"compression wire format {self.wire!r} is not one of {', '.join(WIRE_FORMATS)}; e.g. "
                "compression='bf16'."
            )
        limit = self.max_references
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(
                f"max_references must be an int >= 1 (extra parameter copies compression may hold), got "
                f"{limit!r}."
            )


#: What a ``compression`` argument may be: None (off), a wire format name, or a GossipCompression.
CompressionSpec = str | GossipCompression | None


def resolve_compression(spec: object) -> GossipCompression | None:
    """Turn a ``compression`` argument into a :class:`GossipCompression` (None: off)."""
    if spec is None or isinstance(spec, GossipCompression):
        return spec
    if isinstance(spec, str):
        if spec not in WIRE_FORMATS:
            raise ValueError(
                f"compression={spec!r} is not a wire format; pass one of "
                f"{', '.join(map(repr, WIRE_FORMATS))}, a GossipCompression, or None (off)."
            )
        return GossipCompression(spec)
    raise TypeError(
        f"compression must be None, one of {', '.join(map(repr, WIRE_FORMATS))} or a GossipCompression, got "
        f"{type(spec).__name__} {spec!r}."
    )


# -- codecs -------------------------------------------------------------------------------------------
class Codec:
    """Encodes a flat floating tensor into bytes and back; decoding is deterministic.

    ``name`` is recorded with a round in a checkpoint; ``"exact"`` carries the values bit for bit.
    """

    name: str

    def payload_bytes(self, numel: int, dtype: torch.dtype) -> int:
        raise NotImplementedError

    def encode(self, values: torch.Tensor, payload: torch.Tensor) -> None:
        """Write ``values`` (flat, floating) into ``payload`` (flat uint8 of ``payload_bytes``).

        ``values`` is scratch: an encoder may overwrite it (fp16 clamps it in place).
        """
        raise NotImplementedError

    def decode(self, payload: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The values ``payload`` stands for, as a new tensor of ``dtype``."""
        raise NotImplementedError

    def decode_into(self, payload: torch.Tensor, out: torch.Tensor) -> None:
        """:meth:`decode` into ``out`` (flat), bit for bit the same values."""
        out.copy_(self.decode(payload, out.numel(), out.dtype))


class _ExactCodec(Codec):
    """The values' own bytes (a group's first round)."""

    name = "exact"

    def payload_bytes(self, numel: int, dtype: torch.dtype) -> int:
        return numel * dtype.itemsize

    def encode(self, values: torch.Tensor, payload: torch.Tensor) -> None:
        payload.view(values.dtype).copy_(values)

    def decode(self, payload: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return payload.view(dtype).clone()

    def decode_into(self, payload: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(payload.view(out.dtype))


class _Float16Codec(Codec):
    """Round to nearest in a 16-bit float (fp16 saturates: the excess stays in the replica)."""

    def __init__(self, name: str, dtype: torch.dtype) -> None:
        self.name, self._dtype = name, dtype
        self._limit = torch.finfo(dtype).max

    def payload_bytes(self, numel: int, dtype: torch.dtype) -> int:
        return 2 * numel

    def encode(self, values: torch.Tensor, payload: torch.Tensor) -> None:
        wire = payload.view(self._dtype)
        if self._dtype == torch.float16:
            # Clamped, not overflowed to inf: what is not sent stays in x - r for the next round.
            torch.clamp(values, -self._limit, self._limit, out=values)
        wire.copy_(values)

    def decode(self, payload: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return payload.view(self._dtype).to(dtype)

    def decode_into(self, payload: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(payload.view(self._dtype))  # widening is exact: no allocation, one pass


class _Int8Codec(Codec):
    """Blockwise absmax int8: per block of 256, ``q = round(v / s)`` with ``s = max|v| / 127``.

    Layout: ``ceil(n / 256) * 256`` int8 values (the last block zero-padded), then one fp32 scale
    per block.
    """

    name = "int8"

    def payload_bytes(self, numel: int, dtype: torch.dtype) -> int:
        blocks = math.ceil(numel / INT8_BLOCK)
        return blocks * INT8_BLOCK + 4 * blocks

    def encode(self, values: torch.Tensor, payload: torch.Tensor) -> None:
        numel = values.numel()
        blocks, full = math.ceil(numel / INT8_BLOCK), numel // INT8_BLOCK
        codes = payload[: blocks * INT8_BLOCK].view(torch.int8)
        scales = payload[blocks * INT8_BLOCK :].view(torch.float32)
        if values.dtype == torch.float32:
            # fp32 scratch: quantize the whole blocks in place, no bucket-sized temporaries
            _quantize_(values[: full * INT8_BLOCK].view(full, INT8_BLOCK), codes, scales, full)
            if full == blocks:
                return
        start = full * INT8_BLOCK if values.dtype == torch.float32 else 0
        tail = torch.zeros(
            blocks - start // INT8_BLOCK, INT8_BLOCK, dtype=torch.float32, device=values.device
        )
        tail.view(-1)[: numel - start] = values[start:]
        first = start // INT8_BLOCK
        _quantize_(tail, codes[start:], scales[first:], blocks - first)

    def decode(self, payload: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
        blocks = math.ceil(numel / INT8_BLOCK)
        quantized = payload[: blocks * INT8_BLOCK].view(torch.int8).view(blocks, INT8_BLOCK)
        scales = payload[blocks * INT8_BLOCK :].view(torch.float32).view(blocks, 1)
        return (quantized.to(torch.float32) * scales).view(-1)[:numel].to(dtype)

    def decode_into(self, payload: torch.Tensor, out: torch.Tensor) -> None:
        if out.dtype != torch.float32:
            super().decode_into(payload, out)
            return
        numel = out.numel()
        blocks, full = math.ceil(numel / INT8_BLOCK), numel // INT8_BLOCK
        codes = payload[: blocks * INT8_BLOCK].view(torch.int8)
        scales = payload[blocks * INT8_BLOCK :].view(torch.float32)
        whole = out[: full * INT8_BLOCK].view(full, INT8_BLOCK)
        whole.copy_(codes[: full * INT8_BLOCK].view(full, INT8_BLOCK)).mul_(scales[:full, None])
        if full < blocks:  # the same fp32 product as decode(), for the partial last block
            out[full * INT8_BLOCK :].copy_(codes[full * INT8_BLOCK : numel]).mul_(scales[full])


def _quantize_(values: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, blocks: int) -> None:
    """Quantize ``blocks`` rows of ``values`` (fp32, overwritten) into ``codes`` and ``scales``."""
    if blocks == 0:
        return
    rows = values.view(blocks, INT8_BLOCK)
    block_scales = torch.linalg.vector_norm(rows, ord=math.inf, dim=1, keepdim=True).div_(127.0)
    # An all-zero block has scale 0; dividing by 1 instead sends its zeros.
    safe = torch.where(block_scales > 0, block_scales, torch.ones_like(block_scales))
    codes[: blocks * INT8_BLOCK].view(blocks, INT8_BLOCK).copy_(rows.div_(safe).round_().clamp_(-127, 127))
    scales[:blocks].copy_(block_scales.view(-1))


_CODECS: dict[str, Codec] = {
    "exact": _ExactCodec(),
    "bf16": _Float16Codec("bf16", torch.bfloat16),
    "fp16": _Float16Codec("fp16", torch.float16),
    "int8": _Int8Codec(),
}


def codec(name: str) -> Codec:
    """The codec called ``name`` (a wire format, or ``"exact"``)."""
    return _CODECS[name]


# -- which groups compress -------------------------------------------------------------------------------
class CompressionPlan:
    """Decides, identically on every rank, which rounds of a topology go compressed.

    A group compresses a bucket of ``dtype`` when the dtype compresses, gathering the wire format
    moves fewer bytes than an all-reduce in full precision, and the group is among the first
    ``max_references`` such groups (in schedule order) of each of its members.
    """

    def __init__(self, topology: Topology, compression: GossipCompression) -> None:
        self.compression = compression
        self._topology = topology
        self._codec = codec(compression.wire)
        self._allowed: Callable[[torch.dtype], frozenset[tuple[int, ...]]] = cache(self._allowed_groups)

    @property
    def codec(self) -> Codec:
        return self._codec

    def compresses(self, group: Group, dtype: torch.dtype) -> bool:
        return group.ranks in self._allowed(dtype)

    def _saves_bytes(self, group: Group, dtype: torch.dtype) -> bool:
        if dtype not in COMPRESSIBLE_DTYPES or group.size == 1:
            return False
        large = 1 << 20  # per-element cost, without the rounding of tiny buckets
        gathered = (group.size - 1) * self._codec.payload_bytes(large, dtype)
        reduced = allreduce_models_sent(group.size) * large * dtype.itemsize
        return gathered < reduced

    def _allowed_groups(self, dtype: torch.dtype) -> frozenset[tuple[int, ...]]:
        topology, limit = self._topology, self.compression.max_references
        firsts: list[set[tuple[int, ...]]] = []
        for rank in range(topology.world_size):
            chosen: list[tuple[int, ...]] = []
            for step in range(topology.period):
                group = topology.group(rank, step)
                if len(chosen) < limit and group.ranks not in chosen and self._saves_bytes(group, dtype):
                    chosen.append(group.ranks)
            firsts.append(set(chosen))
        return frozenset(
            ranks for rank_groups in firsts for ranks in rank_groups if all(ranks in firsts[r] for r in ranks)
        )

    def bytes_sent(self, group: Group, numel: int, dtype: torch.dtype, reduced_itemsize: int) -> float:
        """Bytes a member of ``group`` sends in a steady-state round of a bucket (first rounds aside)."""
        if group.size == 1:
            return 0.0
        if self.compresses(group, dtype):
            return float((group.size - 1) * self._codec.payload_bytes(numel, dtype))
        return allreduce_models_sent(group.size) * numel * reduced_itemsize

r"""The dense wire formats of compressed gossip: what one member's difference becomes in bytes.

A :class:`Codec` turns a flat floating tensor into a uint8 payload and back, deterministically, so
that every member of a group decodes a round to the same values bit for bit. This module holds the
interface and the dense formats: ``exact`` (a group's first round where no common starting point is
known), ``bf16``/``fp16`` and blockwise ``int8``. The sparse and low-bit formats live in
:mod:`~decent_optim_wrapper.engine.wire.chunk_codec`;
:mod:`~decent_optim_wrapper.engine.wire.compression` names them all.
"""

from __future__ import annotations

import math

import torch

__all__ = ["INT8_BLOCK", "Codec", "DENSE_CODECS"]

#: Elements sharing one int8 scale, small enough to follow the local magnitude, large enough that
#: the fp32 scale costs 1.6% of the payload.
INT8_BLOCK = 256


class Codec:
    """Encodes a flat floating tensor into bytes and back; decoding is deterministic.

    ``name`` is recorded with a round in a checkpoint; ``"exact"`` carries the values bit for bit.
    """

    name: str

    def payload_bytes(self, numel: int, dtype: torch.dtype) -> int:
        raise NotImplementedError

    def encode(self, values: torch.Tensor, payload: torch.Tensor, seed: int = 0) -> None:
        """Write ``values`` (flat, floating) into ``payload`` (flat uint8 of ``payload_bytes``).

        ``values`` is scratch: an encoder may overwrite it (fp16 clamps it in place). ``seed`` is
        the round's: a codec that draws (random-k) draws from it, so that every member of a group
        and every later decoder draws the same.
        """
        raise NotImplementedError

    def decode(self, payload: torch.Tensor, numel: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
        """The values ``payload`` stands for, as a new tensor of ``dtype``."""
        raise NotImplementedError

    def decode_into(self, payload: torch.Tensor, out: torch.Tensor, seed: int = 0) -> None:
        """:meth:`decode` into ``out`` (flat), bit for bit the same values."""
        out.copy_(self.decode(payload, out.numel(), out.dtype, seed))

    def add_into(
        self, payload: torch.Tensor, total: torch.Tensor, scratch: torch.Tensor, seed: int = 0
    ) -> None:
        """``total += decode(payload)`` elementwise; ``scratch`` (like ``total``) may be overwritten.

        Every member sums a round's payloads with this in rank order, so they agree bit for bit.
        """
        self.decode_into(payload, scratch, seed)
        total.add_(scratch)


class _ExactCodec(Codec):
    """The values' own bytes (a group's first round without a common starting point)."""

    name = "exact"

    def payload_bytes(self, numel: int, dtype: torch.dtype) -> int:
        return numel * dtype.itemsize

    def encode(self, values: torch.Tensor, payload: torch.Tensor, seed: int = 0) -> None:
        payload.view(values.dtype).copy_(values)

    def decode(self, payload: torch.Tensor, numel: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
        return payload.view(dtype).clone()

    def decode_into(self, payload: torch.Tensor, out: torch.Tensor, seed: int = 0) -> None:
        out.copy_(payload.view(out.dtype))


class _Float16Codec(Codec):
    """Round to nearest in a 16-bit float (fp16 saturates: the excess stays in the replica)."""

    def __init__(self, name: str, dtype: torch.dtype) -> None:
        self.name, self._dtype = name, dtype
        self._limit = torch.finfo(dtype).max

    def payload_bytes(self, numel: int, dtype: torch.dtype) -> int:
        return 2 * numel

    def encode(self, values: torch.Tensor, payload: torch.Tensor, seed: int = 0) -> None:
        wire = payload.view(self._dtype)
        if self._dtype == torch.float16:
            # Clamped, not overflowed to inf: what is not sent stays in x - r for the next round.
            torch.clamp(values, -self._limit, self._limit, out=values)
        wire.copy_(values)

    def decode(self, payload: torch.Tensor, numel: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
        return payload.view(self._dtype).to(dtype)

    def decode_into(self, payload: torch.Tensor, out: torch.Tensor, seed: int = 0) -> None:
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

    def encode(self, values: torch.Tensor, payload: torch.Tensor, seed: int = 0) -> None:
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

    def decode(self, payload: torch.Tensor, numel: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
        blocks = math.ceil(numel / INT8_BLOCK)
        quantized = payload[: blocks * INT8_BLOCK].view(torch.int8).view(blocks, INT8_BLOCK)
        scales = payload[blocks * INT8_BLOCK :].view(torch.float32).view(blocks, 1)
        return (quantized.to(torch.float32) * scales).view(-1)[:numel].to(dtype)

    def decode_into(self, payload: torch.Tensor, out: torch.Tensor, seed: int = 0) -> None:
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


#: The dense codecs by name.
DENSE_CODECS: dict[str, Codec] = {
    "exact": _ExactCodec(),
    "bf16": _Float16Codec("bf16", torch.bfloat16),
    "fp16": _Float16Codec("fp16", torch.float16),
    "int8": _Int8Codec(),
}

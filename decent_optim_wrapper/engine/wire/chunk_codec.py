r"""Sparse and low-bit wire formats: ``k`` elements of every chunk, each in 16, 8, 4 or 2 bits.

A flat tensor of ``n`` elements is cut into ``m = ceil(n / C)`` chunks of ``C`` (the last one
zero-padded), and every chunk keeps ``k`` of its elements:

* **top-k**: the ``k`` largest in magnitude. Their positions in the chunk travel: one byte each
  for ``C <= 256``, two up to ``C = 65536``.
* **random-k**: ``k`` positions drawn from the round's seed, one in each of ``k`` equal strata of
  the chunk, ``p_j = floor((j C + v_j) / k)`` with ``v_j`` uniform in ``[0, C)`` (so no position
  repeats and every position can be drawn). Every member draws the same positions from the same
  seed, so nothing but the values travel. The draw is made on the CPU whatever the tensor's device,
  so a checkpoint's pending round decodes the same on CPU and CUDA.
* **all** (``k = C``): the dense low-bit formats ``int4`` and ``int2``.

The kept values travel as 16-bit floats (``bf16``, ``fp16``: no scale) or as ``b``-bit integers
(``int8``, ``int4``, ``int2``) with one bf16 scale per chunk:

.. math::
    s = \mathrm{bf16}\big(\max_{j \text{ kept}} |v_j|\big), \qquad
    \delta = s \cdot \mathrm{fp32}(1 / L), \quad L = 2^{b - 1} - 1, \qquad
    c_j = \mathrm{clamp}\big(\mathrm{round}(v_j / \delta), -L, L\big), \qquad
    \hat v_j = c_j \, \delta ,

absmax rounding with a zero level, like int8's (``delta`` is a product, not a quotient: CUDA
divides by a scalar through its reciprocal, so only a product rounds the same on every device).
Rounding to the nearest level, zero included, never moves a kept value further from zero than it
was (``|v - \hat v| <= |v|``), so with error feedback every round shrinks what is left to send;
``int2`` is therefore ternary, ``{-s, 0, s}``.

Payload (bytes, every part starting at an even offset, the whole padded to a multiple of 4)::

    [m bf16 scales (b-bit values only)] [m k positions (top-k only)] [m k values, b bits each, packed]

and every byte not written (alignment, padding) is zero, so a payload is a function of its input.

Encoding and decoding are vectorised over the chunks (one ``topk`` or one draw per call, no Python
loop over chunks); decoding adds a payload into a sum with one gather and one scatter of its ``m k``
values, positions being distinct.
"""

from __future__ import annotations

import math

import torch

from decent_optim_wrapper.engine.wire.codecs import Codec

__all__ = ["SELECTIONS", "VALUE_BITS", "ChunkCodec"]

#: Bits per kept value of each value format.
VALUE_BITS = {"bf16": 16, "fp16": 16, "int8": 8, "int4": 4, "int2": 2}

#: How a chunk's kept elements are chosen (``"all"``: every element, the dense low-bit formats).
SELECTIONS = ("topk", "randk")

_FLOAT16 = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _even(nbytes: int) -> int:
    return nbytes + (nbytes & 1)


class ChunkCodec(Codec):
    """Keeps ``kept`` of every ``chunk`` elements (``selection``) and sends them in ``values`` format.

    Args:
        name: the format's name, as :mod:`~.compression` spells it (recorded with a checkpoint's
            pending rounds).
        values: ``"bf16"``, ``"fp16"``, ``"int8"``, ``"int4"`` or ``"int2"``.
        selection: ``"topk"``, ``"randk"`` or ``"all"``.
        kept: elements kept per chunk, ``1 <= kept <= chunk`` (``chunk`` for ``"all"``).
        chunk: elements per chunk, at most 65536.
    """

    def __init__(self, name: str, values: str, selection: str, kept: int, chunk: int) -> None:
        if (
            values not in VALUE_BITS
            or selection not in (*SELECTIONS, "all")
            or not 1 <= kept <= chunk <= 65536
        ):
            raise ValueError(f"no chunk codec for values={values!r}, selection={selection!r}, {kept}/{chunk}")
        self.name, self.values, self.selection = name, values, selection
        self.kept, self.chunk = (chunk if selection == "all" else kept), chunk
        self.bits = VALUE_BITS[values]
        self.levels = (1 << (self.bits - 1)) - 1  # L: codes -L..L
        self._position_dtype = torch.uint8 if chunk <= 256 else torch.int16
        self._drawn: tuple[tuple[int, int, torch.device], torch.Tensor] | None = None  # last random draw

    # -- layout ----------------------------------------------------------------------------------------
    def _layout(self, numel: int) -> tuple[int, int, int, int]:
        """(chunks, offset of the positions, offset of the values, payload bytes)."""
        chunks = math.ceil(numel / self.chunk)
        kept = chunks * self.kept
        scales = 2 * chunks if self.bits < 16 else 0
        positions = kept * self._position_dtype.itemsize if self.selection == "topk" else 0
        values = 2 * kept if self.bits == 16 else math.ceil(kept * self.bits / 8)
        value_start = scales + _even(positions)
        total = value_start + values
        return chunks, scales, value_start, total + (-total) % 4

    def payload_bytes(self, numel: int, dtype: torch.dtype) -> int:
        return self._layout(numel)[3]

    # -- encoding --------------------------------------------------------------------------------------
    def encode(self, values: torch.Tensor, payload: torch.Tensor, seed: int = 0) -> None:
        numel = values.numel()
        chunks, position_start, value_start, _ = self._layout(numel)
        payload.zero_()  # small (a sparse payload is a few percent of the values' bytes)
        rows = self._rows(values, chunks)
        positions = self._select(rows, chunks, seed)
        kept = rows if positions is None else rows.gather(1, positions)
        if self.selection == "topk":
            assert positions is not None
            stored = positions if self._position_dtype == torch.uint8 else positions - 32768
            end = position_start + chunks * self.kept * self._position_dtype.itemsize
            payload[position_start:end].view(self._position_dtype).copy_(stored.view(-1))
        if self.bits == 16:
            wire = _FLOAT16[self.values]
            if wire == torch.float16:  # saturate, as the fp16 codec does: the excess waits a round
                limit = torch.finfo(torch.float16).max
                kept = kept.clamp(-limit, limit)
            payload[value_start : value_start + 2 * kept.numel()].view(wire).copy_(kept.reshape(-1))
            return
        scales = kept.abs().amax(dim=1).to(torch.bfloat16)
        payload[: 2 * chunks].view(torch.bfloat16).copy_(scales)
        step = self._steps(scales)
        safe = torch.where(step > 0, step, torch.ones_like(step))  # an all-zero chunk sends zeros
        codes = kept.div(safe[:, None]).round_().clamp_(-self.levels, self.levels).add_(self.levels)
        self._pack(codes.to(torch.uint8).view(-1), payload[value_start:])

    def _rows(self, values: torch.Tensor, chunks: int) -> torch.Tensor:
        """``values`` in fp32 as ``chunks`` rows of ``chunk`` (zero-padded); may be ``values`` itself."""
        numel = values.numel()
        if numel == chunks * self.chunk and values.dtype == torch.float32:
            return values.view(chunks, self.chunk)
        rows = torch.zeros(chunks * self.chunk, dtype=torch.float32, device=values.device)
        rows[:numel] = values
        return rows.view(chunks, self.chunk)

    def _select(self, rows: torch.Tensor, chunks: int, seed: int) -> torch.Tensor | None:
        """Each chunk's kept positions, shape ``(chunks, kept)`` (None: all of them)."""
        if self.selection == "all":
            return None
        if self.selection == "topk":
            # Sorted positions: the same payload on every device (topk's own order is unspecified).
            return rows.abs().topk(self.kept, dim=1, sorted=False).indices.sort(dim=1).values
        return self._random_positions(chunks, seed, rows.device)

    def _random_positions(self, chunks: int, seed: int, device: torch.device) -> torch.Tensor:
        key = (seed, chunks, device)
        if self._drawn is not None and self._drawn[0] == key:
            return self._drawn[1]  # a round decodes every member's payload with the same draw
        generator = torch.Generator().manual_seed(seed)
        draws = torch.randint(0, self.chunk, (chunks, self.kept), generator=generator)
        strata = torch.arange(self.kept).mul_(self.chunk)
        positions = draws.add_(strata).div_(self.kept, rounding_mode="floor").to(device)
        self._drawn = (key, positions)
        return positions

    def _steps(self, scales: torch.Tensor) -> torch.Tensor:
        """``delta = s * fp32(1 / L)`` in fp32, per chunk (the same expression encodes and decodes)."""
        return scales.to(torch.float32).mul_(1.0 / self.levels)

    def _pack(self, codes: torch.Tensor, out: torch.Tensor) -> None:
        """``codes`` (uint8, each below ``2^bits``) packed little-end first into ``out``'s bytes."""
        if self.bits == 8:
            out[: codes.numel()].copy_(codes)
            return
        per_byte = 8 // self.bits
        count = codes.numel()
        padded = torch.zeros(math.ceil(count / per_byte) * per_byte, dtype=torch.uint8, device=codes.device)
        padded[:count] = codes
        shifts = torch.arange(0, 8, self.bits, dtype=torch.uint8, device=codes.device)
        packed = padded.view(-1, per_byte).bitwise_left_shift(shifts).sum(dim=1, dtype=torch.uint8)
        out[: packed.numel()].copy_(packed)

    # -- decoding --------------------------------------------------------------------------------------
    def _kept(self, payload: torch.Tensor, numel: int, seed: int) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(flat positions in the tensor or None for all, the kept values decoded, flat)."""
        chunks, position_start, value_start, _ = self._layout(numel)
        count = chunks * self.kept
        positions: torch.Tensor | None = None
        if self.selection == "topk":
            end = position_start + count * self._position_dtype.itemsize
            stored = payload[position_start:end].view(self._position_dtype).to(torch.int64)
            positions = stored.view(chunks, self.kept) + (0 if self._position_dtype == torch.uint8 else 32768)
        elif self.selection == "randk":
            positions = self._random_positions(chunks, seed, payload.device)
        if self.bits == 16:
            decoded = payload[value_start : value_start + 2 * count].view(_FLOAT16[self.values])
        else:
            codes = self._unpack(payload[value_start:], count).view(chunks, self.kept)
            step = self._steps(payload[: 2 * chunks].view(torch.bfloat16))
            decoded = codes.to(torch.float32).sub_(self.levels).mul_(step[:, None]).view(-1)
        if positions is None:
            return None, decoded
        bases = torch.arange(0, chunks * self.chunk, self.chunk, device=positions.device)
        return positions.add(bases[:, None]).view(-1), decoded

    def _unpack(self, packed: torch.Tensor, count: int) -> torch.Tensor:
        if self.bits == 8:
            return packed[:count]
        per_byte = 8 // self.bits
        shifts = torch.arange(0, 8, self.bits, dtype=torch.uint8, device=packed.device)
        whole = packed[: math.ceil(count / per_byte)]
        mask = (1 << self.bits) - 1
        return whole[:, None].bitwise_right_shift(shifts).bitwise_and_(mask).view(-1)[:count]

    def _within(
        self, positions: torch.Tensor, values: torch.Tensor, numel: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Drop the kept elements of the last chunk's zero padding."""
        if numel % self.chunk == 0:
            return positions, values
        inside = positions < numel
        return positions[inside], values[inside]

    def decode(self, payload: torch.Tensor, numel: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
        out = torch.empty(numel, dtype=dtype, device=payload.device)
        self.decode_into(payload, out, seed)
        return out

    def decode_into(self, payload: torch.Tensor, out: torch.Tensor, seed: int = 0) -> None:
        numel = out.numel()
        positions, values = self._kept(payload, numel, seed)
        if positions is None:
            out.copy_(values[:numel])
            return
        out.zero_()
        positions, values = self._within(positions, values, numel)
        out[positions] = values.to(out.dtype)

    def add_into(
        self, payload: torch.Tensor, total: torch.Tensor, scratch: torch.Tensor, seed: int = 0
    ) -> None:
        numel = total.numel()
        positions, values = self._kept(payload, numel, seed)
        if positions is None:
            total.add_(values[:numel].to(total.dtype))
            return
        positions, values = self._within(positions, values, numel)
        # Positions are distinct, so a gather, an add and a scatter are exact and deterministic on
        # every device (an index_add_ would be flagged nondeterministic on CUDA).
        total[positions] = total[positions] + values.to(total.dtype)

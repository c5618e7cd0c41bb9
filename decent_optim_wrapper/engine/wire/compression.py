r"""Compressed gossip: what travels on the wire, and which groups may compress.

A round sends each member's difference to a reference its group shares, ``q_i = Q(x_i - r_G)``, in a
compressed wire format; every member mixes ``x_i <- x_i + a c (sum_j q_j - k q_i)`` and moves the
reference by ``sum_j q_j / k``. What ``Q`` leaves out stays in the replica's difference to the
reference and is sent in a later round (error feedback), and the mean of the replicas moves only by
rounding in the parameters' dtype. The formats: 16-bit floats, blockwise int8
(:mod:`~decent_optim_wrapper.engine.wire.codecs`), and the sparse and low-bit ones, top-k or random-k per
chunk with values in 2 to 16 bits (:mod:`~decent_optim_wrapper.engine.wire.chunk_codec`). This module
holds the option (:class:`GossipCompression`), the formats' names, and the plan of which groups
compress. The algorithm, its guarantees, costs and figures: the compressed gossip page of the docs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache

import torch

from decent_optim_wrapper.checks import is_int, is_real
from decent_optim_wrapper.engine.wire.chunk_codec import SELECTIONS, ChunkCodec
from decent_optim_wrapper.engine.wire.codecs import DENSE_CODECS, INT8_BLOCK, Codec
from decent_optim_wrapper.topo import Group, Topology
from decent_optim_wrapper.topo.mixing import allreduce_models_sent

__all__ = [
    "INT8_BLOCK",
    "SELECTIONS",
    "WIRE_FORMATS",
    "Codec",
    "CompressionPlan",
    "CompressionSpec",
    "GossipCompression",
    "codec",
    "is_codec_name",
    "parse_compression",
    "resolve_compression",
    "round_seed",
]

#: The value formats a compressed round may use, by name; alone, each sends every element.
WIRE_FORMATS = ("bf16", "fp16", "int8", "int4", "int2")

#: The bucket dtypes that compress.
COMPRESSIBLE_DTYPES = (torch.float32, torch.float64)

#: The largest chunk, whose positions fit in two bytes.
MAX_CHUNK = 65536


@dataclass(frozen=True)
class GossipCompression:
    """Opt-in compressed gossip (the compressed gossip page of the docs explains the algorithm).

    Args:
        wire: how each sent value travels: ``"bf16"``, ``"fp16"`` (16 bits; fp16 is 8x more precise
            than bf16 but saturates at 65504, beyond which the excess waits for the next round),
            ``"int8"``, ``"int4"`` or ``"int2"`` (absmax integers with one scale per chunk: int8 one
            fp32 scale per 256 elements when dense, the others one bf16 scale per chunk; int2 is
            ternary).
        max_references: the most groups a rank keeps a reference for, i.e. the most extra copies of
            its gossiped parameters that compression may hold.
        density: the fraction of every chunk sent, ``0 < density <= 1``: each chunk of ``chunk``
            elements sends ``max(1, round(density * chunk))`` of them (1.0: every element).
        selection: which elements a sparse round sends: ``"topk"`` (the largest differences in
            magnitude; their positions travel, one byte each for ``chunk <= 256``, else two) or
            ``"randk"`` (positions drawn from a seed the group shares: no positions travel).
        chunk: elements per chunk, ``2 <= chunk <= 65536`` (top-k and random-k choose per chunk;
            the low-bit formats keep one scale per chunk).

    The name of a sparse format, as :func:`resolve_compression` and the planner accept it, is
    ``"SELECTION:DENSITY:WIRE"`` (``":CHUNK"`` appended when it is not 256), e.g.
    ``"topk:0.01:int2"``.
    """

    wire: str = "bf16"
    max_references: int = 4
    density: float = 1.0
    selection: str = "topk"
    chunk: int = 256

    def __post_init__(self) -> None:
        if self.wire not in WIRE_FORMATS:
            raise ValueError(
                f"compression wire format {self.wire!r} is not one of {', '.join(WIRE_FORMATS)}; e.g. "
                "compression='bf16'."
            )
        limit = self.max_references
        if not is_int(limit) or limit < 1:
            raise ValueError(
                f"max_references must be an int >= 1 (extra parameter copies compression may hold), got "
                f"{limit!r}."
            )
        chunk = self.chunk
        if not is_int(chunk) or not 2 <= chunk <= MAX_CHUNK:
            raise ValueError(
                f"chunk must be an int in [2, {MAX_CHUNK}] (elements per chunk; a position must fit in two "
                f"bytes), got {chunk!r}; e.g. chunk=256."
            )
        density = self.density
        if not is_real(density) or not 0 < density <= 1:
            raise ValueError(
                f"density must be a number in (0, 1] (the fraction of each chunk sent), got {density!r}; "
                "e.g. density=0.01 sends 1%."
            )
        if self.selection not in SELECTIONS:
            raise ValueError(
                f"selection must be one of {', '.join(map(repr, SELECTIONS))}, got {self.selection!r}."
            )
        if density < 1 and self.kept == chunk:
            raise ValueError(
                f"density={density!r} with chunk={chunk} keeps all {chunk} elements of a chunk; pass "
                "density=1.0 for a dense format, or a smaller density (or a larger chunk) for a sparse one."
            )

    @property
    def sparse(self) -> bool:
        """Whether a round sends only some elements of each chunk."""
        return self.density < 1

    @property
    def kept(self) -> int:
        """Elements sent per chunk."""
        return max(1, round(self.density * self.chunk)) if self.sparse else self.chunk

    @property
    def name(self) -> str:
        """The wire format's name (recorded with a checkpoint's pending rounds)."""
        if not self.sparse:
            return self.wire
        name = f"{self.selection}:{float(self.density)!r}:{self.wire}"
        return name if self.chunk == 256 else f"{name}:{self.chunk}"


#: What a ``compression`` argument may be: None (off), a format's name, or a GossipCompression.
CompressionSpec = str | GossipCompression | None


def parse_compression(name: str, max_references: int = 4) -> GossipCompression:
    """The :class:`GossipCompression` a format's name stands for (``"int8"``, ``"topk:0.01:int2"``).

    A density may also be written in percent (``"topk:1%:int2"``).
    """
    if name in WIRE_FORMATS:
        return GossipCompression(name, max_references)
    parts = name.split(":")
    if len(parts) in (3, 4) and parts[0] in SELECTIONS:
        text = parts[1]
        try:
            density = float(text[:-1]) / 100 if text.endswith("%") else float(text)
            chunk = int(parts[3]) if len(parts) == 4 else 256
        except ValueError:
            pass
        else:
            try:
                return GossipCompression(parts[2], max_references, density, parts[0], chunk)
            except ValueError as error:
                raise ValueError(f"compression={name!r}: {error}") from None
    raise ValueError(
        f"compression={name!r} is not a wire format; pass one of {', '.join(map(repr, WIRE_FORMATS))}, a "
        "sparse format 'SELECTION:DENSITY:WIRE[:CHUNK]' (e.g. 'topk:0.01:int2', 'randk:3%:int4'), a "
        "GossipCompression, or None (off)."
    )


def resolve_compression(spec: object) -> GossipCompression | None:
    """Turn a ``compression`` argument into a :class:`GossipCompression` (None: off)."""
    if spec is None or isinstance(spec, GossipCompression):
        return spec
    if isinstance(spec, str):
        return parse_compression(spec)
    raise TypeError(
        f"compression must be None, one of {', '.join(map(repr, WIRE_FORMATS))}, a sparse format name such "
        f"as 'topk:0.01:int2', or a GossipCompression, got {type(spec).__name__} {spec!r}."
    )


def is_codec_name(name: object) -> bool:
    """Whether ``name`` names a codec (a checkpoint's pending round records one)."""
    if not isinstance(name, str):
        return False
    try:
        codec(name)
    except ValueError:
        return False
    return True


def round_seed(step: int, bucket: int) -> int:
    """The seed of bucket number ``bucket``'s round at ``step``: every member of the group derives the
    same, and so does a resumed run decoding a checkpoint's pending round."""
    return (step * 65537 + bucket) % (1 << 63)


@cache
def codec(name: str) -> Codec:
    """The codec called ``name``: ``"exact"``, or the :attr:`~GossipCompression.name` of a format.

    Raises ``ValueError`` for a name that is neither.
    """
    if name in DENSE_CODECS:
        return DENSE_CODECS[name]
    option = parse_compression(name)
    selection = option.selection if option.sparse else "all"
    return ChunkCodec(name, option.wire, selection, option.kept, option.chunk)


# -- which groups compress -------------------------------------------------------------------------------
class CompressionPlan:
    """Decides, identically on every rank, which rounds of a topology go compressed.

    A group compresses a bucket of ``dtype`` when the dtype compresses, gathering the wire format
    moves fewer bytes than an all-reduce in full precision, and the group is among the first
    ``max_references`` such groups (in schedule order) of each of its members.

    ``bucket_numbers`` gives each bucket's number (``BucketSpec.number``, the exchange's) by its
    position in the engine's list; a position beyond it is its own number. A round's random draws
    are seeded with the number, not the position, so that a bucket draws the same whichever order a
    front-end lists the buckets in.
    """

    def __init__(
        self, topology: Topology, compression: GossipCompression, bucket_numbers: Sequence[int] = ()
    ) -> None:
        self.compression = compression
        self._topology = topology
        self._codec = codec(compression.name)
        self._numbers = tuple(bucket_numbers)
        self._allowed: Callable[[torch.dtype], frozenset[tuple[int, ...]]] = cache(self._allowed_groups)

    @property
    def codec(self) -> Codec:
        return self._codec

    def bucket_number(self, bucket: int) -> int:
        """The number that seeds the rounds of the bucket at position ``bucket`` (see :func:`round_seed`)."""
        return self._numbers[bucket] if bucket < len(self._numbers) else bucket

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

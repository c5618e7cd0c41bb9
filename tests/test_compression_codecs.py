"""Pure logic of compressed gossip: the wire codecs, ``resolve_compression`` and ``CompressionPlan``.

Expectations are derived here, not read back from the library: the 16-bit codecs against an
independent round-to-nearest-even (integer bit arithmetic for bf16, Python's ``struct`` half
precision for fp16), int8 against the error of blockwise absmax rounding, the plan against the byte
rule of the module docstring (a group of ``k`` compresses a dtype of ``itemsize`` bytes when
``k * payload_bytes_per_element < 2 * itemsize``) and the ``max_references`` rule.

Tolerances: none where the arithmetic is exact (round trips, conversions, byte counts, the plan).
Error bounds use the unit roundoff ``u = 2^-p`` of a ``p``-bit significand (bf16: ``p = 8``,
fp16: ``p = 11``, fp32: ``p = 24``); round to nearest moves a value by at most ``u / (1 + u)`` of
itself. Every allowance beyond that is derived next to the test that uses it.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from fractions import Fraction

import numpy as np
import pytest
import torch

from decent_optim_wrapper.engine.wire.compression import (
    INT8_BLOCK,
    CompressionPlan,
    GossipCompression,
    codec,
    resolve_compression,
)
from decent_optim_wrapper.topo import Group, Topology, TopologyFactory

pytestmark = pytest.mark.pure

FLOATS = (torch.float32, torch.float64)
WIRES = ("bf16", "fp16", "int8")
U_BF16 = 2.0**-8  # unit roundoff of bf16: 8-bit significand (7 stored + the implicit bit)
U_FP16 = 2.0**-11  # unit roundoff of fp16: 11-bit significand
U_FP32 = 2.0**-24
FP16_MAX = 65504.0
FP16_MIN_NORMAL = 2.0**-14


# -- helpers ----------------------------------------------------------------------------------------------
def roundtrip(name: str, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(payload, decoded) of ``values`` through codec ``name``; ``values`` itself is left untouched."""
    coder = codec(name)
    payload = torch.empty(coder.payload_bytes(values.numel(), values.dtype), dtype=torch.uint8)
    coder.encode(values.clone(), payload)  # a clone: fp16 clamps its input in place
    return payload, coder.decode(payload, values.numel(), values.dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a float tensor, as signed integers of its width (for bitwise comparison)."""
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_bitwise(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(bits(got), bits(want))


def float_from_bits(pattern: int, dtype: torch.dtype) -> float:
    signed = {torch.float32: torch.int32, torch.float64: torch.int64}[dtype]
    width = 8 * dtype.itemsize
    if pattern >= 1 << (width - 1):
        pattern -= 1 << width
    return torch.tensor([pattern], dtype=signed).view(dtype).item()


def spread(n: int, low: float, high: float, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """Random signs and significands at magnitudes spread log-uniformly over ``[10^low, 10^high]``."""
    gen = torch.Generator().manual_seed(seed)
    exponent = torch.empty(n, dtype=torch.float64).uniform_(low, high, generator=gen)
    sign = torch.randint(0, 2, (n,), generator=gen).to(torch.float64) * 2 - 1
    return (sign * torch.pow(10.0, exponent)).to(dtype)


def bf16_rne(values: torch.Tensor) -> torch.Tensor:
    """fp32 -> nearest bf16 (ties to even), by integer arithmetic on the bits; finite inputs only."""
    raw = values.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    rounded = ((raw + 0x7FFF + ((raw >> 16) & 1)) >> 16) << 16  # a carry into the exponent is right
    rounded = torch.where(rounded >= 1 << 31, rounded - (1 << 32), rounded)
    return rounded.to(torch.int32).view(torch.float32)


def fp16_rne(values: torch.Tensor) -> torch.Tensor:
    """Nearest fp16 (ties to even) of each value, by Python's IEEE half-precision pack."""
    packed = [struct.unpack("<e", struct.pack("<e", x))[0] for x in values.tolist()]
    return torch.tensor(packed, dtype=values.dtype)


# -- exact ------------------------------------------------------------------------------------------------
def special_values(dtype: torch.dtype) -> torch.Tensor:
    info = torch.finfo(dtype)
    nan_with_payload = float_from_bits(0x7FC00123 if dtype == torch.float32 else 0x7FF8000000000123, dtype)
    values = [0.0, -0.0, 1.0, -1.0, info.max, -info.max, info.tiny, info.smallest_normal / 8]
    values += [math.inf, -math.inf, nan_with_payload, math.pi, -1e-3]
    return torch.tensor(values, dtype=dtype)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("n", [1, 7, 1000])
def test_exact_codec_is_bitwise(dtype: torch.dtype, n: int) -> None:
    values = torch.cat(
        [special_values(dtype), spread(n, -300 if dtype == torch.float64 else -30, 30, n, dtype)]
    )
    payload, decoded = roundtrip("exact", values)
    assert payload.numel() == codec("exact").payload_bytes(values.numel(), dtype)
    assert payload.numel() == values.numel() * dtype.itemsize
    assert_bitwise(decoded, values)  # NaN payload, -0.0 and subnormals included


# -- bf16 / fp16 ------------------------------------------------------------------------------------------
def bf16_inputs(dtype: torch.dtype) -> torch.Tensor:
    ties = [1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 2**-100 * (1 + 2**-8)]  # -> 1, 1 + 2^-6, -1, 2^-100
    fp32 = torch.finfo(torch.float32)
    specials = [0.0, -0.0, fp32.tiny / 4, fp32.max, -fp32.max, math.inf, -math.inf, math.nan]
    finite = torch.cat([spread(4096, -35, 35, 1, torch.float32), torch.tensor(ties)])
    return torch.cat([finite, torch.tensor(specials)]).to(dtype)


def fp16_inputs(dtype: torch.dtype) -> torch.Tensor:
    ties = [1 + 2**-11, 1 + 3 * 2**-11, -(1 + 2**-11), 2**-20 + 2**-25]  # 2^-20 + 2^-25: a subnormal tie
    values = torch.cat(
        [spread(4096, -9, 4.5, 2, torch.float32), torch.tensor(ties), torch.tensor([0.0, -0.0])]
    )
    values = torch.cat([values, torch.tensor([65503.0, 65519.0, -65519.0, math.nan])])
    return values.to(dtype)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize(
    ("wire", "target", "make"), [("bf16", torch.bfloat16, bf16_inputs), ("fp16", torch.float16, fp16_inputs)]
)
def test_16bit_codec_equals_torch_rounding(
    dtype: torch.dtype, wire: str, target: torch.dtype, make: Callable[[torch.dtype], torch.Tensor]
) -> None:
    values = make(dtype)
    payload, decoded = roundtrip(wire, values)
    assert payload.numel() == 2 * values.numel() == codec(wire).payload_bytes(values.numel(), dtype)
    assert_bitwise(decoded, values.to(target).to(dtype))


def test_bf16_codec_rounds_fp32_to_nearest_even() -> None:
    values = bf16_inputs(torch.float32)
    finite = values[values.isfinite()]
    _, decoded = roundtrip("bf16", finite)
    assert_bitwise(decoded, bf16_rne(finite))
    assert decoded[4096:4100].tolist() == [1.0, 1 + 2**-6, -1.0, 2**-100]  # the ties, by hand


def test_fp16_codec_rounds_fp32_to_nearest_even() -> None:
    values = fp16_inputs(torch.float32)
    finite = values[values.isfinite()]
    _, decoded = roundtrip("fp16", finite)
    assert_bitwise(decoded, fp16_rne(finite))
    assert decoded[4096:4100].tolist() == [1.0, 1 + 2**-9, -1.0, 2**-20]  # the ties, by hand


@pytest.mark.parametrize(
    ("wire", "u", "low", "high"), [("bf16", U_BF16, -37, 37), ("fp16", U_FP16, -4.2, 4.8)]
)
def test_16bit_relative_error_of_normal_numbers(wire: str, u: float, low: float, high: float) -> None:
    # fp32 inputs, normal in the wire format (fp16: [2^-14, 65504]). d and v are fp32, so d - v, its
    # product with 1 + u (at most 33 significant bits) and u * |v| are all exact in fp64: rtol=0, atol=0.
    values = spread(20000, low, high, 3, torch.float32)
    if wire == "fp16":
        values = values[(values.abs() >= FP16_MIN_NORMAL) & (values.abs() <= FP16_MAX)]
    _, decoded = roundtrip(wire, values)
    v, d = values.double(), decoded.double()
    assert bool(((d - v).abs() * (1 + u) <= u * v.abs()).all())


@pytest.mark.parametrize(("wire", "u"), [("bf16", U_BF16), ("fp16", U_FP16)])
def test_16bit_relative_error_bound_is_attained(wire: str, u: float) -> None:
    # 1 + u is the midpoint between 1 and the next value, and ties go to even, i.e. to 1: the error is
    # exactly u / (1 + u) of the value. So the bound is 2^-8 (bf16) and 2^-11 (fp16), not half of it.
    _, decoded = roundtrip(wire, torch.tensor([1 + u], dtype=torch.float64))
    assert decoded.item() == 1.0
    assert abs(decoded.item() - (1 + u)) / (1 + u) == u / (1 + u) > u / 2


@pytest.mark.parametrize(("wire", "u"), [("bf16", U_BF16), ("fp16", U_FP16)])
def test_16bit_relative_error_of_fp64_inputs(wire: str, u: float) -> None:
    # torch converts fp64 to a 16-bit float through fp32 (two roundings), so the error is at most
    # 2^-24 |v| (to fp32) plus u / (1 + u) of the fp32 value, i.e. below (u + 2^-23) |v|. The last input
    # shows the second rounding: 1 + u + 2^-30 lies above the midpoint 1 + u, so rounding it once gives
    # 1 + 2u; fp32 first rounds it to the midpoint itself, which then ties to even, 1. The fp64
    # subtraction below rounds by at most 2^-53 of the error, far inside the 2^-24 |v| of slack.
    values = spread(20000, -4.2, 4.8, 4, torch.float64)
    values = values[(values.abs() >= FP16_MIN_NORMAL) & (values.abs() <= FP16_MAX)]
    values = torch.cat([values, torch.tensor([1 + u + 2**-30], dtype=torch.float64)])
    _, decoded = roundtrip(wire, values)
    assert bool(((decoded - values).abs() <= (u + 2 * U_FP32) * values.abs()).all())
    assert decoded[-1].item() in (1.0, 1 + 2 * u)  # 1 today (through fp32); 1 + 2u if rounded once


@pytest.mark.parametrize("dtype", FLOATS)
def test_fp16_subnormals_have_absolute_error_at_most_half_their_spacing(dtype: torch.dtype) -> None:
    # Below 2^-14 fp16 is subnormal with spacing 2^-24: round to nearest errs by at most 2^-25 (fp32
    # inputs exactly; fp64 inputs pass through fp32 first, adding at most 2^-24 of 2^-14 = 2^-38).
    values = spread(5000, -10, math.log10(FP16_MIN_NORMAL), 5, dtype)
    _, decoded = roundtrip("fp16", values)
    allowance = 2.0**-25 + (2.0**-38 if dtype == torch.float64 else 0.0)
    assert bool(((decoded.double() - values.double()).abs() <= allowance).all())


@pytest.mark.parametrize("dtype", FLOATS)
def test_fp16_saturates_instead_of_overflowing(dtype: torch.dtype) -> None:
    big = [FP16_MAX, 65519.0, 65520.0, 70000.0, 1e5, 3e38, math.inf]
    values = torch.tensor(big + [-x for x in big] + [math.nan], dtype=dtype)
    _, decoded = roundtrip("fp16", values)
    assert decoded[:-1].tolist() == [FP16_MAX] * len(big) + [-FP16_MAX] * len(big)
    assert math.isnan(decoded[-1].item())


@pytest.mark.parametrize("dtype", FLOATS)
def test_bf16_keeps_inf_and_nan(dtype: torch.dtype) -> None:
    _, decoded = roundtrip("bf16", torch.tensor([math.inf, -math.inf, math.nan], dtype=dtype))
    assert decoded[:2].tolist() == [math.inf, -math.inf] and math.isnan(decoded[2].item())


# -- int8 -------------------------------------------------------------------------------------------------
def int8_blocks(n: int) -> int:
    return -(-n // INT8_BLOCK)


def int8_inputs(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Gaussian values whose scale changes by many orders of magnitude from block to block."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(n, generator=gen, dtype=torch.float64)
    magnitude = torch.tensor(
        [10.0 ** ((7 * b) % 61 - 30) for b in range(int8_blocks(n))], dtype=torch.float64
    )
    return (values * magnitude.repeat_interleave(INT8_BLOCK)[:n]).to(dtype)


@pytest.mark.parametrize("n", [1, 255, 256, 257, 1000, 4096, 100_000])
def test_int8_payload_bytes(n: int) -> None:
    blocks = math.ceil(n / 256)
    for dtype in FLOATS:  # the wire size does not depend on the bucket's dtype
        assert codec("int8").payload_bytes(n, dtype) == blocks * 256 + 4 * blocks


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("n", [1, 255, 256, 257, 1000])
def test_int8_error_is_half_a_step_per_block(dtype: torch.dtype, n: int) -> None:
    # Per block, s = max|v| / 127 and |decoded - v| <= s / 2 exactly in real arithmetic. In fp32 the
    # encoder rounds v to fp32 (fp64 inputs), s = m / 127 and v / s, the decoder rounds q * s: each at
    # most 2^-24 relative, on quantities of size at most 127 s (and |v| <= 127 s), which adds at most
    # 4 * 127 * 2^-24 * s (1 + 2^-23) < 2^-15 s. The fp64 comparison adds nothing that matters.
    values = int8_inputs(n, dtype, seed=n)
    payload, decoded = roundtrip("int8", values)
    assert payload.numel() == codec("int8").payload_bytes(n, dtype)
    assert decoded.dtype == dtype and decoded.shape == values.shape
    v, d = values.double(), decoded.double()
    for start in range(0, n, INT8_BLOCK):
        block = slice(start, start + INT8_BLOCK)
        step = v[block].abs().max().item() / 127
        assert step > 0
        assert (d[block] - v[block]).abs().max().item() <= step / 2 + step * 2.0**-15


@pytest.mark.parametrize("dtype", FLOATS)
def test_int8_payload_layout(dtype: torch.dtype) -> None:
    # ceil(n/256) * 256 int8 codes (padding zero), then one fp32 scale per block, fl32(fl32(max) / 127).
    n = 1000
    values = int8_inputs(n, dtype, seed=11)
    payload, _ = roundtrip("int8", values)
    blocks = int8_blocks(n)
    codes = payload[: blocks * INT8_BLOCK].view(torch.int8)
    assert bool((codes[n:] == 0).all())
    fp32 = values.to(torch.float32).numpy()
    want = [np.float32(np.abs(fp32[b * 256 : (b + 1) * 256]).max()) / np.float32(127) for b in range(blocks)]
    assert payload[blocks * INT8_BLOCK :].view(torch.float32).tolist() == [float(w) for w in want]


@pytest.mark.parametrize("dtype", FLOATS)
def test_int8_reproduces_each_block_maximum(dtype: torch.dtype) -> None:
    # The element of largest magnitude gets the code +-127, and decodes to fl32(127 * fl32(m / 127)) with
    # m = fl32(max|v|): emulated in numpy fp32, it must match bit for bit. Relative to the input that is
    # three roundings of at most 2^-24 (two for fp32 inputs), so within 2^-22.
    n = 1000
    values = int8_inputs(n, dtype, seed=12)
    payload, decoded = roundtrip("int8", values)
    codes = payload[: int8_blocks(n) * INT8_BLOCK].view(torch.int8)
    for start in range(0, n, INT8_BLOCK):
        block = values[start : start + INT8_BLOCK]
        i = start + int(block.abs().argmax())
        m = np.float32(abs(values[i].item()))
        want = math.copysign(float(np.float32(127) * (m / np.float32(127))), values[i].item())
        assert codes[i].item() == (127 if values[i] > 0 else -127)
        assert decoded[i].item() == want
        assert abs(decoded[i].item() - values[i].item()) <= 2.0**-22 * abs(values[i].item())


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("n", [1, 256, 700])
def test_int8_all_zero_blocks_decode_to_zeros(dtype: torch.dtype, n: int) -> None:
    # A zero block has scale 0; it must not divide by it. Zeros in any block decode to exactly 0.
    values = torch.zeros(n, dtype=dtype)
    if n == 700:
        values[300:400] = torch.linspace(-1, 1, 100, dtype=dtype)  # block 1 non-zero, blocks 0 and 2 zero
    payload, decoded = roundtrip("int8", values)
    assert not bool(decoded.isnan().any())
    assert bool((decoded[values == 0] == 0).all())
    scales = payload[int8_blocks(n) * INT8_BLOCK :].view(torch.float32).tolist()
    assert scales[0] == 0.0 and scales[-1] == 0.0
    if n == 700:
        assert scales[1] == float(np.float32(1) / np.float32(127))


@pytest.mark.parametrize("wire", ["exact", *WIRES])
@pytest.mark.parametrize("dtype", FLOATS)
def test_encode_and_decode_are_deterministic(wire: str, dtype: torch.dtype) -> None:
    values = int8_inputs(1000, dtype, seed=13) if wire == "int8" else spread(1000, -4, 4, 13, dtype)
    payload, first = roundtrip(wire, values)
    again, _ = roundtrip(wire, values)
    assert torch.equal(payload, again)
    assert_bitwise(codec(wire).decode(payload, values.numel(), dtype), first)


@pytest.mark.parametrize("wire", ["exact", "bf16"])
def test_encode_leaves_its_input_alone(wire: str) -> None:
    # fp16 and int8 are left out: their input is scratch (the engine passes its staging buffer), which
    # fp16 clamps to +-65504 and int8 divides by the block scales in place.
    values = torch.cat([spread(600, -4, 4, 14, torch.float32), torch.tensor([1e5, -1e6])])
    before = values.clone()
    coder = codec(wire)
    coder.encode(values, torch.empty(coder.payload_bytes(values.numel(), values.dtype), dtype=torch.uint8))
    assert_bitwise(values, before)


@pytest.mark.parametrize("numel", [1, 255, 256, 257, 1000, 4096])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("wire", ["exact", "bf16", "fp16", "int8"])
def test_decode_into_equals_decode_bit_for_bit(wire: str, dtype: torch.dtype, numel: int) -> None:
    # The engine decodes into per-bucket buffers; every member must get decode()'s values exactly.
    values = spread(numel, -6, 3, 5, dtype)
    payload, decoded = roundtrip(wire, values)
    out = torch.full_like(values, float("nan"))
    codec(wire).decode_into(payload, out)
    assert_bitwise(out, decoded)


@pytest.mark.parametrize("numel", [1, 255, 256, 257, 1000])
def test_int8_encode_in_place_equals_a_padded_reference(numel: int) -> None:
    # An independent quantizer on a zero-padded copy: per block s = max|v| / 127, q = round(v / s).
    values = spread(numel, -6, 3, 9, torch.float32)
    payload, _ = roundtrip("int8", values)
    blocks = -(-numel // 256)
    padded = torch.zeros(blocks * 256)
    padded[:numel] = values
    rows = padded.view(blocks, 256)
    scales = rows.abs().amax(dim=1) / 127
    codes = (rows / torch.where(scales > 0, scales, 1.0)[:, None]).round().clamp(-127, 127).to(torch.int8)
    assert torch.equal(payload[: blocks * 256].view(torch.int8), codes.view(-1))
    assert torch.equal(payload[blocks * 256 :].view(torch.float32), scales)


# -- resolve_compression and GossipCompression --------------------------------------------------------
def test_resolve_compression_accepts_none_names_and_instances() -> None:
    assert resolve_compression(None) is None
    for wire in WIRES:
        resolved = resolve_compression(wire)
        assert isinstance(resolved, GossipCompression)
        assert resolved == GossipCompression(wire) and resolved.wire == wire
    given = GossipCompression("int8", max_references=2)
    assert resolve_compression(given) is given


@pytest.mark.parametrize(
    "bad",
    [
        "BF16",
        "int3",
        "",
        "exact",
        "fp32",
        " bf16",
        "topk",
        "topk:0.01",
        "topk:x:int2",
        "top:0.01:int2",
        "topk:1:int2:7:8",
    ],
)
def test_resolve_compression_rejects_unknown_names(bad: str) -> None:
    with pytest.raises(ValueError) as raised:
        resolve_compression(bad)
    message = str(raised.value)
    assert repr(bad) in message
    assert all(repr(wire) in message for wire in WIRES)


@pytest.mark.parametrize("bad", [True, 16, 1.5, b"bf16", ["bf16"], torch.bfloat16, {"wire": "bf16"}])
def test_resolve_compression_rejects_other_types(bad: object) -> None:
    with pytest.raises(TypeError, match="compression must be None"):
        resolve_compression(bad)


@pytest.mark.parametrize("bad", [0, -1, True, False, 1.5, 2.0, "2", None])
def test_gossip_compression_rejects_bad_max_references(bad: object) -> None:
    with pytest.raises(ValueError, match="max_references") as raised:
        GossipCompression("bf16", max_references=bad)  # type: ignore[arg-type]
    assert repr(bad) in str(raised.value)


@pytest.mark.parametrize("bad", ["int3", "BF16", "exact"])
def test_gossip_compression_rejects_bad_wire(bad: str) -> None:
    with pytest.raises(ValueError) as raised:
        GossipCompression(bad)
    assert repr(bad) in str(raised.value) and all(wire in str(raised.value) for wire in WIRES)


# -- CompressionPlan: the byte rule ---------------------------------------------------------------------
def wire_bytes_per_element(wire: str) -> Fraction:
    """Bytes on the wire per element of a large bucket: 2 for 16 bits, 1 + 4/256 for int8."""
    return Fraction(2) if wire in ("bf16", "fp16") else Fraction(INT8_BLOCK + 4, INT8_BLOCK)


def saves_bytes(k: int, wire: str, dtype: torch.dtype) -> bool:
    """The module docstring's rule: a gather of k-1 payloads beats an all-reduce of 2(k-1)/k copies."""
    if dtype not in FLOATS or k == 1:
        return False
    return k * wire_bytes_per_element(wire) < 2 * dtype.itemsize


def test_byte_rule_by_hand() -> None:
    # 16 bits, fp32: 2k < 8, so k <= 3. int8, fp32: 1.015625 k < 8, so k <= 7 (8 * 1.015625 = 8.125).
    # 16 bits, fp64: 2k < 16, so k <= 7. int8, fp64: 1.015625 k < 16, so k <= 15.
    largest = {(w, d): max(k for k in range(2, 40) if saves_bytes(k, w, d)) for w in WIRES for d in FLOATS}
    assert largest == {
        ("bf16", torch.float32): 3,
        ("fp16", torch.float32): 3,
        ("int8", torch.float32): 7,
        ("bf16", torch.float64): 7,
        ("fp16", torch.float64): 7,
        ("int8", torch.float64): 15,
    }


def only_group(world_size: int) -> tuple[Topology, Group]:
    topology = TopologyFactory.create("complete", world_size)
    (group,) = topology.phase(0)
    return topology, group


@pytest.mark.parametrize("wire", WIRES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k", range(1, 17))
def test_complete_group_compresses_exactly_when_it_saves_bytes(wire: str, dtype: torch.dtype, k: int) -> None:
    topology, group = only_group(k)
    plan = CompressionPlan(topology, GossipCompression(wire))
    assert plan.codec.name == wire
    assert plan.compresses(group, dtype) == saves_bytes(k, wire, dtype)


def test_complete_by_hand() -> None:
    def compresses(k: int, wire: str, dtype: torch.dtype = torch.float32) -> bool:
        topology, group = only_group(k)
        return CompressionPlan(topology, GossipCompression(wire)).compresses(group, dtype)

    assert compresses(3, "bf16") and compresses(3, "fp16")  # 3 * 2 < 2 * 4
    assert not compresses(4, "bf16") and not compresses(8, "bf16")  # 8 ranks: 7 * 2n > 1.75 * 4n
    assert compresses(4, "int8") and compresses(7, "int8") and not compresses(8, "int8")
    assert compresses(7, "bf16", torch.float64) and not compresses(8, "bf16", torch.float64)
    for wire in WIRES:
        assert not compresses(2, wire, torch.bfloat16) and not compresses(2, wire, torch.float16)
        assert not compresses(1, wire)


@pytest.mark.parametrize("wire", WIRES)
@pytest.mark.parametrize("dtype", FLOATS)
def test_ring_of_8_compresses_every_pair(wire: str, dtype: torch.dtype) -> None:
    topology = TopologyFactory.create("ring", 8)
    plan = CompressionPlan(topology, GossipCompression(wire))
    groups = [g for phase in topology.schedule for g in phase]
    assert len(groups) == 8 and all(g.size == 2 for g in groups)
    assert all(plan.compresses(g, dtype) for g in groups)
    assert not any(plan.compresses(g, torch.bfloat16) or plan.compresses(g, torch.float16) for g in groups)


# -- CompressionPlan: the max_references cap -----------------------------------------------------------
@pytest.mark.parametrize("wire", WIRES)
def test_ring_of_8_with_one_reference_compresses_phase_0_only(wire: str) -> None:
    # Every rank meets its phase-0 partner first (step 0) and its phase-1 partner second, so phase-0
    # pairs are the first group of both members and phase-1 pairs the first group of neither.
    topology = TopologyFactory.create("ring", 8)
    first, second = ([g.ranks for g in phase] for phase in topology.schedule)
    assert first == [(0, 1), (2, 3), (4, 5), (6, 7)] and second == [(0, 7), (1, 2), (3, 4), (5, 6)]
    plan = CompressionPlan(topology, GossipCompression(wire, max_references=1))
    for dtype in FLOATS:
        assert [plan.compresses(g, dtype) for g in topology.phase(0)] == [True] * 4
        assert [plan.compresses(g, dtype) for g in topology.phase(1)] == [False] * 4
    both = CompressionPlan(topology, GossipCompression(wire, max_references=2))
    assert all(both.compresses(g, torch.float32) for phase in topology.schedule for g in phase)


@pytest.mark.parametrize("cap", [1, 2, 3, 4])
def test_one_peer_exp_of_8_compresses_its_first_cap_phases(cap: int) -> None:
    # The hypercube: phase i pairs j with j XOR 2^i, so every rank meets its partners in the same order
    # and the first `cap` phases are the first `cap` groups of every member.
    topology = TopologyFactory.create("one-peer-exp", 8)
    assert [sorted(g.ranks for g in phase) for phase in topology.schedule] == [
        sorted(tuple(sorted((j, j ^ 1 << i))) for j in range(8) if j < j ^ 1 << i) for i in range(3)
    ]
    plan = CompressionPlan(topology, GossipCompression("bf16", max_references=cap))
    for i, phase in enumerate(topology.schedule):
        assert all(plan.compresses(g, torch.float32) == (i < cap) for g in phase)


def expected_compressed(topology: Topology, wire: str, dtype: torch.dtype, cap: int) -> set[tuple[int, ...]]:
    """Groups among the first ``cap`` distinct byte-saving groups, in schedule order, of every member."""
    firsts = []
    for rank in range(topology.world_size):
        chosen: list[tuple[int, ...]] = []
        for step in range(topology.period):
            ranks = topology.group(rank, step).ranks
            if ranks not in chosen and saves_bytes(len(ranks), wire, dtype):
                chosen.append(ranks)
        firsts.append(set(chosen[:cap]))
    return {ranks for mine in firsts for ranks in mine if all(ranks in firsts[r] for r in ranks)}


CAP_CASES = [
    ("ring", 1, range(2, 10)),
    ("one-peer-exp", 1, range(2, 10)),
    ("alternating-exp-ring", 1, range(2, 10)),
    ("alternating-exp-ring", 2, range(2, 10, 2)),
    ("hierarchical", 2, range(2, 10, 2)),
    ("complete", 1, range(2, 10)),
]


@pytest.mark.parametrize("wire", WIRES)
@pytest.mark.parametrize(("name", "local", "sizes"), CAP_CASES, ids=[f"{c[0]}-L{c[1]}" for c in CAP_CASES])
def test_members_agree_and_the_cap_holds(wire: str, name: str, local: int, sizes: range) -> None:
    for world_size in sizes:
        topology = TopologyFactory.create(name, world_size, local)
        for cap in (1, 2, 3, 4):
            plan = CompressionPlan(topology, GossipCompression(wire, max_references=cap))
            for dtype in FLOATS:
                case = f"{name} n={world_size} L={local} cap={cap} {dtype}"
                held = [set() for _ in range(world_size)]
                for step in range(topology.period):
                    for rank in range(world_size):
                        group = topology.group(rank, step)
                        answer = plan.compresses(group, dtype)
                        # Every member sees the same group at this step and gets the same answer: a
                        # member that gathers while another all-reduces would deadlock.
                        for member in group.ranks:
                            theirs = topology.group(member, step)
                            assert theirs.ranks == group.ranks, case
                            assert plan.compresses(theirs, dtype) == answer, case
                        if answer:
                            held[rank].add(group.ranks)
                assert all(len(groups) <= cap for groups in held), case  # memory: at most cap references
                assert set().union(*held) == expected_compressed(topology, wire, dtype, cap), case


def test_cap_skips_groups_that_do_not_save_bytes() -> None:
    # alternating-exp-ring, 4 ranks in 2 nodes of 2: the merged group of 4 gains nothing with 16 bits on
    # fp32, so it must not use up the single reference; the intra-node pairs still compress.
    topology = TopologyFactory.create("alternating-exp-ring", 4, 2)
    assert sorted({g.ranks for phase in topology.schedule for g in phase}) == [(0, 1), (0, 1, 2, 3), (2, 3)]
    plan = CompressionPlan(topology, GossipCompression("bf16", max_references=1))
    compressed = {g.ranks for phase in topology.schedule for g in phase if plan.compresses(g, torch.float32)}
    assert compressed == {(0, 1), (2, 3)}
    int8 = CompressionPlan(topology, GossipCompression("int8", max_references=1))
    merged_first = topology.group(0, 0).size == 4
    compressed = {g.ranks for phase in topology.schedule for g in phase if int8.compresses(g, torch.float32)}
    assert compressed == ({(0, 1, 2, 3)} if merged_first else {(0, 1), (2, 3)})


# -- bytes_sent -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 1000, 1 << 20])
def test_bytes_sent_for_a_compressed_pair_is_half(n: int) -> None:
    topology = TopologyFactory.create("ring", 8)
    group = topology.group(0, 0)
    allreduce = 2 * (2 - 1) / 2 * n * 4  # 2(k-1)/k copies of n fp32 values: 4n bytes
    assert allreduce == 4 * n
    bf16 = CompressionPlan(topology, GossipCompression("bf16"))
    assert bf16.bytes_sent(group, n, torch.float32, 4) == 2 * n == allreduce / 2
    int8 = CompressionPlan(topology, GossipCompression("int8"))
    assert int8.bytes_sent(group, n, torch.float32, 4) == math.ceil(n / 256) * 260
    # A bf16 bucket does not compress: its all-reduce runs in an fp32 buffer (reduced itemsize 4).
    assert bf16.bytes_sent(group, n, torch.bfloat16, 4) == allreduce


def test_bytes_sent_uncompressed_and_singletons() -> None:
    n = 1000
    topology, group = only_group(8)
    plan = CompressionPlan(topology, GossipCompression("bf16"))
    assert not plan.compresses(group, torch.float32)
    assert plan.bytes_sent(group, n, torch.float32, 4) == 2 * 7 / 8 * n * 4 == 7 * n
    triple_topology, triple = only_group(3)
    triple_plan = CompressionPlan(triple_topology, GossipCompression("bf16"))
    assert triple_plan.bytes_sent(triple, n, torch.float32, 4) == 2 * 2 * n  # 2 payloads of 2n < 16n/3
    alone_topology, alone = only_group(1)
    assert (
        CompressionPlan(alone_topology, GossipCompression("bf16")).bytes_sent(alone, n, torch.float32, 4)
        == 0.0
    )

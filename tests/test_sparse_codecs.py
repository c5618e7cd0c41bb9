"""Pure logic of the sparse and low-bit wire formats (top-k, random-k, int4, int2, composed).

Expectations come from :mod:`wire_reference` (numpy, a loop over chunks, written from the rule) and
from byte counts worked out by hand. Tolerances: none for the round trips (the reference computes
the same IEEE operations in fp32, so decoded values are compared bit for bit); the error-feedback
identity holds to float64 rounding, bounded next to its test.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from wire_reference import reference_quantize, round_seed

from decent_optim_wrapper.engine.wire.compression import (
    CompressionPlan,
    GossipCompression,
    codec,
    parse_compression,
    resolve_compression,
)
from decent_optim_wrapper.engine.wire.compression import round_seed as library_round_seed
from decent_optim_wrapper.topo import TopologyFactory

pytestmark = pytest.mark.pure

SPARSE = [
    ("topk", 0.01, "int2"),
    ("topk", 0.03, "int4"),
    ("topk", 0.03, "int2"),
    ("topk", 0.01, "int8"),
    ("topk", 0.05, "bf16"),
    ("topk", 0.1, "fp16"),
    ("randk", 0.01, "int2"),
    ("randk", 0.03, "int4"),
    ("randk", 0.1, "bf16"),
    ("all", 1.0, "int4"),
    ("all", 1.0, "int2"),
]


def _name(selection: str, density: float, wire: str, chunk: int = 256) -> str:
    if selection == "all":
        return wire
    return GossipCompression(wire, density=density, selection=selection, chunk=chunk).name


def _trip(name: str, values: torch.Tensor, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    coder = codec(name)
    payload = torch.empty(coder.payload_bytes(values.numel(), values.dtype), dtype=torch.uint8)
    coder.encode(values.clone(), payload, seed)
    return payload, coder.decode(payload, values.numel(), values.dtype, seed)


def _values(n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Magnitudes spread over four decades (no ties, so top-k is unambiguous)."""
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(n, generator=g, dtype=torch.float64)
        * 10 ** torch.empty(n, dtype=torch.float64).uniform_(-2, 2, generator=g)
    ).to(dtype)


# -- round trips against the independent implementation ----------------------------------------------------
@pytest.mark.parametrize(("selection", "density", "wire"), SPARSE)
@pytest.mark.parametrize("n", [1, 200, 256, 1000, 4096])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_decoded_values_equal_the_reference(selection, density, wire, n, dtype):
    values = _values(n, dtype, seed=n)
    _, got = _trip(_name(selection, density, wire), values, seed=12345)
    want = reference_quantize(values, selection, density, wire, seed=12345)
    assert got.dtype == dtype and torch.equal(got, want)


@pytest.mark.parametrize("chunk", [2, 100, 257, 4096, 65536])
@pytest.mark.parametrize("selection", ["topk", "randk"])
def test_other_chunk_sizes_equal_the_reference(chunk, selection):
    values = _values(70000, torch.float32, seed=chunk)
    name = _name(selection, 0.02, "int4", chunk)
    _, got = _trip(name, values, seed=7)
    assert torch.equal(got, reference_quantize(values, selection, 0.02, "int4", chunk, seed=7))


def test_random_positions_depend_on_the_seed_only():
    values = _values(4096, torch.float32)
    name = _name("randk", 0.03, "bf16")
    first, again, other = (_trip(name, values, seed)[1] for seed in (5, 5, 6))
    assert torch.equal(first, again) and not torch.equal(first.ne(0), other.ne(0))
    # Positions come from the seed, not the values: other values, the same positions.
    assert torch.equal(_trip(name, values * 3 + 1, seed=5)[1].ne(0), first.ne(0))


def test_random_positions_cover_every_stratum_once():
    n, kept = 256 * 64, 8  # randk 3.125%: 8 positions per chunk, one in each stratum of 32
    name = _name("randk", kept / 256, "bf16")
    sent = _trip(name, torch.ones(n), seed=3)[1].view(64, 8, 32)
    assert torch.equal(sent.ne(0).sum(dim=2), torch.ones(64, 8, dtype=torch.int64))


# -- properties ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("selection", "density", "wire"), SPARSE)
def test_no_value_moves_further_from_zero(selection, density, wire):
    # |v - Q(v)| <= |v|: rounding with a zero level never expands a value, so error feedback
    # shrinks what is left to send (fp16 saturation and 16-bit rounding keep the sign too).
    values = _values(5000, torch.float32, seed=1)
    _, got = _trip(_name(selection, density, wire), values)
    assert torch.all((values - got).abs() <= values.abs())


@pytest.mark.parametrize("wire", ["int8", "int4", "int2"])
def test_each_chunks_largest_kept_value_is_its_scale(wire):
    # The largest decodes to L * fl(s * fl(1 / L)): s itself up to three fp32 roundings (1 / L and the
    # two products), at most 2^-22 of s (u = 2^-24 each).
    values = _values(256 * 16, torch.float32, seed=2)
    _, got = _trip(_name("topk", 0.02, wire), values)
    rows, sent = values.view(16, 256), got.view(16, 256)
    biggest = rows.abs().argmax(dim=1)[:, None]
    scale = rows.abs().amax(dim=1).to(torch.bfloat16).float()
    picked = sent.gather(1, biggest).squeeze(1)
    torch.testing.assert_close(picked.abs(), scale, rtol=2.0**-22, atol=0)
    assert torch.equal(picked.sign(), rows.gather(1, biggest).squeeze(1).sign())


def test_int2_is_ternary():
    _, got = _trip("int2", _values(4096, torch.float32, seed=3))
    scales = got.view(16, 256).abs().amax(dim=1, keepdim=True)
    assert torch.all((got.view(16, 256).abs() == 0) | (got.view(16, 256).abs() == scales))


@pytest.mark.parametrize(("selection", "density", "wire"), SPARSE)
def test_add_into_equals_decode_then_add(selection, density, wire):
    name = _name(selection, density, wire)
    coder = codec(name)
    for n in (300, 1024):
        payload, decoded = _trip(name, _values(n, torch.float32, seed=n), seed=9)
        total = _values(n, torch.float32, seed=n + 1)
        want = total + decoded
        coder.add_into(payload, total, torch.empty_like(total), seed=9)
        assert torch.equal(total, want)
        into = torch.full((n,), 7.0)
        coder.decode_into(payload, into, seed=9)
        assert torch.equal(into, decoded)


@pytest.mark.parametrize(("selection", "density", "wire"), SPARSE)
def test_encoding_leaves_its_input_alone_and_is_deterministic(selection, density, wire):
    name = _name(selection, density, wire)
    values = _values(3000, torch.float32, seed=4)
    before = values.clone()
    coder = codec(name)
    payloads = []
    for _ in range(2):
        payload = torch.zeros(coder.payload_bytes(3000, torch.float32), dtype=torch.uint8)
        coder.encode(values, payload, 11)
        payloads.append(payload)
    assert torch.equal(values, before) and torch.equal(payloads[0], payloads[1])


def test_all_zero_chunks_send_zeros():
    values = torch.zeros(1000)
    values[300] = 2.5
    for name in ("int2", "int4", _name("topk", 0.01, "int2"), _name("randk", 0.5, "int4")):
        _, got = _trip(name, values)
        assert torch.all(got[:256] == 0) and torch.all(got[512:] == 0), name


# -- error feedback ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(("selection", "density", "wire"), SPARSE)
def test_error_feedback_sends_what_a_round_drops_later(selection, density, wire):
    # Per round: v = d_t + e, q = Q(v), e <- v - q. The identity sum_t q_t + e_T = sum_t d_t holds in
    # exact arithmetic; in float64 each of the 2T additions rounds by at most u |.| with
    # u = 2^-53: the bound below is 4 T u max(sum |d_t|) (every partial sum is below sum |d_t| + 2|e|).
    name = _name(selection, density, wire)
    n, rounds = 2048, 40
    g = torch.Generator().manual_seed(0)
    residual, sent, total = (
        torch.zeros(n, dtype=torch.float64),
        torch.zeros(n, dtype=torch.float64),
        torch.zeros(n, dtype=torch.float64),
    )
    absolute = torch.zeros(n, dtype=torch.float64)
    for t in range(rounds):
        change = (
            torch.randn(n, generator=g, dtype=torch.float64)
            if t < 10
            else torch.zeros(n, dtype=torch.float64)
        )
        total += change
        absolute += change.abs()
        owed = change + residual
        q = _trip(name, owed, seed=round_seed(t, 0))[1]
        sent += q
        residual = owed - q
    u = 2.0**-53
    bound = 4 * rounds * u * (absolute.max().item() + 2 * residual.abs().max().item())
    assert (sent + residual - total).abs().max().item() <= bound
    # And it is sent: after 30 rounds without new changes the residual has shrunk. Top-k keeps at
    # least the largest of each chunk, random-k each position about every 1/density rounds.
    assert residual.norm() < 0.9 * total.norm()


def test_error_feedback_eventually_sends_everything_with_top_k():
    # No new changes: every round sends each chunk's largest remaining values (the largest exactly, up
    # to the bf16 scale); the residual shrinks every round, strictly.
    name = _name("topk", 0.01, "int4")
    residual = _values(256 * 8, torch.float64, seed=5)
    norms = [residual.norm().item()]
    for t in range(200):
        residual = residual - _trip(name, residual, seed=t)[1]
        norms.append(residual.norm().item())
    assert all(b < a for a, b in itertools.pairwise(norms) if a > 0)
    assert norms[-1] < 1e-2 * norms[0]


# -- bytes -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "per_chunk"),
    [
        # scale (2 bytes) + 3 positions (1 byte each) + 3 values of 2 bits (6 bits)
        ("topk:0.01:int2", (2, 3, 6)),
        # scale + 8 positions + 8 values of 4 bits
        ("topk:0.03:int4", (2, 8, 32)),
        # random-k: no positions
        ("randk:0.01:int2", (2, 0, 6)),
        # 16-bit values: no scale
        ("topk:0.05:bf16", (0, 13, 13 * 16)),
        ("int4", (2, 0, 256 * 4)),
        ("int2", (2, 0, 256 * 2)),
    ],
)
def test_payload_bytes_by_hand(name, per_chunk):
    scale, positions, value_bits = per_chunk
    for chunks in (1, 3, 4096):
        numel = chunks * 256 - 17
        pos_bytes = chunks * positions
        body = chunks * scale + pos_bytes + (pos_bytes & 1) + math.ceil(chunks * value_bits / 8)
        assert codec(name).payload_bytes(numel, torch.float32) == body + (-body) % 4


def test_two_byte_positions_beyond_256():
    coder = codec("topk:0.01:int2:4096")  # 41 kept of 4096: positions need two bytes
    assert coder.payload_bytes(4096, torch.float32) == 2 + 82 + math.ceil(41 * 2 / 8) + 1  # padded to 96


@pytest.mark.parametrize(
    "name", ["topk:0.01:int2", "topk:0.03:int2", "topk:0.03:int4", "randk:0.01:int2", "randk:0.03:int4"]
)
def test_the_sparse_settings_send_at_most_a_64th_of_fp32(name):
    numel = 1 << 20
    assert codec(name).payload_bytes(numel, torch.float32) <= 4 * numel / 64


def test_the_plan_compresses_and_counts_sparse_payloads():
    ring = TopologyFactory.create("ring", 8)
    option = parse_compression("topk:0.01:int2")
    plan = CompressionPlan(ring, option)
    group = ring.group(0, 0)
    assert plan.compresses(group, torch.float32)
    numel = 1 << 20
    assert plan.bytes_sent(group, numel, torch.float32, 4) == (group.size - 1) * codec(
        option.name
    ).payload_bytes(numel, torch.float32)
    complete = TopologyFactory.create("complete", 8)  # a gather of 7 sparse payloads beats an all-reduce
    assert CompressionPlan(complete, option).compresses(complete.group(0, 0), torch.float32)


# -- names and options ------------------------------------------------------------------------------------
def test_names_round_trip():
    for option in (
        GossipCompression("int2", density=0.01),
        GossipCompression("int4", density=0.03, selection="randk"),
        GossipCompression("bf16", density=0.5, chunk=4096),
        GossipCompression("int4"),
    ):
        assert parse_compression(option.name) == option
        assert resolve_compression(option.name) == option
    assert parse_compression("topk:1%:int2") == GossipCompression("int2", density=0.01)
    assert GossipCompression("int2", density=0.01).kept == 3
    assert GossipCompression("int2", density=0.001).kept == 1  # at least one per chunk


def test_the_round_seed_is_the_documented_one():
    for step, bucket in ((0, 0), (1, 0), (7, 3), (10**12, 5)):
        assert library_round_seed(step, bucket) == round_seed(step, bucket)


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"density": 0}, "density"),
        ({"density": -0.1}, "density"),
        ({"density": 1.5}, "density"),
        ({"density": True}, "density"),
        ({"density": "0.01"}, "density"),
        ({"density": 0.999}, "density=0.999"),
        ({"chunk": 1}, "chunk"),
        ({"chunk": 65537}, "chunk"),
        ({"chunk": 256.0}, "chunk"),
        ({"selection": "random"}, "selection"),
    ],
)
def test_bad_options_name_the_argument_and_the_value(kwargs, named):
    with pytest.raises(ValueError) as raised:
        GossipCompression("int2", **kwargs)
    message = str(raised.value)
    assert named in message and repr(next(iter(kwargs.values()))) in message

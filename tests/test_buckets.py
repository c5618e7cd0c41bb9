"""Pure logic: bucket planning and parameter views (no process group)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from decent_optim_wrapper.engine.exchange.buckets import (
    ALIGN_BYTES,
    build_buckets,
    check_named_params,
    plan_buckets,
)
from decent_optim_wrapper.front_ends.optimizer import named_param_groups

pytestmark = pytest.mark.pure


def _params(*specs):
    return [nn.Parameter(torch.randn(*shape).to(dtype)) for shape, dtype in specs]


def test_buckets_never_mix_dtypes_and_keep_order():
    params = _params(
        ((3,), torch.float32), ((4,), torch.bfloat16), ((5,), torch.float32), ((2,), torch.float16)
    )
    specs = plan_buckets(params, cap_bytes=2**20)
    assert [(s.dtype, s.param_indices) for s in specs] == [
        (torch.float32, (0, 2)),
        (torch.bfloat16, (1,)),
        (torch.float16, (3,)),
    ]


def test_cap_splits_buckets_and_oversized_params_get_their_own():
    params = _params(
        ((100,), torch.float32), ((100,), torch.float32), ((1000,), torch.float32), ((10,), torch.float32)
    )
    # 100 floats take 112 after alignment (448 bytes): two fit in 1000 bytes, the 1000-float one
    # exceeds any cap below 4 kB and sits alone, and the last one starts a new bucket after it
    specs = plan_buckets(params, cap_bytes=1000)
    assert [s.param_indices for s in specs] == [(0, 1), (2,), (3,)]
    specs = plan_buckets(params, cap_bytes=4 * 1200)
    assert [s.param_indices for s in specs] == [(0, 1), (2, 3)]


def test_reversed_buckets_are_the_same_buckets_listed_last_first():
    # The module front-end lists its buckets last first; each must be the optimizer front-end's bucket
    # (same parameters, offsets and number), or a compressed round would quantize other chunks.
    params = _params(
        ((100,), torch.float32), ((4,), torch.bfloat16), ((100,), torch.float32), ((1000,), torch.float32)
    )
    names = [f"p{i}" for i in range(len(params))]
    forward = build_buckets(params, names, cap_bytes=1000)
    backward = build_buckets(params, names, cap_bytes=1000, reverse=True)
    assert [b.spec for b in backward] == [b.spec for b in reversed(forward)]
    assert [b.spec.number for b in forward] == list(range(len(forward))) == [0, 1, 2]
    added = build_buckets(params[:1], names[:1], cap_bytes=1000, first=3)  # after the first three
    assert [b.spec.number for b in added] == [3]


def test_offsets_are_aligned():
    params = _params(
        ((3,), torch.float32), ((5,), torch.float32), ((7,), torch.bfloat16), ((9,), torch.bfloat16)
    )
    for spec in plan_buckets(params, cap_bytes=2**20):
        element = torch.empty((), dtype=spec.dtype).element_size()
        assert all(offset * element % ALIGN_BYTES == 0 for offset in spec.offsets)
        assert spec.numel * element % ALIGN_BYTES == 0


def test_bind_makes_parameters_views_and_keeps_values_and_identity():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Linear(4, 2))
    model[0].weight.data = model[0].weight.data.contiguous(memory_format=torch.channels_last)
    params = list(model.parameters())
    values = [p.detach().clone() for p in params]
    strides = [p.stride() for p in params]
    (bucket,) = build_buckets(params, [str(i) for i in range(len(params))], cap_bytes=2**20)
    bucket.bind()
    assert list(model.parameters()) == params  # same Parameter objects: optimizer state keys survive
    for param, value, stride, offset in zip(params, values, strides, bucket.spec.offsets, strict=True):
        assert torch.equal(param, value)
        assert param.stride() == stride  # channels_last stays channels_last
        assert param.untyped_storage().data_ptr() == bucket.data.untyped_storage().data_ptr()
        assert param.storage_offset() == offset
    with torch.no_grad():
        bucket.data.fill_(2.0)
    assert all(bool((p == 2.0).all()) for p in params)
    bucket.check_views()


def test_check_views_names_the_parameter_and_the_fix():
    params = _params(((3,), torch.float32), ((2,), torch.float32))
    (bucket,) = build_buckets(params, ["encoder.weight", "encoder.bias"], cap_bytes=2**20)
    bucket.bind()
    params[1].data = torch.zeros(2)
    with pytest.raises(
        RuntimeError, match=r"encoder.bias no longer lives in its gossip bucket.*before building"
    ):
        bucket.check_views()


def test_non_dense_parameters_are_rejected():
    base = torch.randn(4, 4)
    param = nn.Parameter(base[:, ::2])  # strided, not dense
    (bucket,) = build_buckets([param], ["w"], cap_bytes=2**20)
    with pytest.raises(ValueError, match=r"w .* not dense.*contiguous"):
        bucket.bind()


@pytest.mark.parametrize(
    ("groups", "error", "match"),
    [
        ([{"params": []}], ValueError, "no parameters"),
        ([{"params": [nn.Parameter(torch.eye(2).to_sparse())]}], ValueError, "sparse"),
        ([{"params": [torch.zeros(2, dtype=torch.int64)]}], TypeError, "floating-point"),
    ],
)
def test_check_params_rejects(groups, error, match):
    with pytest.raises(error, match=match):
        check_named_params(named_param_groups(groups))


def test_check_params_rejects_duplicates():
    p = nn.Parameter(torch.zeros(2))
    with pytest.raises(
        ValueError, match=r"param_groups\[1\]\['params'\]\[0\].*same tensor as.*\[0\]\['params'\]\[0\]"
    ):
        check_named_params(named_param_groups([{"params": [p]}, {"params": [p]}]))

"""AccumAdam / AccumAdamW: torch parity at accum_iter=1, the update rule in float64, state, errors."""

from __future__ import annotations

import copy
import inspect
import math
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

from decent_optim_wrapper.optim import AccumAdam, AccumAdamW

pytestmark = pytest.mark.pure

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")],
    ),
]
PAIRS = [(AccumAdamW, torch.optim.AdamW), (AccumAdam, torch.optim.Adam)]


def _model(device: str, dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 9), nn.LayerNorm(9), nn.Tanh(), nn.Linear(9, 3)).to(device, dtype)


def _groups(model: nn.Module) -> list[dict[str, Any]]:
    """Two groups with their own lr and weight decay, over the defaults."""
    first, _, _, last = model
    return [
        {"params": list(first.parameters()), "weight_decay": 0.2},
        {"params": [*model[1].parameters(), *last.parameters()], "lr": 3e-3},
    ]


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: range, scheduler: Any = None) -> None:
    param = next(model.parameters())
    for step in steps:
        g = torch.Generator().manual_seed(step)
        x = torch.randn(5, 7, generator=g).to(param.device, param.dtype)
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    # Tiny tensors: intra-op threads only contend (20x slower steps on a loaded 2-core runner).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("ours_foreach", [False, True])
@pytest.mark.parametrize("torch_foreach", [False, True])
@pytest.mark.parametrize(("ours", "reference"), PAIRS, ids=["AdamW", "Adam"])
def test_accum_iter_1_is_torch_adam_bit_for_bit(ours, reference, torch_foreach, ours_foreach, dtype, device):
    # Same op sequence as torch's _multi_tensor_adam/_single_tensor_adam, so equal to the last bit:
    # over 60 steps, two param groups, weight decay, an lr from a scheduler.
    if torch_foreach != ours_foreach and (device == "cuda" or dtype == torch.bfloat16):
        # e.g. CPU bf16 with this model's groups: torch.optim.AdamW(foreach=True) != (foreach=False)
        pytest.skip("torch's own foreach and single-tensor paths round differently here")
    models = _model(device, dtype), _model(device, dtype)
    optimizers = (
        reference(_groups(models[0]), lr=1e-2, weight_decay=0.05, foreach=torch_foreach),
        ours(_groups(models[1]), lr=1e-2, weight_decay=0.05, accum_iter=1, foreach=ours_foreach),
    )
    for model, optimizer in zip(models, optimizers, strict=True):
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=40)
        _train(model, optimizer, range(60), scheduler)
    for p, q in zip(models[0].parameters(), models[1].parameters(), strict=True):
        assert torch.equal(p, q)
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(optimizers[0].state[p][key], optimizers[1].state[q][key])


@pytest.mark.parametrize(("ours", "reference"), PAIRS, ids=["AdamW", "Adam"])
def test_accum_iter_1_is_torch_adam_for_complex_parameters(ours, reference):
    g = torch.Generator().manual_seed(3)
    params = [torch.randn(4, 3, dtype=torch.complex64, generator=g) for _ in range(2)]
    copies = [p.clone() for p in params]
    optimizers = (
        reference(params, lr=1e-2, weight_decay=0.1),
        ours(copies, lr=1e-2, weight_decay=0.1, accum_iter=1),
    )
    for _ in range(20):
        grads = [torch.randn(4, 3, dtype=torch.complex64, generator=g) for _ in params]
        for group, optimizer in zip((params, copies), optimizers, strict=True):
            for p, grad in zip(group, grads, strict=True):
                p.grad = grad.clone()
            optimizer.step()
    for p, q in zip(params, copies, strict=True):
        assert torch.equal(p, q)


# ---- the update rule, against float64 ------------------------------------------------------------


def _reference_step(
    p: torch.Tensor,
    g: torch.Tensor,
    state: dict[str, torch.Tensor],
    t: int,
    hyper: dict[str, Any],
    decoupled: bool,
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One step of the documented rule in float64 from the given values, written from the formulas.

    Returns the new values and, per element, the size the fp32 rounding errors scale with.
    """
    lr, (b1, b2), eps, wd, n = (
        hyper["lr"],
        hyper["betas"],
        hyper["eps"],
        hyper["weight_decay"],
        hyper["accum_iter"],
    )
    m, v, a = state["exp_avg"], state["exp_avg_sq"], state["accum_grad"]
    # The sizes each value's rounding scales with: g' = g + wd*p may cancel, and so may a and
    # m_now, but their rounding errors are relative to the sizes of the terms, not to the result.
    g_size = g.abs() if decoupled else g.abs() + wd * p.abs()
    a_size = a.abs() + g_size / n
    scales = {"param": p.abs(), "accum_grad": a_size, "exp_avg": m.abs(), "exp_avg_sq": v.abs()}
    if decoupled:
        p = p * (1 - lr * wd)
        g_eff = g
    else:
        g_eff = g + wd * p
    a = a + g_eff / n
    m_now = b1 * m + (1 - b1) * g_eff
    v_now = b2 * v + (1 - b2) * g_eff**2
    k = math.ceil(t / n)
    step_size = lr / (1 - b1**k)
    denom = v_now.sqrt() / math.sqrt(1 - b2**k) + eps
    p = p - step_size * m_now / denom
    # denom is a sum of non-negative terms (accurate to a few units of roundoff), |m_now| <= |m| + |g'|
    scales["param"] = scales["param"] + step_size * (m.abs() + g_size) / denom
    if t % n == 0:
        scales["exp_avg"] = m.abs() + a_size
        scales["exp_avg_sq"] = v.abs() + a_size**2
        m, v = b1 * m + (1 - b1) * a, b2 * v + (1 - b2) * a**2
        a = torch.zeros_like(a)
    return {"param": p, "exp_avg": m, "exp_avg_sq": v, "accum_grad": a}, scales


# fp32 rounds each op to within 2^-24 relatively; one step is under ten ops on any value, so the
# result is within 8 units of roundoff (4 fp32 ulps) of the exact step from the same inputs,
# measured against the size of the terms involved (see _reference_step).
ROUNDOFF = 2.0**-24
TOLERANCE_UNITS = 8


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("accum_iter", [1, 3, 4])
@pytest.mark.parametrize(
    ("cls", "decoupled"), [(AccumAdamW, True), (AccumAdam, False)], ids=["AdamW", "Adam"]
)
def test_update_rule_matches_float64_reference(cls, decoupled, accum_iter, foreach):
    # Step by step: the reference starts each step from the optimizer's own parameters and state
    # (cast to float64), so the comparison bounds one step's rounding and never drifts; by
    # induction the whole trajectory follows the rule. 14 steps span several rounds.
    g = torch.Generator().manual_seed(11)
    params = [torch.randn(shape, generator=g) for shape in [(3, 4), (5,), (2, 3, 2)]]
    hyper = {"lr": 0.05, "betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": 0.3, "accum_iter": accum_iter}
    optimizer = cls(params, **hyper, foreach=foreach)
    worst = 0.0
    for t in range(1, 15):
        grads = [torch.randn(p.shape, generator=g) * 10.0 ** (t % 3 - 1) for p in params]
        before = []
        for p, grad in zip(params, grads, strict=True):
            p.grad = grad
            state = optimizer.state[p]
            zeros = torch.zeros_like(p, dtype=torch.float64)
            values = {
                k: state[k].double() if state else zeros for k in ("exp_avg", "exp_avg_sq", "accum_grad")
            }
            before.append((p.double(), values))
        optimizer.step()
        for p, grad, (p_before, values) in zip(params, grads, before, strict=True):
            expected, scales = _reference_step(p_before, grad.double(), values, t, hyper, decoupled)
            state = optimizer.state[p]
            assert int(state["step"]) == t
            actual = {"param": p, **{key: state[key] for key in ("exp_avg", "exp_avg_sq", "accum_grad")}}
            for key, value in actual.items():
                error = (value.double() - expected[key]).abs()
                bound = TOLERANCE_UNITS * ROUNDOFF * scales[key] + 1e-300
                worst = max(worst, float((error / bound).max()))
                assert bool((error <= bound).all()), (key, t, float((error / bound).max()))
    assert worst <= 1.0


def test_moments_move_only_at_the_end_of_each_round():
    param = torch.randn(6, generator=torch.Generator().manual_seed(0))
    optimizer = AccumAdamW([param], lr=1e-2, accum_iter=3)
    g = torch.Generator().manual_seed(1)
    previous = None
    for t in range(1, 10):
        param.grad = torch.randn(6, generator=g)
        before = param.clone()
        optimizer.step()
        state = optimizer.state[param]
        moments = state["exp_avg"].clone(), state["exp_avg_sq"].clone()
        assert not torch.equal(param, before)  # the parameters move every step
        if t % 3 == 0:
            assert previous is None or not any(
                torch.equal(a, b) for a, b in zip(moments, previous, strict=True)
            )
            assert not state["accum_grad"].any()
        else:
            expected = previous or (torch.zeros(6), torch.zeros(6))
            assert all(torch.equal(a, b) for a, b in zip(moments, expected, strict=True))
            assert state["accum_grad"].any()
        previous = moments


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("accum_iter", [1, 4])
def test_l2_term_does_not_touch_p_grad(accum_iter, foreach):
    param = torch.randn(5, 4, generator=torch.Generator().manual_seed(0))
    grad = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
    param.grad = grad.clone()
    optimizer = AccumAdam([param], lr=1e-2, weight_decay=0.5, accum_iter=accum_iter, foreach=foreach)
    for _ in range(3):
        optimizer.step()
        assert torch.equal(param.grad, grad)


def test_parameters_that_miss_steps_keep_their_own_rounds():
    # b has no gradient at steps 2 and 5, so its step count and round boundaries lag a's; the
    # update of each must be what it would be in an optimizer of its own.
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(4, generator=g), torch.randn(3, 2, generator=g)
    alone = [a.clone(), b.clone()]
    together = AccumAdamW([a, b], lr=1e-2, weight_decay=0.1, accum_iter=3, foreach=True)
    separate = [AccumAdamW([p], lr=1e-2, weight_decay=0.1, accum_iter=3, foreach=True) for p in alone]
    for step in range(9):
        grads = torch.randn(4, generator=g), torch.randn(3, 2, generator=g)
        b_skips = step in (2, 5)
        a.grad, b.grad = grads[0], None if b_skips else grads[1]
        together.step()
        for index, (param, optimizer) in enumerate(zip(alone, separate, strict=True)):
            if index == 1 and b_skips:
                continue
            param.grad = grads[index]
            optimizer.step()
    assert int(together.state[b]["step"]) == 7
    assert torch.equal(a, alone[0])
    assert torch.equal(b, alone[1])


def test_closure_runs_with_grad_enabled_and_returns_the_loss():
    model, twin = _model("cpu", torch.float32), _model("cpu", torch.float32)
    x = torch.randn(5, 7, generator=torch.Generator().manual_seed(0))
    optimizer = AccumAdamW(model.parameters(), lr=1e-2, accum_iter=2)
    reference = AccumAdamW(twin.parameters(), lr=1e-2, accum_iter=2)

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        return loss

    for _ in range(3):
        with torch.no_grad():  # the closure must still be able to build a graph
            loss = optimizer.step(closure)
        reference.zero_grad()
        expected = twin(x).square().mean()
        expected.backward()
        reference.step()
        assert torch.equal(loss, expected)
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize("foreach", [False, True])
def test_state_dict_round_trip_resumes_bit_for_bit(foreach):
    # Saved in the middle of a round (step 6 of accum_iter=4), so accum_grad is part of the state.
    model = _model("cpu", torch.float32)
    optimizer = AccumAdam(_groups(model), lr=1e-2, weight_decay=0.01, accum_iter=4, foreach=foreach)
    _train(model, optimizer, range(6))
    saved_model, saved_optimizer = copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict())
    assert saved_optimizer["state"][0]["accum_grad"].any()
    _train(model, optimizer, range(6, 13))

    resumed = _model("cpu", torch.float32)
    resumed.load_state_dict(saved_model)
    resumed_optimizer = AccumAdam(_groups(resumed), lr=1e-2, weight_decay=0.01, accum_iter=4, foreach=foreach)
    resumed_optimizer.load_state_dict(saved_optimizer)
    _train(resumed, resumed_optimizer, range(6, 13))
    for p, q in zip(model.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p, q)
    for state, resumed_state in zip(optimizer.state.values(), resumed_optimizer.state.values(), strict=True):
        for key, value in state.items():
            assert torch.equal(value, resumed_state[key]), key


def test_state_layout_and_defaults_match_decent_dp():
    param = torch.randn(3, requires_grad=True)
    optimizer = AccumAdamW([param])
    param.grad = torch.ones(3)
    optimizer.step()
    state = optimizer.state[param]
    assert set(state) == {"step", "exp_avg", "exp_avg_sq", "accum_grad"}
    # a CPU step: reading it (for k and the round boundary) never waits for the device
    assert state["step"].device.type == "cpu" and state["step"].dtype == torch.int64
    for cls, weight_decay in ((AccumAdamW, 0), (AccumAdam, 0.0)):
        parameters = inspect.signature(cls).parameters
        assert list(parameters)[:6] == ["params", "lr", "betas", "eps", "weight_decay", "accum_iter"]
        defaults = {name: parameters[name].default for name in list(parameters)[1:6]}
        assert defaults == {
            "lr": 1e-3,
            "betas": (0.9, 0.999),
            "eps": 1e-8,
            "weight_decay": 0,
            "accum_iter": 4,
        }
        assert type(parameters["weight_decay"].default) is type(weight_decay)
        assert parameters["foreach"].kind is inspect.Parameter.KEYWORD_ONLY


def test_sparse_gradients_are_refused():
    param = torch.zeros(4, 2)
    param.grad = torch.eye(4, 2).to_sparse()
    with pytest.raises(RuntimeError, match=r"sparse gradients.*SparseAdam"):
        AccumAdamW([param]).step()


def _construct(**kwargs: Any) -> Callable[[], object]:
    return lambda: AccumAdamW([torch.zeros(2)], **kwargs)


def _add_group(**kwargs: Any) -> Callable[[], object]:
    return lambda: AccumAdam([torch.zeros(2)]).add_param_group({"params": [torch.zeros(3)], **kwargs})


BAD_ARGUMENTS: dict[str, tuple[Callable[[], object], type[Exception], list[str]]] = {
    "negative lr": (_construct(lr=-0.1), ValueError, ["lr must be >= 0", "-0.1", "non-negative lr"]),
    "nan lr": (_construct(lr=float("nan")), ValueError, ["lr must be >= 0", "nan"]),
    "tensor lr": (_construct(lr=torch.tensor(0.1)), TypeError, ["lr must be a Python float", "float(lr)"]),
    "negative eps": (_construct(eps=-1e-8), ValueError, ["eps must be >= 0", "-1e-08"]),
    "beta1 of 1": (_construct(betas=(1.0, 0.999)), ValueError, ["betas[0] must be in [0, 1)", "1.0"]),
    "negative beta2": (_construct(betas=(0.9, -0.1)), ValueError, ["betas[1] must be in [0, 1)", "-0.1"]),
    "one beta": (
        _construct(betas=(0.9,)),
        TypeError,
        ["betas must be a pair", "(0.9,)", "betas=(0.9, 0.999)"],
    ),
    "negative weight_decay": (
        _construct(weight_decay=-0.1),
        ValueError,
        ["weight_decay must be >= 0", "-0.1"],
    ),
    "zero accum_iter": (
        _construct(accum_iter=0),
        ValueError,
        ["accum_iter must be >= 1", "0", "accum_iter=1"],
    ),
    "float accum_iter": (
        _construct(accum_iter=2.0),
        TypeError,
        ["accum_iter must be an int", "2.0", "float"],
    ),
    "bool accum_iter": (_construct(accum_iter=True), TypeError, ["accum_iter must be an int", "True"]),
    "bad foreach": (_construct(foreach="yes"), TypeError, ["foreach must be True, False or None", "'yes'"]),
    "bad group lr": (_add_group(lr=-1.0), ValueError, ["param group 1: lr must be >= 0", "-1.0"]),
    "bad group accum_iter": (_add_group(accum_iter=-2), ValueError, ["param group 1: accum_iter", "-2"]),
}


@pytest.mark.parametrize("case", list(BAD_ARGUMENTS))
def test_bad_arguments_raise_errors_that_name_them(case):
    build, error, fragments = BAD_ARGUMENTS[case]
    with pytest.raises(error) as info:
        build()
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))

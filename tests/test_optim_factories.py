"""optim_fn_* and lr_scheduler_fn_cosine_with_warmup: decent-dp 0.2.3 signatures, groups, schedules."""

from __future__ import annotations

import copy
import functools
import inspect
import math
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from decent_optim_wrapper.optim import (
    AccumAdam,
    AccumAdamW,
    lr_scheduler_fn_cosine_with_warmup,
    optim_fn_accum_adam,
    optim_fn_accum_adamw,
    optim_fn_adam,
    optim_fn_adamw,
)

pytestmark = pytest.mark.pure

FACTORIES: dict[str, tuple[Callable[..., torch.optim.Optimizer], type, dict[str, Any]]] = {
    # name: (factory, optimizer class, decent-dp 0.2.3's parameters after `params`, in order)
    "adam": (
        optim_fn_adam,
        torch.optim.Adam,
        {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "weight_decay": 1.0 / 32768, "eps": 1e-8},
    ),
    "adamw": (
        optim_fn_adamw,
        torch.optim.AdamW,
        {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "weight_decay": 0.1, "eps": 1e-8},
    ),
    "accum_adam": (
        optim_fn_accum_adam,
        AccumAdam,
        {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 1.0 / 32768, "accum_iter": 4},
    ),
    "accum_adamw": (
        optim_fn_accum_adamw,
        AccumAdamW,
        {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.1, "accum_iter": 4},
    ),
}


class _Net(nn.Module):
    """Weights of every usual kind (linear, conv, embedding) and parameters that are not (biases, norms)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(10, 4)
        self.conv = nn.Conv1d(4, 4, 3, padding=1)
        self.norm = nn.LayerNorm(4)
        self.batch_norm = nn.BatchNorm1d(4)
        self.head = nn.Linear(4, 2)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.conv(self.embed(tokens).transpose(1, 2))
        return self.head(self.norm(self.batch_norm(x).transpose(1, 2))).sum()


WEIGHTS = {"embed.weight", "conv.weight", "head.weight"}
NOT_WEIGHTS = {"conv.bias", "norm.weight", "norm.bias", "batch_norm.weight", "batch_norm.bias", "head.bias"}


@pytest.mark.parametrize("name", list(FACTORIES))
def test_signature_is_decent_dp_s(name):
    factory, _, expected = FACTORIES[name]
    parameters = inspect.signature(factory).parameters
    assert list(parameters) == ["params", *expected]
    assert {key: parameters[key].default for key in expected} == expected


@pytest.mark.parametrize("name", list(FACTORIES))
def test_weight_decay_goes_to_weights_only(name):
    factory, cls, defaults = FACTORIES[name]
    net = _Net()
    optimizer = factory(list(net.named_parameters()), lr=0.01, weight_decay=0.25)
    assert type(optimizer) is cls
    decayed, plain = optimizer.param_groups
    assert set(decayed["param_names"]) == WEIGHTS and decayed["weight_decay"] == 0.25
    assert set(plain["param_names"]) == NOT_WEIGHTS and plain["weight_decay"] == 0.0
    for group in optimizer.param_groups:
        assert group["lr"] == 0.01 and group["betas"] == (0.9, 0.999) and group["eps"] == 1e-8
        assert group.get("accum_iter", 4) == defaults.get("accum_iter", 4)


@pytest.mark.parametrize("name", list(FACTORIES))
def test_weight_decay_moves_weights_and_leaves_the_rest(name):
    # With zero gradients Adam's own step is exactly 0 (m = 0), so any change is weight decay's.
    factory, cls, _ = FACTORIES[name]
    net = _Net()
    before = {key: value.detach().clone() for key, value in net.named_parameters()}
    optimizer = factory(list(net.named_parameters()), lr=0.01, weight_decay=0.25)
    for param in net.parameters():
        param.grad = torch.zeros_like(param)
    optimizer.step()
    for key, param in net.named_parameters():
        if key in NOT_WEIGHTS:
            assert torch.equal(param, before[key]), key
        elif cls in (torch.optim.AdamW, AccumAdamW):  # decoupled: p (1 - lr wd), nothing else
            assert torch.equal(param, before[key] * (1 - 0.01 * 0.25)), key
        else:  # L2: the gradient becomes wd p, so Adam moves p by about lr against its sign
            expected = before[key] - 0.01 * torch.sign(before[key])
            torch.testing.assert_close(param.detach(), expected, rtol=0, atol=1e-5)


def test_empty_groups_are_left_out():
    only_biases = [("bias", torch.zeros(3, requires_grad=True))]
    only_weights = [("weight", torch.zeros(3, 2, requires_grad=True))]
    (group,) = optim_fn_adamw(only_biases).param_groups
    assert group["weight_decay"] == 0.0 and group["param_names"] == ["bias"]
    (group,) = optim_fn_accum_adamw(only_weights).param_groups
    assert group["weight_decay"] == 0.1 and group["param_names"] == ["weight"]


def test_partial_changes_hyperparameters():
    factory = functools.partial(optim_fn_accum_adamw, lr=3e-4, accum_iter=8)
    optimizer = factory(list(_Net().named_parameters()))
    assert all(group["lr"] == 3e-4 and group["accum_iter"] == 8 for group in optimizer.param_groups)


BAD_FACTORY_INPUT: dict[str, tuple[Callable[[], object], type[Exception], list[str]]] = {
    "parameters, not named": (
        lambda: optim_fn_adamw(list(_Net().parameters())),
        TypeError,
        ["params[0] must be a (name, parameter) pair", "Parameter", "named_parameters()"],
    ),
    "a module": (lambda: optim_fn_adam(_Net()), TypeError, ["list of (name, parameter) pairs", "_Net"]),
    "no parameters": (lambda: optim_fn_accum_adam([]), ValueError, ["params is empty"]),
    "negative weight decay": (
        lambda: optim_fn_adamw(list(_Net().named_parameters()), weight_decay=-0.1),
        ValueError,
        ["weight_decay must be >= 0", "-0.1"],
    ),
    "bad accum_iter": (
        lambda: optim_fn_accum_adamw(list(_Net().named_parameters()), accum_iter=0),
        ValueError,
        ["accum_iter must be >= 1", "0"],
    ),
}


@pytest.mark.parametrize("case", list(BAD_FACTORY_INPUT))
def test_bad_factory_input(case):
    build, error, fragments = BAD_FACTORY_INPUT[case]
    with pytest.raises(error) as info:
        build()
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))


# ---- the schedule ---------------------------------------------------------------------------------


def _expected_lr(base: float, s: int, t_max: int, t_warmup: int, eta_min: float, decay: float) -> float:
    if s < t_warmup:
        return base * (decay + (1 - decay) * s / t_warmup)
    return eta_min + 0.5 * (base - eta_min) * (1 + math.cos(math.pi * (s - t_warmup) / t_max))


def _two_groups() -> torch.optim.Optimizer:
    return torch.optim.SGD(
        [{"params": [torch.zeros(2)], "lr": 0.1}, {"params": [torch.zeros(2)], "lr": 0.02}]
    )


@pytest.mark.parametrize(("t_max", "t_warmup"), [(10, 5), (7, 1), (12, 0)])
def test_schedule_follows_the_closed_form(t_max, t_warmup):
    # CosineAnnealingLR updates lr recursively; its float64 rounding stays below 1e-15 relative
    # per step, so 1e-12 over a few dozen steps leaves a margin of orders of magnitude.
    optimizer = _two_groups()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no deprecation noise from SequentialLR's milestone
        scheduler = lr_scheduler_fn_cosine_with_warmup(
            optimizer, t_max=t_max, t_warmup=t_warmup, cosine_eta_min=1e-4
        )
        for s in range(t_warmup + t_max + 1):
            for group, base in zip(optimizer.param_groups, (0.1, 0.02), strict=True):
                expected = _expected_lr(base, s, t_max, t_warmup, 1e-4, 0.01)
                assert group["lr"] == pytest.approx(expected, rel=1e-12, abs=0), (s, base)
            optimizer.step()
            scheduler.step()
    assert optimizer.param_groups[0]["lr"] != pytest.approx(1e-4)  # past t_max the cosine climbs back


def test_schedule_defaults_and_end_points():
    parameters = inspect.signature(lr_scheduler_fn_cosine_with_warmup).parameters
    assert list(parameters) == ["optimizer", "t_max", "t_warmup", "cosine_eta_min", "warmup_decay"]
    assert parameters["cosine_eta_min"].default == 1e-6 and parameters["warmup_decay"].default == 0.01
    optimizer = _two_groups()
    scheduler = lr_scheduler_fn_cosine_with_warmup(optimizer, t_max=4, t_warmup=2)
    lrs = []
    for _ in range(7):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert lrs[0] == pytest.approx(0.1 * 0.01)  # warm-up starts at warmup_decay of the base
    assert lrs[2] == pytest.approx(0.1)  # the cosine starts at the base
    assert lrs[6] == pytest.approx(1e-6)  # and ends at cosine_eta_min


def test_schedule_resumes_from_its_state_dict():
    optimizer = _two_groups()
    scheduler = lr_scheduler_fn_cosine_with_warmup(optimizer, t_max=6, t_warmup=3)
    for _ in range(2):  # saved inside the warm-up
        optimizer.step()
        scheduler.step()
    saved_optimizer, saved_scheduler = (
        copy.deepcopy(optimizer.state_dict()),
        copy.deepcopy(scheduler.state_dict()),
    )
    expected = []
    for _ in range(6):
        optimizer.step()
        scheduler.step()
        expected.append(optimizer.param_groups[0]["lr"])

    resumed = _two_groups()
    resumed_scheduler = lr_scheduler_fn_cosine_with_warmup(resumed, t_max=6, t_warmup=3)
    resumed.load_state_dict(saved_optimizer)
    resumed_scheduler.load_state_dict(saved_scheduler)
    actual = []
    for _ in range(6):
        resumed.step()
        resumed_scheduler.step()
        actual.append(resumed.param_groups[0]["lr"])
    assert actual == expected


BAD_SCHEDULE: dict[str, tuple[dict[str, Any], type[Exception], list[str]]] = {
    "zero t_max": ({"t_max": 0}, ValueError, ["t_max must be >= 1", "got 0"]),
    "float t_max": ({"t_max": 10.0}, TypeError, ["t_max must be an int", "10.0", "float"]),
    "negative t_warmup": ({"t_warmup": -1}, ValueError, ["t_warmup must be >= 0", "-1"]),
    "zero warmup_decay": ({"warmup_decay": 0.0}, ValueError, ["warmup_decay must be in (0, 1]", "0.0"]),
    "warmup_decay above 1": ({"warmup_decay": 1.5}, ValueError, ["warmup_decay must be in (0, 1]", "1.5"]),
    "negative eta_min": (
        {"cosine_eta_min": -1e-6},
        ValueError,
        ["cosine_eta_min must be a float >= 0", "-1e-06"],
    ),
}


@pytest.mark.parametrize("case", list(BAD_SCHEDULE))
def test_bad_schedule_arguments(case):
    overrides, error, fragments = BAD_SCHEDULE[case]
    kwargs = {"t_max": 10, "t_warmup": 2, **overrides}
    with pytest.raises(error) as info:
        lr_scheduler_fn_cosine_with_warmup(_two_groups(), **kwargs)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))

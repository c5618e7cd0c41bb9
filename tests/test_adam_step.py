"""The rule's Adam step (``engine.adam_step``) against torch's own Adam and AdamW.

References nobody here wrote: torch's optimizer database (every Adam and AdamW configuration torch's
own tests run, enumerated as they enumerate it) and torch's step itself. After every step the
optimizer's own state (``step``, ``exp_avg``, ``exp_avg_sq``) must equal, bit for bit, what torch's
step computes from the same parameters, gradients and state (a bare twin stepped beside it), and the
parameters must be finite wherever torch's are. A property sweep (hypothesis) checks the same over
maximize / weight decay / amsgrad / foreach / fused / differentiable / complex / GradScaler / chunk
sizes, and the update against a float64 formula.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from twins import assert_state_is_torchs, bare_twin, database_under_the_wrapper

from decent_optim_wrapper.engine.rules import adam_step
from decent_optim_wrapper.engine.rules.second_moment import SIGNAL, SecondMomentRule
from decent_optim_wrapper.front_ends.inner_step import scaled_step

ADAMS = (torch.optim.Adam, torch.optim.AdamW)


#: Run in a process of its own: importing torch's test internals switches off torch's global
#: backend flags (``torch.backends.disable_global_flags``) for the whole process, which breaks
#: Lightning's tests in the same pytest process or worker.
_ENUMERATE_DATABASE = """
import json, torch
from torch.testing._internal.common_optimizers import (
    _get_optim_inputs_including_global_cliquey_kwargs, optim_db,
)
configs = []
for info in optim_db:
    if info.optim_cls in (torch.optim.Adam, torch.optim.AdamW):
        for entry in _get_optim_inputs_including_global_cliquey_kwargs("cpu", torch.float32, info):
            kwargs = {k: float(v) if isinstance(v, torch.Tensor) else v for k, v in entry.kwargs.items()}
            configs.append((info.optim_cls.__name__, entry.desc, kwargs))
print(json.dumps(configs))
"""


def _database_configs() -> list[tuple[type[torch.optim.Optimizer], str, dict]]:
    """torch's Adam and AdamW configurations on the CPU, enumerated as torch's own tests enumerate
    them, and each once more with ``foreach=True`` (torch lists foreach only for devices with foreach
    kernels; on a CPU it loops the same kernels)."""
    # Collected by every pytest-xdist worker, which must list the same tests: the listing is cached per
    # torch version (written whole, then renamed), and the generous timeout covers 3 workers importing
    # torch's test database at once on 2 busy cores.
    cache = Path(tempfile.gettempdir()) / f"decent-optim-wrapper-adam-db-{torch.__version__}.json"
    if not cache.exists():
        listed = subprocess.run(
            [sys.executable, "-c", _ENUMERATE_DATABASE],
            capture_output=True,
            text=True,
            timeout=600,
            check=True,
        )
        partial = cache.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(listed.stdout.strip().splitlines()[-1])
        os.replace(partial, cache)
    configs = []
    for name, desc, kwargs in json.loads(cache.read_text()):
        cls = getattr(torch.optim, name)
        configs.append((cls, desc, kwargs))
        if not any(kwargs.get(flag) for flag in ("fused", "differentiable")):
            configs.append((cls, f"{desc} & foreach", {**kwargs, "foreach": True}))
    return configs


DATABASE = _database_configs()


def _params(differentiable: bool = False) -> list[torch.Tensor]:
    """Linear(4, 6) - Tanh - Linear(6, 3)'s weights; non-leaf tensors for a differentiable step (it
    updates them in place under autograd, which a leaf refuses)."""
    g = torch.Generator().manual_seed(0)
    shapes = [(6, 4), (6,), (3, 6), (3,)]
    return [_as_param(torch.randn(s, generator=g) * 0.5, differentiable) for s in shapes]


def _as_param(value: torch.Tensor, differentiable: bool) -> torch.Tensor:
    leaf = value.requires_grad_()
    return leaf.clone() if differentiable else leaf


def _set_gradients(params: list[torch.Tensor], maximize: bool) -> None:
    """The loss's gradients at the parameters' values (not through their history of steps)."""
    leaves = [p.detach().requires_grad_() for p in params]
    for p, grad in zip(params, torch.autograd.grad(_loss(leaves, maximize), leaves), strict=True):
        p.grad = grad


def _loss(params: list[torch.Tensor], maximize: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(8, 4, generator=g), torch.randn(8, 3, generator=g)
    w1, b1, w2, b2 = params
    out = torch.tanh(x.to(w1.dtype) @ w1.T + b1) @ w2.T + b2
    mse = torch.nn.functional.mse_loss(out, y.to(out.dtype))
    return -mse if maximize else mse  # the reproduction: maximize the negated loss


def _train(cls, options: dict, ranks: int | None, steps: int = 6, check=True):
    """``steps`` steps on a fixed batch; ``ranks``: the rule's n (None: torch's own step)."""
    params = _params(options.get("differentiable", False))
    opt = cls(params, **options)
    rule = SecondMomentRule("average")
    maximize = options.get("maximize", False)
    for _ in range(steps):
        _set_gradients(params, maximize)
        if ranks is None:
            opt.step()
            continue
        twin, twins = bare_twin(opt)
        rule.step(opt, ranks)
        twin.step()
        if check:
            assert_state_is_torchs(opt, twin, twins)
    return params, opt


@pytest.mark.pure
@pytest.mark.parametrize(
    ("cls", "desc", "options"), DATABASE, ids=[f"{c.__name__}-{d}" for c, d, _ in DATABASE]
)
def test_torchs_database_under_the_rule(cls, desc, options):
    bare, _ = _train(cls, options, None)
    ours, opt = _train(cls, options, 2)  # the state checked bitwise against torch's after every step
    for mine, theirs in zip(ours, bare, strict=True):
        if bool(theirs.isfinite().all()):
            assert bool(mine.isfinite().all()), desc
    assert all(SIGNAL in opt.state[p] for p in ours)


@pytest.mark.pure
def test_the_reported_maximize_and_l2_case_stays_finite_and_trains():
    # Adam(maximize=True, weight_decay=0.1) went NaN within 5 steps under the old rule.
    options = {"lr": 1e-2, "maximize": True, "weight_decay": 0.1}
    ours, _ = _train(torch.optim.Adam, options, 2, steps=30)
    bare, _ = _train(torch.optim.Adam, options, None, steps=30)
    assert all(bool(p.isfinite().all()) for p in ours)
    start = float(_loss(_params(), False).detach())
    # maximizing the negated loss minimizes the loss: both must have lowered it
    assert float(_loss(ours, False).detach()) < start and float(_loss(bare, False).detach()) < start


@pytest.mark.pure
def test_the_rules_step_is_the_optimizers_step_for_hooks_and_schedulers():
    # The module front-end builds a scheduler on each bucket's optimizer: torch warns "Detected call
    # of lr_scheduler.step() before optimizer.step()" unless the step it watches was taken.
    params = _params()
    opt = torch.optim.AdamW(params, lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    fired = []
    opt.register_step_pre_hook(lambda o, a, k: fired.append("pre"))
    opt.register_step_post_hook(lambda o, a, k: fired.append("post"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            _set_gradients(params, maximize=False)
            SecondMomentRule("average").step(opt, 2)
            scheduler.step()
    assert fired == ["pre", "post"] * 2
    assert opt.param_groups[0]["lr"] == 0.0025


@pytest.mark.pure
def test_a_subclass_with_a_step_of_its_own_is_stepped_as_it_is():
    class Counted(torch.optim.AdamW):
        steps = 0

        def step(self, closure=None):
            Counted.steps += 1
            return super().step(closure)

    params = _params()
    opt = Counted(params, lr=0.01)
    rule = SecondMomentRule("average")
    assert not rule.applies(opt, 2)
    _set_gradients(params, maximize=False)
    rule.step(opt, 2)
    assert Counted.steps == 1 and SIGNAL not in opt.state[params[0]]


@pytest.mark.pure
def test_what_the_rule_leaves_to_the_optimizer():
    rule = SecondMomentRule("average")
    # hyperparameters that take gradients through a differentiable step (hypergradients)
    params = _params(differentiable=True)
    lr = torch.tensor(0.01, requires_grad=True)
    hyper = torch.optim.Adam(params, lr=lr, differentiable=True)
    assert not rule.applies(hyper, 2)
    _set_gradients(params, maximize=False)
    rule.step(hyper, 2)  # torch's own step: the graph reaches lr
    (grad_lr,) = torch.autograd.grad(sum(p.sum() for p in params), lr)
    assert float(grad_lr) != 0.0
    # a step patched onto the instance (a wrapper of someone else's) is not bypassed
    patched = torch.optim.AdamW(_params(), lr=0.01)
    patched.step = lambda closure=None, inner=patched.step: inner(closure)
    assert not rule.applies(patched, 2)
    # an LR scheduler's wrapper only records the call: the rule still applies
    scheduled = torch.optim.AdamW(_params(), lr=0.01)
    torch.optim.lr_scheduler.StepLR(scheduled, step_size=1)
    assert rule.applies(scheduled, 2)


@pytest.mark.pure
@pytest.mark.parametrize("foreach", [False, True])
def test_the_rules_step_at_one_rank_is_torchs_step(foreach):
    # n = 1: v_t = s_t, the update of torch's own step, bit for bit (the signal is kept, unused)
    ours, theirs = _params(), _params()
    opt = torch.optim.AdamW(ours, lr=0.01, weight_decay=0.1, foreach=foreach)
    ref = torch.optim.AdamW(theirs, lr=0.01, weight_decay=0.1, foreach=foreach)
    for _ in range(5):
        _set_gradients(ours, maximize=False)
        _set_gradients(theirs, maximize=False)
        adam_step.adam_step_with_rule(opt, 1)
        ref.step()
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
    with pytest.raises(ValueError, match="ranks must be an int >= 1, got 0"):
        adam_step.adam_step_with_rule(opt, 0)


# -- the property sweep ------------------------------------------------------------------------------


def _sweep_params(
    sizes: list[int], complex_: bool, seed: int, differentiable: bool, dtype: torch.dtype
) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if complex_:
        dtype = torch.complex128 if dtype == torch.float64 else torch.complex64
    return [
        _as_param(torch.randn(n, generator=g, dtype=torch.float64).to(dtype), differentiable) for n in sizes
    ]


@pytest.mark.pure
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    cls=st.sampled_from(ADAMS),
    impl=st.sampled_from(["single", "foreach", "fused", "differentiable"]),
    maximize=st.booleans(),
    weight_decay=st.sampled_from([0.0, 1e-3, 0.1]),
    l2_in_adamw=st.booleans(),  # an AdamW group with decoupled_weight_decay=False
    amsgrad=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.float16]),
    complex_=st.booleans(),
    tensor_betas=st.booleans(),
    scale=st.sampled_from([None, 2.0**7]),
    ranks=st.sampled_from([2, 3, 8]),
    sizes=st.lists(st.integers(1, 300), min_size=1, max_size=3),
    zero_rows=st.booleans(),  # coordinates whose gradient is always 0 (s = 0 there)
    chunk=st.sampled_from([64, 128, 1 << 18]),  # multiples of torch's vectorised block (adam_step)
    seed=st.integers(0, 1000),
)
def test_property_sweep(
    monkeypatch,
    cls,
    impl,
    maximize,
    weight_decay,
    l2_in_adamw,
    amsgrad,
    dtype,
    complex_,
    tensor_betas,
    scale,
    ranks,
    sizes,
    zero_rows,
    chunk,
    seed,
):
    assume(not (complex_ and dtype in (torch.bfloat16, torch.float16)))  # no complex32 in Adam
    assume(not (tensor_betas and impl == "foreach"))  # torch: tensor betas need capturable with foreach
    monkeypatch.setattr(adam_step, "CHUNK_NUMEL", chunk)  # chunk boundaries inside the tensors
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)  # chunks are taken on one thread only
    betas = (torch.tensor(0.9), torch.tensor(0.999)) if tensor_betas else (0.9, 0.999)
    options = {
        "lr": 0.05,
        "betas": betas,
        "maximize": maximize,
        "weight_decay": weight_decay,
        "amsgrad": amsgrad,
    }
    flags = {"single": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}
    options.update(flags.get(impl, {"differentiable": True}))
    params = _sweep_params(sizes, complex_, seed, impl == "differentiable", dtype)
    group = (
        {"params": params, "decoupled_weight_decay": False}
        if cls is torch.optim.AdamW and l2_in_adamw
        else params
    )
    opt = None
    try:
        opt = cls([group] if isinstance(group, dict) else group, **options)
        for p in params:
            p.grad = torch.ones_like(p)
        probe, _ = bare_twin(opt)
        probe.step()  # torch's own first step on copies
    except (RuntimeError, ValueError) as refused:  # torch refuses it (fused complex, ...): so must the rule
        if opt is not None:
            with pytest.raises(type(refused)):
                SecondMomentRule("average").step(opt, ranks)
        return
    decoupled = cls is torch.optim.AdamW and not l2_in_adamw
    rule = SecondMomentRule("average")
    g = torch.Generator().manual_seed(seed + 1)
    for _ in range(5):
        for p in params:
            grad = (torch.randn(p.shape, generator=g, dtype=p.dtype) + 0.3).to(p.dtype)
            if zero_rows:
                grad.view(-1)[::3] = 0
            p.grad = grad * scale if scale is not None else grad
        twin, twins = bare_twin(opt)
        before = {p: (p.detach().clone(), p.grad.clone(), _copy(opt.state.get(p, {}))) for p in params}
        grad_scale = None if scale is None else torch.tensor(scale)
        scaled_step(
            opt,
            None,
            grad_scale,
            None if scale is None else torch.tensor(0.0),
            lambda s: rule.step(opt, ranks, s),
        )
        scaled_step(twin, None, grad_scale, None if scale is None else torch.tensor(0.0))
        assert_state_is_torchs(opt, twin, twins)
        for p in params:
            if bool(twins[p].isfinite().all()):  # fp16: eps underflows, so torch itself can divide 0 by 0
                assert bool(p.isfinite().all())
            x0, grad0, state0 = before[p]
            _check_update(decoupled, options, ranks, p, x0, grad0 / (scale or 1.0), state0, opt.state[p])


def _copy(state: dict) -> dict:
    return {k: v.detach().clone() for k, v in state.items()}


def _real64(t: torch.Tensor) -> torch.Tensor:
    return (torch.view_as_real(t) if torch.is_complex(t) else t).detach().double()


def _check_update(decoupled, options, n, p, x0, grad, state0, state):
    """The signal and the parameter update against the formula in float64, from the state before
    (x_{t-1}, c_{t-1}, m_{t-1}) and torch's own m_t, s_t after. Tolerances: a handful of roundings
    of each term in the parameters' dtype (unit roundoff u), so 8 u (16 u for the update) of the
    terms' magnitudes."""
    finfo = torch.finfo(p.dtype)
    u = finfo.eps / 2
    floor = 8 * finfo.smallest_normal * finfo.eps  # a few roundings among fp16's subnormals
    b1, b2 = (float(b) for b in options["betas"])
    lr, wd, eps = options["lr"], options["weight_decay"], 1e-8
    x0, x, grad = _real64(x0), _real64(p), _real64(grad)
    m, s, c = _real64(state["exp_avg"]), _real64(state["exp_avg_sq"]), _real64(state[SIGNAL])
    t = float(state["step"])
    seen = -grad if options["maximize"] else grad  # the gradient torch's moments see
    if wd and not decoupled:
        seen = seen + wd * x0
    if not state0:  # first step: divided by s_1, and c_1 = s_1 exactly
        assert torch.equal(state[SIGNAL], state["exp_avg_sq"])
        v = s
    else:
        c0, m0 = _real64(state0[SIGNAL]), _real64(state0["exp_avg"])
        weight = (1 - b2) / (1 - b1 ** (t - 1)) * m0
        expected_c = b2 * c0 + weight * seen
        # g' = g + wd x rounds relative to its terms, not to their (cancelling) sum
        terms = grad.abs() + (wd * x0.abs() if wd and not decoupled else 0)
        tolerance = 8 * u * (b2 * c0.abs() + (weight * terms).abs()) + floor
        assert bool(((c - expected_c).abs() <= tolerance).all()), "signal"
        v = s / n + (1 - 1 / n) * c.abs()
    assert bool((v >= 0).all())
    if options["amsgrad"]:
        previous = _real64(state0["max_exp_avg_sq"]) if state0 else torch.zeros_like(v)
        expected_max = torch.maximum(previous, v)
        got_max = _real64(state["max_exp_avg_sq"])
        assert bool(((got_max - expected_max).abs() <= 8 * u * expected_max + floor).all()), "max"
        v = got_max
    decayed = x0 * (1 - lr * wd) if decoupled and wd else x0
    update = lr / (1 - b1**t) * m / ((v / (1 - b2**t)).sqrt() + eps)
    tolerance = 4 * u * decayed.abs() + 16 * u * update.abs() + floor
    # where fp16 holds the moments as subnormals they carry few digits: no relative bound there
    normal = update.isfinite() & (s >= finfo.smallest_normal) & (m.abs() >= finfo.smallest_normal)
    assert bool(((x - (decayed - update)).abs() <= tolerance)[normal].all()), "update"


# -- the database under the wrapper, at world size 2 -----------------------------------------------


@pytest.mark.dist
def test_torchs_database_under_the_wrapper_at_world_size_two(pool):
    # differentiable configurations update parameters in place under autograd, which the model's
    # leaf parameters refuse (the bare optimizer raises too); they are checked above, on non-leaves.
    configs = [c for c in DATABASE if not c[2].get("differentiable")]
    results = pool(2).run(database_under_the_wrapper, configs, timeout=120)
    for rank_results in results:
        assert len(rank_results) == len(configs)
        for result in rank_results:
            assert result["finite"] or not result["bare finite"], result["desc"]
            assert result["mismatches"] == [], result["desc"]

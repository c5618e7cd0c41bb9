"""Adam's second moment of the average gradient (decent_optim_wrapper.engine.rules.second_moment).

The rule, per coordinate, with n ranks: s_t = b2 s + (1 - b2) g^2 (the optimizer's own),
c_t = b2 c + (1 - b2) g m_hat_{t-1} (c_1 = s_1), and the step divides by
v_t = s_t / n + (1 - 1/n) |c_t|, bias-corrected as Adam does. ``RuleAdamW`` below writes it
from the formula, without torch's optimizers or the library; at n = 1 it is AdamW, which the first
test checks against torch's.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from helpers import flat, tiny_model, train_steps
from simulation import BlockingGossip, Gossip

from decent_optim_wrapper import DecentOptimWrapper, DecentralizedDataParallel
from decent_optim_wrapper.engine.rules.second_moment import SIGNAL, SecondMomentRule, check_second_moment
from decent_optim_wrapper.front_ends.inner_step import scaled_step


class RuleAdamW(torch.optim.Optimizer):
    """AdamW (or Adam with L2 decay) whose step divides by the rule's v_t; n = 1 is plain AdamW."""

    def __init__(self, params, n: int, lr=0.01, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, l2=False):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.n, self.l2 = n, l2

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            lr, wd = group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad + wd * p if self.l2 else p.grad.clone()
                st = self.state[p]
                if not st:
                    st.update(t=0, m=torch.zeros_like(p), s=torch.zeros_like(p), c=None)
                t = st["t"] = st["t"] + 1
                m_prev_hat = st["m"] / (1 - b1 ** (t - 1)) if t > 1 else g
                st["m"] = b1 * st["m"] + (1 - b1) * g
                st["s"] = b2 * st["s"] + (1 - b2) * g * g
                c_prev = st["c"] if st["c"] is not None else torch.zeros_like(p)
                st["c"] = b2 * c_prev + (1 - b2) * g * m_prev_hat
                v = st["s"] / self.n + (1 - 1 / self.n) * st["c"].abs()
                if not self.l2:
                    p.mul_(1 - lr * wd)
                m_hat, v_hat = st["m"] / (1 - b1**t), v / (1 - b2**t)
                p.sub_(lr * m_hat / (v_hat.sqrt() + group["eps"]))


def _gradients(steps: int, shape=(5, 3), dtype=torch.float64, seed=0) -> list[torch.Tensor]:
    """Fixed gradients that do not depend on the parameters: a signal plus noise, some sign flips."""
    g = torch.Generator().manual_seed(seed)
    signal = torch.randn(shape, generator=g, dtype=dtype)
    return [
        signal * (1 if t % 7 else -1) + 2 * torch.randn(shape, generator=g, dtype=dtype) for t in range(steps)
    ]


def _run(optimizer_cls, ranks, grads, rule: bool, **kwargs) -> tuple[torch.Tensor, torch.optim.Optimizer]:
    first = grads[0]
    p = torch.nn.Parameter(
        torch.linspace(-1, 1, first.numel(), dtype=first.dtype, device=first.device).view(first.shape)
    )
    opt = optimizer_cls([p], **kwargs)
    hook = SecondMomentRule("average")
    for g in grads:
        p.grad = g.clone()
        if rule:
            hook.step(opt, ranks)
        else:
            opt.step()
    return p.detach().clone(), opt


@pytest.mark.pure
def test_reference_at_one_rank_is_torch_adamw():
    grads = _gradients(30)
    ours, _ = _run(RuleAdamW, 1, grads, rule=False, n=1, weight_decay=0.1)
    torch_, _ = _run(torch.optim.AdamW, 1, grads, rule=False, lr=0.01, weight_decay=0.1)
    # fp64; other operation order (division vs torch's fused expressions)
    torch.testing.assert_close(ours, torch_, rtol=0, atol=1e-14)


@pytest.mark.pure
@pytest.mark.parametrize("n", [2, 4, 16])
@pytest.mark.parametrize(
    ("cls", "options"),
    [
        (torch.optim.AdamW, {"weight_decay": 0.1, "foreach": False}),
        (torch.optim.AdamW, {"weight_decay": 0.1, "foreach": True}),
        (torch.optim.AdamW, {"weight_decay": 0.1, "fused": True}),
        (torch.optim.Adam, {"weight_decay": 0.1}),  # L2 decay: the moments see g + wd p
    ],
    ids=["adamw", "adamw-foreach", "adamw-fused", "adam-l2"],
)
def test_rule_on_torch_optimizers_equals_the_reference(n, cls, options):
    grads = _gradients(40)
    got, _ = _run(cls, n, grads, rule=True, lr=0.01, **options)
    expected, _ = _run(RuleAdamW, n, grads, rule=False, n=n, weight_decay=0.1, l2=cls is torch.optim.Adam)
    # fp64, parameters of order 1: the rule folds the bias correction and eps into the square root's
    # argument (other operation order than the reference), a few ulp (2e-16 each) over 40 steps.
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-14)


@pytest.mark.pure
def test_maximize_follows_the_negated_gradient():
    grads = _gradients(20)
    got, _ = _run(torch.optim.AdamW, 4, grads, rule=True, lr=0.01, weight_decay=0.0, maximize=True)
    expected, _ = _run(RuleAdamW, 4, [-g for g in grads], rule=False, n=4)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


@pytest.mark.pure
@pytest.mark.parametrize("foreach", [False, True])
def test_the_optimizers_own_moments_are_untouched(foreach):
    # Gradients that do not depend on the parameters: the optimizer's m and s follow the same
    # sequence with and without the rule, bit for bit (the rule writes s_t back after the step, and
    # computes it with the optimizer's own operations).
    grads = _gradients(25, dtype=torch.float32)
    _, with_rule = _run(torch.optim.AdamW, 8, grads, rule=True, lr=0.01, foreach=foreach)
    _, bare = _run(torch.optim.AdamW, 8, grads, rule=False, lr=0.01, foreach=foreach)
    (state,), (bare_state,) = with_rule.state.values(), bare.state.values()
    assert torch.equal(state["exp_avg"], bare_state["exp_avg"])
    assert torch.equal(state["exp_avg_sq"], bare_state["exp_avg_sq"])
    assert set(state) - set(bare_state) == {SIGNAL}


@pytest.mark.pure
def test_first_step_is_the_optimizers_own_and_starts_the_signal():
    grads = _gradients(1)
    got, opt = _run(torch.optim.AdamW, 4, grads, rule=True, lr=0.01)
    bare, _bare_opt = _run(torch.optim.AdamW, 4, grads, rule=False, lr=0.01)
    assert torch.equal(got, bare)
    (state,) = opt.state.values()
    assert torch.equal(state[SIGNAL], state["exp_avg_sq"])  # c_1 = s_1


@pytest.mark.pure
def test_amsgrad_keeps_the_running_maximum_of_v():
    grads = _gradients(15)
    _, opt = _run(torch.optim.AdamW, 4, grads, rule=True, lr=0.01, amsgrad=True)
    (state,) = opt.state.values()
    s, c = state["exp_avg_sq"], state[SIGNAL]
    v_last = s / 4 + 0.75 * c.abs()
    # the maximum over the steps of v_t, so at least the last one (up to its rounding)
    assert bool((state["max_exp_avg_sq"] >= v_last * (1 - 1e-12)).all())


@pytest.mark.pure
def test_complex_parameters_are_pairs_of_reals():
    g = torch.Generator().manual_seed(3)
    grads = [torch.randn(4, dtype=torch.complex128, generator=g) for _ in range(10)]
    p = torch.nn.Parameter(torch.zeros(4, dtype=torch.complex128))
    q = torch.nn.Parameter(torch.zeros(4, 2, dtype=torch.float64))
    opt, ref = torch.optim.AdamW([p], lr=0.01), torch.optim.AdamW([q], lr=0.01)
    rule = SecondMomentRule("average")
    for grad in grads:
        p.grad, q.grad = grad.clone(), torch.view_as_real(grad).clone()
        for optimizer in (opt, ref):
            rule.step(optimizer, 4)
    torch.testing.assert_close(torch.view_as_real(p.detach()), q.detach(), rtol=0, atol=1e-15)


@pytest.mark.pure
def test_other_optimizers_and_one_rank_are_left_alone():
    rule = SecondMomentRule("average")
    model = tiny_model()
    assert not rule.applies(torch.optim.SGD(model.parameters(), lr=0.1), 4)
    assert not rule.applies(torch.optim.AdamW(model.parameters()), 1)
    assert not SecondMomentRule("local").applies(torch.optim.AdamW(model.parameters()), 4)
    assert rule.applies(torch.optim.Adam(model.parameters()), 2)

    class MyAdamW(torch.optim.AdamW):
        pass

    assert rule.applies(MyAdamW(model.parameters()), 2)


@pytest.mark.pure
@pytest.mark.parametrize("value", ["global", None, 1, True])
def test_bad_second_moment_names_the_argument_and_the_choices(value):
    with pytest.raises(ValueError, match=r"second_moment must be one of 'average', 'local'"):
        check_second_moment(value)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    "options",
    [{"foreach": False}, {"foreach": True}, {"fused": True}, {"foreach": True, "capturable": True}],
    ids=["single", "foreach", "fused", "capturable"],
)
def test_rule_on_cuda_tensors_equals_the_reference(options):
    # The step counters live on the GPU (fused, capturable): the rule reads them once per group.
    grads = [g.cuda() for g in _gradients(40)]
    got, opt = _run(torch.optim.AdamW, 4, grads, rule=True, lr=0.01, weight_decay=0.1, **options)
    expected, _ = _run(RuleAdamW, 4, [g.cpu() for g in grads], rule=False, n=4, weight_decay=0.1)
    assert got.is_cuda and opt.state[next(iter(opt.state))][SIGNAL].is_cuda
    # fp64, as the CPU test; the GPU's kernels round in their own order (1e-16 relative per op).
    tolerance = 1e-12
    if options.get("capturable"):
        # Capturable AdamW keeps its step count in a float32 tensor and computes the bias
        # corrections from it in float32 (1e-7 relative, divided by 1 - b2^t): torch's own
        # rounding, measured here without the rule, bounds the rule's distance to the reference.
        plain, _ = _run(torch.optim.AdamW, 1, grads, rule=False, lr=0.01, weight_decay=0.1, foreach=True)
        captured, _ = _run(
            torch.optim.AdamW, 1, grads, rule=False, lr=0.01, weight_decay=0.1, foreach=True, capturable=True
        )
        own = (captured - plain).abs().max().item()
        assert own > 0
        tolerance += 4 * own
    torch.testing.assert_close(got.cpu(), expected, rtol=0, atol=tolerance)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_scaled_fused_step_on_cuda_gives_the_unscaled_rule():
    # GradScaler's scale and found-inf tensors on the GPU; the fused kernel unscales inside its step.
    grads = [g.cuda() for g in _gradients(10, dtype=torch.float32)]
    scale = torch.tensor(2.0**10, device="cuda")
    rule = SecondMomentRule("average")
    results = []
    for fused, factor in ((True, scale), (False, None)):
        p = torch.nn.Parameter(torch.zeros(5, 3, device="cuda"))
        opt = torch.optim.AdamW([p], lr=0.01, fused=fused)
        for g in grads:
            p.grad = g * scale if factor is not None else g.clone()
            found = torch.tensor(0.0, device="cuda") if factor is not None else None
            scaled_step(opt, None, factor, found, lambda s, o=opt: rule.step(o, 4, s))
        results.append(p.detach().cpu())
    # fp32, fused kernel against the single-tensor path: their own roundings (a few ulp per step)
    torch.testing.assert_close(results[0], results[1], rtol=1e-5, atol=1e-6)


@pytest.mark.pure
@pytest.mark.parametrize("fused", [False, True])
def test_a_skipped_inf_step_does_not_feed_the_estimate(fused):
    # GradScaler found inf/NaN: neither the optimizer's state nor the signal may move.
    grads = _gradients(3, dtype=torch.float32)
    p = torch.nn.Parameter(torch.zeros(5, 3))
    opt = torch.optim.AdamW([p], lr=0.01, fused=fused)
    rule = SecondMomentRule("average")
    scale = torch.tensor(1024.0)
    for g in grads[:2]:
        p.grad = g * scale
        scaled_step(opt, None, scale, torch.tensor(0.0), lambda s: rule.step(opt, 4, s))
    before = {k: v.clone() for k, v in opt.state[p].items()}
    params = p.detach().clone()
    p.grad = torch.full_like(p, float("inf"))
    calls = []
    scaled_step(opt, None, scale, torch.tensor(1.0), lambda s: calls.append(s) or rule.step(opt, 4, s))
    assert calls == []
    assert torch.equal(p.detach(), params)
    for key, value in before.items():
        assert torch.equal(opt.state[p][key], value), key


@pytest.mark.pure
def test_scaled_gradients_give_the_unscaled_rule():
    # A fused optimizer unscales inside its step; the rule must see the unscaled gradients too.
    grads = _gradients(10, dtype=torch.float32)
    scale = torch.tensor(2.0**10)
    rule = SecondMomentRule("average")
    results = []
    for fused, factor in ((True, scale), (False, None)):
        p = torch.nn.Parameter(torch.zeros(5, 3))
        opt = torch.optim.AdamW([p], lr=0.01, fused=fused)
        for g in grads:
            p.grad = g * scale if factor is not None else g.clone()
            found = torch.tensor(0.0) if factor is not None else None
            scaled_step(opt, None, factor, found, lambda s, o=opt: rule.step(o, 4, s))
        results.append(p.detach().clone())
    # fp32, fused kernel against the single-tensor path: their own roundings (a few ulp per step)
    torch.testing.assert_close(results[0], results[1], rtol=1e-5, atol=1e-6)


@pytest.mark.pure
def test_a_closure_is_evaluated_before_the_rule():
    model = tiny_model(dtype=torch.float64)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    rule = SecondMomentRule("average")
    x, y = torch.randn(5, 6, dtype=torch.float64), torch.tensor([0, 1, 2, 0, 1])
    seen = []

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        return loss

    def prepare(scale):
        seen.append([p.grad is not None for p in model.parameters()])
        rule.step(opt, 4, scale)

    for _ in range(3):
        loss = scaled_step(opt, closure, None, None, prepare)
        assert isinstance(loss, torch.Tensor)
    assert seen == [[True] * 4] * 3
    assert all(SIGNAL in s for s in opt.state.values())


# -- both front-ends against the independent simulation ---------------------------------------------


def _rule_replicas(world_size: int, n: int):
    models = [tiny_model(dtype=torch.float64) for _ in range(world_size)]
    return models, [RuleAdamW(m.parameters(), n=n, lr=0.01) for m in models]


def _adamw(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.0)


def _trained(
    front_end: str,
    second_moment: str,
    topology: str,
    steps: int,
    blocking: bool = False,
    optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer] = _adamw,
) -> torch.Tensor:
    """Rank's parameters after ``steps`` steps of ``optimizer`` under gossip, in ``front_end``."""
    model = tiny_model(dtype=torch.float64)
    schedule = {"sync_every": 1, "sync_delay": 0} if blocking else {}
    if front_end == "module":
        net = DecentralizedDataParallel(
            model,
            lambda named: optimizer([p for _, p in named]),
            topology=topology,
            second_moment=second_moment,
            **schedule,
        )
        loss_fn = torch.nn.CrossEntropyLoss()
        from helpers import batch

        for step in range(steps):
            x, y = batch(dist.get_rank(), step, torch.float64)
            loss_fn(net(x), y).backward()
        return flat(model)
    opt = DecentOptimWrapper(
        optimizer(list(model.parameters())),
        topology=topology,
        second_moment=second_moment,
        **schedule,
    )
    train_steps(model, opt, dist.get_rank(), range(steps))
    return flat(model)


@pytest.mark.parametrize("front_end", ["optimizer", "module"])
@pytest.mark.parametrize(("world_size", "topology"), [(4, "ring"), (4, "one-peer-exp"), (3, "complete")])
def test_gossip_with_the_rule_equals_the_independent_simulation(pool, front_end, world_size, topology):
    got = pool(world_size).run(_trained, front_end, "average", topology, 8)
    expected = Gossip(topology, *_rule_replicas(world_size, world_size)).run(8)
    # fp64: the rule's operation order (a few ulp per step) and the simulation's own mixing order
    for rank in range(world_size):
        torch.testing.assert_close(got[rank], expected[rank], rtol=0, atol=1e-11)


@pytest.mark.parametrize("front_end", ["optimizer", "module"])
@pytest.mark.parametrize("topology", ["ring", "one-peer-exp"])
def test_blocking_gossip_with_the_rule_equals_the_independent_simulation(pool, front_end, topology):
    # sync_every=1, sync_delay=0: each round mixed in before the next forward (docs/adam.md).
    got = pool(4).run(_trained, front_end, "average", topology, 8, True)
    expected = BlockingGossip(topology, *_rule_replicas(4, 4)).run(8)
    overlapped = Gossip(topology, *_rule_replicas(4, 4)).run(8)
    # fp64: as above, plus the low-communication fold x + (mix - x) rounding once more than the mix
    for rank in range(4):
        torch.testing.assert_close(got[rank], expected[rank], rtol=0, atol=1e-11)
        assert not torch.allclose(got[rank], overlapped[rank], rtol=0, atol=1e-6)


def test_local_is_the_plain_optimizer_under_gossip(pool):
    got = pool(4).run(_trained, "optimizer", "local", "ring", 8)
    expected = Gossip("ring", *_rule_replicas(4, 1)).run(8)  # n = 1: plain AdamW
    for rank in range(4):
        torch.testing.assert_close(got[rank], expected[rank], rtol=0, atol=1e-11)
    corrected = pool(4).run(_trained, "optimizer", "average", "ring", 8)
    assert not math.isclose(float((corrected[0] - got[0]).abs().max()), 0.0, abs_tol=1e-9)


def _scaler_skip_and_new_group() -> dict[str, bool]:
    rank = dist.get_rank()
    model = tiny_model()
    opt = DecentOptimWrapper(torch.optim.AdamW(model.parameters(), lr=0.01), topology="ring")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    loss_fn = torch.nn.CrossEntropyLoss()
    from helpers import batch

    def step(index: int, poison: bool) -> None:
        x, y = batch(rank, index)
        opt.zero_grad()
        scaler.scale(loss_fn(model(x), y)).backward()
        if poison:
            next(model.parameters()).grad[0, 0] = float("inf")
        scaler.step(opt)
        scaler.update()

    for index in range(3):
        step(index, poison=False)
    before = {k: v.clone() for k, v in opt.state[next(model.parameters())].items() if torch.is_tensor(v)}
    step(3, poison=rank == 0)  # rank 0 skips its update; both ranks still gossip
    after = opt.state[next(model.parameters())]
    unchanged = all(torch.equal(after[k], v) for k, v in before.items())
    extra = torch.nn.Linear(3, 3)
    opt.add_param_group({"params": list(extra.parameters())})
    for index in range(4, 6):
        x, y = batch(rank, index)
        opt.zero_grad()
        (loss_fn(model(x), y) + extra(model(x)).square().mean()).backward()
        opt.step()
    saved = opt.state_dict()["state"]
    return {
        "unchanged": unchanged,
        "signal in every state": all(SIGNAL in saved[i] for i in saved),
        "new group started": all(SIGNAL in opt.state[p] for p in extra.parameters()),
    }


def test_a_skipped_scaler_step_and_a_new_param_group_under_gossip(pool):
    results = pool(2).run(_scaler_skip_and_new_group)
    assert results[0]["unchanged"] and not results[1]["unchanged"]  # only the skipping rank kept its state
    for result in results:
        assert result["signal in every state"] and result["new group started"]

"""AccumAdam(W) with Adam's second moment of the average gradient (``second_moment_ranks``).

AccumAdam's moments move once per round of ``accum_iter`` steps, so the engine cannot correct them
from outside the step as it does torch's Adam; the optimizer takes the rule itself, counted in
rounds, and the engine sets ``n`` before every step. ``RuleAccumAdamW`` below writes the update from
its docstring's formula, without the library; at n = 1 it is AccumAdamW, at accum_iter = 1 the
engine's rule on torch's AdamW (both checked), and under gossip the simulation of
``tests/simulation.py`` with it is what both front-ends must give.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from helpers import tiny_model
from simulation import Gossip
from test_second_moment import _gradients, _run
from test_second_moment import _trained as trained_under_gossip

from decent_optim_wrapper import AccumAdam, AccumAdamW
from decent_optim_wrapper.engine.rules.second_moment import SecondMomentRule


class RuleAccumAdamW(torch.optim.Optimizer):
    """AccumAdamW (or AccumAdam with ``l2``) whose step divides by the rule's estimate for n replicas."""

    def __init__(
        self,
        params,
        n: int,
        accum_iter: int,
        lr=0.01,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=0.0,
        l2=False,
    ):
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults)
        self.n, self.accum_iter, self.l2 = n, accum_iter, l2

    @torch.no_grad()
    def step(self, closure=None):
        big_a, n = self.accum_iter, self.n
        for group in self.param_groups:
            b1, b2 = group["betas"]
            lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st.update(
                        t=0, m=torch.zeros_like(p), s=torch.zeros_like(p), a=torch.zeros_like(p), c=None
                    )
                t = st["t"] = st["t"] + 1
                k, done = math.ceil(t / big_a), (t - 1) // big_a
                g = p.grad + wd * p if self.l2 else p.grad.clone()
                if not self.l2:
                    p.mul_(1 - lr * wd)
                st["a"] = st["a"] + g / big_a
                m_now = st["m"] + (1 - b1) * (g - st["m"])
                s_now = b2 * st["s"] + (1 - b2) * g * g
                if done >= 1:
                    if st["c"] is None:  # switched on mid-run: the signal starts as this rank's v
                        st["c"] = st["s"].clone()
                    m_hat = st["m"] / (1 - b1**done)
                    c_now = b2 * st["c"] + (1 - b2) * g * m_hat
                    v = s_now / n + (1 - 1 / n) * c_now.abs()
                else:
                    v = s_now
                p.sub_(lr / (1 - b1**k) * m_now / (v.sqrt() / math.sqrt(1 - b2**k) + eps))
                if t % big_a == 0:
                    a = st["a"]
                    if done >= 1:
                        st["c"] = b2 * st["c"] + (1 - b2) * a * m_hat
                    st["m"] = st["m"] + (1 - b1) * (a - st["m"])
                    st["s"] = b2 * st["s"] + (1 - b2) * a * a
                    if done == 0:
                        st["c"] = st["s"].clone()
                    st["a"] = torch.zeros_like(p)
                if n == 1:  # the rule is off: no signal is kept (the library's n = 1 is plain AccumAdam)
                    st["c"] = None


def _steps(opt: torch.optim.Optimizer, p: torch.Tensor, grads: list[torch.Tensor]) -> torch.Tensor:
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return p.detach().clone()


def _param(grads: list[torch.Tensor]) -> torch.nn.Parameter:
    first = grads[0]
    return torch.nn.Parameter(torch.linspace(-1, 1, first.numel(), dtype=first.dtype).view(first.shape))


@pytest.mark.pure
@pytest.mark.parametrize("cls", [AccumAdamW, AccumAdam])
def test_reference_at_one_rank_is_accum_adam(cls):
    grads = _gradients(30)
    p, q = _param(grads), _param(grads)
    ours = _steps(RuleAccumAdamW([p], n=1, accum_iter=3, weight_decay=0.1, l2=cls is AccumAdam), p, grads)
    library = _steps(cls([q], lr=0.01, weight_decay=0.1, accum_iter=3), q, grads)
    # fp64; the reference divides where the library multiplies by reciprocals
    torch.testing.assert_close(ours, library, rtol=0, atol=1e-14)


@pytest.mark.pure
@pytest.mark.parametrize("n", [2, 4, 16])
@pytest.mark.parametrize("accum_iter", [1, 3])
@pytest.mark.parametrize("cls", [AccumAdamW, AccumAdam])
@pytest.mark.parametrize("foreach", [False, True])
def test_the_rule_in_accum_adam_equals_the_reference(n, accum_iter, cls, foreach):
    grads = _gradients(40)
    p, q = _param(grads), _param(grads)
    opt = cls([p], lr=0.01, weight_decay=0.1, accum_iter=accum_iter, foreach=foreach, second_moment_ranks=n)
    got = _steps(opt, p, grads)
    ref = RuleAccumAdamW([q], n=n, accum_iter=accum_iter, weight_decay=0.1, l2=cls is AccumAdam)
    expected = _steps(ref, q, grads)
    # fp64, 40 steps of lr 0.01: only the order of the elementwise operations differs
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    plain = _steps(cls([(r := _param(grads))], lr=0.01, weight_decay=0.1, accum_iter=accum_iter), r, grads)
    assert (got - plain).abs().max() > 1e-3  # the rule changes the trajectory
    assert set(opt.state[p]) == {"step", "exp_avg", "exp_avg_sq", "accum_grad", "exp_avg_signal"}


@pytest.mark.pure
@pytest.mark.parametrize("n", [2, 4])
def test_accum_iter_one_is_the_engines_rule_on_torch_adamw(n):
    # The two implementations of the rule agree: AccumAdamW inside its step, the engine around
    # torch's AdamW (exp_avg_sq set before the step, restored after).
    grads = _gradients(40)
    p = _param(grads)
    accum = _steps(AccumAdamW([p], lr=0.01, weight_decay=0.1, accum_iter=1, second_moment_ranks=n), p, grads)
    torch_rule, _ = _run(torch.optim.AdamW, n, grads, rule=True, lr=0.01, weight_decay=0.1)
    # fp64: the two implementations order their operations differently (a few ulp per step)
    torch.testing.assert_close(accum, torch_rule, rtol=0, atol=1e-12)


@pytest.mark.pure
def test_the_engine_sets_the_count_before_every_step():
    model = tiny_model()
    opt = AccumAdamW(model.parameters(), accum_iter=2)
    rule = SecondMomentRule("average")
    assert rule.applies(opt, 1) and rule.applies(opt, 4)  # always: the count must be set
    rule.step(opt, 4)
    assert [g["second_moment_ranks"] for g in opt.param_groups] == [4]
    rule.step(opt, 1)  # a world shrunk to one rank: the bare optimizer again
    assert opt.param_groups[0]["second_moment_ranks"] == 1
    rule.step(opt, 4)
    SecondMomentRule("local").step(opt, 4)  # the seeds' behaviour
    assert opt.param_groups[0]["second_moment_ranks"] == 1


@pytest.mark.pure
def test_a_state_without_the_signal_starts_it_from_v():
    # A run switched to the rule mid-way (a checkpoint of the local rule, a world grown from one rank)
    grads = _gradients(24)
    p, q = _param(grads), _param(grads)
    opt = AccumAdamW([p], lr=0.01, accum_iter=2)
    ref = RuleAccumAdamW([q], n=1, accum_iter=2)
    _steps(opt, p, grads[:9])  # mid-round: the accumulated gradient carries over
    _steps(ref, q, grads[:9])
    assert "exp_avg_signal" not in opt.state[p]
    opt.param_groups[0]["second_moment_ranks"] = ref.n = 4
    got, expected = _steps(opt, p, grads[9:]), _steps(ref, q, grads[9:])
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


@pytest.mark.pure
def test_resume_with_the_signal_is_bitwise():
    grads = _gradients(20)
    p = _param(grads)
    opt = AccumAdamW([p], lr=0.01, accum_iter=3, second_moment_ranks=4)
    _steps(opt, p, grads[:7])
    saved_param, saved_state = p.detach().clone(), copy.deepcopy(opt.state_dict())
    assert "exp_avg_signal" in saved_state["state"][0]
    uninterrupted = _steps(opt, p, grads[7:])
    q = torch.nn.Parameter(saved_param)
    resumed_opt = AccumAdamW([q], lr=0.01, accum_iter=3)
    resumed_opt.load_state_dict(saved_state)
    assert resumed_opt.param_groups[0]["second_moment_ranks"] == 4
    assert torch.equal(_steps(resumed_opt, q, grads[7:]), uninterrupted)


@pytest.mark.pure
@pytest.mark.parametrize(
    ("value", "error"), [(0, ValueError), (2.0, TypeError), (True, TypeError), (None, TypeError)]
)
def test_bad_second_moment_ranks_names_the_argument(value, error):
    with pytest.raises(error, match=r"second_moment_ranks must be"):
        AccumAdamW(tiny_model().parameters(), second_moment_ranks=value)


# -- both front-ends against the independent simulation ---------------------------------------------


def _accum_adamw(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    return AccumAdamW(params, lr=0.01, weight_decay=0.1, accum_iter=2)


def _trained(front_end: str, second_moment: str, steps: int) -> torch.Tensor:
    return trained_under_gossip(front_end, second_moment, "ring", steps, optimizer=_accum_adamw)


def _replicas(n: int):
    models = [tiny_model(dtype=torch.float64) for _ in range(4)]
    return models, [RuleAccumAdamW(m.parameters(), n=n, accum_iter=2, weight_decay=0.1) for m in models]


@pytest.mark.parametrize("front_end", ["optimizer", "module"])
def test_gossip_with_accum_adamw_follows_the_rule(pool, front_end):
    got = pool(4).run(_trained, front_end, "average", 8)
    expected = Gossip("ring", *_replicas(4)).run(8)
    local = Gossip("ring", *_replicas(1)).run(8)
    # fp64: the library's operation order and the simulation's own mixing order
    for rank in range(4):
        torch.testing.assert_close(got[rank], expected[rank], rtol=0, atol=1e-11)
        assert not torch.allclose(got[rank], local[rank], rtol=0, atol=1e-6)


def test_local_keeps_accum_adamw_as_it_was(pool):
    got = pool(4).run(_trained, "optimizer", "local", 8)
    expected = Gossip("ring", *_replicas(1)).run(8)
    for rank in range(4):
        torch.testing.assert_close(got[rank], expected[rank], rtol=0, atol=1e-11)


@pytest.mark.pure
def test_complex_parameters_are_pairs_of_reals():
    grads = _gradients(20, shape=(4, 3, 2))
    real = _param(grads)
    complex_ = torch.nn.Parameter(torch.view_as_complex(real.detach().clone()))
    on_real = AccumAdamW([real], lr=0.01, accum_iter=2, second_moment_ranks=4)
    on_complex = AccumAdamW([complex_], lr=0.01, accum_iter=2, second_moment_ranks=4)
    for g in grads:
        real.grad, complex_.grad = g.clone(), torch.view_as_complex(g.clone())
        on_real.step()
        on_complex.step()
    # the same elementwise ops on the same numbers: bitwise
    assert torch.equal(torch.view_as_real(complex_.detach()), real.detach())
    assert on_complex.state[complex_]["exp_avg_signal"].is_complex()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("accum_iter", [1, 3])
def test_the_rule_on_cuda_tensors_equals_the_reference(accum_iter):
    grads = [g.cuda() for g in _gradients(40)]
    p = torch.nn.Parameter(_param([g.cpu() for g in grads]).detach().cuda())
    opt = AccumAdamW([p], lr=0.01, weight_decay=0.1, accum_iter=accum_iter, second_moment_ranks=4)
    got = _steps(opt, p, grads)
    q = _param([g.cpu() for g in grads])
    ref = RuleAccumAdamW([q], n=4, accum_iter=accum_iter, weight_decay=0.1)
    expected = _steps(ref, q, [g.cpu() for g in grads])
    assert got.is_cuda and opt.state[p]["exp_avg_signal"].is_cuda
    # fp64, as the CPU test; the GPU's kernels round in their own order (1e-16 relative per op)
    torch.testing.assert_close(got.cpu(), expected, rtol=0, atol=1e-12)

"""A bare twin of an Adam optimizer: what torch's own step computes from the same point.

Shared by ``test_adam_step.py`` and the pool's workers (a module of its own, so that a worker that
runs :func:`database_under_the_wrapper` imports no test module and none of torch's test internals).
"""

from __future__ import annotations

import torch

from decent_optim_wrapper import DecentOptimWrapper
from decent_optim_wrapper.engine.rules.second_moment import SIGNAL


def bare_twin(opt: torch.optim.Optimizer) -> tuple[torch.optim.Optimizer, dict[torch.Tensor, torch.Tensor]]:
    """A torch optimizer of ``opt``'s class with copies of its groups, parameters, gradients and
    state (the rule's signal left out): what the bare optimizer would step from the same point."""
    twins: dict[torch.Tensor, torch.Tensor] = {}
    groups = []
    for group in opt.param_groups:
        copies = []
        for p in group["params"]:
            copy = p.detach().clone()
            if p.grad is not None:
                copy.grad = p.grad.detach().clone()
            twins[p] = copy
            copies.append(copy)
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": copies})
    twin = type(opt)(groups)
    for p, copy in twins.items():
        if p in opt.state:
            twin.state[copy] = {k: v.detach().clone() for k, v in opt.state[p].items() if k != SIGNAL}
    return twin, twins


def assert_state_is_torchs(opt, twin, twins) -> None:
    for p, copy in twins.items():
        ours, theirs = opt.state[p], twin.state[copy]
        for key in ("step", "exp_avg", "exp_avg_sq"):
            # bit for bit; a NaN where torch's own holds one (fp16 divides by an eps that rounds to 0)
            torch.testing.assert_close(ours[key], theirs[key], rtol=0, atol=0, equal_nan=True, msg=key)


def database_under_the_wrapper(configs: list[tuple[type, str, dict]]) -> list[dict]:
    """Each configuration for 5 steps on a fixed batch (the same on both ranks), wrapped with the
    default rule on "complete", beside the bare optimizer; a bare twin checks the state every step."""
    results = []
    for cls, desc, options in configs:
        runs = {}
        for wrapped in (False, True):
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
            inner = cls(model.parameters(), **options)
            opt = DecentOptimWrapper(inner, topology="complete") if wrapped else inner
            mismatches: list[str] = []
            pending: list = []
            inner.register_step_pre_hook(lambda o, a, k, p=pending: p.append(bare_twin(o)))

            def check(o, a, k, p=pending, bad=mismatches):
                twin, twins = p.pop()
                twin.step()
                try:
                    assert_state_is_torchs(o, twin, twins)
                except AssertionError as error:
                    bad.append(str(error))

            inner.register_step_post_hook(check)
            g = torch.Generator().manual_seed(7)
            x, y = torch.randn(8, 4, generator=g), torch.randn(8, 3, generator=g)
            for _ in range(5):
                opt.zero_grad()
                mse = torch.nn.functional.mse_loss(model(x), y)
                (-mse if options.get("maximize") else mse).backward()
                opt.step()
            finite = all(bool(p.isfinite().all()) for p in model.parameters())
            runs[wrapped] = (finite, mismatches)
        results.append(
            {
                "desc": f"{cls.__name__} {desc}",
                "bare finite": runs[False][0],
                "finite": runs[True][0],
                "mismatches": runs[True][1],
            }
        )
    return results

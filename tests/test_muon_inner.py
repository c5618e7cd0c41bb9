"""Multi-process: Muon as the inner optimizer of low-communication gossip, the documented way.

``torch.optim.Muon`` steps 2-D parameters only, so the matrices go to a wrapped Muon and the rest
(biases, norms, embeddings a user keeps out) to a wrapped AdamW, both with the same ``sync_every``
and outer optimizer (docs/low-communication.md). The low-communication rule is per parameter, so two
wrappers over a partition of the parameters are the rule over all of them: checked against the
gossip rule written from its formula (tests/test_local_steps.py's simulation) with Muon and AdamW
as each replica's inner steps.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from helpers import batch, flat, tiny_model
from test_local_steps import OUTER, _GossipOuter, _reordering_tolerance
from torch import nn

from decent_optim_wrapper import DecentOptimWrapper

pytestmark = pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon: torch >= 2.9")

MUON_LR, ADAMW_LR = 0.02, 0.01


def inner_pair(model: nn.Module) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
    """Muon over the model's matrices, AdamW over the rest: the split the docs recommend."""
    matrices = [p for p in model.parameters() if p.ndim == 2]
    rest = [p for p in model.parameters() if p.ndim != 2]
    return torch.optim.Muon(matrices, lr=MUON_LR), torch.optim.AdamW(rest, lr=ADAMW_LR)


class Pair:
    """Two optimizers stepped as one (the simulation's replica steps both, as a training loop does)."""

    def __init__(self, optimizers: tuple[torch.optim.Optimizer, ...]) -> None:
        self.optimizers = optimizers

    def zero_grad(self) -> None:
        for opt in self.optimizers:
            opt.zero_grad()

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()


class _MuonGossip(_GossipOuter):
    """The gossip rule of ``_GossipOuter`` with Muon + AdamW as every replica's inner steps."""

    def __init__(self, topology: str, world_size: int, outer: str, sync_every: int, delay: int) -> None:
        super().__init__(topology, world_size, outer, sync_every, delay)
        self.optimizers = [Pair(inner_pair(m)) for m in self.models]  # type: ignore[misc]


def _run(topology: str, steps: int, outer: str, sync_every: int, delay: int) -> torch.Tensor:
    model = tiny_model(dtype=torch.float64)
    options = dict(topology=topology, sync_every=sync_every, outer_optimizer=OUTER[outer], sync_delay=delay)
    inner_muon, inner_adamw = inner_pair(model)
    # second_moment="local": torch's AdamW step, as in the simulation (the default averages Adam's
    # statistics over the group, a rule of its own: docs/adam.md)
    muon = DecentOptimWrapper(inner_muon, **options)
    adamw = DecentOptimWrapper(inner_adamw, second_moment="local", **options)
    for step in range(steps):
        x, y = batch(dist.get_rank(), step, torch.float64)
        muon.zero_grad()
        adamw.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        muon.step()
        adamw.step()
    muon.engine.wait_all()
    adamw.engine.wait_all()
    return flat(model)


# Muon orthogonalizes its momentum in bfloat16 (torch's Newton-Schulz casts it). The engine mixes
# with other roundings than the simulation (a few n u max|x| a round, u = 2^-53: test_local_steps'
# reordering tolerance), and such a difference changes a bf16 input only where it lands within
# 2^-53 relative of a bf16 rounding boundary: about one chance in 10^13 per element, and the inputs are
# fixed, so the comparison is deterministic. A flip would show as a difference near 1e-4, far above
# the tolerance: the test would fail, not pass by luck.
@pytest.mark.parametrize(
    ("topology", "world_size", "delay"),
    [("ring", 2, 0), ("ring", 2, 4), ("ring", 4, 1), ("one-peer-exp", 4, 4)],
)
def test_muon_for_the_matrices_and_adamw_for_the_rest_follow_the_gossip_rule(
    pool, topology, world_size, delay
):
    sync_every, rounds = 4, 4
    steps = sync_every * rounds + 2  # ends inside a round, with a round in flight when delay > 2
    reference = _MuonGossip(topology, world_size, "nesterov", sync_every, delay).run(steps)
    results = pool(world_size).run(_run, topology, steps, "nesterov", sync_every, delay)
    atol = _reordering_tolerance(world_size, rounds, reference)
    for rank in range(world_size):
        torch.testing.assert_close(results[rank], reference[rank], rtol=0, atol=atol)
    # and not by accident: plain SGD as the inner optimizer ends elsewhere
    sgd = _GossipOuter(topology, world_size, "nesterov", sync_every, delay).run(steps)
    assert (sgd[0] - reference[0]).abs().max() > 1e6 * atol

"""Clipped gossip's audit (``ClippedGossip(audit_every=...)``): the ranks compare the values each of them
sent, and a rank whose values stood far from everyone's is quarantined.

The verdict is checked against the rule written out here in float64 loops (medians by sorting), on
honest ranks and on the sign-flipping attackers; then on gloo ranks: without survival every rank leaves
the quarantined rank out of its mix; with ``on_peer_failure="continue"`` it leaves the job
(``QuarantinedError``) and the others go on over a ring of the rest.
"""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Any

import pytest
import torch
from failures import join, run_with_faults
from helpers import batch, tiny_model
from torch import nn

from decent_optim_wrapper import ClippedGossip, DecentOptimWrapper, QuarantinedError
from decent_optim_wrapper.engine.exchange.audit import (
    COORDINATES,
    OUTLIER_SPREADS,
    outliers,
    sampled_coordinates,
)


def _reference_outliers(samples: list[list[list[float] | None]], spreads: float, share: float) -> list[int]:
    """The audit's rule in plain float64 loops: ``samples[rank][t]`` a sample or None (not recorded)."""
    ranks = len(samples)
    beyond, counted = [0] * ranks, [0] * ranks
    for t in range(len(samples[0])):
        present = [r for r in range(ranks) if samples[r][t] is not None]
        if len(present) < 3:
            continue
        rows = [samples[r][t] for r in present]
        assert all(row is not None for row in rows)
        median = []
        for k in range(len(rows[0])):  # the lower median, as torch.median takes it
            column = sorted(row[k] for row in rows)  # type: ignore[index]
            median.append(column[(len(column) - 1) // 2])
        distances = [math.sqrt(sum((a - m) ** 2 for a, m in zip(row, median, strict=True))) for row in rows]  # type: ignore[arg-type]
        spread = sorted(distances)[(len(distances) - 1) // 2]
        for r, d in zip(present, distances, strict=True):
            counted[r] += 1
            beyond[r] += d > spreads * spread if spread > 0 else d > 0
    return [r for r in range(ranks) if counted[r] and beyond[r] / counted[r] >= share]


def _fleet(
    attack: str | None, ranks: int = 8, steps: int = 16, seed: int = 0
) -> list[list[list[float] | None]]:
    """Honest ranks: a common model drifting over the steps plus small noise of their own; rank 3 sends
    the negation (``negated``), the negation every other step (``alternating``), or 100 times it."""
    g = torch.Generator().manual_seed(seed)
    centre = torch.randn(COORDINATES, generator=g, dtype=torch.float64)
    fleet: list[list[list[float] | None]] = [[] for _ in range(ranks)]
    for t in range(steps):
        centre = centre + 0.01 * torch.randn(COORDINATES, generator=g, dtype=torch.float64)
        for r in range(ranks):
            value = centre + 0.02 * torch.randn(COORDINATES, generator=g, dtype=torch.float64)
            if (r == 3 and attack == "negated") or (attack == "alternating" and r == 3 and t % 2 == 1):
                value = -value
            elif r == 3 and attack == "scaled":
                value = 100 * value
            fleet[r].append(value.tolist())
    return fleet


def _as_tensor(fleet: list[list[list[float] | None]]) -> torch.Tensor:
    rows = [[s if s is not None else [math.nan] * COORDINATES for s in rank] for rank in fleet]
    return torch.tensor(rows, dtype=torch.float64)


@pytest.mark.pure
@pytest.mark.parametrize("attack", [None, "negated", "alternating", "scaled"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_verdict_follows_the_rule_written_out(attack, seed):
    fleet = _fleet(attack, seed=seed)
    want = _reference_outliers(fleet, OUTLIER_SPREADS, 0.25)
    got, shares = outliers(_as_tensor(fleet))
    assert got == want == ([] if attack is None else [3]), (got, want, shares)
    if attack == "alternating":
        assert shares[3] == pytest.approx(0.5)  # beyond the cut-off in its odd steps only


@pytest.mark.pure
def test_samples_fewer_than_three_ranks_recorded_and_equal_replicas_judge_nobody_by_accident():
    fleet = _fleet("negated", ranks=4, steps=4)
    for r in (0, 1):  # only ranks 2 and 3 recorded step 0: a median of two tells nothing
        fleet[r][0] = None
    got, _shares = outliers(_as_tensor(fleet))
    assert got == _reference_outliers(fleet, OUTLIER_SPREADS, 0.25) == [3]
    # Replicas that agree exactly (the spread is 0): only a rank that differs at all is beyond it, here
    # in one of its three samples (a third: at least a quarter).
    same: list[list[list[float] | None]] = [[[1.0] * COORDINATES for _ in range(3)] for _ in range(4)]
    assert outliers(_as_tensor(same))[0] == []
    same[2][2] = [-1.0] * COORDINATES
    assert outliers(_as_tensor(same))[0] == _reference_outliers(same, OUTLIER_SPREADS, 0.25) == [2]


@pytest.mark.pure
def test_every_rank_samples_the_same_coordinates_of_a_bucket():
    first, again = sampled_coordinates(7, 1000), sampled_coordinates(7, 1000)  # two ranks, one bucket
    assert torch.equal(first, again) and len(set(first.tolist())) == COORDINATES
    assert not torch.equal(first, sampled_coordinates(8, 1000))  # another bucket, other coordinates
    assert sorted(sampled_coordinates(7, 5).tolist()) == [0, 1, 2, 3, 4]  # a small bucket: all of it


@pytest.mark.pure
@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "32"])
def test_audit_every_is_checked_with_the_fix(bad):
    with pytest.raises(ValueError, match=r"audit_every=\.\.\.\) must be None or an int >= 1.*e\.g\. 32"):
        ClippedGossip(audit_every=bad)


# -- on gloo ranks -------------------------------------------------------------------------------------
ATTACKER = 3
EVERY = 4
STEPS = 14


def _negate_after_each_step(optimizer: torch.optim.Optimizer) -> None:
    @torch.no_grad()
    def hook(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for group in opt.param_groups:
            for p in group["params"]:
                p.neg_()

    optimizer.register_step_post_hook(hook)


def _train(rank: int, attack: bool, **options: Any) -> dict[str, Any]:
    """4 ranks on a ring with clipped gossip auditing every 4 steps; rank 3 sends its negated model."""
    model = tiny_model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    if attack and rank == ATTACKER:
        _negate_after_each_step(inner)
    clipping = ClippedGossip(audit_every=EVERY)
    opt = DecentOptimWrapper(inner, topology="ring", clipped_gossip=clipping, **options)
    events: list[tuple[str, int, tuple[int, ...]]] = []
    opt.register_guard_hook(lambda e: events.append((e.kind, e.step, e.senders)))
    steps = 0
    try:
        for step in range(STEPS):
            x, y = batch(rank, step)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            steps += 1
    except QuarantinedError as err:
        return {"quarantined": str(err), "steps": steps, "events": events}
    return {"events": events, "world_size": opt.world_size, "counts": opt.guard_counts, "steps": steps}


def _without_survival(attack: bool) -> dict[str, Any]:
    import torch.distributed as dist

    return _train(dist.get_rank(), attack)


@pytest.mark.parametrize("attack", [False, True])
def test_without_survival_every_rank_leaves_the_quarantined_rank_out_of_its_mix(pool, attack):
    results = pool(4).run(_without_survival, attack)
    for rank, result in enumerate(results):
        assert result["steps"] == STEPS and result["world_size"] == 4
        quarantined = [(step, senders) for kind, step, senders in result["events"] if kind == "quarantined"]
        dropped = [(step, senders) for kind, step, senders in result["events"] if kind == "dropped"]
        if not attack:  # a clean run: nobody quarantined, no honest difference dropped
            assert quarantined == [] and dropped == [], result["events"]
            continue
        # The first audit (after step 4) names the attacker on every rank alike, counted once.
        assert quarantined == [(EVERY, (ATTACKER,))], result["events"]
        assert result["counts"]["quarantined"] == 1
        if rank != ATTACKER:  # from then on its values are left out before they are judged
            assert all(step < EVERY for step, _ in dropped), dropped


def _with_survival(rank: int, world_size: int, port: int) -> dict[str, Any]:
    store = join(rank, world_size, port)
    return _train(rank, True, on_peer_failure="continue", store=store, timeout=timedelta(seconds=5))


@pytest.mark.fleet
@pytest.mark.timeout(120)
def test_with_survival_the_quarantined_rank_leaves_and_the_others_go_on_without_it():
    outcome = run_with_faults(_with_survival, 4, deadline_s=90)
    assert not outcome.errors, outcome.errors
    attacker = outcome.results[ATTACKER]
    # It stops at the audit after step 4, told why and what to do.
    assert attacker["steps"] == EVERY - 1, attacker  # its 4th step() raised
    assert "quarantined and has left the job" in attacker["quarantined"]
    assert "restart it from a checkpoint" in attacker["quarantined"]
    for rank in (0, 1, 2):
        result = outcome.results[rank]
        assert result["steps"] == STEPS and result["world_size"] == 3, result
        assert result["counts"]["quarantined"] == 1

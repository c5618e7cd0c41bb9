"""Multi-process: global_avg gives the exact average; revert_global_avg restores bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from helpers import batch, flat, gather, tiny_model, train_steps
from torch import nn

from decent_optim_wrapper import DecentOptimWrapper


def _make():
    model = tiny_model()
    opt = DecentOptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), topology="ring")
    return model, opt


def _average_then_revert_then_continue() -> dict[str, object]:
    rank = dist.get_rank()
    # reference: 6 steps without any global average
    ref_model, ref_opt = _make()
    train_steps(ref_model, ref_opt, rank, range(6))
    reference = flat(ref_model)

    model, opt = _make()
    train_steps(model, opt, rank, range(3))  # gossip of step 2 is in flight now
    before = flat(model)
    replicas = gather(before).double()
    opt.global_avg()
    averaged = gather(flat(model))
    opt.global_avg()  # a second call keeps the first snapshot
    opt.revert_global_avg()
    reverted = flat(model)
    train_steps(model, opt, rank, range(3, 6))
    return {
        "replicas": replicas,
        "averaged": averaged,
        "before": before,
        "reverted": reverted,
        "continued": flat(model),
        "reference": reference,
    }


def test_global_avg_is_exact_and_revert_is_bitwise(pool):
    results = pool(4).run(_average_then_revert_then_continue)
    for rank, r in enumerate(results):
        averaged = r["averaged"]
        # every replica holds the very same bits
        for other in averaged[1:]:
            assert torch.equal(other, averaged[0])
        # the average of fp32 replicas: sum in fp32 then one division; within 4 roundings of the
        # float64 mean (relative to the largest replica value)
        exact = r["replicas"].mean(0)
        atol = 4 * 4 * torch.finfo(torch.float32).eps * r["replicas"].abs().max().item()
        torch.testing.assert_close(averaged[0].double(), exact, rtol=0, atol=atol)
        assert torch.equal(r["reverted"], r["before"]), f"rank {rank}: revert is not bitwise"
        assert torch.equal(r["continued"], r["reference"]), f"rank {rank}: training after revert diverged"


def _revert_errors() -> list[str]:
    model, opt = _make()
    train_steps(model, opt, dist.get_rank(), range(2))
    messages = []
    for prepare in (lambda: None, lambda: opt.global_avg(may_revert=False)):
        prepare()
        try:
            opt.revert_global_avg()
        except RuntimeError as err:
            messages.append(str(err))
    return messages


def test_revert_without_snapshot_is_an_error(pool):
    for messages in pool(2).run(_revert_errors):
        assert len(messages) == 2  # never averaged; averaged with may_revert=False
        for message in messages:
            assert "nothing to revert" in message and "global_avg(may_revert=True)" in message


def _untouched_after_failed_revert() -> bool:
    model, opt = _make()
    train_steps(model, opt, dist.get_rank(), range(2))
    before = flat(model)
    with pytest.raises(RuntimeError):
        opt.revert_global_avg()
    return torch.equal(flat(model), before)


def test_failed_revert_leaves_parameters_untouched(pool):
    assert all(pool(2).run(_untouched_after_failed_revert))


def _step_after_unreverted_average() -> tuple[torch.Tensor, torch.Tensor]:
    rank = dist.get_rank()
    model = tiny_model()
    opt = DecentOptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1), topology="ring")
    train_steps(model, opt, rank, range(3))
    opt.global_avg()
    averaged = flat(model)
    # one more step: no stale gossip is mixed in, so the result is the average minus lr * grad
    train_steps(model, opt, rank, range(3, 4))
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    return flat(model), averaged - 0.1 * grads


def test_step_after_unreverted_average_continues_from_the_average(pool):
    for got, expected in pool(4).run(_step_after_unreverted_average):
        # x - lr * g computed fused by SGD and in two roundings here: within 1e-7 for |x| < 1
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-7)


def _consensus_distances() -> tuple[float, torch.Tensor, float]:
    from decent_optim_wrapper import consensus_distance

    model, opt = _make()
    train_steps(model, opt, dist.get_rank(), range(3))
    measured = consensus_distance(opt)
    replicas = gather(flat(model)).double()
    opt.global_avg(may_revert=False)
    return measured, replicas, opt.consensus_distance()


def test_consensus_distance_is_the_rms_distance_to_the_average(pool):
    results = pool(4).run(_consensus_distances)
    replicas = results[0][1]
    expected = (replicas - replicas.mean(0)).square().sum(1).mean().sqrt().item()
    for measured, _, after_average in results:
        assert measured == results[0][0]  # the same value on every rank
        assert measured == pytest.approx(expected, rel=1e-12)  # float64 both ways, different order
        assert after_average == 0.0 and measured > 0


def _consensus_distance_of_every_front_end() -> list[float]:
    from decent_optim_wrapper import DecentralizedDataParallel, consensus_distance

    model = tiny_model()
    ddp = DecentralizedDataParallel(
        model, lambda params: torch.optim.SGD([p for _, p in params], lr=0.1), topology="ring"
    )
    for step in range(3):
        x, y = batch(dist.get_rank(), step)
        nn.functional.cross_entropy(ddp(x), y).backward()
    return [consensus_distance(ddp), ddp.consensus_distance(), consensus_distance(ddp.engine)]


def test_metrics_consensus_distance_accepts_the_module_front_end_and_the_engine(pool):
    for by_metric, by_method, by_engine in pool(4).run(_consensus_distance_of_every_front_end):
        assert by_metric == by_method == by_engine and by_metric > 0

"""Multi-process: the wrapper inside real training loops (AMP, clipping, accumulation, dtypes, buffers)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from helpers import bare_and_wrapped, batch, flat, gather, tiny_model, train_steps
from simulation import Gossip, sgd_replicas
from torch import nn

from decent_optim_wrapper import DecentOptimWrapper


def _amp_with_inf_on_one_rank() -> dict[str, object]:
    rank = dist.get_rank()
    model = tiny_model()
    opt = DecentOptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1), topology="complete")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    scales = []
    for step in range(6):
        x, y = batch(rank, step)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        if step == 3 and rank == 1:
            next(model.parameters()).grad[0, 0] = math.inf  # only rank 1 overflows
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        if step == 2:
            sent = gather(flat(model))  # what the round of step 2 carries, mixed in at step 3
        if step == 3:
            after_inf_step = flat(model)
    return {
        "scales": scales,
        "finite": bool(flat(model).isfinite().all()),
        "steps": opt.step_count,
        "mixed": (sent[0] + sent[1]) / 2,  # a pair's average: x/2 + y/2 is exact
        "after_inf_step": after_inf_step,
    }


def test_grad_scaler_inf_on_one_rank_skips_its_update_but_not_the_gossip(pool):
    results = pool(2).run(_amp_with_inf_on_one_rank, timeout=60)
    for rank, r in enumerate(results):
        assert r["steps"] == 6 and r["finite"]  # every rank took every step: nobody waited forever
        halved = r["scales"][3] == r["scales"][2] / 2
        assert halved == (rank == 1), f"rank {rank}: scales {r['scales']}"
        # step 3 mixed the round of step 2 on both ranks; only rank 0 then took its own step
        took_its_step = not torch.equal(r["after_inf_step"], r["mixed"])
        assert took_its_step == (rank == 0), f"rank {rank}"


MAX_NORM = 0.05  # below every gradient norm of these batches (0.4 to 1): every step is clipped


def _seen_gradients(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The flat gradient the (inner) optimizer steps with, once per step it takes."""
    inner = optimizer.optimizer if isinstance(optimizer, DecentOptimWrapper) else optimizer
    seen: list[torch.Tensor] = []

    def record(opt: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        seen.append(torch.cat([p.grad.reshape(-1) for g in opt.param_groups for p in g["params"]]))

    inner.register_step_pre_hook(record)
    return seen


def _first_accumulated_gradient() -> torch.Tensor:
    """The gradients of micro-batches 0 and 1 (loss / 2 each, at the initial parameters), added."""
    model = tiny_model()
    grads = []
    for step in (0, 1):
        x, y = batch(0, step)
        loss = nn.functional.cross_entropy(model(x), y) / 2
        grads.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, list(model.parameters()))]))
    return grads[0] + grads[1]


def _bare_and_wrapped(loop: str) -> dict[str, object]:
    def run(model, opt):
        seen, norms = _seen_gradients(opt), []
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
        for step in range(6):
            x, y = batch(0, step)
            if loop == "accumulate":
                # step every 2 micro-batches; the loss is scaled so gradients average
                loss = nn.functional.cross_entropy(model(x), y) / 2
                loss.backward()
                if step % 2 == 1:
                    opt.step()
                    opt.zero_grad()
            elif loop == "clip":
                opt.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
                norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), max_norm=MAX_NORM)))
                opt.step()
            else:  # AMP with unscale_ + clipping, the pattern the PyTorch AMP docs give
                opt.zero_grad()
                scaler.scale(nn.functional.cross_entropy(model(x), y)).backward()
                if loop == "amp-clip":
                    scaler.unscale_(opt)
                    norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), max_norm=MAX_NORM)))
                scaler.step(opt)
                scaler.update()
        return flat(model), seen, norms

    (bare, bare_seen, _), (wrapped, seen, norms) = bare_and_wrapped(run, topology="ring")
    return {
        "bare": bare,
        "wrapped": wrapped,
        "bare_seen": bare_seen,
        "seen": seen,
        "norms": norms,
        "first_sum": _first_accumulated_gradient(),
    }


@pytest.mark.parametrize("loop", ["accumulate", "clip", "amp", "amp-clip"])
def test_loop_patterns_match_the_bare_optimizer_at_world_size_one(pool, loop):
    (r,) = pool(1).run(_bare_and_wrapped, loop)
    assert torch.equal(r["bare"], r["wrapped"])
    # the inner optimizer stepped as often as the bare one, with the very same gradients
    assert len(r["seen"]) == len(r["bare_seen"]) == (3 if loop == "accumulate" else 6)
    assert all(torch.equal(a, b) for a, b in zip(r["seen"], r["bare_seen"], strict=True))
    if loop == "accumulate":
        # once per 2 micro-batches, with their summed gradient (autograd adds like `+`: bit for bit)
        assert torch.equal(r["seen"][0], r["first_sum"])
    if loop.endswith("clip"):
        # clipping changed every update: the raw norms exceed max_norm, the optimizer saw max_norm
        # (clip_grad_norm_ scales by max_norm / (norm + 1e-6): 3e-6 relative for norms above 0.4)
        assert min(r["norms"]) > 2 * MAX_NORM
        for grad in r["seen"]:
            assert grad.double().norm().item() == pytest.approx(MAX_NORM, rel=1e-5)


ACCUMULATED_MAX_NORM = 0.25  # below the norms of these summed gradients (0.3 to 1): every step clipped


def _accumulate_and_clip_across_ranks() -> tuple[int, torch.Tensor, list[float]]:
    rank = dist.get_rank()
    model = tiny_model()
    opt = DecentOptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1), topology="ring")
    norms = []
    for step in range(8):
        x, y = batch(rank, step)
        (nn.functional.cross_entropy(model(x), y) / 2).backward()
        if step % 2 == 1:
            norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), max_norm=ACCUMULATED_MAX_NORM)))
            opt.step()
            opt.zero_grad()
    return opt.step_count, flat(model), norms


class _AccumulatedClippedGossip(Gossip):
    """The gossip rule, where step t's gradient is micro-batches 2t and 2t+1's (loss / 2), clipped."""

    def gradients(self, step: int) -> list[torch.Tensor]:
        grads = []
        for rank, (model, opt) in enumerate(zip(self.models, self.optimizers, strict=True)):
            opt.zero_grad()
            for micro in (2 * step, 2 * step + 1):
                x, y = batch(rank, micro)
                (nn.functional.cross_entropy(model(x), y) / 2).backward()
            nn.utils.clip_grad_norm_(model.parameters(), max_norm=ACCUMULATED_MAX_NORM)
            grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
        return grads


def test_accumulation_and_clipping_across_ranks(pool):
    # One update per 2 micro-batches with their summed, clipped gradient, mixed with the ring's pairs:
    # x/2 + y/2 is exact, so the replicas equal the simulation of the rule bit for bit.
    expected = _AccumulatedClippedGossip("ring", *sgd_replicas(4, momentum=0.0)).run(4)
    for rank, (steps, replica, norms) in enumerate(pool(4).run(_accumulate_and_clip_across_ranks)):
        assert steps == 4 and min(norms) > ACCUMULATED_MAX_NORM  # clipping changed every update
        assert torch.equal(replica, expected[rank]), f"rank {rank}"


def _add_param_group() -> dict[str, object]:
    rank = dist.get_rank()
    model = tiny_model()
    opt = DecentOptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1), topology="ring")
    train_steps(model, opt, rank, range(2))  # gossip in flight while the group is added
    torch.manual_seed(100 + rank)  # each rank initialises the new head differently
    head = nn.Linear(3, 2)
    buckets_before = len(opt.buckets)
    opt.add_param_group({"params": head.parameters(), "lr": 0.05})
    synced = gather(torch.cat([p.detach().reshape(-1) for p in head.parameters()]))
    for step in range(2, 6):
        x, y = batch(rank, step)
        opt.zero_grad()
        nn.functional.cross_entropy(head(model(x)[:, :3]), y.clamp(max=1)).backward()
        opt.step()
    trained = gather(torch.cat([p.detach().reshape(-1) for p in head.parameters()]))
    opt.global_avg(may_revert=False)
    averaged = gather(torch.cat([p.detach().reshape(-1) for p in head.parameters()]))
    return {
        "synced": synced,
        "trained": trained,
        "averaged": averaged,
        "new_buckets": len(opt.buckets) - buckets_before,
        "lr": opt.param_groups[-1]["lr"],
    }


def test_add_param_group_syncs_and_gossips_the_new_parameters(pool):
    r = pool(2).run(_add_param_group)[0]
    assert r["new_buckets"] == 1 and r["lr"] == 0.05
    assert torch.equal(r["synced"][0], r["synced"][1])  # rank 0's initialisation everywhere
    assert not torch.equal(r["trained"][0], r["trained"][1])  # trained on different data
    assert torch.equal(r["averaged"][0], r["averaged"][1])  # reached by global averaging


class MixedPrecisionNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.full = nn.Linear(4, 4)
        self.bf16 = nn.Linear(4, 4).to(torch.bfloat16)
        self.fp16 = nn.Linear(4, 4).to(torch.float16)


def _mixed_precision_round() -> dict[str, object]:
    rank = dist.get_rank()
    model = MixedPrecisionNet()
    opt = DecentOptimWrapper(torch.optim.SGD(model.parameters(), lr=0.0), topology="complete")
    g = torch.Generator().manual_seed(rank)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 3)
    before = {n: gather(p.detach().clone()) for n, p in model.named_parameters()}
    opt.step()
    opt.step()
    after = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"dtypes": sorted(str(b.data.dtype) for b in opt.buckets), "before": before, "after": after}


def test_mixed_dtypes_get_separate_buckets_and_average_within_one_rounding(pool):
    results = pool(4).run(_mixed_precision_round)
    assert results[0]["dtypes"] == ["torch.bfloat16", "torch.float16", "torch.float32"]
    for r in results:
        for name, stacked in r["before"].items():
            got = r["after"][name]
            exact = stacked.double().mean(0)
            info = torch.finfo(got.dtype)
            # one rounding of the exact average: half an ulp of it, plus fp32 accumulation error
            ulp = info.eps * torch.exp2(torch.floor(torch.log2(exact.abs().clamp_min(info.tiny))))
            error = (got.double() - exact).abs()
            bound = 0.5 * ulp + 16 * torch.finfo(torch.float32).eps * exact.abs() + info.tiny
            assert bool((error <= bound).all()), f"{name}: max error {error.max()} beyond one rounding"


class WithBuffers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 4), nn.BatchNorm1d(4), nn.Linear(4, 3))
        self.register_buffer("ema_bf16", torch.zeros(4, dtype=torch.bfloat16))

    def forward(self, x):
        h = self.net[1](self.net[0](x))
        with torch.no_grad():
            self.ema_bf16.mul_(0.5).add_(h.mean(0).to(torch.bfloat16))
        return self.net[2](h)


def _buffers_in_global_avg() -> dict[str, object]:
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = WithBuffers()
    opt = DecentOptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1), topology="ring")
    train_steps(model, opt, rank, range(3))
    bn = model.net[1]
    before = [bn.running_mean.clone(), bn.running_var.clone(), model.ema_bf16.clone()]
    tracked = bn.num_batches_tracked.clone()
    replicas = [gather(b).double() for b in before]
    opt.global_avg(buffers=model)
    averaged = [gather(b.clone()) for b in (bn.running_mean, bn.running_var, model.ema_bf16)]
    tracked_after = bn.num_batches_tracked.clone()
    opt.revert_global_avg()
    restored = [bn.running_mean, bn.running_var, model.ema_bf16]
    return {
        "replicas": replicas,
        "averaged": averaged,
        "restored_bitwise": all(torch.equal(a, b) for a, b in zip(restored, before, strict=True)),
        "int_untouched": torch.equal(tracked, tracked_after),
    }


def test_global_avg_averages_floating_buffers_and_revert_restores_them(pool):
    for r in pool(2).run(_buffers_in_global_avg):
        assert r["restored_bitwise"] and r["int_untouched"]
        for replicas, averaged in zip(r["replicas"], r["averaged"], strict=True):
            assert torch.equal(averaged[0], averaged[1])  # identical on every rank
            exact = replicas.mean(0)
            # fp32 sum then one rounding to the buffer's dtype: within one ulp of the exact mean
            eps = torch.finfo(averaged.dtype).eps
            torch.testing.assert_close(averaged[0].double(), exact, rtol=eps, atol=eps * 1e-3)

"""Multi-process: low-communication gossip (``sync_every=H``, an outer optimizer, a delayed exchange).

The rule (decent_optim_wrapper.engine.rules.local_steps): every H inner steps, per rank,
``a' = OuterStep(a, a - x)``, ``x <- a'``, the anchors ``a'`` are gossiped, and D steps later
``x <- x + (W a' - a')``, ``a <- W a'``. Checked here against two independent one-process
simulations: DiLoCo's published rule (the mean pseudo-gradient, one shared anchor) and the gossip
rule written from the formula with the dense mixing matrix.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from helpers import batch, flat, gather, set_distinct, tiny_model, train_steps
from resume import Resumable, assert_resume_is_bitwise
from simulation import Simulation, sgd_replicas
from torch import nn

from decent_optim_wrapper import DecentOptimWrapper, DecentralizedDataParallel, TopologyFactory

U64 = 2.0**-53  # unit roundoff of float64: the simulations and the runs below are in float64
INNER_LR = 0.1


def nesterov(params):
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)  # DiLoCo's outer optimizer


def heavy_ball(params):
    return torch.optim.SGD(params, lr=0.7, momentum=0.9)


def plain_sgd(params):
    return torch.optim.SGD(params, lr=0.7)


def adam(params):
    return torch.optim.Adam(params, lr=0.01)


OUTER = {"nesterov": nesterov, "momentum": heavy_ball, "sgd": plain_sgd, "adam": adam, None: None}


def _params(model: nn.Module) -> list[torch.Tensor]:
    return list(model.parameters())


# -- the two simulations -------------------------------------------------------------------------------
class _DiLoCo(Simulation):
    """DiLoCo (Douillard et al. 2023, Algorithm 1): every replica takes H inner steps from the shared
    anchor; the outer optimizer steps the anchor with the mean of the replicas' pseudo-gradients
    ``anchor - replica``; every replica restarts from the anchor."""

    def __init__(self, world_size: int, outer: str, sync_every: int) -> None:
        super().__init__("complete", *sgd_replicas(world_size, torch.float64, lr=INNER_LR))
        self.anchor = tiny_model(dtype=torch.float64)
        self.outer = OUTER[outer](_params(self.anchor))
        self.sync_every = sync_every

    def run(self, steps: int) -> list[torch.Tensor]:
        for step in range(steps):
            self.local_step(self.gradients(step))
            if (step + 1) % self.sync_every:
                continue
            with torch.no_grad():
                for k, anchor in enumerate(_params(self.anchor)):
                    replicas = [_params(m)[k] for m in self.models]
                    anchor.grad = sum(anchor - r for r in replicas) / self.world_size
                self.outer.step()
                for model in self.models:
                    for p, anchor in zip(_params(model), _params(self.anchor), strict=True):
                        p.copy_(anchor)
        return [self.vector(i) for i in range(self.world_size)]


class _GossipOuter(Simulation):
    """The gossip rule from its formula: per replica an anchor and an outer optimizer of its own; at
    the end of round r, a' = OuterStep(a, a - x), x <- a', a' sent; at the end of step t_r + D,
    mixed = sum_j W_ij a'_j (W of phase r), x <- x + mixed - a', a <- mixed."""

    def __init__(
        self, topology: str, world_size: int, outer: str | None, sync_every: int, delay: int
    ) -> None:
        super().__init__(topology, *sgd_replicas(world_size, torch.float64, lr=INNER_LR))
        self.anchors = [tiny_model(dtype=torch.float64) for _ in range(world_size)]
        self.outers = [OUTER[outer](_params(a)) if outer else None for a in self.anchors]
        self.sync_every, self.delay = sync_every, delay
        self.pending: tuple[int, int, list[torch.Tensor]] | None = None  # round, launch step, sent

    def anchor_vector(self, i: int) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.anchors[i].parameters()])

    def fold(self) -> None:
        assert self.pending is not None
        round_, _, sent = self.pending
        w, n = self.topo.mixing_matrix(round_), self.world_size
        for i in range(n):
            mixed = sum(w[i, j] * sent[j] for j in range(n))
            self.set_vector(i, self.vector(i) + (mixed - sent[i]))
            torch.nn.utils.vector_to_parameters(mixed, self.anchors[i].parameters())
        self.pending = None

    def run(self, steps: int) -> list[torch.Tensor]:
        for step in range(steps):
            self.local_step(self.gradients(step))
            with torch.no_grad():
                if self.pending is not None and step >= self.pending[1] + self.delay:
                    self.fold()
                if (step + 1) % self.sync_every:
                    continue
                for i, (model, anchor, outer) in enumerate(
                    zip(self.models, self.anchors, self.outers, strict=True)
                ):
                    if outer is None:
                        torch.nn.utils.vector_to_parameters(self.vector(i), anchor.parameters())
                    else:
                        for a, p in zip(_params(anchor), _params(model), strict=True):
                            a.grad = a - p
                        outer.step()
                    self.set_vector(i, self.anchor_vector(i))
                sent = [self.anchor_vector(i) for i in range(self.world_size)]
                self.pending = ((step + 1) // self.sync_every - 1, step, sent)
                if self.delay == 0:
                    self.fold()
        return [self.vector(i) for i in range(self.world_size)]


# -- runs on the pool --------------------------------------------------------------------------------
def _inner(params):
    return torch.optim.SGD(params, lr=INNER_LR, momentum=0.9)


def _train_module(ddp: DecentralizedDataParallel, rank: int, steps: range) -> None:
    dtype = next(ddp.parameters()).dtype
    for step in steps:
        x, y = batch(rank, step, dtype)
        nn.functional.cross_entropy(ddp(x), y).backward()


def _run(
    topology: str,
    steps: int,
    outer: str | None,
    sync_every: int,
    delay: int | None,
    front_end: str = "optimizer",
    **options: object,
) -> torch.Tensor:
    model = tiny_model(dtype=torch.float64)
    keywords = dict(topology=topology, sync_every=sync_every, outer_optimizer=OUTER[outer], sync_delay=delay)
    if front_end == "module":
        ddp = DecentralizedDataParallel(
            model, lambda named: _inner([p for _, p in named]), bucket_size_in_mb=1e-4, **keywords, **options
        )
        _train_module(ddp, dist.get_rank(), range(steps))
        ddp.engine.wait_all()
    else:
        opt = DecentOptimWrapper(_inner(model.parameters()), **keywords, **options)
        train_steps(model, opt, dist.get_rank(), range(steps))
        opt.engine.wait_all()
    return flat(model)


# How far the complete-topology runs may be from DiLoCo's rule: they compute the same numbers in
# another order (the anchors a' are averaged after each rank's outer step, where DiLoCo averages
# the pseudo-gradients before one outer step), so each round differs by a few roundings of the
# parameters' size, n u max|x| each; the next H inner steps of the tiny model carry such a
# difference along without amplifying it by more than a small factor (measured: about 1e-15 after
# 3 rounds, max|x| ~ 1). 2^10 n u max|x| per round leaves that margin and is still 10 orders of
# magnitude below any difference of rule (one inner step moves x by ~1e-2).
def _reordering_tolerance(world_size: int, rounds: int, reference: list[torch.Tensor]) -> float:
    scale = max(r.abs().max().item() for r in reference)
    return 2**10 * world_size * rounds * U64 * scale


@pytest.mark.parametrize("front_end", ["optimizer", "module"])
@pytest.mark.parametrize("world_size", [2, 4])
def test_complete_topology_without_delay_is_diloco(pool, world_size, front_end):
    sync_every, rounds = 4, 3
    reference = _DiLoCo(world_size, "nesterov", sync_every).run(sync_every * rounds)
    results = pool(world_size).run(
        _run, "complete", sync_every * rounds, "nesterov", sync_every, 0, front_end
    )
    atol = _reordering_tolerance(world_size, rounds, reference)
    for rank in range(world_size):
        torch.testing.assert_close(results[rank], reference[rank], rtol=0, atol=atol)
    # and not by accident: without the outer optimizer's momentum the runs end elsewhere
    periodic = pool(world_size).run(_run, "complete", sync_every * rounds, None, sync_every, 0)
    assert (periodic[0] - reference[0]).abs().max() > 1e6 * atol


# The gossip simulation mixes with the dense matrix (sum_j W_ij a_j in index order) where the engine
# all-reduces c a_j in its group; both round each term once, so a round differs by at most k u
# max|a| per element (k <= 3 members here), carried through the following inner steps as above.
@pytest.mark.parametrize(
    ("topology", "world_size", "outer", "delay"),
    [
        ("ring", 4, "nesterov", 0),
        ("ring", 4, "nesterov", 1),
        ("ring", 4, "nesterov", 4),
        ("one-peer-exp", 4, "momentum", 2),
        ("one-peer-exp", 4, "adam", 4),
        ("ring", 4, None, 3),
        ("ring", 3, "sgd", 4),
    ],
)
def test_every_delay_and_topology_follows_the_gossip_rule(pool, topology, world_size, outer, delay):
    sync_every, rounds = 4, 4
    steps = sync_every * rounds + 2  # ends inside a round, with a round in flight when delay > 2
    reference = _GossipOuter(topology, world_size, outer, sync_every, delay).run(steps)
    results = pool(world_size).run(_run, topology, steps, outer, sync_every, delay)
    atol = _reordering_tolerance(world_size, rounds, reference)
    for rank in range(world_size):
        torch.testing.assert_close(results[rank], reference[rank], rtol=0, atol=atol)


@pytest.mark.parametrize("delay", [0, 2])
def test_both_front_ends_give_the_same_numbers(pool, delay):
    # Per bucket the module front-end does what the optimizer front-end does for all buckets at once,
    # with the same elementwise operations: bit for bit.
    optimizer = pool(4).run(_run, "ring", 10, "nesterov", 4, delay)
    module = pool(4).run(_run, "ring", 10, "nesterov", 4, delay, "module")
    for rank in range(4):
        assert torch.equal(module[rank], optimizer[rank]), f"rank {rank}"


# -- the mean follows DiLoCo for linear outer rules ------------------------------------------------------
class _RecordingSGD(torch.optim.SGD):
    """Inner SGD that records the flat parameters after each of its steps (before any outer step)."""

    def __init__(self, params, **kwargs) -> None:
        params = list(params)
        super().__init__(params, **kwargs)
        self.after: list[torch.Tensor] = []

    def step(self, closure=None):
        result = super().step(closure)
        self.after.append(
            torch.cat([p.detach().reshape(-1).clone() for g in self.param_groups for p in g["params"]])
        )
        return result


def _momentum(outer: torch.optim.Optimizer) -> torch.Tensor:
    state = [outer.state[p].get("momentum_buffer") for g in outer.param_groups for p in g["params"]]
    if any(s is None for s in state):
        return torch.zeros(
            sum(p.numel() for g in outer.param_groups for p in g["params"]), dtype=torch.float64
        )
    return torch.cat([s.reshape(-1) for s in state])


def _anchor_vector(outer: torch.optim.Optimizer) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for g in outer.param_groups for p in g["params"]])


def _one_round_of_means(topology: str, outer: str) -> dict[str, torch.Tensor]:
    rank, sync_every = dist.get_rank(), 3
    model = tiny_model(dtype=torch.float64)
    inner = _RecordingSGD(model.parameters(), lr=INNER_LR, momentum=0.9)
    opt = DecentOptimWrapper(
        inner, topology=topology, sync_every=sync_every, outer_optimizer=OUTER[outer], sync_delay=0
    )
    train_steps(model, opt, rank, range(2 * sync_every))  # two rounds: the outer state is not zero
    before = {"anchor": _anchor_vector(opt.outer_optimizer), "momentum": _momentum(opt.outer_optimizer)}
    train_steps(model, opt, rank, range(2 * sync_every, 3 * sync_every))
    after = {"anchor": _anchor_vector(opt.outer_optimizer), "momentum": _momentum(opt.outer_optimizer)}
    delta = before["anchor"] - inner.after[-1]  # this rank's pseudo-gradient of the third round
    return {
        "anchor_before": gather(before["anchor"]),
        "momentum_before": gather(before["momentum"]),
        "delta": gather(delta),
        "anchor_after": gather(after["anchor"]),
        "momentum_after": gather(after["momentum"]),
        "params": gather(flat(model)),
    }


@pytest.mark.parametrize("outer", ["nesterov", "momentum", "sgd"])
@pytest.mark.parametrize("topology", ["ring", "one-peer-exp"])
def test_the_mean_anchor_follows_diloco_on_the_mean_pseudo_gradient(pool, topology, outer):
    r = pool(4).run(_one_round_of_means, topology, outer)[0]
    mean_anchor, mean_momentum, mean_delta = (
        r[k].mean(0) for k in ("anchor_before", "momentum_before", "delta")
    )
    # DiLoCo's outer step on the means (torch's SGD rule written out: buf <- mu buf + g, Nesterov
    # steps with g + mu buf, heavy ball with buf, plain SGD with g)
    lr, mu = 0.7, 0.9
    if outer == "sgd":
        expected_momentum, direction = torch.zeros_like(mean_momentum), mean_delta
    else:
        expected_momentum = mu * mean_momentum + mean_delta
        direction = mean_delta + mu * expected_momentum if outer == "nesterov" else expected_momentum
    expected = mean_anchor - lr * direction
    # Mixing keeps the mean up to one rounding per term (k u max|a|, k <= 3), and the outer step
    # rounds a few times per element: 16 u max|a| bounds both with room.
    atol = 16 * U64 * r["anchor_after"].abs().max().item()
    torch.testing.assert_close(r["anchor_after"].mean(0), expected, rtol=0, atol=atol)
    if outer != "sgd":  # each rank's momentum is its own; their mean follows the mean pseudo-gradient
        torch.testing.assert_close(r["momentum_after"].mean(0), expected_momentum, rtol=0, atol=atol)
    # with no delay the replicas restart from their mixed anchors
    assert torch.equal(r["params"], r["anchor_after"])


# -- consensus -------------------------------------------------------------------------------------
def _zero_lr_rounds(topology: str, delay: int, compression: str | None, initial: bool = False) -> list[float]:
    model = tiny_model(dtype=torch.float64)
    opt = DecentOptimWrapper(
        torch.optim.SGD(model.parameters(), lr=0.0),
        topology=topology,
        sync_every=2,
        outer_optimizer=nesterov,
        sync_delay=delay,
        compression=compression,
    )
    set_distinct(model, dist.get_rank(), dyadic=True)  # before step 0, which anchors there
    start = gather(flat(model)).flatten().tolist()
    distances = [opt.consensus_distance()]
    for round_ in range(4):
        train_steps(model, opt, dist.get_rank(), range(2 * round_, 2 * round_ + 2))
        distances.append(opt.consensus_distance())
    opt.engine.wait_all()
    return [*distances, *(start if initial else gather(flat(model)).flatten().tolist())]


def test_with_zero_inner_lr_the_anchors_are_gossip(pool):
    # Zero pseudo-gradients leave the anchors alone (the outer momentum stays 0), so every round is
    # one gossip round of the parameters. one-peer-exp on 4 ranks averages exactly in log2(4) = 2
    # rounds, and multiples of 12 make every x/2 exact: bitwise consensus, with or without delay.
    for delay in (0, 2):
        out = pool(4).run(_zero_lr_rounds, "one-peer-exp", delay, None)[0]
        distances, replicas = out[:5], torch.tensor(out[5:]).view(4, -1)
        assert distances[0] > 0
        if delay == 0:
            assert distances[2] == 0.0
        assert torch.equal(replicas[1:], replicas[:1].expand(3, -1)), f"delay {delay}"


def _spread(replicas: torch.Tensor) -> float:
    return math.sqrt((replicas - replicas.mean(0)).square().sum(1).mean().item())


@pytest.mark.parametrize("topology", ["ring", "one-peer-exp"])
def test_spread_contracts_with_the_mixing_matrices_compressed_or_not(pool, topology):
    topo = TopologyFactory.create(topology, 4)
    for compression in (None, "bf16"):
        out = pool(4).run(_zero_lr_rounds, topology, 0, compression, True)[0]
        distances, initial = out[:5], torch.tensor(out[5:], dtype=torch.float64).view(4, -1)
        expected, x = [_spread(initial)], initial
        for round_ in range(4):  # round r mixes with W of phase r
            x = topo.mixing_matrix(round_) @ x
            expected.append(_spread(x))
        assert all(b <= a for a, b in itertools.pairwise(distances)), distances
        if compression is None:  # fp64 rounding of a few terms per element: 1e-12 relative is ample
            torch.testing.assert_close(torch.tensor(distances), torch.tensor(expected), rtol=1e-12, atol=1e-9)
        else:  # each round sends x - r to 2^-8 relative; what is not sent stays in the replica
            assert distances[-1] <= expected[-1] + 2**-7 * distances[0], (distances, expected)


# -- world size 1 ------------------------------------------------------------------------------------
def _world_size_one(outer: str, delay: int) -> tuple[torch.Tensor, torch.Tensor]:
    model = tiny_model(dtype=torch.float64)
    opt = DecentOptimWrapper(
        _inner(model.parameters()),
        topology="ring",
        sync_every=3,
        outer_optimizer=OUTER[outer],
        sync_delay=delay,
    )
    train_steps(model, opt, 0, range(10))
    assert opt.engine.bytes_sent_per_step() == 0.0
    # The same rule by hand on one replica: DiLoCo with one worker (Lookahead with an outer optimizer).
    bare = tiny_model(dtype=torch.float64)
    inner, anchor = _inner(bare.parameters()), tiny_model(dtype=torch.float64)
    outer_opt = OUTER[outer](_params(anchor))
    for step in range(10):
        train_steps(bare, inner, 0, range(step, step + 1))
        if (step + 1) % 3 == 0:
            with torch.no_grad():
                for a, p in zip(_params(anchor), _params(bare), strict=True):
                    a.grad = a - p
                outer_opt.step()
                for a, p in zip(_params(anchor), _params(bare), strict=True):
                    p.copy_(a)
    return flat(model), flat(bare)


@pytest.mark.parametrize(("outer", "delay"), [("nesterov", 0), ("nesterov", 3), ("adam", 1)])
def test_world_size_one_is_diloco_with_one_worker(pool, outer, delay):
    # No exchange, so the delay changes nothing; every operation is the same elementwise: bitwise.
    wrapped, bare = pool(1).run(_world_size_one, outer, delay)[0]
    assert torch.equal(wrapped, bare)


# -- global averaging ---------------------------------------------------------------------------------
def _average_mid_round(front_end: str) -> dict[str, torch.Tensor]:
    rank = dist.get_rank()

    def build():
        model = tiny_model(dtype=torch.float64)
        keywords = dict(topology="ring", sync_every=4, outer_optimizer=nesterov, sync_delay=3)
        if front_end == "module":
            ddp = DecentralizedDataParallel(model, lambda named: _inner([p for _, p in named]), **keywords)
            return model, ddp, lambda steps: _train_module(ddp, rank, steps)
        opt = DecentOptimWrapper(_inner(model.parameters()), **keywords)
        return model, opt, lambda steps: train_steps(model, opt, rank, steps)

    model, front, train = build()
    train(range(9))
    reference = flat(model)
    ref_anchor = torch.cat(front.engine.anchors)
    train(range(9, 14))
    reference_end = flat(model)

    model, front, train = build()
    train(range(6))  # round 0 was launched after step 3 and is folded in after step 6: in flight
    before, anchors_before = flat(model), torch.cat(front.engine.anchors)
    replicas, anchor_replicas = gather(before), gather(anchors_before)
    front.global_avg()
    averaged, averaged_anchors = gather(flat(model)), gather(torch.cat(front.engine.anchors))
    front.revert_global_avg()
    reverted, reverted_anchors = flat(model), torch.cat(front.engine.anchors)
    train(range(6, 9))
    return {
        "replicas": replicas,
        "anchor_replicas": anchor_replicas,
        "averaged": averaged,
        "averaged_anchors": averaged_anchors,
        "reverted": torch.stack([reverted, before]),
        "reverted_anchors": torch.stack([reverted_anchors, anchors_before]),
        "continued": torch.stack([flat(model), reference]),
        "continued_anchor": torch.stack([torch.cat(front.engine.anchors), ref_anchor]),
        "end": reference_end,
    }


@pytest.mark.parametrize("front_end", ["optimizer", "module"])
def test_global_avg_averages_parameters_and_anchors_and_revert_is_bitwise(pool, front_end):
    for rank, r in enumerate(pool(4).run(_average_mid_round, front_end)):
        for key, replicas in (("averaged", "replicas"), ("averaged_anchors", "anchor_replicas")):
            assert torch.equal(r[key], r[key][:1].expand_as(r[key])), key  # identical on every rank
            # an fp64 sum of 4 values and one division: within 4 roundings of the exact mean
            atol = 4 * U64 * r[replicas].abs().max().item()
            torch.testing.assert_close(r[key][0], r[replicas].mean(0), rtol=0, atol=atol)
        for key in ("reverted", "reverted_anchors", "continued", "continued_anchor"):
            assert torch.equal(r[key][0], r[key][1]), f"rank {rank}: {key}"


# -- checkpoints -------------------------------------------------------------------------------------
@dataclass
class _LocalRun(Resumable):
    """A ring with H=4, D=3 and a Nesterov outer optimizer, saved with an anchor round in flight."""

    front_end: str
    compression: str | None = None

    def build(self, seed: int):
        model = tiny_model(seed=seed)
        keywords = dict(
            topology="ring",
            sync_every=4,
            outer_optimizer=nesterov,
            sync_delay=3,
            compression=self.compression,
        )
        if self.front_end == "module":
            return model, DecentralizedDataParallel(
                model,
                lambda named: torch.optim.AdamW([p for _, p in named], lr=0.01),
                lr_scheduler_fn=lambda o: torch.optim.lr_scheduler.StepLR(o, 2, 0.5),
                bucket_size_in_mb=1e-4,
                **keywords,
            )
        return model, DecentOptimWrapper(torch.optim.AdamW(model.parameters(), lr=0.01), **keywords)

    def train(self, run, steps: range) -> None:
        model, front = run
        if self.front_end == "module":
            _train_module(front, dist.get_rank(), steps)
        else:
            train_steps(model, front, dist.get_rank(), steps)

    def state_dict(self, run) -> dict:
        front = run[1]
        state = front.training_state_dict() if self.front_end == "module" else front.state_dict()
        local = state["decent"]["local_steps"]
        assert local["gossip"] is not None and local["gossip"]["step"] == 0  # round 0 still to fold in
        assert local["outer"]["state"]  # the outer optimizer has momentum
        return state

    def load_state_dict(self, run, state: dict) -> None:
        front = run[1]
        if self.front_end == "module":
            front.load_training_state_dict(state)
        else:
            front.load_state_dict(state)

    def result(self, run) -> torch.Tensor:
        model, front = run
        front.engine.wait_all()
        return torch.cat([flat(model), *front.engine.anchors])


@pytest.mark.parametrize(
    "case",
    [
        _LocalRun("optimizer"),
        _LocalRun("module"),
        _LocalRun("optimizer", "bf16"),
        _LocalRun("module", "randk:0.1:int4"),
    ],
    ids=str,
)
def test_resume_mid_period_with_a_round_in_flight_is_bitwise(pool, resume_pool, tmp_path, case):
    # saved after 5 steps: the round launched after step 3 is folded in after step 6
    assert_resume_is_bitwise(pool, resume_pool, 4, case, tmp_path, total=11, save_at=5)


# -- composition -----------------------------------------------------------------------------------
def _compressed_mean(compression: str) -> tuple[float, float, float]:
    model = tiny_model()
    opt = DecentOptimWrapper(
        torch.optim.SGD(model.parameters(), lr=0.0), topology="ring", sync_every=2, compression=compression
    )
    set_distinct(model, dist.get_rank())
    start = gather(flat(model).double()).mean(0)
    train_steps(model, opt, dist.get_rank(), range(12))
    opt.engine.wait_all()
    end = gather(flat(model).double())
    return (end.mean(0) - start).abs().max().item(), end.abs().max().item(), opt.engine.bytes_sent_per_step()


@pytest.mark.parametrize("compression", ["bf16", "int8", "topk:0.03:int2", "randk:0.1:int4"])
def test_compressed_anchor_rounds_keep_the_mean(pool, compression):
    moved, scale, sent = pool(4).run(_compressed_mean, compression)[0]
    # The compressed-gossip guarantee, restated for anchors: the mean moves only by the rounding of
    # x + a c (s - k q) in fp32, at most about 2 u32 max|x| per round (6 rounds, sum and update).
    assert moved <= 6 * 2 * 2**-24 * 2 * scale
    numel = sum(p.numel() for p in tiny_model().parameters())
    assert sent < 2 * numel * 4 / 2  # fewer bytes per step than one fp32 ring round every 2 steps


def _bytes_per_step() -> list[float]:
    model = tiny_model()
    return [
        DecentOptimWrapper(
            torch.optim.SGD(model.parameters(), lr=0.1), topology="ring", **kw
        ).engine.bytes_sent_per_step()
        for kw in ({}, {"sync_every": 8}, {"sync_every": 8, "outer_optimizer": nesterov})
    ]


def test_bytes_per_step_are_one_round_over_sync_every(pool):
    per_step, periodic, diloco = pool(4).run(_bytes_per_step)[0]
    assert periodic == diloco == per_step / 8


def _tracking_refused() -> str:
    model = tiny_model()
    try:
        DecentOptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1), sync_every=4, gradient_tracking=True)
    except ValueError as err:
        return str(err)
    return "no error"


def test_gradient_tracking_is_refused_by_name(pool):
    for message in pool(2).run(_tracking_refused):
        assert "gradient_tracking=True cannot be combined with low-communication gossip" in message


def _add_param_group_mid_round() -> tuple[int, bool, int]:
    torch.manual_seed(0)
    model, extra = tiny_model(), nn.Linear(3, 2)
    opt = DecentOptimWrapper(
        torch.optim.SGD(model.parameters(), lr=0.1), topology="ring", sync_every=3, outer_optimizer=nesterov
    )
    train_steps(model, opt, dist.get_rank(), range(2))
    opt.add_param_group({"params": list(extra.parameters())})
    before = [p.detach().clone() for p in extra.parameters()]
    for step in range(2, 9):
        opt.zero_grad()
        x, y = batch(dist.get_rank(), step)
        (nn.functional.cross_entropy(model(x), y) + extra(model(x)).square().mean()).backward()
        opt.step()
    moved = any(not torch.equal(b, p) for b, p in zip(before, extra.parameters(), strict=True))
    opt.global_avg(may_revert=False)
    return len(opt.outer_optimizer.param_groups), moved, len(opt.engine.anchors)


def test_add_param_group_anchors_the_new_parameters(pool):
    for groups, moved, anchors in pool(2).run(_add_param_group_mid_round):
        assert groups == 2 and moved and anchors == 2


def _scaler_clipping_accumulation_and_schedulers() -> list[float]:
    torch.manual_seed(0)
    model = tiny_model()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    ddp = DecentralizedDataParallel(
        model,
        lambda named: torch.optim.SGD([p for _, p in named], lr=0.1),
        lr_scheduler_fn=lambda o: torch.optim.lr_scheduler.StepLR(o, 4, 0.5),
        topology="ring",
        scaler=scaler,
        grad_clip_norm=1.0,
        sync_every=2,
        outer_optimizer=nesterov,
    )
    for step in range(8):
        with ddp.no_sync():
            x, y = batch(dist.get_rank(), 2 * step)
            scaler.scale(nn.functional.cross_entropy(ddp(x), y) / 2).backward()
        x, y = batch(dist.get_rank(), 2 * step + 1)
        scaler.scale(nn.functional.cross_entropy(ddp(x), y) / 2).backward()
    ddp.global_avg(will_revert=False)
    return [
        ddp.step_count,
        ddp.get_lr(),
        ddp.outer_optimizer.param_groups[0]["lr"],
        float(flat(model).abs().sum()),
    ]


def test_scaler_clipping_accumulation_and_schedulers_compose(pool):
    # The inner schedulers drive the inner lr only; the outer lr is the outer optimizer's own.
    results = pool(2).run(_scaler_clipping_accumulation_and_schedulers)
    assert results[0] == results[1]
    steps, lr, outer_lr, total = results[0]
    assert steps == 8 and lr == 0.1 * 0.5**2 and outer_lr == 0.7 and math.isfinite(total)


# -- bad input, on every rank ------------------------------------------------------------------------
def _bad(case: str) -> str:
    model, rank = tiny_model(), dist.get_rank()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    options: dict[str, object] = {
        "zero": {"sync_every": 0 if rank == 1 else 4},
        "float": {"sync_every": 4.0 if rank == 1 else 4},
        "delay": {"sync_every": 4, "sync_delay": 5 if rank == 1 else 4},
        "disagree": {"sync_every": 8 if rank == 1 else 4},
        "no-optimizer": {"sync_every": 4, "outer_optimizer": (lambda p: None) if rank == 1 else nesterov},
        "wrong-tensors": {
            "sync_every": 4,
            "outer_optimizer": (lambda p: nesterov(model.parameters())) if rank == 1 else nesterov,
        },
        "raises": {"sync_every": 4, "outer_optimizer": (lambda p: p[99]) if rank == 1 else nesterov},
        "instance": {
            "sync_every": 4,
            "outer_optimizer": nesterov(model.parameters()) if rank == 1 else nesterov,
        },
        "outer-class": {"sync_every": 4, "outer_optimizer": adam if rank == 1 else nesterov},
        "outer-lr": {"sync_every": 4, "outer_optimizer": heavy_ball if rank == 1 else nesterov},
    }[case]
    try:
        DecentOptimWrapper(inner, topology="ring", **options)
    except (ValueError, TypeError) as err:
        return f"{type(err).__name__}: {err}"
    return "no error"


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("zero", "sync_every must be >= 1"),
        ("float", "sync_every must be a positive int"),
        ("delay", r"sync_delay=5 exceeds sync_every=4"),
        ("disagree", "Low-communication gossip .* differs between rank 0 and rank\\(s\\) \\[1\\]"),
        ("no-optimizer", "returned NoneType, not a torch.optim.Optimizer"),
        ("wrong-tensors", "must cover exactly the .* anchor tensors"),
        ("raises", "outer_optimizer\\(params\\) raised IndexError"),
        ("instance", "outer_optimizer must be None or a function"),
        ("outer-class", "Low-communication gossip .* differs"),
        ("outer-lr", "Low-communication gossip .* differs"),
    ],
)
def test_bad_input_fails_on_every_rank(pool, case, message):
    import re

    results = pool(2).run(_bad, case)
    assert re.search(message, results[1]), results[1]
    assert results[0] != "no error", results[0]  # rank 0 had good input and still stops

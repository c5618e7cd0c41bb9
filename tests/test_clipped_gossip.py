"""Clipped gossip (``clipped_gossip=``): a neighbour that sends finite but wrong values moves its
receivers by at most its weight times the radius per round.

The rule on gloo ranks against an independent float64 simulation (one bucket, the radius from the
same window of norms), the radius alone, and training with an attacker that sends its model scaled by
100, random values or the negated model: the honest ranks stay near where they would be without it,
where plain gossip is dragged away. Both front-ends; with compression and with low-communication
gossip; a checkpoint resumes bit for bit (the radius's norms are in it).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import batch, flat, gather, set_distinct, tiny_model
from torch import nn

from decent_optim_wrapper import ClippedGossip, DecentOptimWrapper, DecentralizedDataParallel
from decent_optim_wrapper.engine.exchange.clipping import RadiusWindow, clip_scale, resolve_clipped_gossip

U64 = 2.0**-53


# -- the radius alone ----------------------------------------------------------------------------------
@pytest.mark.pure
def test_the_radius_is_factor_times_a_quantile_of_the_recent_norms():
    window = RadiusWindow(ClippedGossip(factor=2.0, quantile=0.25, window=8))
    assert window.radius() == 0.0  # nothing seen: the first round mixes nothing of the neighbours
    window.add([5.0, 1.0])
    assert window.radius() == 2.0  # fewer than four: the minimum
    window.add([3.0, 4.0, 2.0])  # sorted 1 2 3 4 5: the lower quartile is 2
    assert window.radius() == 4.0 and not window.full()
    window.add([100.0] * 6)  # the window keeps the last 8: 3 4 2 100 x 6 -> sorted 2 3 4 100 ...
    assert window.radius() == pytest.approx(2.0 * (4.0 + 0.75 * 96.0)) and window.full()
    # Dropping (drop_beyond=3): with a full window beyond 3 radii; before, only if also longer than the
    # receiver's own values (the warm-up: a few early norms alone leave nobody out).
    warming = RadiusWindow(ClippedGossip(factor=1.0, window=8, drop_beyond=3.0), [1.0, 1.0])
    assert warming.scale(4.0, 1.0, own_norm=10.0) == 0.25  # 4 radii but shorter than x_i: clipped
    assert warming.scale(40.0, 1.0, own_norm=10.0) == 0.0  # 40 radii and longer than x_i: dropped
    full = RadiusWindow(ClippedGossip(factor=1.0, window=2, drop_beyond=3.0), [1.0, 1.0])
    assert full.scale(4.0, 1.0, own_norm=10.0) == 0.0 and full.scale(2.0, 1.0, own_norm=10.0) == 0.5
    # Probation: once dropped, rank 7 is left out of its next 2 rounds whatever it sends; rank 5 is not.
    judged = RadiusWindow(ClippedGossip(factor=1.0, window=2, drop_beyond=3.0, probation=2), [1.0, 1.0])
    assert judged.judge(7, 4.0, 1.0, 10.0) == 0.0 and judged.on_probation() == {7: 2}
    assert judged.judge(5, 2.0, 1.0, 10.0) == 0.5
    assert [judged.judge(7, 0.5, 1.0, 10.0) for _ in range(3)] == [0.0, 0.0, 1.0]
    assert judged.on_probation() == {}
    with pytest.raises(ValueError, match=r"probation=...\) must be an int >= 0 \(rounds\), got -1"):
        ClippedGossip(probation=-1)
    assert clip_scale(1.0, 2.0) == 1.0 and clip_scale(8.0, 2.0) == 0.25 and clip_scale(0.0, 0.0) == 1.0
    assert (
        clip_scale(5.0, 2.0, 3.0) == 0.4
        and clip_scale(8.0, 2.0, 3.0) == 0.0
        and clip_scale(1.0, 2.0, 3.0) == 1.0
    )


@pytest.mark.pure
def test_clipped_gossip_options_are_checked_with_the_fix():
    assert resolve_clipped_gossip(None) is None and resolve_clipped_gossip(False) is None
    assert resolve_clipped_gossip(True) == ClippedGossip()
    with pytest.raises(TypeError, match="clipped_gossip must be None, True or a ClippedGossip"):
        resolve_clipped_gossip("median")
    with pytest.raises(ValueError, match=r"factor=...\) must be a number > 0, got 0"):
        ClippedGossip(factor=0)
    with pytest.raises(ValueError, match=r"quantile=...\) must lie in \[0, 1\], got 1.5"):
        ClippedGossip(quantile=1.5)
    with pytest.raises(ValueError, match=r"window=...\) must be an int >= 1, got 0"):
        ClippedGossip(window=0)
    for bad in (0.5, True, math.inf, "10"):
        with pytest.raises(ValueError, match=r"drop_beyond=\.\.\.\) must be None or a number >= 1"):
            ClippedGossip(drop_beyond=bad)


# -- the rule against a simulation ---------------------------------------------------------------------
class _Scaled(torch.optim.Optimizer):
    """An attacker's "local step": at its ``k``-th step its parameters become ``scales[k % len(scales)]``
    times the given values (what its round of that step sends)."""

    def __init__(self, params, values: list[torch.Tensor], scales: tuple[float, ...]) -> None:
        super().__init__(params, {})
        self._values, self._scales, self._steps = values, scales, 0

    @torch.no_grad()
    def step(self, closure=None):
        scale = self._scales[self._steps % len(self._scales)]
        self._steps += 1
        for group in self.param_groups:
            for p, v in zip(group["params"], self._values, strict=True):
                p.copy_(v * scale)


#: What the attacker sends, as multiples of its start: 100x; the negated model; and a sign-flipper that
#: alternates its honest replica with the negated one, round by round.
ATTACKS = {"scaled": (100.0,), "negated": (-1.0,), "alternating": (1.0, -1.0)}


ROUNDS = 6
OPTIONS = ClippedGossip(factor=2.0, quantile=0.25, window=8, drop_beyond=None)


def _clipped_rounds(
    topology: str, options: ClippedGossip = OPTIONS, scales: tuple[float, ...] = ATTACKS["scaled"]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct dyadic replicas; honest ranks take no steps (lr 0), rank 3 sends ``scales`` times its
    start in turn."""
    rank, model = dist.get_rank(), tiny_model(dtype=torch.float64)
    set_distinct(model, rank, dyadic=True)
    values = [p.detach().clone() for p in model.parameters()]
    inner = (
        _Scaled(model.parameters(), values, scales)
        if rank == 3
        else torch.optim.SGD(model.parameters(), lr=0.0)
    )
    front = DecentOptimWrapper(inner, topology=topology, clipped_gossip=options)
    set_distinct(model, rank, dyadic=True)  # the wrapper broadcast rank 0's values
    start = gather(flat(model))
    for _ in range(ROUNDS + 1):  # the last step mixes the last round
        front.step()
    return start, flat(model)


def _simulate(
    start: torch.Tensor,
    topology: str,
    options: ClippedGossip = OPTIONS,
    scales: tuple[float, ...] = ATTACKS["scaled"],
) -> torch.Tensor:
    """Every honest rank's replica after ``ROUNDS`` rounds of the clipped rule, from the mixing matrices
    (with ``drop_beyond``: a difference longer than that many radii left out once a rank's window is
    full, and before that if it is also longer than the rank's own values; written out here)."""
    from decent_optim_wrapper.topo import TopologyFactory

    topo = TopologyFactory.create(topology, 4)
    x = start.clone()
    windows = [RadiusWindow(options) for _ in range(4)]
    probation: list[dict[int, int]] = [{} for _ in range(4)]  # receiver -> sender -> rounds left out
    for r in range(ROUNDS):
        w = topo.mixing_matrix(r)
        sent = x.clone()
        sent[3] = scales[r % len(scales)] * start[3]
        new = x.clone()
        for i in range(3):
            radius, norms = windows[i].radius(), []
            update = torch.zeros_like(x[i])
            for j in range(4):
                if j == i or w[i, j] == 0:
                    continue
                d = sent[j] - sent[i]
                norm = float(torch.linalg.vector_norm(d))
                norms.append(norm)
                # left out beyond drop_beyond radii: with a full window, or if longer than x_i itself
                trusted = len(windows[i].state()) == options.window or norm > float(x[i].norm())
                if trusted and options.drop_beyond is not None and norm > options.drop_beyond * radius:
                    if radius > 0:  # (a radius of 0, before any norm, mixes nobody: no verdict on j)
                        probation[i][j] = options.probation  # left out of j's next rounds with i too
                    continue  # its weight stays with rank i
                if probation[i].get(j, 0) > 0:
                    probation[i][j] -= 1
                    continue
                update.add_(d, alpha=float(w[i, j]) * clip_scale(norm, radius))
            new[i] = x[i] + update
            windows[i].add(norms)
        x = new
    return x


DROPPING = ClippedGossip(factor=2.0, quantile=0.25, window=4, drop_beyond=3.0)  # full from round 4 on a ring


@pytest.mark.parametrize("attack", list(ATTACKS))
@pytest.mark.parametrize("options", [OPTIONS, DROPPING], ids=["clipped", "dropping"])
@pytest.mark.parametrize("topology", ["complete", "ring"])
def test_clipped_mixing_follows_the_simulation(pool, topology, options, attack):
    scales = ATTACKS[attack]
    results = pool(4).run(_clipped_rounds, topology, options, scales)
    start = results[0][0]
    want = _simulate(start, topology, options, scales)
    if options is DROPPING and attack == "scaled":  # 100x is far beyond 3 radii once there is a radius
        assert not torch.equal(want, _simulate(start, topology, OPTIONS, scales))
    for rank in range(3):
        got = results[rank][1]
        # the same operations in the same order; the norms alike: a few u of the largest entry
        torch.testing.assert_close(got, want[rank], rtol=0, atol=16 * U64 * start.abs().max().item())
        assert got.abs().max() < 2 * start[:3].abs().max(), "an honest replica was dragged away"


class _SignFlipper(torch.optim.Optimizer):
    """A sign-flipping attacker's "local step" over a replica that mixes by the rule like everyone's:
    ``negated`` sends the negation of its replica every round, ``alternating`` its replica and its
    negation in turn (both restored to the replica before the next round is mixed in: ``restore``),
    ``flipping`` negates its replica in place, so that every other round it sends a stale one (what
    it mixed in while negated, negated back)."""

    def __init__(self, params, mode: str) -> None:
        super().__init__(params, {})
        self._mode, self._steps = mode, 0
        self._honest: list[torch.Tensor] | None = None

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    @torch.no_grad()
    def step(self, closure=None):
        odd = self._steps % 2 == 1
        self._steps += 1
        if self._mode != "flipping":
            self._honest = [p.clone() for p in self._params()]
        if self._mode != "alternating" or odd:
            for p in self._params():
                p.neg_()

    @torch.no_grad()
    def restore(self) -> None:
        if self._honest is not None:
            for p, honest in zip(self._params(), self._honest, strict=True):
                p.copy_(honest)


FLIPPERS = ("negated", "alternating", "flipping")


def _flipped_rounds(topology: str, options: ClippedGossip, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """As :func:`_clipped_rounds`, rank 3 a :class:`_SignFlipper` of ``mode``."""
    rank, model = dist.get_rank(), tiny_model(dtype=torch.float64)
    set_distinct(model, rank, dyadic=True)
    inner = (
        _SignFlipper(model.parameters(), mode) if rank == 3 else torch.optim.SGD(model.parameters(), lr=0.0)
    )
    front = DecentOptimWrapper(inner, topology=topology, clipped_gossip=options)
    set_distinct(model, rank, dyadic=True)  # the wrapper broadcast rank 0's values
    start = gather(flat(model))
    for _ in range(ROUNDS + 1):  # the last step mixes the last round
        if isinstance(inner, _SignFlipper):
            inner.restore()  # its replica again, before the round it sent is mixed in
        front.step()
    return start, flat(model)


def _simulate_flipper(
    start: torch.Tensor, topology: str, options: ClippedGossip, mode: str, stale: bool = True
) -> torch.Tensor:
    """Every rank's replica after ``ROUNDS`` rounds of the clipped rule (written out as in
    :func:`_simulate`), rank 3 a sign-flipper of ``mode`` whose replica mixes by the rule too: it
    receives against what it sent (``x_3 <- x_3 + sum_j W_3j clip(x_j - s_3, tau_3)``). ``stale=False``
    leaves its replica at its start (what the sign-flippers of ``_simulate`` send): a check that the
    rounds it mixed in change what it sends."""
    from decent_optim_wrapper.topo import TopologyFactory

    topo = TopologyFactory.create(topology, 4)
    x = start.clone()
    windows = [RadiusWindow(options) for _ in range(4)]
    probation: list[dict[int, int]] = [{} for _ in range(4)]  # receiver -> sender -> rounds left out
    for r in range(ROUNDS):
        w = topo.mixing_matrix(r)
        if mode == "flipping":
            x[3] = -x[3]  # in place, after its step: what it sends and what it mixes into
        sent = x.clone()
        if mode == "negated" or (mode == "alternating" and r % 2 == 1):
            sent[3] = -x[3]
        new = x.clone()
        for i in range(4):
            radius, norms = windows[i].radius(), []
            update = torch.zeros_like(x[i])
            for j in range(4):
                if j == i or w[i, j] == 0:
                    continue
                d = sent[j] - sent[i]
                norm = float(torch.linalg.vector_norm(d))
                norms.append(norm)
                trusted = len(windows[i].state()) == options.window or norm > float(x[i].norm())
                if trusted and options.drop_beyond is not None and norm > options.drop_beyond * radius:
                    if radius > 0:
                        probation[i][j] = options.probation
                    continue
                if probation[i].get(j, 0) > 0:
                    probation[i][j] -= 1
                    continue
                update.add_(d, alpha=float(w[i, j]) * clip_scale(norm, radius))
            new[i] = x[i] + update
            windows[i].add(norms)
        x = new
        if not stale:
            x[3] = start[3]
    return x


@pytest.mark.parametrize("mode", FLIPPERS)
@pytest.mark.parametrize("options", [OPTIONS, DROPPING], ids=["clipped", "dropping"])
@pytest.mark.parametrize("topology", ["complete", "ring"])
def test_clipped_mixing_follows_the_simulation_under_sign_flippers(pool, topology, options, mode):
    # The attacker's own replica mixes by the rule (against what it sent) and what it sends next is
    # built from it: the stale replica of the in-place flipper, the honest replica under the others.
    results = pool(4).run(_flipped_rounds, topology, options, mode)
    start = results[0][0]
    want = _simulate_flipper(start, topology, options, mode)
    assert not torch.equal(want[:3], _simulate_flipper(start, topology, options, mode, stale=False)[:3])
    for rank in range(3):
        got = results[rank][1]
        # the same operations in the same order; the norms alike: a few u of the largest entry
        torch.testing.assert_close(got, want[rank], rtol=0, atol=16 * U64 * start.abs().max().item())
        assert got.abs().max() < 2 * start[:3].abs().max(), "an honest replica was dragged away"


# -- training with an attacker -------------------------------------------------------------------------
def _attack_after_each_step(optimizer: torch.optim.Optimizer, attack: str) -> None:
    """After each local step the attacker's parameters become what it sends: its model scaled by 100,
    random values, or the negated model (an SGD like everyone's otherwise, so the front-ends accept it)."""
    generator = torch.Generator().manual_seed(5)

    @torch.no_grad()
    def hook(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for group in opt.param_groups:
            for p in group["params"]:
                if attack == "scaled":
                    p.mul_(100.0)
                elif attack == "random":
                    p.copy_(torch.randn(p.shape, generator=generator, dtype=p.dtype) * 10)
                else:  # negated
                    p.neg_()

    optimizer.register_step_post_hook(hook)


ATTACKER = 3


def _probe_loss(model: nn.Module) -> float:
    g = torch.Generator().manual_seed(123)
    x = torch.randn(256, 6, generator=g)
    teacher = torch.randn(6, 3, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        return float(nn.functional.cross_entropy(model(x), (x @ teacher).argmax(1)))


def _under_attack(front_end: str, attack: str | None, clipped: Any, steps: int, **options: Any) -> dict:
    """4 ranks on a ring learning one teacher; rank 3 attacks (or not). The honest ranks' loss and
    their distance to their own mean at the end."""
    rank, model = dist.get_rank(), tiny_model()
    attacker = attack is not None and rank == ATTACKER
    teacher = torch.randn(6, 3, generator=torch.Generator().manual_seed(9))

    def make(params):
        optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.5)
        if attacker:
            _attack_after_each_step(optimizer, attack)
        return optimizer

    options = {"topology": "ring", **options}
    common = dict(
        clipped_gossip=clipped if not isinstance(clipped, bool) else (True if clipped else None), **options
    )
    if front_end == "optimizer":
        front = DecentOptimWrapper(make(model.parameters()), **common)
    else:
        front = DecentralizedDataParallel(model, lambda named: make([p for _, p in named]), **common)
    dropped: list[tuple[int, int]] = []  # the guard's "dropped" events: (step, whose difference)
    front.register_guard_hook(
        lambda event: (
            dropped.extend((event.step, s) for s in event.senders) if event.kind == "dropped" else None
        )
    )
    for step in range(steps):
        x, _ = batch(rank, step)
        loss = nn.functional.cross_entropy(model(x), (x @ teacher).argmax(1))
        if front_end == "optimizer":
            front.zero_grad()
            loss.backward()
            front.step()
        else:
            loss.backward()
    front.engine.wait_all()
    replicas = gather(flat(model))
    honest = [r for r in range(dist.get_world_size()) if attack is None or r != ATTACKER]
    mean = replicas[honest].mean(0)
    return {
        "loss": None if attacker else _probe_loss(model),
        "spread": float((replicas[honest] - mean).norm(dim=1).max()),
        "finite": bool(torch.isfinite(replicas[honest]).all()),
        "dropped": dropped,
    }


def _honest_loss(results: list[dict]) -> float:
    return max(r["loss"] for r in results if r["loss"] is not None)


@pytest.mark.parametrize("attack", ["scaled", "random", "negated"])
def test_an_attacker_drags_plain_gossip_away_but_not_clipped_gossip(pool, attack):
    # 4 ranks on a ring: the attacker is a neighbour of two of the three honest ranks, half their rounds.
    steps = 60
    clean_runs = pool(4).run(_under_attack, "optimizer", None, True, steps)
    clean = _honest_loss(clean_runs)
    clipped = pool(4).run(_under_attack, "optimizer", attack, True, steps)
    plain = _honest_loss(pool(4).run(_under_attack, "optimizer", attack, False, steps))
    assert all(r["finite"] for r in clipped)
    # Plain gossip is dragged to 4x the clean loss or more (scaled: to inf). Clipped gossip with its
    # defaults (differences beyond ten radii dropped): within 15% of the clean run for the scaled and
    # random attacks. On this tiny model the honest replicas differ by a good fraction of their norm,
    # so the negated model (twice the norm away) is sometimes within ten radii and clipped rather than
    # dropped: 1.16x the clean loss (measured), bound 1.25.
    assert not math.isfinite(plain) or plain >= 3 * clean, (plain, clean)
    bound = 1.25 if attack == "negated" else 1.15
    assert _honest_loss(clipped) <= bound * clean, (_honest_loss(clipped), clean)
    # The guard's counters ("dropped": a difference beyond ten radii left out): the attacker's
    # neighbours leave it out (the negated model, sometimes within ten radii of one of them, by one at
    # least), and no honest difference is ever left out, with or without the attacker (under the radius
    # alone, before the warm-up rule: one at step 3 of the clean run).
    senders = [{sender for _, sender in r["dropped"]} for r in clipped[:ATTACKER]]
    if attack == "negated":
        assert ATTACKER in senders[0] | senders[2], senders
    else:
        assert senders == [{ATTACKER}, set(), {ATTACKER}], senders
    honest_drops = [d for r in clean_runs for d in r["dropped"]]
    honest_drops += [
        (step, sender) for r in clipped[:ATTACKER] for step, sender in r["dropped"] if sender != ATTACKER
    ]
    assert honest_drops == [], honest_drops


@pytest.mark.parametrize(
    ("front_end", "options"),
    [
        ("module", {}),
        ("optimizer", {"compression": "int8"}),
        ("optimizer", {"sync_every": 4, "sync_delay": 1}),
        ("optimizer", {"host_staging": True}),
    ],
    ids=["module", "int8", "low-communication", "staged"],
)
def test_clipped_gossip_holds_on_both_front_ends_and_composes(pool, front_end, options):
    steps = 60
    clean = pool(4).run(_under_attack, front_end, None, True, steps, **options)
    clipped = pool(4).run(_under_attack, front_end, "scaled", True, steps, **options)
    assert all(r["finite"] for r in clipped)
    assert _honest_loss(clipped) <= 1.15 * _honest_loss(clean), (_honest_loss(clipped), _honest_loss(clean))
    plain = pool(4).run(_under_attack, front_end, "scaled", False, steps, **options)
    assert not all(r["finite"] for r in plain) or _honest_loss(plain) >= 3 * _honest_loss(clean)


def _resume(save: bool, attack: str | None) -> tuple[torch.Tensor, list[Any]]:
    """12 steps on a ring, resumed from a checkpoint at step 5 into a fresh model and wrapper (or
    not); rank 3 flips its sign now and then when ``attack`` is given. The parameters and the
    probation the checkpoint held."""
    rank, model = dist.get_rank(), tiny_model()

    steps = [0]

    @torch.no_grad()
    def flip_now_and_then(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        # Sign flips after steps 1 and 2 of every 4: the model goes out negated after steps 1, 5, 9
        # and whole after 3, 7, 11, so the neighbour it meets at odd steps sees both.
        if steps[0] % 4 in (1, 2):
            for group in opt.param_groups:
                for p in group["params"]:
                    p.neg_()
        steps[0] += 1

    def make(params):
        optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.5)
        if attack is not None and rank == ATTACKER:
            optimizer.register_step_post_hook(flip_now_and_then)
        return optimizer

    front = DecentOptimWrapper(make(model.parameters()), topology="ring", clipped_gossip=True)
    held: list[Any] = []
    for step in range(12):
        x, y = batch(rank, step)
        front.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        front.step()
        if save and step == 5:
            state = front.state_dict()
            held = state["decent"]["gossip"]["clip_probation"]
            fresh_model = tiny_model(seed=3)
            fresh = DecentOptimWrapper(make(fresh_model.parameters()), topology="ring", clipped_gossip=True)
            fresh.load_state_dict(state)  # a fresh radius window, then the saved norms and probation
            assert fresh.state_dict()["decent"]["gossip"]["clip_probation"] == held
            model, front = fresh_model, fresh
    return flat(model), held


def _resume_pair(attack: str | None) -> tuple[torch.Tensor, torch.Tensor, list[Any]]:
    plain, _ = _resume(False, attack)
    resumed, held = _resume(True, attack)
    return plain, resumed, held


@pytest.mark.parametrize("attack", [None, "flipping"])
def test_a_checkpoint_with_clipped_gossip_resumes_bit_for_bit(pool, attack):
    # With a sign-flipper (rank 3) a neighbour holds it on probation at the checkpoint, and the resumed
    # wrapper holds the same (asserted on load). No honest rank is put on probation.
    results = pool(4).run(_resume_pair, attack)
    holding = set()
    for rank, (plain, resumed, held) in enumerate(results):
        assert torch.equal(plain, resumed)
        if rank == ATTACKER:  # its own replica is the odd one out: what it holds is of no account
            continue
        assert all(set(bucket) <= {ATTACKER} for bucket in held), (rank, held)
        if any(ATTACKER in bucket for bucket in held):
            holding.add(rank)
    assert holding <= {0, 2} and (attack is None) == (not holding), holding


@pytest.mark.parametrize("attack", ["scaled", "negated"])
def test_clipping_alone_bounds_the_pull_of_an_attacker(pool, attack):
    # The published rule (drop_beyond=None) on the same ring: every difference clipped, none dropped.
    # The negated model pushes the same way every round, and the drift it leaves (about its weight
    # times the radius a round) ends within 1.5x the clean loss (measured 1.37x; 1.65x with factor 1).
    steps, clipping = 60, ClippedGossip(drop_beyond=None)
    clean = _honest_loss(pool(4).run(_under_attack, "optimizer", None, clipping, steps))
    attacked = pool(4).run(_under_attack, "optimizer", attack, clipping, steps)
    assert all(r["finite"] for r in attacked)
    bound = 1.5 if attack == "negated" else 1.15
    assert _honest_loss(attacked) <= bound * clean, (_honest_loss(attacked), clean)

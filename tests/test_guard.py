"""Guarded mixing: one bad worker does not poison the fleet.

Fault injection on gloo ranks, both front-ends: a rank's loss made inf, its gradients NaN, its
parameters NaN between steps, a payload altered after its sender's check (plain and compressed
rounds), every member of a round bad. In each, the honest ranks stay finite and keep training, the
bad rank heals, everyone ends identical after ``global_avg``, and nothing hangs. The exact rule (a
withheld member's weight stays with the receiver; the withheld member takes the average of those
who sent) is compared with an independent float64 simulation from the topology's mixing matrix.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import batch, flat, forget_start_point, gather, set_distinct, tiny_model
from loguru import logger
from torch import nn

from decent_optim_wrapper import (
    DecentOptimWrapper,
    DecentralizedDataParallel,
    GuardEvent,
    NonFiniteReplicaError,
)
from decent_optim_wrapper.engine.exchange.guard import GuardLog, all_finite, drop_state, withhold_if_nonfinite
from decent_optim_wrapper.topo import TopologyFactory

U64 = 2.0**-53


# -- the pieces alone ----------------------------------------------------------------------------------
@pytest.mark.pure
def test_withholding_zeroes_values_that_are_not_finite_and_raises_the_flag():
    flag = torch.zeros(1)
    values = torch.tensor([1.0, 2.0, 3.0])
    assert withhold_if_nonfinite(values, flag) is False
    assert torch.equal(values, torch.tensor([1.0, 2.0, 3.0])) and flag.item() == 0.0
    for bad in (math.nan, math.inf, -math.inf):
        values = torch.tensor([1.0, bad, 3.0])
        assert withhold_if_nonfinite(values, flag) is True
        assert torch.equal(values, torch.zeros(3)) and flag.item() == 1.0


@pytest.mark.pure
def test_the_finiteness_check_sums_half_precision_in_fp32():
    # 3 x 60000 overflows an fp16 sum (max 65504) although every entry is finite
    assert all_finite(torch.full((3,), 60000.0, dtype=torch.float16))
    assert not all_finite(torch.tensor([1.0, math.nan], dtype=torch.bfloat16))


@pytest.mark.pure
def test_the_guard_log_counts_every_event_logs_each_kind_once_and_calls_hooks():
    log, seen, lines = GuardLog(rank=3), [], []
    handle = log.register_hook(seen.append)
    sink = logger.add(lines.append, level="WARNING")
    try:
        for step in range(3):
            log.record(GuardEvent("withheld", step, 0, "parameters", (2, 3)))
        log.record(GuardEvent("peer_withheld", 5, 1, "parameters", (3, 4), senders=(4,)))
    finally:
        logger.remove(sink)
    assert log.counts == {"withheld": 3, "peer_withheld": 1}
    assert [e.step for e in seen] == [0, 1, 2, 5]
    assert len(lines) == 2 and "rank 3" in lines[0] and "step 0" in lines[0] and "ranks [4]" in lines[1]
    handle.remove()
    log.record(GuardEvent("healed", 6, 0, "anchors", (2, 3)))
    assert len(seen) == 4
    with pytest.raises(TypeError, match="hook must be callable"):
        log.register_hook("not a function")  # type: ignore[arg-type]


@pytest.mark.pure
def test_drop_state_forgets_only_the_given_parameters():
    a, b = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2))
    opt = torch.optim.Adam([a, b], lr=0.1)
    (a.sum() + b.sum()).backward()
    opt.step()
    drop_state(opt, [a])
    assert a not in opt.state and "exp_avg" in opt.state[b]
    opt.step()  # starts a's state again as at its first step
    assert opt.state[a]["step"].item() == 1.0 and opt.state[b]["step"].item() == 2.0


# -- the exact rule against a simulation ---------------------------------------------------------------
def _simulate(x: torch.Tensor, w: torch.Tensor, bad: set[int]) -> torch.Tensor:
    """Guarded mixing of rows ``x`` (one per rank) by ``W``: a bad rank's weight stays with each receiver;
    a bad rank takes the weighted average of its good peers."""
    out = torch.empty_like(x)
    for i in range(x.shape[0]):
        good = [j for j in range(x.shape[0]) if w[i, j] > 0 and j not in bad]
        if i in bad:
            out[i] = sum(w[i, j] * x[j] for j in good) / sum(w[i, j] for j in good)
        else:
            kept = sum(w[i, j] for j in range(x.shape[0]) if w[i, j] > 0 and j in bad)
            out[i] = sum(w[i, j] * x[j] for j in good) + kept * x[i]
    return out


def _one_guarded_round(
    front_end: str, topology: str, bad: int, clipped: bool = False
) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Distinct dyadic replicas, rank ``bad``'s made NaN; one round launched and mixed with lr 0."""
    rank, model = dist.get_rank(), tiny_model(dtype=torch.float64)
    set_distinct(model, rank, dyadic=True)
    options: dict[str, Any] = {"topology": topology, "clipped_gossip": clipped}
    if front_end == "optimizer":
        front = DecentOptimWrapper(torch.optim.SGD(model.parameters(), lr=0.0), **options)
    else:
        front = DecentralizedDataParallel(
            model, lambda named: torch.optim.SGD([p for _, p in named], lr=0.0), **options
        )
    set_distinct(model, rank, dyadic=True)  # the wrapper broadcast rank 0's values
    before = gather(flat(model))
    if rank == bad:
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(math.nan)
    for _ in range(2):  # the first step launches the round, the second mixes it
        if front_end == "optimizer":
            front.step()
        else:
            x, _ = batch(rank, 0, torch.float64)
            model(x).sum().backward()
    return before, flat(model), front.guard_counts


@pytest.mark.parametrize("front_end", ["optimizer", "module"])
@pytest.mark.parametrize("topology", ["ring", "complete", "one-peer-exp"])
def test_a_withheld_replica_heals_and_its_peers_keep_its_weight_as_the_simulation_says(
    pool, front_end, topology
):
    results = pool(4).run(_one_guarded_round, front_end, topology, 2)
    before = results[0][0]
    w = TopologyFactory.create(topology, 4).mixing_matrix(0)
    want = _simulate(before, w, {2})
    for rank, (_, got, counts) in enumerate(results):
        # the same sums in another order and one division: a few u of the largest entry
        torch.testing.assert_close(got, want[rank], rtol=0, atol=8 * U64 * before.abs().max().item())
        assert torch.isfinite(got).all()
        if rank == 2:
            assert counts["withheld"] >= 1 and counts["healed"] >= 1
        elif w[rank, 2] > 0:
            assert counts["peer_withheld"] >= 1
        else:
            assert counts == {}


@pytest.mark.parametrize("front_end", ["optimizer", "module"])
def test_under_clipped_gossip_the_bad_rank_counts_withheld_and_healed_its_peers_not_finite(pool, front_end):
    # A clipped round gathers the values themselves: the bad rank's NaN slot is found at the mix by every
    # member (its peers count "not_finite" naming it), the bad rank counts "withheld" and "healed".
    results = pool(4).run(_one_guarded_round, front_end, "ring", 2, True)
    before = results[0][0]
    w = TopologyFactory.create("ring", 4).mixing_matrix(0)
    good = [j for j in range(4) if w[2, j] > 0 and j != 2]
    for rank, (_, got, counts) in enumerate(results):
        assert torch.isfinite(got).all()
        if rank == 2:  # the average of the peers that sent, as under plain gossip
            want = sum(w[2, j] * before[j] for j in good) / sum(w[2, j] for j in good)
            torch.testing.assert_close(got, want, rtol=0, atol=8 * U64 * before.abs().max().item())
            assert counts == {"withheld": 1, "healed": 1}, counts
        elif w[rank, 2] > 0:
            assert counts == {"not_finite": 1}, counts
        else:
            assert counts == {}, counts


# -- fault injection in training -----------------------------------------------------------------------
OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.05),
    "momentum": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.01),
}


def _all_nan(grad: torch.Tensor) -> torch.Tensor:
    return torch.full_like(grad, math.nan)


def _faulty_run(
    front_end: str,
    optimizer: str,
    fault: str,
    steps: int = 24,
    bad_rank: int = 1,
    at: int = 10,
    **options: Any,
) -> dict[str, Any]:
    """Train ``steps`` steps; at step ``at`` rank ``bad_rank`` suffers ``fault``. Returns what the
    tests check: finiteness throughout, the guard's counts and events, the averaged model."""
    rank, model = dist.get_rank(), tiny_model()
    make = OPTIMIZERS[optimizer]
    if front_end == "optimizer":
        front = DecentOptimWrapper(make(model.parameters()), **options)
    else:
        front = DecentralizedDataParallel(model, lambda named: make([p for _, p in named]), **options)
    events: list[GuardEvent] = []
    front.register_guard_hook(events.append)
    finite_after: list[bool] = []
    losses: list[float] = []
    for step in range(steps):
        x, y = batch(rank, step)
        bad_now = rank == bad_rank and step == at
        loss = nn.functional.cross_entropy(model(x), y)
        if bad_now and fault == "loss_inf":
            loss = loss * math.inf
        if front_end == "optimizer":
            front.zero_grad()
            loss.backward()
            if bad_now and fault == "grads_nan":
                for p in model.parameters():
                    p.grad.fill_(math.nan)
            front.step()
        else:
            handles = []
            if bad_now and fault == "grads_nan":
                handles = [p.register_hook(_all_nan) for p in model.parameters()]
            loss.backward()
            for handle in handles:
                handle.remove()
        if bad_now and fault == "params_nan":  # between steps, after the round was launched
            with torch.no_grad():
                for p in model.parameters():
                    p.fill_(math.nan)
        finite_after.append(bool(torch.isfinite(flat(model)).all()))
        losses.append(float(loss))
    front.global_avg()
    averaged = flat(model)
    return {
        "finite_after": finite_after,
        "counts": front.guard_counts,
        "events": [(e.kind, e.step, e.tensors) for e in events],
        "averaged": averaged,
        "everyone": gather(averaged),
    }


def _check_fleet_survived(
    results: list[dict[str, Any]], bad_rank: int = 1, at: int = 10, heal_within: int = 3
) -> None:
    """Honest ranks finite throughout; the bad rank finite again within ``heal_within`` steps (per-step
    gossip: the round launched at the bad step is mixed at the next; with local steps, the round
    that ends after it is folded in up to ``H + D`` steps later); all equal after the global average."""
    for rank, result in enumerate(results):
        finite = result["finite_after"]
        if rank != bad_rank:
            assert all(finite), f"honest rank {rank} was poisoned: {finite}"
        else:
            assert all(finite[:at]) and all(finite[at + heal_within :]), f"bad rank did not heal: {finite}"
        assert torch.isfinite(result["averaged"]).all()
        assert all(torch.equal(result["averaged"], r) for r in result["everyone"])
    assert results[bad_rank]["counts"].get("healed", 0) >= 1, results[bad_rank]["counts"]


@pytest.mark.parametrize("front_end", ["optimizer", "module"])
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_a_loss_made_inf_on_one_rank_does_not_poison_the_fleet(pool, front_end, optimizer):
    # The scenario: 4 workers on a ring, one rank's loss inf at step 10. Unguarded, every rank
    # was NaN by step 12 for good.
    results = pool(4).run(_faulty_run, front_end, optimizer, "loss_inf", topology="ring")
    _check_fleet_survived(results)
    assert ("withheld", 10, "parameters") in results[1]["events"]
    assert ("healed", 10, "parameters") in results[1]["events"]


@pytest.mark.parametrize("front_end", ["optimizer", "module"])
@pytest.mark.parametrize("fault", ["grads_nan", "params_nan"])
def test_nan_gradients_or_parameters_on_one_rank_heal(pool, front_end, fault):
    results = pool(4).run(_faulty_run, front_end, "momentum", fault, topology="ring")
    _check_fleet_survived(results)


def _nesterov(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.5, momentum=0.9, nesterov=True)


@pytest.mark.parametrize(
    "options",
    [
        {"topology": "ring", "compression": "int8"},
        {"topology": "ring", "compression": "topk:0.1:int8"},
        {"topology": "one-peer-exp", "sync_every": 4, "outer_optimizer": None},
        {
            "topology": "ring",
            "sync_every": 4,
            "sync_delay": 2,
            "outer_optimizer": _nesterov,
        },
        {"topology": "ring", "gradient_tracking": True},
        {"topology": "ring", "host_staging": True},
    ],
    ids=["int8", "topk", "periodic", "outer-nesterov", "tracking", "staged"],
)
def test_the_guard_holds_with_compression_local_steps_tracking_and_staging(pool, options):
    results = pool(4).run(_faulty_run, "optimizer", "adamw", "loss_inf", **options)
    every = options.get("sync_every", 1)
    delay = options.get("sync_delay", every)
    _check_fleet_survived(results, heal_within=3 if every == 1 else every + delay + 1)


def _guard_off_on_rank_0() -> dict[str, Any]:
    """Ranks may differ in nonfinite_guard: rank 0 checks nothing, rank 1 goes bad and heals."""
    rank, model = dist.get_rank(), tiny_model()
    front = DecentOptimWrapper(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), topology="ring", nonfinite_guard=rank != 0
    )
    finite = []
    for step in range(16):
        x, y = batch(rank, step)
        front.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        (loss * math.inf if rank == 1 and step == 6 else loss).backward()
        front.step()
        finite.append(bool(torch.isfinite(flat(model)).all()))
    return {"finite": finite, "counts": front.guard_counts}


def test_ranks_may_differ_in_the_guard_and_a_bad_rank_still_heals(pool):
    results = pool(4).run(_guard_off_on_rank_0)
    for rank, result in enumerate(results):
        assert all(result["finite"][9:]), (rank, result)
        if rank != 1:
            assert all(result["finite"]), (rank, result)
    assert results[1]["counts"]["healed"] >= 1
    assert results[0]["counts"].get("withheld", 0) == 0  # rank 0's weight-keeping still follows the flags


def _corrupted_after_the_check(compression: str | None, exact_first: bool = False) -> dict[str, Any]:
    """Rank 1's payload altered after its check at every round (entry 3 of a plain round made NaN; the
    first four bytes of its payload set to a NaN pattern: an exact first round's first fp32 value (with
    ``exact_first``: no common starting point), an int4 round's first bf16 scales)."""
    rank, model = dist.get_rank(), tiny_model(dtype=torch.float64 if compression is None else torch.float32)
    set_distinct(model, rank, dyadic=True)
    front = DecentOptimWrapper(
        torch.optim.SGD(model.parameters(), lr=0.0), topology="complete", compression=compression
    )
    if exact_first:
        forget_start_point(front)
    set_distinct(model, rank, dyadic=True)
    real_all_reduce, real_gather = dist.all_reduce, dist.all_gather_into_tensor

    def all_reduce(tensor, *args, **kwargs):
        if rank == 1 and tensor.dtype == torch.float64:
            tensor[3] = math.nan
        return real_all_reduce(tensor, *args, **kwargs)

    def all_gather_into_tensor(output, own, *args, **kwargs):
        if rank == 1:
            own[0:4] = torch.tensor([0xFF, 0x7F, 0xFF, 0x7F], dtype=torch.uint8)  # NaN as fp32 and as bf16
        return real_gather(output, own, *args, **kwargs)

    dist.all_reduce, dist.all_gather_into_tensor = all_reduce, all_gather_into_tensor
    before = gather(flat(model))
    try:
        for _ in range(6):
            front.step()
    finally:
        dist.all_reduce, dist.all_gather_into_tensor = real_all_reduce, real_gather
    after = flat(model)
    front.global_avg()
    return {"before": before, "after": after, "counts": front.guard_counts, "averaged": gather(flat(model))}


def test_a_plain_payload_altered_after_its_check_is_left_out_where_it_is_not_finite(pool):
    results = pool(4).run(_corrupted_after_the_check, None)
    before = results[0]["before"]  # the distinct replicas of the start (complete rounds: the mean at once)
    mean = before.mean(0)
    for rank, result in enumerate(results):
        after = result["after"]
        assert torch.isfinite(after).all()
        assert after[3] == before[rank, 3], "the NaN entry keeps each member's own value"
        torch.testing.assert_close(after[4:], mean[4:], rtol=0, atol=8 * U64 * before.abs().max().item())
        assert result["counts"]["not_finite"] >= 1
    assert all(torch.equal(r["averaged"], results[0]["averaged"]) for r in results)


@pytest.mark.parametrize("exact_first", [False, True])
def test_a_compressed_payload_that_decodes_to_nan_is_read_as_the_reference_by_everyone(pool, exact_first):
    results = pool(4).run(_corrupted_after_the_check, "int4", exact_first)
    for result in results:
        assert torch.isfinite(result["after"]).all()
        assert torch.isfinite(result["averaged"]).all()
    assert all(r["counts"].get("not_finite", 0) >= 1 for r in results if r is not results[1]), [
        (r["counts"], r["after"][:3]) for r in results
    ]
    # every member read the bad slot alike: the replicas still agree after the global average
    assert all(torch.equal(r["averaged"], results[0]["averaged"]) for r in results)


def _everyone_bad() -> str:
    model = tiny_model()
    front = DecentOptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1), topology="ring")
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(math.nan)
    front.step()
    try:
        front.step()
    except NonFiniteReplicaError as err:
        return str(err)
    return "no error"


def test_a_round_where_every_member_withheld_raises_naming_the_step_and_bucket(pool):
    messages = pool(2).run(_everyone_bad, timeout=60)
    for message in messages:
        assert "not finite" in message and "step 0" in message and "bucket 0" in message, message
        assert "restart from the last checkpoint" in message


def _resume_with_a_withheld_round_in_flight() -> tuple[torch.Tensor, torch.Tensor]:
    """Save right after rank 1 withheld a round (it is in flight), load it back, go on: the same bits
    as going on without saving."""
    rank = dist.get_rank()

    def run(save: bool) -> torch.Tensor:
        model = tiny_model()
        front = DecentOptimWrapper(
            torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), topology="ring"
        )
        for step in range(14):
            x, y = batch(rank, step)
            front.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            (loss * math.inf if rank == 1 and step == 6 else loss).backward()
            front.step()
            if save and step == 6:
                state = front.state_dict()
                front.load_state_dict(state)
        return flat(model)

    return run(False), run(True)


def test_a_checkpoint_with_a_withheld_round_in_flight_resumes_bit_for_bit(pool):
    for plain, resumed in pool(4).run(_resume_with_a_withheld_round_in_flight):
        assert torch.isfinite(plain).all()
        assert torch.equal(plain, resumed)

"""Multi-process: paced rounds survive a lost peer and take in a joiner (``on_peer_failure="continue"``).

Paced ranks stand at different steps of one round, so survivors and joiners resume by round, not
by step: the survivors launch rounds again from the furthest round any of them can still launch,
a joiner takes its donor's round position, and the pace messages restart at that round on the new
group. What must hold: the survivors (and the joiner) finish without a second failure (a round or a
pace message launched by some members and not others would hang until the timeout and count as
one), the world is what it should be, gossip alone still contracts the replicas (rounds are mixed
in the new groups), ``global_avg`` gives every rank the same bits (the mean of the replicas), and
the joiner starts at its donor's round, step and parameters, bit for bit.

Every run starts fresh gloo workers around a store hosted by the test process (``failures.py``).
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from failures import inject, join, request_worker, run_elastic, run_with_faults
from helpers import flat as _flat
from helpers import tiny_model
from torch import nn

from decent_optim_wrapper import DecentOptimWrapper, DecentralizedDataParallel, Pacing, init_elastic

pytestmark = pytest.mark.fleet

TIMEOUT = timedelta(seconds=3)
SYNC_EVERY = 3
ROUNDS = 14  # training rounds; then gossip alone for GOSSIP_ROUNDS more
GOSSIP_ROUNDS = 10


def flat(model: nn.Module) -> torch.Tensor:
    """The flat parameters, on the host (results travel to the test process)."""
    return _flat(model).cpu()


def scheduled(rank: int, round_: int) -> int:
    """Uneven counts that move around the ranks: 2, 3 or 4 inner steps per round."""
    return 2 + (rank + round_) % 3


def _pacing(kind: str) -> Pacing:
    return Pacing(schedule=scheduled) if kind == "schedule" else Pacing(repace_every=2)


def _step_seconds(rank_at_launch: int) -> float:
    """Measured runs emulate speeds by sleeping: rank 0 (at launch) 24 ms per step, the others 8 ms."""
    return 0.024 if rank_at_launch == 0 else 0.008


def _build(model: nn.Module, front: str, **options: Any) -> Any:
    common = dict(topology="ring", sync_every=SYNC_EVERY, outer_optimizer=None, timeout=TIMEOUT, **options)
    if front == "module":
        return DecentralizedDataParallel(
            model, lambda named: torch.optim.SGD([p for _, p in named], lr=0.2), **common
        )
    return DecentOptimWrapper(torch.optim.SGD(model.parameters(), lr=0.2), **common)


def _step(front_end: Any, model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> None:
    loss = nn.functional.mse_loss(model(x), target)
    if isinstance(front_end, DecentralizedDataParallel):
        loss.backward()
    else:
        front_end.zero_grad()
        loss.backward()
        front_end.step()


def _inputs(seed: int, step: int) -> torch.Tensor:
    return torch.randn(16, 6, generator=torch.Generator().manual_seed(1000 * seed + step))


def _gossip_then_average(front_end: Any, model: nn.Module, probe: torch.Tensor) -> dict[str, Any]:
    """Rounds of gossip alone (learning rate 0), then the global average: what every check compares."""
    optimizer = front_end.optimizers[0] if isinstance(front_end, DecentralizedDataParallel) else front_end
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    spread = front_end.consensus_distance()
    while front_end.round_count < ROUNDS + GOSSIP_ROUNDS:
        _step(front_end, model, probe, model(probe).detach())  # zero gradient: the anchors only mix
    contracted = front_end.consensus_distance()
    before = flat(model)
    front_end.global_avg()
    return {
        "rank": front_end.rank,
        "world_size": front_end.world_size,
        "dist_world_size": dist.get_world_size(),
        "failures": front_end.peer_failures,
        "joins": front_end.peer_joins,
        "spread": spread,
        "contracted": contracted,
        "before": before,
        "averaged": flat(model),
        "pace": front_end.pace_report(),
    }


def _survive(rank: int, world_size: int, port: int, front: str, kind: str, fault: dict[str, Any]):
    store = join(rank, world_size, port)
    model = tiny_model()
    teacher = torch.randn(6, 3, generator=torch.Generator().manual_seed(0))
    probe = torch.randn(64, 6, generator=torch.Generator().manual_seed(1))
    front_end = _build(model, front, on_peer_failure="continue", store=store, pacing=_pacing(kind))
    losses, round_start = [], 0
    while front_end.round_count < ROUNDS:
        began = time.perf_counter()
        at = (fault["rank"], fault["round"], "mid-round", round_start + 1)
        if (rank, front_end.round_count, fault["where"], front_end.step_count) == at:
            inject("kill")
        x = _inputs(rank, front_end.step_count)
        _step(front_end, model, x, x @ teacher)
        if kind == "measured":
            time.sleep(max(0.0, _step_seconds(rank) - (time.perf_counter() - began)))
        if front_end.round_ended:
            round_start = front_end.step_count
            with torch.no_grad():
                losses.append(nn.functional.mse_loss(model(probe), probe @ teacher).item())
            at = (fault["rank"], "round in flight", fault["round"] + 1)
            if (rank, fault["where"], front_end.round_count) == at:
                inject("kill")  # its anchors' round fault["round"] is in flight
    return {"losses": losses, **_gossip_then_average(front_end, model, probe)}


FAULTS = {
    "killed mid-round": {"rank": 2, "round": 5, "where": "mid-round"},
    "killed with its round in flight": {"rank": 1, "round": 4, "where": "round in flight"},
}


@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    "front, kind, case",
    [
        ("optimizer", "schedule", "killed mid-round"),
        ("module", "schedule", "killed with its round in flight"),
        ("optimizer", "measured", "killed mid-round"),
    ],
)
def test_paced_rounds_survive_a_lost_peer(front, kind, case):
    fault = FAULTS[case]
    outcome = run_with_faults(_survive, 4, (front, kind, fault), deadline_s=120)
    assert not outcome.errors, outcome.errors
    survivors = [r for r in range(4) if r != fault["rank"]]
    assert sorted(outcome.results) == survivors, outcome
    results = [outcome.results[r] for r in survivors]
    for new_rank, result in enumerate(results):
        assert (result["rank"], result["world_size"], result["dist_world_size"]) == (new_rank, 3, 3)
        (failure,) = result["failures"]  # a second one: rounds or pace messages did not line up
        assert failure.lost == (fault["rank"],) and failure.survivors == tuple(survivors)
        losses = result["losses"]
        assert sum(losses[-3:]) < sum(losses[:3]), losses
        # 10 rounds of ring gossip over 3 ranks (each a third of the spread's worst mode left) contract
        # the spread by far more than 10x
        assert result["contracted"] < 0.1 * result["spread"], (result["spread"], result["contracted"])
    _check_average(results)
    if kind == "measured":
        # Every survivor planned from the same pace message, sent by the survivors after the recovery.
        assert len({r["pace"].round_seconds for r in results}) == 1, [r["pace"] for r in results]


def _check_average(results: list[dict[str, Any]]) -> None:
    """Every rank holds the same bits: the mean of the replicas (k fp32 replicas, each rounded once in
    the sum, are within k u max|x| of the float64 mean)."""
    averaged = results[0]["averaged"]
    assert all(torch.equal(r["averaged"], averaged) for r in results[1:])
    replicas = torch.stack([r["before"] for r in results]).double()
    bound = len(results) * 2**-24 * float(replicas.abs().max())
    torch.testing.assert_close(averaged.double(), replicas.mean(0), rtol=0, atol=bound)


# -- a joiner ------------------------------------------------------------------------------------------
def _grow(
    index: int, world_size: int, port: int, workdir: str, front: str, device_type: str = "cpu"
) -> dict[str, Any]:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    # On a GPU: processes sharing it, each a node of its own (an NCCL group of one), gloo between.
    nodes = {} if device_type == "cpu" else {"shards": 1, "backend": "nccl"}
    joining = init_elastic(store, index, world_size, job="paced", timeout=timedelta(seconds=60), **nodes)
    device = torch.device(device_type)
    model = tiny_model().to(device)
    teacher = torch.randn(6, 3, generator=torch.Generator().manual_seed(0)).to(device)
    probe = torch.randn(64, 6, generator=torch.Generator().manual_seed(1)).to(device)
    front_end = _build(model, front, on_peer_failure="continue", pacing=Pacing(schedule=scheduled))
    donated: list[dict[str, Any]] = []
    front_end.register_join_hook(
        lambda join: donated.append(
            {
                "join": join,
                "params": flat(model),
                "step": front_end.step_count,
                "round": front_end.round_count,
            }
        )
    )
    received = None
    if front_end.joined is not None:
        received = {"params": flat(model), "step": front_end.step_count, "round": front_end.round_count}
    losses = []
    while front_end.round_count < ROUNDS:
        if not joining and index == 0 and front_end.round_count == 2 and front_end.round_ended:
            request_worker(workdir, "0")
        if not joining and front_end.round_count >= 2 and not front_end.peer_joins:
            time.sleep(0.6)  # until the joiner arrives: a process takes seconds to start
        x = _inputs(index, front_end.step_count).to(device)
        _step(front_end, model, x, x @ teacher)
        if front_end.round_ended:
            with torch.no_grad():
                losses.append(nn.functional.mse_loss(model(probe), probe @ teacher).item())
    result = _gossip_then_average(front_end, model, probe)
    joined = {"joining": joining, "joined": front_end.joined, "received": received, "donated": donated}
    return {**result, **joined, "losses": losses}


@pytest.mark.timeout(150)
@pytest.mark.parametrize("front", ["optimizer", "module"])
def test_a_joiner_takes_its_donors_round_and_paced_rounds_go_on(front):
    outcome = run_elastic(_grow, 3, (front,), deadline_s=120)
    assert not outcome.errors, outcome.errors
    results = sorted(outcome.results.values(), key=lambda r: r["rank"])
    assert [r["rank"] for r in results] == [0, 1, 2, 3]
    for result in results:
        assert (result["world_size"], result["dist_world_size"]) == (4, 4)
        assert not result["failures"]
        assert result["losses"][-1] < result["losses"][0], result["losses"]
        assert result["contracted"] < 0.1 * result["spread"], (result["spread"], result["contracted"])
    (joiner,) = [r for r in results if r["joining"]]
    join = joiner["joined"]
    donor_rank = join.donors[join.joined.index(join.rank)]
    (donation,) = [d for d in results[donor_rank]["donated"] if d["join"].joined == join.joined]
    received = joiner["received"]
    assert (received["step"], received["round"]) == (donation["step"], donation["round"])
    assert torch.equal(received["params"], donation["params"])
    _check_average(results)

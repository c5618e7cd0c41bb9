"""Surviving a lost peer (``on_peer_failure="continue"``): kill or hang a rank, the others go on.

Every run starts 4 fresh gloo workers around a store hosted by the test process (as torchrun's
agent hosts it); one is killed with SIGKILL or hangs at a chosen point. The survivors must finish,
agree on the new world, keep training (their loss falls), reach consensus by gossip, and
``global_avg`` must average exactly the survivors' replicas.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from failures import inject, join, run_with_faults
from helpers import flat, tiny_model
from torch import nn

from decent_optim_wrapper import DecentOptimWrapper, DecentralizedDataParallel
from decent_optim_wrapper.engine.fleet.membership import (
    ChannelReport,
    Decision,
    Membership,
    PeerLost,
    Report,
    nodes_of,
    whole_nodes,
)
from decent_optim_wrapper.engine.survival import Survival

pytestmark = pytest.mark.dist

TIMEOUT = timedelta(seconds=3)
STEPS = 36
AVERAGE_AT = 10  # global_avg then revert after this step, as an evaluation would


def _train(rank: int, world_size: int, port: int, front: str, fault: dict[str, Any], options: dict[str, Any]):
    store = (
        join(rank, world_size, port)
        if not fault.get("store_in_rank0")
        else _join_rank0_store(rank, world_size, port)
    )
    model = tiny_model()
    teacher = torch.randn(6, 3, generator=torch.Generator().manual_seed(0))
    probe = torch.randn(64, 6, generator=torch.Generator().manual_seed(1))
    loss_fn = nn.MSELoss()
    common = dict(timeout=TIMEOUT, on_peer_failure="continue", store=store, **options)
    if front == "module":
        ddp = DecentralizedDataParallel(
            model, lambda named: torch.optim.SGD([p for _, p in named], lr=0.2), topology="ring", **common
        )
        front_end: Any = ddp

        def step(t: int) -> None:
            x = _inputs(rank, t)
            loss_fn(ddp(x), x @ teacher).backward()
    else:
        opt = DecentOptimWrapper(torch.optim.SGD(model.parameters(), lr=0.2), topology="ring", **common)
        front_end = opt

        def step(t: int) -> None:
            x = _inputs(rank, t)
            opt.zero_grad()
            loss_fn(model(x), x @ teacher).backward()
            opt.step()

    seen: list[Any] = []
    front_end.register_peer_failure_hook(seen.append)
    losses = []
    for t in range(STEPS):
        if fault.get("rank") == rank and fault["step"] == t and fault["where"] == "before_step":
            inject(fault["how"])
        step(t)
        with torch.no_grad():  # this replica's loss on data every rank shares: falls while it learns
            losses.append(loss_fn(model(probe), probe @ teacher).item())
        if fault.get("rank") == rank and fault["step"] == t and fault["where"] == "after_step":
            inject(fault["how"])  # its round of step t is in flight
        if t == AVERAGE_AT:
            if fault.get("rank") == rank and fault["where"] == "in_global_avg":
                # Killed a moment into global_avg: before, during or after its all-reduce, all survived.
                threading.Timer(0.002, inject, (fault["how"],)).start()
            front_end.global_avg()
            if fault.get("rank") == rank and fault["where"] == "after_global_avg":
                inject(fault["how"])
            front_end.revert_global_avg()
    trained = flat(model)
    # Gossip alone (no update) contracts the survivors' replicas towards their mean.
    spread = front_end.consensus_distance()
    for _ in range(30):
        if front == "module":
            (ddp(probe).sum() * 0).backward()
        else:
            opt.zero_grad()
            opt.step()
    contracted = front_end.consensus_distance()
    before = flat(model)
    front_end.global_avg()
    return {
        "rank": front_end.rank,
        "world_size": front_end.world_size,
        "dist_world_size": dist.get_world_size(),
        "failures": front_end.peer_failures,
        "hooked": seen,
        "losses": losses,
        "trained": trained,
        "spread": spread,
        "contracted": contracted,
        "before": before,
        "averaged": flat(model),
    }


def _inputs(rank: int, step: int) -> torch.Tensor:
    """Fresh inputs per rank and step from one distribution: every replica learns the same teacher."""
    return torch.randn(16, 6, generator=torch.Generator().manual_seed(1000 * rank + step))


def _join_rank0_store(rank: int, world_size: int, port: int) -> dist.Store:
    """Plain init_process_group: rank 0 hosts the store the group and the library meet in.

    Rank 0 binds its store to a port the kernel picks (a guessed port may be taken: by a gloo socket
    of another test, say) and posts it in the parent's store, used for nothing else here.
    """
    rendezvous = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    if rank == 0:
        store = dist.TCPStore(
            "127.0.0.1", 0, world_size, True, timeout=timedelta(seconds=30), wait_for_workers=False
        )
        rendezvous.set("rank0_store_port", str(store.port))
    else:
        host_port = int(rendezvous.get("rank0_store_port"))
        store = dist.TCPStore("127.0.0.1", host_port, world_size, False, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    return store


def _check_survivors(outcome, lost: int, world_size: int = 4) -> list[dict[str, Any]]:
    survivors = [r for r in range(world_size) if r != lost]
    assert not outcome.errors, outcome.errors
    assert sorted(outcome.results) == survivors, outcome
    results = [outcome.results[r] for r in survivors]
    for new_rank, result in enumerate(results):
        assert (result["rank"], result["world_size"]) == (new_rank, world_size - 1)
        assert result["dist_world_size"] == world_size - 1  # the default group is the survivors'
        (failure,) = result["failures"]
        assert result["hooked"] == result["failures"]
        assert failure.lost == (lost,) and failure.survivors == tuple(survivors)
        assert (failure.previous_world_size, failure.world_size) == (world_size, world_size - 1)
        losses = result["losses"]
        # Still learning after the failure: windows of 6 steps (two rounds of sync_every=3), so that
        # low-communication gossip's saw-tooth between rounds averages out.
        after = losses[failure.step + 1 : failure.step + 7]
        assert sum(losses[-6:]) < sum(after) < sum(losses[:6]), losses
        # 30 rounds of ring gossip over 3 ranks contract the spread by far more than 10x
        assert result["contracted"] < 0.1 * result["spread"], (result["spread"], result["contracted"])
    # global_avg: every survivor holds the same bits, the average of the survivors' replicas. The
    # sum of k fp32 replicas, each rounded once, is within k u max|x| of the float64 mean.
    averaged = results[0]["averaged"]
    for result in results[1:]:
        assert torch.equal(result["averaged"], averaged)
    replicas = torch.stack([r["before"] for r in results]).double()
    bound = len(results) * 2**-24 * float(replicas.abs().max())
    torch.testing.assert_close(averaged.double(), replicas.mean(0), rtol=0, atol=bound)
    return results


FAULTS = {
    "killed mid-training": {"rank": 2, "how": "kill", "where": "before_step", "step": 13},
    "killed with its round in flight": {"rank": 1, "how": "kill", "where": "after_step", "step": 6},
    "killed right after global_avg": {
        "rank": 3,
        "how": "kill",
        "where": "after_global_avg",
        "step": AVERAGE_AT,
    },
    "killed during global_avg": {"rank": 1, "how": "kill", "where": "in_global_avg", "step": AVERAGE_AT},
    "hung mid-training": {"rank": 2, "how": "hang", "where": "before_step", "step": 13},
    # Its neighbours' rounds of that step never complete: they find out while global_avg waits for
    # them, before it saves the snapshot a revert restores.
    "killed in the step before global_avg": {
        "rank": 1,
        "how": "kill",
        "where": "before_step",
        "step": AVERAGE_AT,
    },
    "hung in the step before global_avg": {
        "rank": 1,
        "how": "hang",
        "where": "before_step",
        "step": AVERAGE_AT,
    },
}


@pytest.mark.fleet
@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", list(FAULTS))
def test_survivors_of_a_lost_peer_finish_the_run(case):
    fault = FAULTS[case]
    hung = (fault["rank"],) if fault["how"] == "hang" else ()
    outcome = run_with_faults(_train, 4, ("optimizer", fault, {}), deadline_s=90, expect_hung=hung)
    _check_survivors(outcome, fault["rank"])


@pytest.mark.fleet
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "front, options",
    [
        ("module", {}),
        ("optimizer", {"compression": "bf16"}),
        ("optimizer", {"compression": "topk:0.1:int2"}),
        ("optimizer", {"gradient_tracking": True}),
        ("module", {"sync_every": 3, "outer_optimizer": None}),
        ("optimizer", {"host_staging": True}),
        ("module", {"host_staging": True, "compression": "int8"}),
    ],
    ids=["module", "bf16", "sparse", "tracking", "local-steps", "host-staged", "host-staged-int8"],
)
def test_every_feature_survives_a_lost_peer(front, options):
    fault = FAULTS["killed mid-training"]
    outcome = run_with_faults(_train, 4, (front, fault, options), deadline_s=90)
    _check_survivors(outcome, fault["rank"])


@pytest.mark.fleet
@pytest.mark.timeout(120)
def test_losing_the_store_host_stops_the_survivors_with_a_named_error():
    # With plain init_process_group, rank 0 hosts the store: its death leaves nowhere to meet.
    fault = {"rank": 0, "how": "kill", "where": "before_step", "step": 5, "store_in_rank0": True}
    outcome = run_with_faults(_train, 4, ("optimizer", fault, {}), deadline_s=90)
    assert not outcome.results
    for rank in (1, 2, 3):
        assert "PeerFailureError" in outcome.errors[rank], outcome.errors[rank]
        assert "store" in outcome.errors[rank]


# -- the decision rule, on its own ---------------------------------------------------------------


def _channel(pending, group, state="running", launched=None, discarded=None, bucket=0):
    return ChannelReport("params", bucket, pending, group, state, launched, discarded)


@pytest.mark.pure
def test_a_round_among_survivors_is_mixed_only_if_every_member_launched_it():
    mine = _channel(7, (0, 1), launched=7)
    both = Decision(0, (Report(0, 0, 8, (mine,)), Report(1, 1, 8, (_channel(7, (0, 1), launched=7),))))
    assert both.finishes(mine)
    behind = Decision(0, (Report(0, 0, 8, (mine,)), Report(1, 1, 7, (_channel(6, (1, 2), launched=6),))))
    assert not behind.finishes(mine)
    mixed_already = Decision(
        0, (Report(0, 0, 8, (mine,)), Report(1, 1, 9, (_channel(None, None, launched=8),)))
    )
    assert mixed_already.finishes(mine)
    dropped = Decision(
        0, (Report(0, 0, 8, (mine,)), Report(1, 1, 8, (_channel(None, None, launched=7, discarded=7),)))
    )
    assert not dropped.finishes(mine)


@pytest.mark.pure
def test_a_round_with_a_lost_member_is_mixed_only_where_it_arrived():
    survivors = (Report(0, 0, 5, ()), Report(2, 2, 5, ()))
    assert Decision(0, survivors).finishes(_channel(4, (0, 1), state="done", launched=4))
    assert not Decision(0, survivors).finishes(_channel(4, (0, 1), state="running", launched=4))
    assert not Decision(0, survivors).finishes(_channel(4, (0, 1), state="failed", launched=4))
    assert not Decision(0, survivors).finishes(_channel(None, None))


@pytest.mark.pure
def test_new_rounds_start_where_the_furthest_survivor_is():
    assert Decision(0, (Report(0, 0, 5, ()), Report(3, 1, 7, ()))).resume_step == 7


@pytest.mark.pure
def test_in_a_job_of_nodes_only_whole_nodes_go_on_and_each_shard_world_settles_its_own_rounds():
    # 3 nodes x 2 shards: members are ranks at launch (node * 2 + shard); Report.rank is the node.
    def report(member, node, channels=()):
        return Report(member, node, 5, channels, "updating", member % 2)

    reports = [report(0, 0), report(1, 0), report(3, 1), report(2, 1), report(5, 2)]  # 4 is lost
    kept = whole_nodes(reports, shards=2)
    assert [r.member for r in kept] == [0, 1, 2, 3]  # node 2 lost a rank: it goes whole
    decision = Decision(0, kept, shards=2)
    assert decision.nodes() == [0, 1] and nodes_of([0, 1, 2, 3, 4, 5], 2) == [0, 1, 2]
    # A round of shard world 1 between nodes 0 and 1: node 1's shard-1 report speaks for it.
    mine = _channel(4, (0, 1), launched=4)
    theirs_shard_1 = _channel(4, (0, 1), launched=4)
    theirs_shard_0 = _channel(3, (1, 2), launched=3)
    decision = Decision(
        0,
        (
            report(0, 0),
            report(1, 0, (mine,)),
            report(2, 1, (theirs_shard_0,)),
            report(3, 1, (theirs_shard_1,)),
        ),
        shards=2,
    )
    assert decision.finishes(mine, shard=1)
    assert not decision.finishes(mine, shard=0)  # shard 0's report of node 1 is behind
    singles = [Report(2, 1, 5, ()), Report(0, 0, 5, ())]  # whole replicas: every reporter goes on
    assert [r.member for r in whole_nodes(singles, shards=1)] == [0, 2]


# -- detection on a loaded machine, on its own ------------------------------------------------------


class _Work:
    """A collective as ``Membership.wait`` sees it: completes after ``polls`` polls; the first poll
    blocks ``stall_s`` seconds, as if this process were descheduled while it waited."""

    def __init__(self, polls: int, stall_s: float = 0.0) -> None:
        self.polls, self.stall_s = polls, stall_s

    def is_completed(self) -> bool:
        if self.stall_s:
            time.sleep(self.stall_s)
            self.stall_s = 0.0
        self.polls -= 1
        return self.polls < 0

    def wait(self) -> bool:
        return True


def _membership(timeout_s: float) -> tuple[Membership, dist.Store]:
    store = dist.HashStore()
    return Membership(store, "test", 0, 2, timedelta(seconds=timeout_s)), store


def _failure(cause: BaseException | None) -> Exception:
    return RuntimeError(f"lost: {cause}")


@pytest.mark.pure
def test_a_collective_that_never_completes_is_a_lost_peer_after_the_timeout():
    membership, _ = _membership(0.3)
    start = time.monotonic()
    with pytest.raises(PeerLost, match="lost: None"):
        membership.wait([_Work(polls=10**9)], torch.device("cpu"), None, _failure)
    assert 0.3 <= time.monotonic() - start < 2.0
    membership.close()


@pytest.mark.pure
def test_time_a_rank_spends_descheduled_does_not_count_against_its_peers():
    # 1 s without polling (> the 0.3 s timeout), then the collective is found complete: the rank
    # was starved, its peer was not silent. Counting that second would drop a live peer.
    membership, _ = _membership(0.3)
    membership.wait([_Work(polls=3, stall_s=1.0)], torch.device("cpu"), None, _failure)
    membership.close()


@pytest.mark.pure
def test_a_completed_collective_still_follows_a_peer_into_recovery():
    # A peer gave up on a round this rank then completed: this rank must join its recovery now,
    # or that peer decides alone and the job splits in two.
    membership, store = _membership(3.0)
    membership.wait([_Work(polls=0)], torch.device("cpu"), None, _failure)
    store.set(f"decent-optim-wrapper/test/g{membership.generation}/lost", "1")
    with pytest.raises(PeerLost, match="another rank reported a lost peer"):
        membership.wait([_Work(polls=0)], torch.device("cpu"), None, _failure)
    membership.close()


@pytest.mark.pure
def test_a_recovery_that_keeps_every_member_loses_nobody_and_runs_no_hook():
    class Rejoined:  # every member reports: the timeout was a false alarm
        members, member, shards, shard = [0, 1, 2], 1, 1, 0

        def agree(self, report, cause):
            return Decision(0, tuple(Report(m, m, 4, ()) for m in self.members))

        def reform(self, decision, backend, timeout):
            pass

    survival = Survival(Rejoined(), timedelta(seconds=3))  # type: ignore[arg-type]
    hooked, settled, rewired = [], [], []
    survival.register_hook(hooked.append)
    failure = survival.recover(
        RuntimeError("timeout"),
        step=4,
        position=4,
        rank=1,
        reports=list,
        settle=settled.append,
        rewire=lambda decision, before: rewired.append(before),
    )
    assert failure is None and not hooked and not survival.failures
    assert len(settled) == 1 and rewired == [[0, 1, 2]]  # rounds settled, groups re-formed all the same

"""Joining a running job: workers started later take a member's replica, nobody else restarts.

Each run starts fresh gloo workers around a store hosted by the test process (as a launcher hosts
it); workers enter through :func:`~decent_optim_wrapper.init_elastic`. A worker asks the parent for
one more process (or the parent restarts a killed one); the new process runs the same function,
finds the job running, and joins. Members sleep a little per step only until the join happened, so
that the joiner (seconds to start) arrives mid-run; every worker stops at the same step count.
"""

from __future__ import annotations

import copy
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from failures import inject, note_losses, request_worker, run_elastic
from helpers import flat as _flat
from torch import nn

from decent_optim_wrapper import (
    DecentOptimWrapper,
    DecentralizedDataParallel,
    JoinRejectedError,
    init_elastic,
)
from decent_optim_wrapper.engine.fleet.sealing import Seal

pytestmark = pytest.mark.fleet

TIMEOUT = timedelta(seconds=5)
STEPS = 40
GOSSIP_ONLY = 20


def flat(model: nn.Module) -> torch.Tensor:
    """The flat parameters, on the host (results travel to the test process)."""
    return _flat(model).cpu()


def _model(width: int = 5) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, width), nn.Tanh(), nn.Linear(width, 3)).double()


def _inputs(index: int, step: int) -> torch.Tensor:
    return torch.randn(
        16, 6, generator=torch.Generator().manual_seed(1000 * index + step), dtype=torch.float64
    )


def _optimizer_state(state: dict[str, Any]) -> list[torch.Tensor]:
    """Every tensor of an optimizer state dict, in a fixed order."""
    tensors = []
    for key in sorted(state["state"]):
        for name in sorted(state["state"][key]):
            value = state["state"][key][name]
            tensors.append(value.cpu().clone() if isinstance(value, torch.Tensor) else torch.tensor(value))
    return tensors


def _train(index: int, world_size: int, port: int, workdir: str, plan: dict[str, Any]) -> dict[str, Any]:
    import os

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    # plan["node_backend"]: each process a node of its own (shards=1) whose group is on that backend,
    # the groups between nodes the engine's gloo groups; plan["device"]: where the model lives (the
    # GPU tier shares one GPU between the processes).
    nodes = {} if "node_backend" not in plan else {"shards": 1, "backend": plan["node_backend"]}
    # plan["secret"]: the job secret of every worker; plan["joiner_secret"]: a later worker's instead.
    secret = plan.get("joiner_secret", plan.get("secret")) if index >= world_size else plan.get("secret")
    try:
        joining = init_elastic(
            store, index, world_size, job="test", timeout=timedelta(seconds=60), secret=secret, **nodes
        )
    except JoinRejectedError:
        store.set("refused", "1")  # the members stop waiting for this joiner
        raise
    _inject_faults(plan, store, joining)  # before the front-end: a joiner joins inside its constructor
    device = torch.device(plan.get("device", "cpu"))
    model = _model(plan.get("joiner_width", 5) if joining else 5).to(device)
    teacher = torch.randn(6, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64).to(device)
    probe = torch.randn(64, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(device)
    loss_fn = nn.MSELoss()
    common: dict[str, Any] = dict(timeout=TIMEOUT, on_peer_failure="continue", **plan.get("options", {}))
    if plan["front"] == "module":
        ddp = DecentralizedDataParallel(
            model, lambda named: torch.optim.AdamW([p for _, p in named], lr=0.02), topology="ring", **common
        )
        front_end: Any = ddp

        def step(x: torch.Tensor) -> None:
            loss_fn(ddp(x), x @ teacher).backward()

        def replica_state() -> list[torch.Tensor]:
            return [t for o in ddp.optimizers for t in _optimizer_state(o.state_dict())]
    else:
        inner = torch.optim.AdamW(model.parameters(), lr=0.02)
        try:
            opt = DecentOptimWrapper(inner, topology="ring", **common)
        except JoinRejectedError:
            store.set("refused", "1")  # the members stop waiting for this joiner
            raise
        front_end = opt

        def step(x: torch.Tensor) -> None:
            opt.zero_grad()
            loss_fn(model(x), x @ teacher).backward()
            opt.step()

        def replica_state() -> list[torch.Tensor]:
            return _optimizer_state(inner.state_dict())

    scheduler = torch.optim.lr_scheduler.StepLR(
        front_end.optimizers[0] if plan["front"] == "module" else front_end, step_size=7, gamma=0.9
    )
    front_end.register_join_state("scheduler", scheduler)
    donated: list[dict[str, Any]] = []

    def on_join(join: Any) -> None:  # on members: what a donor held when it donated
        donated.append(
            {"join": join, "params": flat(model), "state": replica_state(), "step": front_end.step_count}
        )

    front_end.register_join_hook(on_join)
    note_losses(front_end, workdir, index)
    received = None
    if front_end.joined is not None:
        received = {
            "params": flat(model),
            "state": replica_state(),
            "step": front_end.step_count,
            "last_epoch": scheduler.last_epoch,
        }
    start = front_end.step_count
    losses = []
    saved = None
    for t in range(start, STEPS):
        if t == plan.get("checkpoint_at"):
            assert front_end.peer_joins or joining, "the join came too late for this test's checkpoint"
            saved = (_state(front_end), scheduler.state_dict())
        if not joining and t == plan.get("request_at") and index == 0 and plan.get("forge"):
            _forge(store, front_end.engine.survival.membership.run)  # an outsider without the secret
        if not joining and t == plan.get("request_at") and index in plan.get("requesters", (0,)):
            for k in range(plan.get("joiners", 1)):
                request_worker(workdir, f"{index}-{k}")
        if not joining and plan.get("kill") == (index, t):
            inject("kill")
        admitted = sum(len(join.joined) for join in front_end.peer_joins)
        # plan["until_world"]: wait for the world to reach that size instead (a joiner admitted, then
        # lost wiring its groups on a loaded machine, applies again: its first admission counts too).
        short = front_end.world_size < plan["until_world"] if "until_world" in plan else None
        if (
            (admitted < plan.get("joins", plan.get("joiners", 1)) if short is None else short)
            and not joining
            and t >= plan.get("request_at", 0)
            and not store.check(["refused"])
        ):
            # Until the joiners arrive: a process takes seconds to start, tens on a loaded machine
            # (the steps left after the request give them about 90 s: time for a joiner whose first
            # attempt failed, its group never forming, to apply again).
            time.sleep(2.5)
        step(_inputs(index, t).to(device))
        scheduler.step()
        with torch.no_grad():
            losses.append(loss_fn(model(probe), probe @ teacher).item())
    trained = flat(model)
    resumed = None
    if saved is not None:  # resume from the checkpoint written after the join: the same bits again
        _load(front_end, saved[0])
        scheduler.load_state_dict(saved[1])
        for t in range(plan["checkpoint_at"], STEPS):
            step(_inputs(index, t).to(device))
            scheduler.step()
        resumed = flat(model)
    # Gossip alone: zero gradients, no update (AdamW with lr 0); mixing keeps the sum of the replicas.
    for group in (front_end.optimizers[0] if plan["front"] == "module" else front_end).param_groups:
        group["lr"] = 0.0
        group["weight_decay"] = 0.0
    before_gossip = flat(model)
    for _ in range(GOSSIP_ONLY):
        if plan["front"] == "module":
            (ddp(probe).sum() * 0).backward()
        else:
            opt.zero_grad()
            model(probe).sum().mul(0).backward()
            opt.step()
    after_gossip = flat(model)
    front_end.global_avg()
    return {
        "index": index,
        "joining": joining,
        "rank": front_end.rank,
        "world_size": front_end.world_size,
        "dist_world_size": dist.get_world_size(),
        "joined": front_end.joined,
        "joins": front_end.peer_joins,
        "failures": front_end.peer_failures,
        "received": received,
        "donated": donated,
        "losses": losses,
        "trained": trained,
        "resumed": resumed,
        "before_gossip": before_gossip,
        "after_gossip": after_gossip,
        "averaged": flat(model),
        "last_epoch": scheduler.last_epoch,
        "recoveries": len(front_end.engine.survival.pauses),
        "guard_counts": front_end.guard_counts,
    }


FORGE_S = 20.0  # how long the outsider writes forged applications, 10 a second
FORGED_VERDICTS = 40  # verdicts written ahead of time at the slots' predictable keys


def _forge(store: dist.Store, run: str) -> None:
    """An outsider that reaches the store but has no secret: plain verdicts refusing whoever applies
    next, ahead of time, at every predictable verdict key, then a stream of plain applications."""
    from decent_optim_wrapper.engine.fleet.admission import JoinRequest, Verdict, slot_key
    from decent_optim_wrapper.engine.fleet.jobs import run_prefix

    plain, prefix = Seal(), run_prefix(run)
    for number in range(1, FORGED_VERDICTS + 1):
        key = f"{slot_key(prefix, number)}/verdict"
        store.set(key, plain.seal(Verdict(False, "refused by an outsider"), key))

    def applications() -> None:
        deadline, number = time.monotonic() + FORGE_S, 1
        while time.monotonic() < deadline:
            request = plain.seal(JoinRequest(number, 1000 + number, ()), slot_key(prefix, number))
            store.compare_set(slot_key(prefix, number), "", request)  # a taken slot: try the next
            number += 1
            time.sleep(0.1)

    threading.Thread(target=applications, daemon=True).start()


def _state(front_end: Any) -> dict[str, Any]:
    if isinstance(front_end, DecentralizedDataParallel):
        return copy.deepcopy(front_end.training_state_dict())
    return copy.deepcopy(front_end.state_dict())


def _load(front_end: Any, state: dict[str, Any]) -> None:
    if isinstance(front_end, DecentralizedDataParallel):
        front_end.load_training_state_dict(state)
    else:
        front_end.load_state_dict(state)


def _inject_faults(plan: dict[str, Any], store: dist.Store, joining: bool) -> None:
    """Faults inside a join, once per run (the store counts): the donor or the joiner dies mid-transfer,
    or the bytes arrive corrupted."""
    from decent_optim_wrapper.engine.fleet import growth

    fault = plan.get("fault")
    if fault == "donor killed" and not joining:
        send = growth.send_replica

        def send_or_die(*args: Any) -> None:
            if store.add("fault", 1) == 1:
                inject("kill")
            send(*args)

        growth.send_replica = send_or_die
    elif fault == "joiner killed" and joining and store.add("fault", 1) == 1:
        growth.receive_payload = lambda *args: inject("kill")  # the donor is sending
    elif fault == "corrupted" and joining:
        unpack = growth.unpack

        def corrupt_once(data: torch.Tensor, digest: bytes, seal: Any) -> dict[str, Any]:
            if store.add("fault", 1) == 1:
                data[len(data) // 2] ^= 1
            return unpack(data, digest, seal)

        growth.unpack = corrupt_once


def _by_rank(outcome) -> list[dict[str, Any]]:
    assert not outcome.errors, outcome.errors
    results = sorted(outcome.results.values(), key=lambda r: r["rank"])
    assert [r["rank"] for r in results] == list(range(len(results)))
    return results


def _check_transfers(results: list[dict[str, Any]]) -> None:
    """Every joiner started as its donor's replica, bit for bit, at its donor's step."""
    joiners = [r for r in results if r["joined"] is not None]
    assert joiners
    for joiner in joiners:
        join = joiner["joined"]
        donor_rank = join.donors[join.joined.index(join.rank)]
        # The donor's record of the same admission (ranks of that admission's world); after an aborted
        # transfer the admission that succeeded is the donor's last.
        donor = [
            d
            for r in results
            for d in r["donated"]
            if d["join"].rank == donor_rank
            and (d["join"].joined, d["join"].world_size, d["step"])
            == (join.joined, join.world_size, join.step)
        ][-1]
        received = joiner["received"]
        assert received["step"] == donor["step"] == join.step
        assert torch.equal(received["params"], donor["params"])
        assert len(received["state"]) == len(donor["state"]) > 0
        for mine, theirs in zip(received["state"], donor["state"], strict=True):
            assert torch.equal(mine, theirs)
        assert received["last_epoch"] == donor["step"]  # the scheduler came along


def _check_world(
    results: list[dict[str, Any]], world_size: int, mixing_only: bool = True, node_size: int | None = None
) -> None:
    """``node_size``: a job of nodes, whose default group is the node (of that many processes)."""
    for result in results:
        assert result["world_size"] == world_size
        assert result["dist_world_size"] == (world_size if node_size is None else node_size)
    if mixing_only:  # (an outer optimizer's momentum keeps moving the anchors without gradients)
        # Gossip alone keeps the sum of the replicas: float64 parameters, GOSSIP_ONLY rounds each
        # rounding every element once per term (3 terms on a ring): well within 1e-12 of the largest.
        before = torch.stack([r["before_gossip"] for r in results]).sum(0)
        after = torch.stack([r["after_gossip"] for r in results]).sum(0)
        torch.testing.assert_close(after, before, rtol=0, atol=1e-12 * float(before.abs().max()))
        spread = torch.stack([r["before_gossip"] for r in results]).std(0).max()
        contracted = torch.stack([r["after_gossip"] for r in results]).std(0).max()
        assert contracted < 0.1 * spread
    averaged = results[0]["averaged"]
    for result in results[1:]:
        assert torch.equal(result["averaged"], averaged)
    torch.testing.assert_close(
        averaged, torch.stack([r["after_gossip"] for r in results]).mean(0), rtol=0, atol=1e-14
    )
    for result in results:
        losses = result["losses"]
        assert losses[-1] < losses[0], losses
        if result["resumed"] is not None:
            assert torch.equal(result["resumed"], result["trained"])


@pytest.mark.timeout(200)
@pytest.mark.parametrize("front", ["optimizer", "module"])
def test_a_worker_joins_a_running_job_beyond_its_starting_size(front):
    outcome = run_elastic(_train, 3, ({"front": front, "request_at": 3, "checkpoint_at": 34},))
    results = _by_rank(outcome)
    assert len(results) == 4
    assert all(r["resumed"] is not None for r in results)
    _check_world(results, 4)
    _check_transfers(results)
    (joiner,) = [r for r in results if r["joining"]]
    assert joiner["rank"] == 3 and joiner["joined"].previous_rank == -1
    for member in results:
        if not member["joining"]:
            (join,) = member["joins"]
            assert (join.previous_world_size, join.world_size, join.joined) == (3, 4, (3,))


def _killed_and_back(restart_after_noted: int) -> list[dict[str, Any]]:
    """Rank 1 killed at step 6 and restarted once ``restart_after_noted`` survivors recorded the loss:
    the world back at 3, each joiner its donor's replica bit for bit; the members' results."""
    plan = {"front": "optimizer", "kill": (1, 6), "request_at": 6, "requesters": ()}
    outcome = run_elastic(_train, 3, (plan,), restart_killed=1, restart_after_noted=restart_after_noted)
    assert outcome.exitcodes[1] == -9
    results = _by_rank(outcome)
    assert len(results) == 3
    _check_world(results, 3)
    _check_transfers(results)
    members = [r for r in results if not r["joining"]]
    for member in members:
        assert [j.world_size for j in member["joins"]] == [3]
    return members


@pytest.mark.timeout(200)
def test_a_killed_worker_comes_back_and_the_world_returns_to_its_size():
    for member in _killed_and_back(restart_after_noted=2):  # the loss settled on both survivors first
        assert [f.world_size for f in member["failures"]] == [2]


@pytest.mark.timeout(200)
def test_a_killed_worker_restarted_at_once_comes_back_whether_or_not_the_loss_settled_first():
    # Restarted as soon as the parent sees it dead: it may apply while the survivors still agree on
    # the loss (then one change of membership drops rank 1 and admits it) or after (two changes).
    for member in _killed_and_back(restart_after_noted=0):
        assert [f.lost for f in member["failures"]] == [(1,)]


@pytest.mark.timeout(200)
def test_a_job_with_a_secret_survives_a_kill_and_takes_the_worker_back():
    # Every entry of the recovery and of the join sealed, the replica's digest an HMAC.
    secret = "a-secret-of-the-test-job-0123"
    outcome = run_elastic(
        _train,
        3,
        ({"front": "optimizer", "kill": (1, 6), "request_at": 6, "requesters": (), "secret": secret},),
        restart_killed=1,
        restart_after_noted=2,
    )
    assert outcome.exitcodes[1] == -9
    results = _by_rank(outcome)
    assert len(results) == 3
    _check_world(results, 3)
    _check_transfers(results)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("theirs", [None, "another-jobs-secret-9876543210"], ids=["none", "another"])
def test_a_joiner_without_the_jobs_secret_is_refused_and_the_members_go_on(theirs):
    plan = {"front": "optimizer", "request_at": 3, "give_up": True, "secret": "the-jobs-secret-0123456789"}
    outcome = run_elastic(_train, 3, ({**plan, "joiner_secret": theirs},))
    (refused,) = outcome.errors.values()
    assert "JoinRejectedError" in refused and "cannot verify it" in refused, refused
    results = sorted(outcome.results.values(), key=lambda r: r["rank"])
    assert len(results) == 3
    for result in results:
        assert result["world_size"] == 3 and not result["joins"]


@pytest.mark.timeout(200)
def test_an_outsider_without_the_secret_keeps_nobody_out_and_stalls_nothing():
    # Forged verdicts written ahead at every predictable key, and forged applications 10 a second,
    # while a worker with the secret joins.
    plan = {"front": "optimizer", "request_at": 3, "secret": "the-jobs-secret-0123456789", "forge": True}
    results = _by_rank(run_elastic(_train, 3, (plan,)))
    assert len(results) == 4
    _check_world(results, 4)
    _check_transfers(results)
    for member in (r for r in results if not r["joining"]):
        # One change of membership, the admission: the forged applications cost no agreement.
        assert member["recoveries"] == 1, member["recoveries"]
        assert member["guard_counts"].get("forged_application", 0) >= 1, member["guard_counts"]


@pytest.mark.timeout(200)
def test_several_workers_join_at_once():
    plan = {"front": "optimizer", "request_at": 3, "joiners": 2, "until_world": 5}
    outcome = run_elastic(_train, 3, (plan,))
    results = _by_rank(outcome)
    assert len(results) == 5
    _check_world(results, 5)
    _check_transfers(results)


@pytest.mark.timeout(200)
def test_a_worker_whose_model_differs_is_refused_and_the_members_go_on():
    outcome = run_elastic(
        _train, 3, ({"front": "optimizer", "request_at": 3, "joiner_width": 7, "give_up": True},)
    )
    (refused,) = outcome.errors.values()
    assert "JoinRejectedError" in refused, refused
    # The first parameter that differs, by its name (the wrapper's: its place in param_groups) and shapes.
    assert (
        "its parameter param_groups[0]['params'][0] (shape (7, 6)) differs from the running job's: it has "
        "shape (7, 6) here and (5, 6) in the job; start it with the job's code, model and options"
    ) in refused, refused
    results = sorted(outcome.results.values(), key=lambda r: r["rank"])
    assert len(results) == 3
    for result in results:
        assert result["world_size"] == 3 and not result["joins"]
    assert JoinRejectedError.__name__ in refused


def _nesterov(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.5, momentum=0.5, nesterov=True)


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    "options",
    [
        {"compression": "int8"},
        {"compression": "topk:0.1:int4", "sync_every": 2},
        {"gradient_tracking": True},
        {"sync_every": 3, "outer_optimizer": _nesterov},
        {"second_moment": "local"},
        {"host_staging": True, "compression": "int8"},
    ],
    ids=[
        "int8",
        "sparse-low-communication",
        "tracking",
        "low-communication",
        "local-second-moment",
        "host-staged",
    ],
)
def test_a_join_composes_with_every_option(options):
    outcome = run_elastic(_train, 3, ({"front": "optimizer", "request_at": 3, "options": options},))
    results = _by_rank(outcome)
    assert len(results) == 4
    _check_world(results, 4, mixing_only="outer_optimizer" not in options)
    _check_transfers(results)


@pytest.mark.timeout(180)
def test_a_donor_lost_during_its_transfer_the_joiner_applies_again():
    outcome = run_elastic(
        _train, 3, ({"front": "optimizer", "request_at": 3, "fault": "donor killed", "joins": 2},)
    )
    assert sorted(outcome.exitcodes.values()).count(-9) == 1
    results = _by_rank(outcome)
    assert len(results) == 3  # two members and the joiner
    _check_world(results, 3)
    _check_transfers(results)
    for member in results:
        if not member["joining"]:
            assert [f.world_size for f in member["failures"]] == [3]  # the donor, lost from 4


@pytest.mark.timeout(180)
def test_a_joiner_lost_during_its_transfer_is_dropped_and_its_restart_joins():
    plan = {"front": "optimizer", "request_at": 3, "fault": "joiner killed", "joins": 2}
    outcome = run_elastic(_train, 3, (plan,), restart_killed=1, restart_after_noted=3)  # the 3 members
    assert outcome.exitcodes[3] == -9
    results = _by_rank(outcome)
    assert len(results) == 4
    _check_world(results, 4)
    _check_transfers(results)
    for member in results:
        if not member["joining"]:
            assert [f.world_size for f in member["failures"]] == [3]  # the first joiner, lost from 4
            assert [j.world_size for j in member["joins"]] == [4, 4]


@pytest.mark.timeout(180)
def test_a_corrupted_transfer_is_refused_by_its_checksum_and_retried():
    outcome = run_elastic(
        _train, 3, ({"front": "optimizer", "request_at": 3, "fault": "corrupted", "joins": 2},)
    )
    results = _by_rank(outcome)
    assert len(results) == 4
    _check_world(results, 4)
    _check_transfers(results)
    for member in results:
        if not member["joining"]:
            assert len(member["joins"]) == 2 and len(member["failures"]) == 1


@pytest.mark.timeout(200)
def test_nodes_of_one_process_survive_a_kill_and_take_it_back():
    # The GPU tier's fleet (test_gpu_fleet) on CPU: each process a node of its own, whose group (gloo
    # here, NCCL on a GPU) is of one, and the groups between nodes the engine's own over the store.
    plan = {"front": "optimizer", "kill": (1, 6), "request_at": 6, "requesters": (), "node_backend": "gloo"}
    outcome = run_elastic(_train, 3, (plan,), restart_killed=1, restart_after_noted=2)
    assert outcome.exitcodes[1] == -9
    results = _by_rank(outcome)
    assert len(results) == 3
    _check_world(results, 3, node_size=1)
    _check_transfers(results)
    for member in results:
        if not member["joining"]:
            assert [f.world_size for f in member["failures"]] == [2]
            assert [j.world_size for j in member["joins"]] == [3]

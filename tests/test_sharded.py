"""Multi-process: decentralized HSDP. FSDP2 shards each replica over a mesh dimension, gossip runs along
the other, and the result equals the same wrapper on unsharded ranks.

The reference is independent of the sharding: ``R`` plain ranks (the default group, whole replicas),
where replica ``k``'s gradient is that of the mean loss over the batches of the ``S`` ranks that
shard it under FSDP2 (whose reduce-scatter averages their gradients). Runs are in float64, so the
only differences are the order in which the two sides sum the ``S`` gradients (the reduce-scatter
against the mean over one concatenated batch) and the sums of gossip: rounding at 1e-16 relative,
grown over a few steps of the update (AdamW divides by ``sqrt(v)``), far below the 1e-9 tolerance.
"""

from __future__ import annotations

import os
import re
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import EmulatedClock
from torch import nn
from workers import spawn

from decent_optim_wrapper import DecentOptimWrapper, DecentralizedDataParallel, Pacing

D_IN, HIDDEN, D_OUT, BATCH, STEPS = 6, 10, 3, 4, 5
ATOL = 1e-9  # float64; see the module docstring


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, D_OUT)).double()


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(BATCH, D_IN, generator=generator, dtype=torch.float64)
    return x, torch.randn(BATCH, D_OUT, generator=generator, dtype=torch.float64)


def _optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


def _options(variant: str) -> dict[str, Any]:
    return {
        "plain": {},
        "bf16": {"compression": "bf16"},
        "sparse": {"compression": "topk:0.2:int4"},
        "tracking": {"gradient_tracking": True},
        "local-steps": {"sync_every": 2},
    }[variant]


def _train(model: nn.Module, optimizer: DecentOptimWrapper, batches: Any) -> None:
    for step in range(STEPS):
        x, y = batches(step)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # the whole model's norm, DTensor or not
        optimizer.step()


@torch.no_grad()
def _full(model: nn.Module) -> list[torch.Tensor]:
    """The whole parameters (a sharded one all-gathered over its mesh), detached."""
    return [
        (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for p in model.parameters()
    ]


def _sharded_run(replicas: int, shards: int, optim: str, variant: str, topology: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (replicas, shards), mesh_dim_names=("replicate", "shard"))
    gossip_along = {"device_mesh": mesh["replicate"]}
    result = _shard_and_train(mesh["shard"], dist.get_rank(), optim, variant, topology, gossip_along)
    return {"replica": mesh["replicate"].get_local_rank(), **result}


def _shard_and_train(
    shard_mesh: Any, rank: int, optim: str, variant: str, topology: str, gossip_along: dict[str, Any]
) -> dict[str, Any]:
    """FSDP2 over ``shard_mesh``, the wrapper (``gossip_along`` its keywords naming where it gossips),
    ``STEPS`` steps on rank ``rank``'s batches of the job: what the checks compare."""
    from torch.distributed.fsdp import fully_shard

    model = _model()
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=shard_mesh)
    fully_shard(model, mesh=shard_mesh)
    optimizer = DecentOptimWrapper(
        _optimizer(optim, model.parameters()), topology=topology, **gossip_along, **_options(variant)
    )
    _train(model, optimizer, lambda step: _batch(step, rank))
    before = [t.clone() for t in _full(model)]
    local_before = [p.to_local().clone() for p in model.parameters()]
    distance = optimizer.consensus_distance()
    optimizer.global_avg()
    averaged = _full(model)
    optimizer.revert_global_avg()
    reverted = [p.to_local().clone() for p in model.parameters()]
    return {
        "gossip_rank": optimizer.rank,
        "world_size": optimizer.world_size,
        "local_world_size": optimizer.local_world_size,
        "bytes": optimizer.engine.bytes_sent_per_step(),
        "shard_numel": sum(p.to_local().numel() for p in model.parameters()),
        "params": before,
        "distance": distance,
        "averaged": averaged,
        "reverted_bitwise": all(torch.equal(a, b) for a, b in zip(local_before, reverted, strict=True)),
    }


def _reference_run(
    shards: int, optim: str, variant: str, topology: str, local_world_size: int | None = None
) -> dict[str, Any]:
    replica = dist.get_rank()
    model = _model()
    optimizer = DecentOptimWrapper(
        _optimizer(optim, model.parameters()),
        topology=topology,
        local_world_size=local_world_size,
        **_options(variant),
    )

    def batches(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        # The S batches FSDP2's shard group of this replica sees, as one: the mean loss over them.
        parts = [_batch(step, replica * shards + s) for s in range(shards)]
        return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])

    _train(model, optimizer, batches)
    params = _full(model)
    distance = optimizer.consensus_distance()
    optimizer.global_avg()
    return {"params": params, "distance": distance, "averaged": _full(model)}


def _check_equal(sharded: list[dict[str, Any]], reference: list[dict[str, Any]], shards: int) -> None:
    for rank, result in enumerate(sharded):
        replica = rank // shards
        assert result["replica"] == replica and result["gossip_rank"] == replica
        assert result["world_size"] == len(reference)
        expected = reference[replica]
        for got, want in zip(result["params"], expected["params"], strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=ATOL)
        for got, want in zip(result["averaged"], expected["averaged"], strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=ATOL)
        assert result["distance"] == pytest.approx(expected["distance"], rel=1e-9, abs=1e-12)
        assert result["reverted_bitwise"], f"rank {rank}: revert_global_avg is not bitwise"


@pytest.mark.parametrize(
    ("optim", "variant"),
    [("sgd", "plain"), ("adamw", "plain"), ("adamw", "bf16"), ("sgd", "tracking"), ("adamw", "local-steps")],
)
def test_two_replicas_of_two_shards_equal_two_whole_replicas(pool, optim, variant):
    sharded = pool(4).run(_sharded_run, 2, 2, optim, variant, "ring")
    reference = pool(2).run(_reference_run, 2, optim, variant, "ring")
    _check_equal(sharded, reference, shards=2)
    # Gossip moves a shard: bytes follow the shard's elements (8 bytes each in float64, twice with tracking).
    rounds = 2 if variant == "tracking" else 1
    for result in sharded:
        sent = result["bytes"]
        assert sent > 0
        if variant == "plain":
            assert sent < rounds * 8 * result["shard_numel"] * 1.5  # a shard, not the whole model


def test_sparse_gossip_runs_shard_by_shard(pool):
    # Top-k chooses per chunk of a shard's bucket, so a sharded run is not the whole replicas' run
    # (the chunks differ); what holds: each rank gossips its shard's payload, the replicas keep
    # their own values (distinct after training), the global average is exact and revert bitwise.
    from decent_optim_wrapper.engine.wire.compression import codec

    sharded = pool(4).run(_sharded_run, 2, 2, "adamw", "sparse", "ring")
    for rank, result in enumerate(sharded):
        assert result["reverted_bitwise"], f"rank {rank}"
        # ring of 2 replicas: one pair, one payload of the shard's bucket per step
        assert result["bytes"] == codec("topk:0.2:int4").payload_bytes(result["shard_numel"], torch.float64)
    replicas = [sharded[0], sharded[2]]  # shard 0 and 1 hold the same full parameters (all-gathered)
    for got, *held in zip(sharded[0]["averaged"], *(r["params"] for r in replicas), strict=True):
        mean = (held[0] + held[1]) / 2
        torch.testing.assert_close(got, mean, rtol=0, atol=1e-15)
    assert any(not torch.equal(a, b) for a, b in zip(*(r["params"] for r in replicas), strict=True))


def _elastic_shards_run(
    rank: int, port: int, workdir: str, nodes: int, shards: int, optim: str, variant: str
) -> None:
    """A job of nodes x shards started with init_elastic(shards=): the default group is the node,
    FSDP2 shards over node_mesh(), and the wrapper finds the replicas by itself."""
    from decent_optim_wrapper import init_elastic, node_mesh

    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    assert init_elastic(store, rank, nodes * shards, job="hsdp", shards=shards) is False
    assert (dist.get_world_size(), dist.get_rank()) == (shards, rank % shards)  # the node
    result = _shard_and_train(node_mesh("cpu"), rank, optim, variant, "ring", {})
    errors = {}
    model = _model()
    for name, options in (
        ("device_mesh", {"device_mesh": node_mesh("cpu")}),
        ("local_world_size", {"local_world_size": 2}),
    ):
        try:
            DecentOptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1), **options)
        except ValueError as err:
            errors[name] = str(err)
    torch.save({"replica": rank // shards, **result, "errors": errors}, f"{workdir}/elastic-{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.parametrize(
    ("nodes", "shards", "optim", "variant"),
    [(2, 2, "adamw", "plain"), (2, 2, "adamw", "local-steps"), (4, 1, "sgd", "tracking")],
)
def test_a_job_of_nodes_started_with_shards_equals_whole_replicas(
    pool, tmp_path, nodes, shards, optim, variant
):
    # 4 nodes of 1: a ring of pairs, each rank forming its groups from the store in the shared order.
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    args = (store.port, str(tmp_path), nodes, shards, optim, variant)
    spawn(_elastic_shards_run, args, nprocs=nodes * shards, timeout=120)
    sharded = [torch.load(tmp_path / f"elastic-{r}.pt", weights_only=False) for r in range(nodes * shards)]
    reference = pool(nodes).run(_reference_run, shards, optim, variant, "ring")
    _check_equal(sharded, reference, shards=shards)
    for result in sharded:
        assert result["local_world_size"] == 1
        assert "gossips along the job's replicas by itself" in result["errors"]["device_mesh"]
        assert "local_world_size is 1" in result["errors"]["local_world_size"]


def _lose_a_node(
    rank: int, world_size: int, port: int, kill_at: int, victims: tuple[int, ...], how: str
) -> dict[str, Any]:
    """A job of 3 nodes x 2 shards with on_peer_failure="continue"; ``victims`` (ranks of node 2)
    fail ``how`` at step ``kill_at``."""
    from datetime import timedelta

    from failures import inject
    from torch.distributed.fsdp import fully_shard

    from decent_optim_wrapper import init_elastic, node_mesh

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    # The node group's timeout is how long a hung victim's node-mate waits in FSDP2's all-gather before
    # it fails: 20 s, still far above forming the groups of 6 forked processes.
    init_elastic(store, rank, world_size, job="nodes", shards=2, timeout=timedelta(seconds=20))
    mesh = node_mesh("cpu")
    model = _model()
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = DecentOptimWrapper(
        _optimizer("adamw", model.parameters()),
        topology="ring",
        on_peer_failure="continue",
        timeout=timedelta(seconds=10),
    )
    for step in range(2 * kill_at):
        if rank in victims and step == kill_at:
            inject(how)
        x, y = _batch(step, rank)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    full = _full(model)  # FSDP2's groups in the node are untouched by the recovery
    optimizer.global_avg()
    return {
        "node": rank // 2,
        "rank": optimizer.rank,
        "world_size": optimizer.world_size,
        "failures": [(f.lost, f.previous_world_size, f.world_size) for f in optimizer.peer_failures],
        "steps": optimizer.step_count,
        "finite": all(bool(torch.isfinite(t).all()) for t in full),
        "averaged": _full(model),
    }


@pytest.mark.fleet
@pytest.mark.parametrize(
    ("victims", "how"),
    [((4,), "kill"), ((4, 5), "kill"), ((4,), "hang")],
    ids=["a rank killed", "the whole node killed", "a rank hung"],
)
@pytest.mark.timeout(240)
def test_a_job_of_nodes_goes_on_without_a_node_that_lost_a_rank(victims, how):
    from failures import run_with_faults

    hung = victims if how == "hang" else ()
    outcome = run_with_faults(_lose_a_node, 6, (6, victims, how), deadline_s=180, expect_hung=hung)
    if how == "kill":
        assert all(outcome.exitcodes[r] == -9 for r in victims), outcome
    # A node-mate of a victim does not go on alone: its node is gone with the victim.
    assert all(outcome.exitcodes[r] != 0 for r in (4, 5)), outcome
    for rank in set((4, 5)) - set(victims):  # in FSDP2's all-gather, or at the engine's node check
        assert re.search(
            "PeerFailureError|Connection reset|Connection closed|Timed out", outcome.errors[rank]
        )
    assert sorted(outcome.results) == [0, 1, 2, 3], outcome
    for rank, result in outcome.results.items():
        assert result["world_size"] == 2 and result["rank"] == rank // 2, result
        assert result["failures"] == [((2,), 3, 2)], result  # node 2 of 3 lost, once, on every rank
        assert result["steps"] == 12 and result["finite"], result
    # Each shard world averaged exactly: both nodes hold the same whole model, bit for bit.
    first = outcome.results[0]["averaged"]
    for result in outcome.results.values():
        assert all(torch.equal(a, b) for a, b in zip(first, result["averaged"], strict=True))


#: Members sleep 0.5 s a step until the node joins: 80 steps leave it more than 35 s to start and apply
#: (two processes starting torch on a loaded machine), and a node looks for applicants every 8 steps.
JOIN_STEPS = 80


def _local_state(model: nn.Module, inner: torch.optim.Optimizer) -> list[torch.Tensor]:
    """This rank's slice of its replica: its parameter shards and their optimizer state (Adam's step and
    moments), in a fixed order."""

    def local(t: Any) -> torch.Tensor:
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.detach().clone() if isinstance(t, torch.Tensor) else torch.tensor(t)

    tensors = [local(p) for p in model.parameters()]
    for p in model.parameters():
        tensors += [local(v) for _, v in sorted(inner.state[p].items())]
    return tensors


def _node_joins(index: int, world_size: int, port: int, workdir: str, plan: dict[str, Any]) -> dict[str, Any]:
    """A job of nodes x 2 shards, open to joiners; worker 0 asks for a node of two more processes
    (``plan["request"]``), or ``plan["kill"]`` names a node whose ranks die (and come back)."""
    from datetime import timedelta
    from pathlib import Path

    from failures import inject, note_losses, request_worker
    from torch.distributed.fsdp import fully_shard

    from decent_optim_wrapper import JoinRejectedError, init_elastic, node_mesh

    torch.set_num_threads(1)
    shards = plan.get("shards", 2)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    joining = init_elastic(store, index, world_size, job="grow", shards=shards, timeout=timedelta(seconds=60))
    torch.manual_seed(0)
    hidden = plan.get("joiner_hidden", HIDDEN) if joining else HIDDEN
    model = nn.Sequential(nn.Linear(D_IN, hidden), nn.Tanh(), nn.Linear(hidden, D_OUT)).double()
    common: dict[str, Any] = dict(topology="ring", on_peer_failure="continue", timeout=timedelta(seconds=10))
    try:
        if plan.get("front") == "module":  # whole replicas: nodes of one process
            ddp = DecentralizedDataParallel(
                model, lambda named: _optimizer("adamw", [p for _, p in named]), **common
            )
            front_end: Any = ddp

            def state() -> list[torch.Tensor]:
                return [
                    t for o in ddp.optimizers for p in o.param_groups[0]["params"] for t in _state_of(o, p)
                ]

            def step(x: torch.Tensor, y: torch.Tensor) -> None:
                nn.functional.mse_loss(ddp(x), y).backward()
        else:
            mesh = node_mesh("cpu")
            for layer in (model[0], model[2]):
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            inner = _optimizer("adamw", model.parameters())
            front_end = optimizer = DecentOptimWrapper(inner, **common)

            def state() -> list[torch.Tensor]:
                return _local_state(model, inner)

            def step(x: torch.Tensor, y: torch.Tensor) -> None:
                optimizer.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
                optimizer.step()
    except JoinRejectedError as err:
        Path(workdir, f"refused-{index}").write_text(str(err))
        return {"refused": str(err)}
    donated: list[dict[str, Any]] = []

    def on_join(join: Any) -> None:  # on members: what each rank of the donor node held when it donated
        record = (join.joined, join.donors, join.previous_world_size, join.world_size)
        donated.append({"join": record, "rank": join.rank, "state": state(), "step": front_end.step_count})

    front_end.register_join_hook(on_join)
    note_losses(front_end, workdir, index)
    received = None
    if front_end.joined is not None:
        received = {"state": state(), "step": front_end.step_count}
    for t in range(front_end.step_count, JOIN_STEPS):
        if index == 0 and t == 2 and plan.get("request"):
            for tag in range(shards):
                request_worker(workdir, str(tag))
        if index in plan.get("kill", ()) and t == 4:
            inject("kill")
        refused = len(list(Path(workdir).glob("refused-*"))) == shards
        if not (front_end.peer_joins or front_end.joined or refused):
            time.sleep(0.5)  # until the node joins (seconds to start), so that it arrives mid-run
        step(*_batch(t, index))
    front_end.global_avg()
    return {
        "shard": dist.get_rank(),  # the node is the default group
        "rank": front_end.rank,
        "world_size": front_end.world_size,
        "joined": front_end.joined,
        "joins": [(j.joined, j.donors, j.previous_world_size, j.world_size) for j in front_end.peer_joins],
        "failures": [(f.lost, f.previous_world_size, f.world_size) for f in front_end.peer_failures],
        "donated": donated,
        "received": received,
        "steps": front_end.step_count,
        "averaged": _full(model),
    }


def _state_of(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> list[torch.Tensor]:
    return [
        v.clone() if isinstance(v, torch.Tensor) else torch.tensor(v)
        for _, v in sorted(optimizer.state[param].items())
    ]


def _check_node_joined(results: dict[int, dict[str, Any]], joiners: tuple[int, ...], world_size: int) -> None:
    """Every process ends in a world of ``world_size`` nodes; each rank of the joining node received
    exactly what the same rank of its donor node held; global averages agree bit for bit."""
    assert all(r["world_size"] == world_size and r["steps"] == JOIN_STEPS for r in results.values()), results
    joiner = results[joiners[0]]["joined"]
    assert joiner is not None and joiner.joined == (world_size - 1,) and joiner.world_size == world_size
    (donor,) = joiner.donors
    for index in joiners:
        got = results[index]["received"]
        shard = results[index]["shard"]
        # The donor node's rank with the same shard index, as it was when it donated.
        (gave,) = [
            d
            for r in results.values()
            if r["shard"] == shard and r["joined"] is None
            for d in r["donated"]
            if d["rank"] == donor and d["join"][0] == joiner.joined
        ]
        assert got["step"] == gave["step"] > 0
        assert len(got["state"]) == len(gave["state"])
        assert all(torch.equal(a, b) for a, b in zip(got["state"], gave["state"], strict=True))
    first = results[joiners[0]]["averaged"]
    for result in results.values():
        assert all(torch.equal(a, b) for a, b in zip(first, result["averaged"], strict=True))


@pytest.mark.fleet
@pytest.mark.timeout(240)
def test_a_node_joins_a_running_job_of_nodes_each_rank_taking_its_shard_from_a_donor_node():
    from failures import run_elastic

    outcome = run_elastic(_node_joins, 4, ({"request": True},), deadline_s=200)
    assert sorted(outcome.results) == [0, 1, 2, 3, 4, 5], outcome
    for index in range(4):
        assert outcome.results[index]["joins"] == [((2,), outcome.results[4]["joined"].donors, 2, 3)]
    _check_node_joined(outcome.results, (4, 5), world_size=3)


@pytest.mark.fleet
@pytest.mark.timeout(240)
def test_a_node_of_one_joins_a_job_of_nodes_under_the_module_front_end():
    from failures import run_elastic

    outcome = run_elastic(
        _node_joins, 2, ({"request": True, "shards": 1, "front": "module"},), deadline_s=200
    )
    assert sorted(outcome.results) == [0, 1, 2], outcome
    _check_node_joined(outcome.results, (2,), world_size=3)


@pytest.mark.fleet
@pytest.mark.timeout(240)
def test_a_node_lost_whole_comes_back_and_the_job_returns_to_its_size():
    from failures import run_elastic

    # Node 2's ranks are killed at step 4; the launcher restarts both (processes 6 and 7: node 3)
    # once the 4 surviving ranks recorded the loss: the loss settles first, then the join.
    outcome = run_elastic(
        _node_joins, 6, ({"kill": (4, 5)},), deadline_s=200, restart_killed=2, restart_after_noted=4
    )
    assert sorted(outcome.results) == [0, 1, 2, 3, 6, 7], outcome
    for index in range(4):
        assert outcome.results[index]["failures"] == [((2,), 3, 2)]
        assert len(outcome.results[index]["joins"]) == 1
    _check_node_joined(outcome.results, (6, 7), world_size=3)


@pytest.mark.fleet
@pytest.mark.timeout(240)
def test_a_node_whose_model_differs_is_refused_and_the_members_go_on():
    from failures import run_elastic

    outcome = run_elastic(_node_joins, 4, ({"request": True, "joiner_hidden": 12},), deadline_s=200)
    assert sorted(outcome.results) == [0, 1, 2, 3, 4, 5], outcome
    for index in (4, 5):  # both ranks refuse themselves against the shapes the job published
        assert re.search(
            r"the running job refuses this worker: its shard \d.*differs", outcome.results[index]["refused"]
        )
    for index in range(4):
        assert outcome.results[index]["world_size"] == 2 and not outcome.results[index]["joins"]


def _eight_rank_runs(rank: int, workdir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{workdir}/rendezvous", rank=rank, world_size=8)
    results = {}
    for replicas, shards in ((4, 2), (2, 4)):
        results[(replicas, shards)] = _sharded_run(replicas, shards, "adamw", "plain", "ring")
    # Two nodes of 4 ranks (torchrun's LOCAL_WORLD_SIZE): along "replicate", two replicas share a node,
    # and the hierarchical topology averages them inside it.
    os.environ["LOCAL_WORLD_SIZE"] = "4"
    results["hierarchical"] = _sharded_run(4, 2, "sgd", "plain", "hierarchical")
    torch.save(results, f"{workdir}/sharded-{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.fleet
@pytest.mark.timeout(300)
def test_eight_ranks_as_four_by_two_and_two_by_four_and_hierarchical_over_nodes(pool, tmp_path):
    spawn(_eight_rank_runs, (str(tmp_path),), nprocs=8, timeout=240)
    for replicas, shards in ((4, 2), (2, 4)):
        sharded = [torch.load(tmp_path / f"sharded-{r}.pt")[(replicas, shards)] for r in range(8)]
        reference = pool(replicas).run(_reference_run, shards, "adamw", "plain", "ring")
        _check_equal(sharded, reference, shards=shards)
    sharded = [torch.load(tmp_path / f"sharded-{r}.pt")["hierarchical"] for r in range(8)]
    assert all(result["local_world_size"] == 2 for result in sharded)
    reference = pool(4).run(_reference_run, 2, "sgd", "plain", "hierarchical", 2)
    _check_equal(sharded, reference, shards=2)


def _tp_run(replicas: int, tp: int) -> dict[str, Any]:
    """Tensor parallelism inside a replica: column- then row-parallel, the second bias replicated."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (replicas, tp), mesh_dim_names=("replicate", "tp"))
    replica = mesh["replicate"].get_local_rank()
    model = parallelize_module(_model(), mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    optimizer = DecentOptimWrapper(
        _optimizer("adamw", model.parameters()), topology="ring", device_mesh=mesh["replicate"]
    )
    _train(model, optimizer, lambda step: _batch(step, replica))  # the TP ranks of a replica share its batch
    params = _full(model)
    distance = optimizer.consensus_distance()
    optimizer.global_avg()
    return {"params": params, "distance": distance, "averaged": _full(model), "replica": replica}


def test_two_replicas_of_two_tensor_parallel_ranks_equal_two_whole_replicas(pool):
    sharded = pool(4).run(_tp_run, 2, 2)
    reference = pool(2).run(_reference_run, 1, "adamw", "plain", "ring")
    for rank, result in enumerate(sharded):
        expected = reference[rank // 2]
        assert result["replica"] == rank // 2
        for key in ("params", "averaged"):
            for got, want in zip(result[key], expected[key], strict=True):
                torch.testing.assert_close(got, want, rtol=0, atol=ATOL)
        # The replicated bias counts once in the distance, not once per tensor-parallel rank.
        assert result["distance"] == pytest.approx(expected["distance"], rel=1e-9)


def _bad_case(name: str) -> tuple[str, str]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from decent_optim_wrapper import DecentralizedDataParallel, optim_fn_adamw

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = _model()
    gossip_along: Any = mesh["replicate"]
    options: dict[str, Any] = {}
    if name == "mesh not 1-D":
        gossip_along = mesh
    elif name == "sharded along the gossip dimension":
        fully_shard(model, mesh=mesh["replicate"])
    elif name == "parameters on two meshes":
        fully_shard(model[0], mesh=mesh["shard"])
        fully_shard(model[2], mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))["a"])
    else:
        fully_shard(model, mesh=mesh["shard"])
    if name == "DTensor parameters without device_mesh":
        gossip_along = None
    elif name == "device_mesh and process_group":
        options["process_group"] = mesh["replicate"].get_group()
    elif name == "continue with a mesh":
        options["on_peer_failure"] = "continue"
    elif name == "groups that do not split the job":
        # Ranks 0 and 1 gossip over {0, 1}, ranks 2 and 3 over everyone.
        group = dist.new_group([0, 1])
        gossip_along, options["process_group"] = None, group if dist.get_rank() < 2 else dist.group.WORLD
        model = _model()
    try:
        if name == "module front-end with sharded parameters":
            DecentralizedDataParallel(model, optim_fn_adamw, device_mesh=gossip_along)
        else:
            DecentOptimWrapper(
                torch.optim.SGD(model.parameters(), lr=0.1), device_mesh=gossip_along, **options
            )
    except (ValueError, TypeError) as err:
        return type(err).__name__, str(err)
    return "no error", ""


BAD = {
    "mesh not 1-D": ["device_mesh must be 1-D", "2-D", 'mesh["replicate"]'],
    "DTensor parameters without device_mesh": ["is a DTensor", "whole job", "device_mesh="],
    "sharded along the gossip dimension": ["sharded or replicated along the dimension gossip runs on"],
    "parameters on two meshes": ["lives on device mesh", "one device mesh"],
    "device_mesh and process_group": ["device_mesh or process_group, not both"],
    "continue with a mesh": ['on_peer_failure="continue"', "device_mesh"],
    "groups that do not split the job": ["gossips over ranks", "split the job"],
    "module front-end with sharded parameters": [
        "DecentralizedDataParallel",
        "DTensor",
        "DecentOptimWrapper(",
    ],
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_input_fails_on_every_rank(pool, name):
    for rank, (kind, message) in enumerate(pool(4).run(_bad_case, name)):
        assert kind == "ValueError", f"rank {rank}: {kind}: {message}"
        for fragment in BAD[name]:
            assert fragment in message, f"rank {rank}: {fragment!r} not in {message!r}"


def _paced_sharded_run(rounds: int) -> dict[str, Any]:
    """Measured pacing under decentralized HSDP: 2 replicas of 2 shards, where only shard 1 of replica
    1 is slow (200 ms per step, the others 10 ms, on an emulated clock), so replica 1 as a whole is."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    replica, shard = mesh["replicate"].get_local_rank(), mesh["shard"].get_local_rank()
    model = _model()
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    clock = EmulatedClock()
    optimizer = DecentOptimWrapper(
        _optimizer("adamw", model.parameters()),
        device_mesh=mesh["replicate"],
        sync_every=4,
        pacing=Pacing(repace_every=2, clock=clock),
    )
    counts: list[int] = []
    while optimizer.round_count < rounds:
        x, y = _batch(optimizer.step_count, dist.get_rank())
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        clock.advance(0.2 if (replica, shard) == (1, 1) else 0.01)
        if optimizer.round_ended:
            counts.append(optimizer.step_count - sum(counts))
    report = optimizer.pace_report()
    assert report is not None
    return {"replica": replica, "counts": counts, "tau": report.round_seconds, "step_s": report.step_seconds}


def test_measured_pacing_plans_the_shards_of_a_replica_alike(pool):
    # The shards of a replica meet in FSDP2's collectives at every step, so they must take the same
    # inner steps in every round (else they would wait for each other forever: the pool's timeout).
    # Each round they plan with the slowest shard's step time (a MAX over the shard mesh): the same
    # float on both, which a per-rank measurement would not give. On the emulated clock (exact
    # whatever the load) replica 0 steps in 10 ms and replica 1 in 200 ms (its slow shard's):
    # tau = 2 H / (1/0.01 + 1/0.2) s = 76.2 ms, so 7.62 steps per round on replica 0 and 0.38, held
    # at 1, on replica 1, from round 3 on (rounds 0-2 take H steps).
    results = pool(4).run(_paced_sharded_run, 12)
    by_replica: dict[int, list[dict[str, Any]]] = {0: [], 1: []}
    for result in results:
        by_replica[result["replica"]].append(result)
    for replica, (first, second) in by_replica.items():
        assert first["counts"] == second["counts"], (replica, first["counts"], second["counts"])
        assert first["step_s"] == second["step_s"] is not None, (first["step_s"], second["step_s"])
    tau = 2 * 4 / (1 / 0.01 + 1 / 0.2)
    assert all(r["tau"] == pytest.approx(tau, rel=1e-9) for r in results)  # integer ns on the wire
    assert by_replica[1][0]["step_s"] == pytest.approx(0.2, rel=1e-9)  # the slow shard's, on both
    fast, slow = (by_replica[k][0]["counts"] for k in (0, 1))
    assert fast[:3] == slow[:3] == [4, 4, 4] and slow[3:] == [1] * 9, (fast, slow)
    assert set(fast[3:]) <= {7, 8} and abs(sum(fast[3:]) - 9 * tau / 0.01) <= 1, fast


def _build_sharded(replicas: int, shards: int) -> tuple[nn.Module, DecentOptimWrapper]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (replicas, shards), mesh_dim_names=("replicate", "shard"))
    model = _model()
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    optimizer = DecentOptimWrapper(_optimizer("adamw", model.parameters()), device_mesh=mesh["replicate"])
    return model, optimizer


def _steps(model: nn.Module, optimizer: DecentOptimWrapper, steps: range) -> None:
    rank = dist.get_rank()
    for step in steps:
        x, y = _batch(step, rank)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()


def _save_then_resume(workdir: str) -> dict[str, Any]:
    """Per-rank checkpoints of local shards: saved at step 3, resumed in a fresh model and wrapper."""
    import io

    rank = dist.get_rank()
    model, optimizer = _build_sharded(2, 2)
    _steps(model, optimizer, range(3))
    state = optimizer.state_dict()
    buffer = io.BytesIO()
    torch.save(state, buffer)
    torch.save(state, f"{workdir}/rank-{rank}.pt")
    _steps(model, optimizer, range(3, 6))

    fresh_model, fresh = _build_sharded(2, 2)
    buffer.seek(0)
    fresh.load_state_dict(torch.load(buffer, weights_only=True))  # plain tensors only
    _steps(fresh_model, fresh, range(3, 6))
    return {
        "plain": all(not hasattr(v, "device_mesh") for e in state["state"].values() for v in e.values()),
        "bitwise": all(
            torch.equal(a.to_local(), b.to_local())
            for a, b in zip(model.parameters(), fresh_model.parameters(), strict=True)
        ),
        "state_bitwise": all(
            torch.equal(a.to_local(), b.to_local())
            for p, q in zip(model.parameters(), fresh_model.parameters(), strict=True)
            for a, b in zip(
                (optimizer.optimizer.state[p][k] for k in ("exp_avg", "exp_avg_sq")),
                (fresh.optimizer.state[q][k] for k in ("exp_avg", "exp_avg_sq")),
                strict=True,
            )
        ),
    }


def _resume_on_fewer_replicas(workdir: str) -> dict[str, Any]:
    """Saved as 2 replicas x 2 shards, resumed as 1 replica x 2 shards: the average of the replicas."""
    shard = dist.get_rank()
    model, optimizer = _build_sharded(1, 2)
    saved = [
        torch.load(f"{workdir}/rank-{replica * 2 + shard}.pt", weights_only=True) for replica in range(2)
    ]
    optimizer.load_state_dicts(saved)
    # Every saved tensor is float64, and the average of two is one rounding: (a + b) / 2.
    params = optimizer.state_dict()["decent"]["params"]
    expected = [(a + b) / 2 for a, b in zip(*(s["decent"]["params"] for s in saved), strict=True)]
    moments = [
        (optimizer.optimizer.state[p]["exp_avg"].to_local().clone(), (s0["exp_avg"] + s1["exp_avg"]) / 2)
        for p, s0, s1 in zip(
            model.parameters(), saved[0]["state"].values(), saved[1]["state"].values(), strict=True
        )
    ]
    _steps(model, optimizer, range(3, 4))  # it trains on
    return {
        "params": all(torch.equal(a, b) for a, b in zip(params, expected, strict=True)),
        "moments": all(torch.equal(a, b) for a, b in moments),
        "sharded_state": all(
            hasattr(optimizer.optimizer.state[p]["exp_avg"], "device_mesh") for p in model.parameters()
        ),
    }


def test_checkpoint_of_local_shards_resumes_bitwise_and_on_fewer_replicas(pool, tmp_path):
    for rank, result in enumerate(pool(4).run(_save_then_resume, str(tmp_path))):
        assert result["plain"], f"rank {rank}: the checkpoint holds DTensors"
        assert result["bitwise"] and result["state_bitwise"], f"rank {rank}: resume is not bitwise"
    for rank, result in enumerate(pool(2).run(_resume_on_fewer_replicas, str(tmp_path))):
        assert result == {"params": True, "moments": True, "sharded_state": True}, f"rank {rank}: {result}"


def _scaled_run(sharded: bool) -> dict[str, Any]:
    """Three steps under a gradient scaler; at step 1 one gradient element of replica 0 is inf.

    Sharded: torch's ShardedGradScaler over the shard group, so the replica's shards skip together.
    Whole replicas: a plain GradScaler, the inf put in the same element of the whole gradient.
    """
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    rank = dist.get_rank()
    if sharded:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        replica, shard = mesh["replicate"].get_local_rank(), mesh["shard"].get_local_rank()
        model = _model()
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh["shard"])
        fully_shard(model, mesh=mesh["shard"])
        optimizer = DecentOptimWrapper(_optimizer("adamw", model.parameters()), device_mesh=mesh["replicate"])
        scaler = ShardedGradScaler("cpu", init_scale=2.0**8, process_group=mesh["shard"].get_group())
    else:
        replica, shard = rank, 0
        model = _model()
        optimizer = DecentOptimWrapper(_optimizer("adamw", model.parameters()))
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    scales = []
    for step in range(3):
        if sharded:
            x, y = _batch(step, rank)
        else:
            parts = [_batch(step, replica * 2 + s) for s in range(2)]
            x, y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        optimizer.zero_grad()
        scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
        if step == 1 and replica == 0 and shard == 0:
            grad = model[0].weight.grad
            (grad.to_local() if sharded else grad)[0, 0] = float("inf")  # row 0 lives on shard 0
        scaler.step(optimizer)
        scaler.update()
        scales.append(scaler.get_scale())
    return {"params": _full(model), "scales": scales}


def test_sharded_grad_scaler_skips_a_replica_as_a_whole(pool):
    sharded = pool(4).run(_scaled_run, True)
    reference = pool(2).run(_scaled_run, False)
    for rank, result in enumerate(sharded):
        expected = reference[rank // 2]
        assert result["scales"] == expected["scales"]  # replica 0 (both shards) backed off, replica 1 not
        for got, want in zip(result["params"], expected["params"], strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=ATOL)
    assert reference[0]["scales"] != reference[1]["scales"]


def _job_model(job: int) -> nn.Module:
    torch.manual_seed(job)
    return nn.Sequential(
        nn.Linear(D_IN, HIDDEN + 4 * job), nn.Tanh(), nn.Linear(HIDDEN + 4 * job, D_OUT)
    ).double()


def _job_run(front_end: str, alone: int | None = None) -> dict[str, Any]:
    """Two jobs in one world of 4 (ranks 0-1 and 2-3, different models), or job ``alone`` on 2 ranks."""
    from decent_optim_wrapper import DecentralizedDataParallel

    if alone is None:
        groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # created by every rank, in one order
        job, group = dist.get_rank() // 2, groups[dist.get_rank() // 2]
    else:
        job, group = alone, None
    model = _job_model(job)
    if front_end == "wrapper":
        optimizer = DecentOptimWrapper(_optimizer("adamw", model.parameters()), process_group=group)
        rank = optimizer.rank
    else:
        model = DecentralizedDataParallel(
            model, lambda params: _optimizer("adamw", [p for _, p in params]), process_group=group
        )
        rank = model.rank
    for step in range(STEPS):
        x, y = _batch(step, rank)
        if front_end == "wrapper":
            optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        if front_end == "wrapper":
            optimizer.step()
    return {"job": job, "rank": rank, "params": _full(model)}


@pytest.mark.parametrize("front_end", ["wrapper", "module"])
def test_two_jobs_in_one_world_each_equal_a_job_of_their_own(pool, front_end):
    jobs = pool(4).run(_job_run, front_end)
    references = {job: pool(2).run(_job_run, front_end, job) for job in (0, 1)}
    for rank, result in enumerate(jobs):
        assert (result["job"], result["rank"]) == (rank // 2, rank % 2)
        expected = references[rank // 2][rank % 2]
        for got, want in zip(result["params"], expected["params"], strict=True):
            assert torch.equal(got, want), f"rank {rank}: differs from a job of its own"


@pytest.mark.pure
def test_a_local_module_state_loads_back_bitwise_and_refuses_another_model():
    """A rank's part of a (here unsharded) replica: copied out, put back bit for bit; a state of
    another model is refused naming what differs, before anything is written."""
    from decent_optim_wrapper.engine import load_local_module_state, local_module_state

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    saved = local_module_state(model)
    before = {key: value.clone() for key, value in saved.items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    load_local_module_state(model, saved)
    assert all(torch.equal(model.state_dict()[key], value) for key, value in before.items())
    with pytest.raises(ValueError, match=r"missing \['1.bias'\], unexpected \['2.bias'\]"):
        load_local_module_state(
            model, {**{k: v for k, v in saved.items() if k != "1.bias"}, "2.bias": saved["1.bias"]}
        )
    with pytest.raises(ValueError, match=r"the saved 0.weight has shape \(4, 4\) but this rank's part"):
        load_local_module_state(model, {**saved, "0.weight": torch.zeros(4, 4)})

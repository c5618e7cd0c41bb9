"""Bad input: each case is a clear error naming the argument, the value and the fix, on every rank."""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from helpers import build_parts_on_rank_0, tiny_model
from torch import nn

from decent_optim_wrapper import DecentOptimWrapper, GossipCompression, Group, RingTopology, Topology
from decent_optim_wrapper.engine.fleet.membership import connect_store
from decent_optim_wrapper.engine.fleet.world import check_job_of_nodes, resolve_gossip_world
from decent_optim_wrapper.engine.layout import check_pacing_composes
from decent_optim_wrapper.engine.options import check_on_peer_failure, resolve_host_staging
from decent_optim_wrapper.launch import plan_node_backend


@pytest.mark.pure
def test_uninitialized_torch_distributed_is_a_runtime_error():
    assert not dist.is_initialized()  # the pytest process never joins a process group
    model = tiny_model()
    with pytest.raises(RuntimeError, match=r"torch.distributed is not initialized.*init_process_group"):
        DecentOptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1))


def _nesterov(params):
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


def _build(subgroup: bool = False, **options):
    """What the engine builds from ``options`` on rank 0 of 4, before any collective (no process group)."""
    return build_parts_on_rank_0(tiny_model().named_parameters(), 4, subgroup=subgroup, **options)


#: Every refused combination of options: (what builds it, fragments the message must hold: both options
#: with their values, and the fix). Engine options go through build_parts, in the order the engine checks.
REFUSED = {
    "pacing with gradient_tracking": (
        lambda: _build(pacing="measured", sync_every=4, gradient_tracking=True),
        ["pacing='measured'", "gradient_tracking=True", "Pass pacing=None", "gradient_tracking=False"],
    ),
    "sync_every with gradient_tracking": (
        lambda: _build(sync_every=4, gradient_tracking=True),
        ["gradient_tracking=True", "sync_every=4", "Pass gradient_tracking=False", "leave sync_every=1"],
    ),
    "outer_optimizer with gradient_tracking": (
        lambda: _build(outer_optimizer=_nesterov, gradient_tracking=True),
        ["gradient_tracking=True", "(outer_optimizer=<function _nesterov", "outer_optimizer=None"],
    ),
    "sync_delay with gradient_tracking": (
        lambda: _build(sync_delay=0, gradient_tracking=True),
        ["gradient_tracking=True", "sync_delay=0", "sync_delay=None"],
    ),
    "sync_delay beyond sync_every": (
        lambda: _build(sync_every=4, sync_delay=5),
        ["sync_delay=5", "sync_every=4", "Pass sync_delay in [0, 4]", "a larger sync_every"],
    ),
    "pacing with continue on sharded replicas": (
        lambda: check_pacing_composes("measured", "continue", sharded=True),
        ["pacing='measured'", "on_peer_failure='continue'", "Pass on_peer_failure='raise'", "pacing=None"],
    ),
    "continue with device_mesh": (
        lambda: _build(on_peer_failure="continue", subgroup=True),
        ['on_peer_failure="continue"', "device_mesh", 'use on_peer_failure="raise"'],
    ),
    "continue with a topology instance": (
        lambda: _build(on_peer_failure="continue", topology=RingTopology(4)),
        ['on_peer_failure="continue"', "topology=", "pass its registered name or its class"],
    ),
    "continue on nccl": (
        lambda: check_on_peer_failure("continue", "ring", backend="nccl"),
        ['on_peer_failure="continue"', "'nccl'", 'use on_peer_failure="raise"'],
    ),
    "host staging on nccl": (
        lambda: resolve_host_staging(True, [torch.device("cuda", 0)], "nccl"),
        ["host_staging=True", "'nccl'", "pass host_staging=None"],
    ),
    "nccl node group without shards": (
        lambda: plan_node_backend("nccl", None, {}, 8),
        ['backend="nccl"', "shards=k", "backend=None"],
    ),
    "nccl node group without a GPU": (
        lambda: plan_node_backend("nccl", 2, {}, 0),
        ['backend="nccl"', "sees none", 'pass backend="gloo"'],
    ),
    "an unknown node backend": (
        lambda: plan_node_backend("mpi", 2, {}, 0),
        ["backend must be", "'mpi'", '"gloo" or "nccl"'],
    ),
    "LOCAL_RANK beyond the node's GPUs": (
        lambda: plan_node_backend(None, 4, {"LOCAL_RANK": "3"}, 2),
        ["LOCAL_RANK=3", "sees 2", "CUDA_VISIBLE_DEVICES"],
    ),
    "continue without a store": (
        lambda: connect_store(None, timedelta(seconds=1)),
        ['on_peer_failure="continue"', "store=None", "pass store=torch.distributed.TCPStore("],
    ),
    "device_mesh with process_group": (
        lambda: resolve_gossip_world(None, None, None, object(), object()),  # type: ignore[arg-type]
        ["device_mesh", "process_group", "not both", "keep one"],
    ),
    "device_mesh in a job of nodes": (
        lambda: check_job_of_nodes(2, object(), None, None),
        ["shards=2", "device_mesh=", "leave device_mesh and process_group out"],
    ),
    "local_world_size in a job of nodes": (
        lambda: check_job_of_nodes(2, None, None, 2),
        ["local_world_size=2", "shards=2", "leave it out"],
    ),
    "density with chunk": (
        lambda: GossipCompression("int8", density=0.999),
        ["density=0.999", "chunk=256", "pass density=1.0", "a larger chunk"],
    ),
}

#: What a message must not say: the cause it is not.
NOT_THE_CAUSE = {
    "pacing with gradient_tracking": ["low-communication", "sync_every"],
    "outer_optimizer with gradient_tracking": ["sync_every > 1", "sync_every=1)"],
}


@pytest.mark.pure
@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_refused_combination_names_both_options_and_the_fix(monkeypatch, name):
    build, fragments = REFUSED[name]
    monkeypatch.delenv("MASTER_ADDR", raising=False)  # no rendezvous for the store to come from
    with pytest.raises(ValueError) as refused:
        build()
    message = str(refused.value)
    print(f"{name}: {message}")
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    for fragment in NOT_THE_CAUSE.get(name, ()):
        assert fragment not in message, f"{fragment!r} in {message!r}"


class OneRankDisagrees(Topology):
    """Valid on every rank but 1, where it is malformed: must fail everywhere, not hang."""

    def assign_groups(self):
        if dist.get_rank() == 1:
            return [[[0]]]  # wrong number of entries
        everyone = list(range(self._world_size))
        return [[everyone] for _ in everyone]


def _sparse_optimizer():
    dense = nn.Parameter(torch.zeros(3))
    sparse = nn.Parameter(torch.eye(3).to_sparse())
    return torch.optim.SGD([dense, sparse], lr=0.1)


def _duplicate_across_groups():
    model = tiny_model()
    params = list(model.parameters())
    inner = torch.optim.SGD([{"params": params[:2]}, {"params": params[2:]}], lr=0.1)
    inner.param_groups[1]["params"].append(params[0])  # torch checks this only in add_param_group
    return inner


class RankOutsideItsGroup(Topology):
    def assign_groups(self):
        return [[[0]], [[0]]]  # rank 1 is assigned a group without itself


class OverweightGroup(Topology):
    def assign_groups(self):
        return [[Group((0, 1), 1.25)], [Group((0, 1), 1.25)]]


def _with_env(name: str, value: str, build):
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        return build()
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old


def _add_group(rank: int, same_shapes: bool):
    model = tiny_model()
    opt = DecentOptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1), topology="complete")
    extra = nn.Parameter(torch.zeros(3 if same_shapes or rank == 0 else 4))
    opt.add_param_group({"params": [extra]})
    if same_shapes:
        opt.add_param_group({"params": [extra]})  # already in the optimizer


def _case(name: str):
    """Build the wrapper for bad-input case ``name``; returns (exception type name, message)."""
    rank = dist.get_rank()
    model = tiny_model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    cases = {
        "unknown topology": lambda: DecentOptimWrapper(sgd, topology="torus"),
        "rank mismatch": lambda: DecentOptimWrapper(sgd, rank=rank + 5),
        "world_size mismatch": lambda: DecentOptimWrapper(sgd, world_size=7),
        "local_world_size": lambda: DecentOptimWrapper(sgd, local_world_size=3),
        "not an optimizer": lambda: DecentOptimWrapper(model, topology="complete"),
        "double wrap": lambda: DecentOptimWrapper(DecentOptimWrapper(sgd, topology="complete")),
        "bucket_cap_mb": lambda: DecentOptimWrapper(sgd, bucket_cap_mb=0),
        "nonfinite_guard": lambda: DecentOptimWrapper(sgd, nonfinite_guard="on"),  # type: ignore[arg-type]
        "empty optimizer": lambda: DecentOptimWrapper(torch.optim.SGD([{"params": []}], lr=0.1)),
        "sparse": lambda: DecentOptimWrapper(_sparse_optimizer()),
        "duplicate": lambda: DecentOptimWrapper(_duplicate_across_groups()),
        "topology instance": lambda: DecentOptimWrapper(sgd, topology=Topology(world_size=3)),
        "layout differs on one rank": lambda: DecentOptimWrapper(
            torch.optim.SGD(tiny_model().parameters() if rank else nn.Linear(6, 2).parameters(), lr=0.1)
        ),
        "topology differs on one rank": lambda: DecentOptimWrapper(
            sgd, topology="ring" if rank else "complete"
        ),
        "topology malformed on one rank": lambda: DecentOptimWrapper(sgd, topology=OneRankDisagrees),
        "topology of wrong type": lambda: DecentOptimWrapper(sgd, topology=4),
        "timeout": lambda: DecentOptimWrapper(sgd, timeout=30),
        "negative timeout": lambda: DecentOptimWrapper(
            sgd, timeout=-__import__("datetime").timedelta(seconds=1)
        ),
        "bucket_cap_mb of wrong type": lambda: DecentOptimWrapper(sgd, bucket_cap_mb="25"),
        "LOCAL_WORLD_SIZE": lambda: _with_env("LOCAL_WORLD_SIZE", "two", lambda: DecentOptimWrapper(sgd)),
        "integer parameter": lambda: DecentOptimWrapper(
            torch.optim.SGD([nn.Parameter(torch.zeros(2)), torch.zeros(2, dtype=torch.int64)], lr=0.1)
        ),
        "rank outside its group": lambda: DecentOptimWrapper(sgd, topology=RankOutsideItsGroup),
        "self_weight out of range": lambda: DecentOptimWrapper(sgd, topology=OverweightGroup),
        "add_param_group differs across ranks": lambda: _add_group(rank, same_shapes=False),
        "add_param_group duplicate": lambda: _add_group(rank, same_shapes=True),
        "global_avg buffers": lambda: DecentOptimWrapper(sgd, topology="complete").global_avg(buffers=[1.0]),
        "revert without global_avg": lambda: DecentOptimWrapper(sgd, topology="complete").revert_global_avg(),
        "on_peer_failure": lambda: DecentOptimWrapper(sgd, on_peer_failure="retry"),
        "second_moment": lambda: DecentOptimWrapper(sgd, second_moment="global"),
        "second_moment of wrong type": lambda: DecentOptimWrapper(sgd, second_moment=True),
        "clipped_gossip": lambda: DecentOptimWrapper(sgd, clipped_gossip="median"),  # type: ignore[arg-type]
        "clipped_gossip differs on one rank": lambda: DecentOptimWrapper(sgd, clipped_gossip=rank == 1),
        "second_moment differs on one rank": lambda: DecentOptimWrapper(
            sgd, second_moment="local" if rank else "average"
        ),
        "on_peer_failure differs on one rank": lambda: DecentOptimWrapper(
            sgd, on_peer_failure="continue" if rank else "raise", store=dist.HashStore()
        ),
        "on_peer_failure with a topology instance": lambda: DecentOptimWrapper(
            sgd, topology=RingTopology(2), on_peer_failure="continue", store=dist.HashStore()
        ),
        "store of wrong type": lambda: DecentOptimWrapper(
            sgd, on_peer_failure="continue", store="host:29500"
        ),
        "peer failure hook without continue": lambda: DecentOptimWrapper(
            sgd, topology="complete"
        ).register_peer_failure_hook(print),
        "load a plain state dict": lambda: DecentOptimWrapper(sgd, topology="complete").load_state_dict(
            torch.optim.SGD(tiny_model().parameters(), lr=0.1).state_dict()
        ),
    }
    try:
        cases[name]()
    except Exception as err:
        return type(err).__name__, str(err)
    return None, "no error"


EXPECTED = {
    # case: (exception type, fragments that the message must contain)
    "unknown topology": ("ValueError", ["'torus'", "complete", "ring", "add_topology"]),
    "rank mismatch": ("ValueError", ["rank=", "disagrees", "leave it out"]),
    "world_size mismatch": ("ValueError", ["world_size=7", "world_size=2"]),
    "local_world_size": ("ValueError", ["local_world_size=3", "divisor of world_size=2"]),
    "not an optimizer": ("TypeError", ["torch.optim.Optimizer", "Sequential"]),
    "double wrap": ("TypeError", ["already a DecentOptimWrapper"]),
    "bucket_cap_mb": ("ValueError", ["bucket_cap_mb", "0"]),
    "empty optimizer": ("ValueError", ["no parameters"]),
    "sparse": ("ValueError", ["sparse", "param_groups[0]['params'][1]"]),
    "duplicate": ("ValueError", ["param_groups[1]['params'][2]", "param_groups[0]['params'][0]", "Remove"]),
    "topology instance": ("ValueError", ["world_size=3", "world_size=2"]),
    "layout differs on one rank": ("ValueError", ["bucket layout", "rank(s) [1]", "same model"]),
    "topology differs on one rank": ("ValueError", ["topology", "rank(s) [1]"]),
    "topology of wrong type": ("TypeError", ["topology must be a name", "4", "Registered names"]),
    "timeout": ("TypeError", ["timeout", "30", "timedelta(minutes=5)"]),
    "negative timeout": ("ValueError", ["timeout must be positive", "days=-1"]),
    "bucket_cap_mb of wrong type": ("TypeError", ["bucket_cap_mb", "'25'", "e.g. 25"]),
    "LOCAL_WORLD_SIZE": ("ValueError", ["LOCAL_WORLD_SIZE='two'", "processes per node"]),
    "integer parameter": ("TypeError", ["param_groups[0]['params'][1]", "torch.int64", "floating-point"]),
    "rank outside its group": ("ValueError", ["phase 0: rank 1", "does not contain it"]),
    "self_weight out of range": ("ValueError", ["self_weight=1.25", "[0, 1]"]),
    "add_param_group differs across ranks": ("ValueError", ["bucket layout", "rank(s) [1]"]),
    "add_param_group duplicate": ("ValueError", ["more than one parameter group"]),
    "global_avg buffers": ("TypeError", ["buffers must be an nn.Module", "list"]),
    "revert without global_avg": ("RuntimeError", ["nothing to revert", "global_avg(may_revert=True)"]),
    "on_peer_failure": ("ValueError", ["on_peer_failure must be", '"continue"', "'retry'"]),
    "nonfinite_guard": ("TypeError", ["nonfinite_guard must be True or False", "'on'"]),
    "second_moment": ("ValueError", ["second_moment must be one of", "'average'", "'local'", "'global'"]),
    "second_moment of wrong type": ("ValueError", ["second_moment must be one of", "True"]),
    "clipped_gossip": ("TypeError", ["clipped_gossip must be None, True or a ClippedGossip", "'median'"]),
    "clipped_gossip differs on one rank": ("ValueError", ["clipped_gossip differs", "rank(s) [1]"]),
    "second_moment differs on one rank": ("ValueError", ["second_moment differs", "rank(s) [1]"]),
    "on_peer_failure differs on one rank": ("ValueError", ["on_peer_failure differs", "rank(s) [1]"]),
    "on_peer_failure with a topology instance": ("ValueError", ["rebuilds the topology", "registered name"]),
    "store of wrong type": ("TypeError", ["store must be a torch.distributed.Store", "'host:29500'"]),
    "peer failure hook without continue": ("RuntimeError", ['on_peer_failure="continue"', "GossipError"]),
    "load a plain state dict": ("ValueError", ["no 'decent' entry", "wrapper.optimizer.load_state_dict"]),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_bad_input(pool, name):
    kind, fragments = EXPECTED[name]
    for rank, (got_kind, message) in enumerate(pool(2).run(_case, name)):
        assert got_kind == kind, f"rank {rank}: {got_kind}: {message}"
        for fragment in fragments:
            assert fragment in message, f"rank {rank}: {fragment!r} not in {message!r}"


def test_topology_malformed_on_one_rank_fails_everywhere(pool):
    results = pool(2).run(_case, "topology malformed on one rank")
    assert results[1][0] == "ValueError" and "needs one per rank" in results[1][1]
    assert (
        results[0][0] == "ValueError"
        and "failed on other ranks" in results[0][1]
        and "rank 1" in results[0][1]
    )

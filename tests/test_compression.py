"""Multi-process: compressed gossip follows its update rule, keeps the mean, resumes bit for bit, and is
the same on both front-ends.

The update rule (decent_optim_wrapper.engine.wire.compression): every group's reference starts at the
common point the replicas were broadcast to (``r = x_0``); a member sends ``q_i = Q(x_i - r)`` and mixes
``x_i <- x_i + c (sum_j q_j - k q_i)``, and every member moves the shared reference
``r <- r + sum_j q_j / k``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from helpers import (
    bare_and_wrapped,
    batch,
    flat,
    forget_start_point,
    gather,
    set_distinct,
    tiny_model,
    train_steps,
)
from resume import Resumable, assert_resume_is_bitwise
from simulation import Simulation, sgd_replicas
from torch import nn
from wire_reference import reference_quantize, round_seed

from decent_optim_wrapper import DecentOptimWrapper, DecentralizedDataParallel, GossipEngine, TopologyFactory


# -- an independent simulation of the rule, all replicas in one process --------------------------------
def _quantize(values: torch.Tensor, wire: str, step: int) -> torch.Tensor:
    """Q: what a member's difference becomes on the wire, decoded (written from the rule, not the codec).

    The sparse and low-bit formats come from ``wire_reference`` (one bucket: its round's seed is
    the step's with bucket 0).
    """
    if ":" in wire or wire in ("int4", "int2"):
        selection, density, values_format = wire.split(":") if ":" in wire else ("all", "1", wire)
        return reference_quantize(values, selection, float(density), values_format, seed=round_seed(step, 0))
    if wire == "bf16":
        return values.to(torch.bfloat16).to(values.dtype)
    assert wire == "int8"
    out = torch.empty_like(values)
    for start in range(0, values.numel(), 256):
        block = values[start : start + 256]
        scale = block.abs().max().float() / 127
        if scale == 0:
            out[start : start + 256] = 0
        else:
            out[start : start + 256] = ((block.float() / scale).round().clamp(-127, 127) * scale).to(
                values.dtype
            )
    return out


class _CompressedGossip(Simulation):
    """The rule above: references start at the broadcast point; rounds send Q(x_i - r) and move r."""

    def __init__(self, topology: str, world_size: int, wire: str) -> None:
        super().__init__(topology, *sgd_replicas(world_size, torch.float64))
        self.wire = wire
        self.start = self.vector(0).clone()  # every replica's, after the broadcast
        self.references: dict[tuple[int, ...], torch.Tensor] = {}
        self.sent: dict[int, torch.Tensor] = {}  # per rank, what it sent

    def mix(self, step: int) -> None:
        for group in self.topo.phase(step):
            if group.size == 1:
                continue
            total = sum(self.sent[j] for j in group.ranks)
            for i in group.ranks:
                self.set_vector(i, self.vector(i) + group.peer_weight * (total - group.size * self.sent[i]))
            self.references[group.ranks] = self.reference(group.ranks) + total / group.size

    def reference(self, ranks: tuple[int, ...]) -> torch.Tensor:
        return self.references.get(ranks, self.start)

    def launch(self, step: int) -> None:
        self.sent = {}
        for group in self.topo.phase(step):
            for i in group.ranks:
                self.sent[i] = _quantize(self.vector(i) - self.reference(group.ranks), self.wire, step)


def _compressed_training(topology: str, wire: str, steps: int) -> torch.Tensor:
    rank = dist.get_rank()
    model = tiny_model(dtype=torch.float64)
    opt = DecentOptimWrapper(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), topology=topology, compression=wire
    )
    train_steps(model, opt, rank, range(steps))
    return flat(model)


#: Sparse and low-bit formats the multi-process tests use (the tiny model is one chunk of 83 elements).
SPARSE = ["topk:0.05:int4", "randk:0.1:int2"]


@pytest.mark.parametrize(("world_size", "topology"), [(2, "ring"), (4, "ring"), (3, "complete")])
@pytest.mark.parametrize("wire", ["bf16", "int8", "int2", *SPARSE])
def test_compressed_training_equals_the_independent_simulation(pool, world_size, topology, wire):
    steps = 8
    got = pool(world_size).run(_compressed_training, topology, wire, steps)
    expected = _CompressedGossip(topology, world_size, wire).run(steps)
    # fp64 throughout; the simulation adds in a different order, so results may differ by a few fp64
    # roundings (1e-16 relative), far below one wire rounding (bf16: 4e-3 of a difference), which a
    # wrong reference, a missing error feedback or a mis-ordered mix would show.
    for rank in range(world_size):
        torch.testing.assert_close(got[rank], expected[rank], rtol=0, atol=1e-12)


def _first_rounds(wire: str, forget: bool) -> list[tuple[list[str | None], bool]]:
    """Per step of one-peer-exp on 4 ranks (groups {0,1} then {0,2}, then {0,1} again): the codec of
    the round in flight and whether the common starting point is still kept."""
    rank, model = dist.get_rank(), tiny_model()
    opt = DecentOptimWrapper(
        torch.optim.SGD(model.parameters(), lr=0.1), topology="one-peer-exp", compression=wire
    )
    if forget:
        forget_start_point(opt)
    seen = []
    for step in range(3):
        train_steps(model, opt, rank, range(step, step + 1))
        gossip = opt.state_dict()["decent"]["gossip"]
        seen.append((gossip["codecs"], "start" in gossip))
    return seen


@pytest.mark.parametrize("wire", ["int8", "topk:0.05:int4"])
def test_a_groups_first_round_is_compressed_from_the_broadcast_point(pool, wire):
    # The replicas start where rank 0's parameters were broadcast: every group's reference starts there,
    # so no round of a fresh job sends exact values; the point is kept until both groups have met.
    for seen in pool(4).run(_first_rounds, wire, False):
        assert seen == [([wire], True), ([wire], True), ([wire], False)]


def test_without_a_common_starting_point_a_groups_first_round_is_exact(pool):
    for seen in pool(4).run(_first_rounds, "int8", True):
        assert seen == [(["exact"], False), (["exact"], False), (["int8"], False)]


# -- the guarantees --------------------------------------------------------------------------------------
def _mean_around_mixes(topology: str, wire: str, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(replicas before, after) every mix, with random local changes between rounds."""
    rank = dist.get_rank()
    model = tiny_model()
    set_distinct(model, rank)
    engine = GossipEngine(list(model.named_parameters()), topology=topology, compression=wire)
    noise = torch.Generator().manual_seed(rank)
    pairs = []
    with torch.no_grad():
        for _ in range(steps):
            before = gather(flat(model))

            def local_update(before: torch.Tensor = before) -> None:  # runs after every bucket is mixed
                pairs.append((before, gather(flat(model))))
                for p in model.parameters():  # a local update of a few percent
                    p.add_(torch.randn(p.shape, generator=noise), alpha=0.03)

            engine.step(local_update)
    return pairs


@pytest.mark.parametrize(("world_size", "topology"), [(4, "ring"), (3, "complete")])
@pytest.mark.parametrize("wire", ["bf16", "fp16", "int8", "int4", *SPARSE])
def test_mixing_moves_the_mean_only_by_rounding(pool, world_size, topology, wire):
    pairs = pool(world_size).run(_mean_around_mixes, topology, wire, 10)[0]
    u = torch.finfo(torch.float32).eps / 2
    k = TopologyFactory.create(topology, world_size).distinct_groups()[0].size
    for step, (before, after) in enumerate(pairs):
        drift = (after.double().mean(0) - before.double().mean(0)).abs()
        scale = torch.maximum(before.abs().amax(0), after.abs().amax(0)).double()
        # The members' updates cancel exactly in exact arithmetic; what is left is fp32 rounding:
        # per member at most 3 roundings of magnitude <= |x| + |update|, and the group sum's k - 1
        # roundings, with |update|, |q| <= 2 max|x| here: (2k^2 + 3) u max|x| bounds them all.
        assert torch.all(drift <= (2 * k * k + 3) * u * scale), f"step {step}: drift {drift.max():.3g}"
        if step >= 3:  # compressed rounds: the replicas did move, by much more than the drift
            assert (after - before).abs().max() > 1e3 * drift.max()


def _consensus_after_training(topology: str, wire: str, rounds: int = 40) -> list[float]:
    rank = dist.get_rank()
    model = tiny_model()
    opt = DecentOptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1), topology=topology, compression=wire)
    train_steps(model, opt, rank, range(10))  # replicas drift apart on their own batches
    for group in opt.param_groups:
        group["lr"] = 0.0
    distances = []
    for _ in range(rounds):
        opt.step()
        distances.append(opt.consensus_distance())
    return distances


@pytest.mark.parametrize("wire", ["bf16", "int8"])
def test_replicas_reach_consensus_below_the_wire_precision(pool, wire):
    # Error feedback: what a round could not send is sent by the next one, so the replicas keep
    # converging long past the wire format's own precision (bf16: 2^-9 relative, ~1e-3 here).
    distances = pool(4).run(_consensus_after_training, "ring", wire)[0]
    assert distances[0] > 1e-4
    assert distances[-1] < 1e-6 * max(distances[0], 1.0)


@pytest.mark.parametrize("wire", ["int2", *SPARSE])
def test_sparse_replicas_reach_consensus_too(pool, wire):
    # Every round sends some of what is left (top-k each chunk's largest, random-k a tenth of the
    # positions, int2 a third of the scale): error feedback still takes the replicas to consensus,
    # in more rounds.
    distances = pool(4).run(_consensus_after_training, "ring", wire, 1000)[0]
    assert distances[0] > 1e-4
    assert distances[-1] < 1e-6 * max(distances[0], 1.0)


def _sums_and_references(topology: str, wire: str) -> list[dict[tuple[int, ...], torch.Tensor]]:
    rank = dist.get_rank()
    model = tiny_model()
    opt = DecentOptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1), topology=topology, compression=wire)
    train_steps(model, opt, rank, range(7))
    state = opt.engine.state_dict()["gossip"]
    return {tuple(e["ranks"]): e["tensors"][0] for e in state["references"]}


@pytest.mark.parametrize("wire", ["bf16", *SPARSE])
def test_every_member_of_a_group_holds_the_same_reference(pool, wire):
    per_rank = pool(4).run(_sums_and_references, "ring", wire)
    groups = {ranks for refs in per_rank for ranks in refs}
    assert groups == {(0, 1), (2, 3), (0, 3), (1, 2)}
    for ranks in groups:
        held = [per_rank[r][ranks] for r in ranks]
        assert all(torch.equal(held[0], other) for other in held[1:]), ranks


def _global_avg_and_revert(wire: str, average: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    rank = dist.get_rank()
    model = tiny_model()
    opt = DecentOptimWrapper(
        torch.optim.AdamW(model.parameters(), lr=0.01), topology="ring", compression=wire
    )
    train_steps(model, opt, rank, range(6))
    averaged = None
    if average:
        replicas = gather(flat(model))
        opt.global_avg()
        averaged = gather(flat(model))
        # exact: every replica the same, the fp32 average of the replicas (world_size roundings)
        assert all(torch.equal(averaged[0], a) for a in averaged)
        u = torch.finfo(torch.float32).eps / 2
        torch.testing.assert_close(
            averaged[0].double(), replicas.double().mean(0), rtol=0, atol=4 * u * replicas.abs().max().item()
        )
        opt.revert_global_avg()
    train_steps(model, opt, rank, range(6, 12))
    return flat(model), averaged


@pytest.mark.parametrize("wire", ["bf16", "int8", "randk:0.1:int2"])
def test_global_avg_is_exact_and_revert_continues_bit_for_bit(pool, wire):
    plain = pool(4).run(_global_avg_and_revert, wire, False)
    reverted = pool(4).run(_global_avg_and_revert, wire, True)
    for rank in range(4):
        assert torch.equal(plain[rank][0], reverted[rank][0]), f"rank {rank}"


# -- checkpoints --------------------------------------------------------------------------------------
def _wrapper_run(wire: str, seed: int = 0, topology: str = "ring"):
    model = tiny_model(seed=seed)
    opt = DecentOptimWrapper(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), topology=topology, compression=wire
    )
    return model, opt


@dataclass(frozen=True)
class _WrapperRun(Resumable):
    wire: str
    early: bool = False  # saved before every group has met: one-peer-exp, the broadcast point still kept

    def build(self, seed: int):
        return _wrapper_run(self.wire, seed, "one-peer-exp" if self.early else "ring")

    def train(self, run, steps: range) -> None:
        train_steps(*run, dist.get_rank(), steps)

    def state_dict(self, run) -> dict:
        model, opt = run
        saved = opt.state_dict()
        gossip = saved["decent"]["gossip"]
        assert gossip["references"] and any(c == self.wire for c in gossip["codecs"])  # saved mid-compression
        assert ("start" in gossip) == self.early
        return {"model": model.state_dict(), "optimizer": saved}

    def load_state_dict(self, run, state: dict) -> None:
        model, opt = run
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])

    def result(self, run) -> torch.Tensor:
        return flat(run[0])


@pytest.mark.parametrize("wire", ["bf16", "fp16", "int8", *SPARSE])
def test_wrapper_resumes_bit_for_bit_with_compression(pool, resume_pool, tmp_path, wire):
    assert_resume_is_bitwise(pool, resume_pool, 4, _WrapperRun(wire), tmp_path, total=11, save_at=6)


def test_a_resume_before_every_group_has_met_keeps_the_broadcast_point(pool, resume_pool, tmp_path):
    # Saved after step 1 of one-peer-exp: group {0,1} has a reference, {0,2} still starts at the
    # broadcast point, which the checkpoint must keep for the resumed run to send the same bytes.
    run = _WrapperRun("int8", early=True)
    assert_resume_is_bitwise(pool, resume_pool, 4, run, tmp_path, total=6, save_at=2)


def _module_run(wire: str, seed: int = 0) -> DecentralizedDataParallel:
    model = tiny_model(seed=seed)
    return DecentralizedDataParallel(
        model,
        lambda named: torch.optim.AdamW([p for _, p in named], lr=0.01),
        topology="ring",
        bucket_size_in_mb=0.0001,  # several buckets, each with its own references
        compression=wire,
    )


def _module_steps(ddp: DecentralizedDataParallel, steps: range) -> None:
    for step in steps:
        x, y = batch(dist.get_rank(), step)
        nn.functional.cross_entropy(ddp(x), y).backward()


@dataclass(frozen=True)
class _ModuleRun(Resumable):
    wire: str

    def build(self, seed: int):
        return _module_run(self.wire, seed)

    def train(self, run, steps: range) -> None:
        _module_steps(run, steps)

    def state_dict(self, run) -> dict:
        return run.training_state_dict()

    def load_state_dict(self, run, state: dict) -> None:
        run.load_training_state_dict(state)

    def result(self, run) -> torch.Tensor:
        return flat(run)


@pytest.mark.parametrize("wire", ["bf16", "randk:0.1:int2"])
def test_module_front_end_resumes_bit_for_bit_with_compression(pool, resume_pool, tmp_path, wire):
    # Several buckets: random-k draws each bucket's positions from its own seed.
    assert_resume_is_bitwise(pool, resume_pool, 4, _ModuleRun(wire), tmp_path, total=11, save_at=6)


# -- the rest of the contract -------------------------------------------------------------------------
def _bytes_per_step(topology: str, wire: str | None) -> tuple[float, int]:
    model = tiny_model()
    opt = DecentOptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1), topology=topology, compression=wire)
    (bucket,) = opt.engine.buckets  # what travels: the bucket, alignment padding included
    return opt.engine.bytes_sent_per_step(), bucket.data.numel()


def test_bytes_per_step(pool):
    plain, numel = pool(4).run(_bytes_per_step, "ring", None)[0]
    assert plain == 4 * numel  # a pair's all-reduce: one fp32 copy sent per member
    assert pool(4).run(_bytes_per_step, "ring", "bf16")[0][0] == 2 * numel
    assert pool(4).run(_bytes_per_step, "ring", "int8")[0][0] == math.ceil(numel / 256) * (256 + 4)
    # top-k 5% of 256 (13 kept) in int4: per chunk a bf16 scale, 13 one-byte positions, 13 x 4 bits;
    # the positions' odd count is padded to an even offset, the whole to a multiple of 4
    chunks = math.ceil(numel / 256)
    body = 2 * chunks + 13 * chunks + (13 * chunks) % 2 + math.ceil(13 * chunks * 4 / 8)
    assert pool(4).run(_bytes_per_step, "ring", "topk:0.05:int4")[0][0] == body + (-body) % 4
    # complete at 4: gathering 16 bits three times (6 bytes/element) is no cheaper than the fp32
    # all-reduce (2 * 3/4 * 4 = 6 bytes/element), so the plan leaves it uncompressed
    complete = pool(4).run(_bytes_per_step, "complete", "bf16")[0][0]
    assert complete == pool(4).run(_bytes_per_step, "complete", None)[0][0]


def test_world_size_one_with_compression_is_the_bare_optimizer(pool):
    bare, wrapped = pool(1).run(bare_and_wrapped, compression="int8")[0]
    assert torch.equal(bare, wrapped)


def _mismatched_compression() -> str:
    model = tiny_model()
    wire = "bf16" if dist.get_rank() == 0 else None
    try:
        DecentOptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1), compression=wire)
    except ValueError as err:
        return str(err)
    return "no error"


def test_ranks_that_disagree_on_compression_all_get_a_clear_error(pool):
    for message in pool(2).run(_mismatched_compression):
        assert "compression differs between rank 0 and rank(s) [1]" in message


def _bad_compression(value: object) -> str:
    model = tiny_model()
    try:
        DecentOptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1), compression=value)
    except (TypeError, ValueError) as err:
        return str(err)
    return "no error"


@pytest.mark.parametrize("value", ["bf8", "BF16", 16])
def test_a_bad_compression_argument_names_the_value_and_the_choices(pool, value):
    message = pool(2).run(_bad_compression, value)[0]
    assert repr(value) in message and "'bf16'" in message


def _partial_revert(wire: str) -> tuple[dict[tuple[int, ...], torch.Tensor], torch.Tensor]:
    # Every rank averages, only rank 0 reverts; both keep training. The pending compressed round is
    # mixed on rank 0 only, yet the groups' references must stay identical on every member, or the
    # replicas would keep an offset (or, for a group's first round, send different sizes and hang).
    rank = dist.get_rank()
    model = tiny_model()
    opt = DecentOptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1), topology="ring", compression=wire)
    train_steps(model, opt, rank, range(1))  # the pending round is a group's first (exact) one
    opt.global_avg()
    if rank == 0:
        opt.revert_global_avg()
    train_steps(model, opt, rank, range(1, 8))
    state = opt.engine.state_dict()["gossip"]
    return {tuple(e["ranks"]): e["tensors"][0] for e in state["references"]}, flat(model)


@pytest.mark.parametrize("wire", ["bf16", "int8", "topk:0.05:int4"])
def test_a_revert_on_some_ranks_only_keeps_the_references_identical(pool, wire):
    results = pool(2).run(_partial_revert, wire)
    (refs0, model0), (refs1, model1) = results
    assert refs0.keys() == refs1.keys() == {(0, 1)}
    assert torch.equal(refs0[(0, 1)], refs1[(0, 1)])
    assert torch.isfinite(model0).all() and torch.isfinite(model1).all()


# -- both front-ends ------------------------------------------------------------------------------------
def _three_layers() -> nn.Module:
    # 880 elements in fp32 buckets (parameters aligned to 16): four 256-element chunks that straddle
    # parameters; buckets of 120 elements split the model otherwise when planned in backward order
    # ({b2, w2} {b1} {w1} {b0} {w0}) than in model order ({w0} {b0} {w1} {b1, w2} {b2}).
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 24), nn.Tanh(), nn.Linear(24, 24), nn.Tanh(), nn.Linear(24, 3))


#: Buckets of 120 fp32 elements for ``_three_layers``.
SPLIT_BUCKETS_MB = 120 * 4 / 2**20


def _sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _front_end_training(
    front_end: str, wire: str | None, bucket_mb: float, steps: int, **rule: object
) -> torch.Tensor:
    rank, model = dist.get_rank(), _three_layers()
    options = {"topology": "ring", "compression": wire, **rule}
    if front_end == "optimizer":
        opt = DecentOptimWrapper(_sgd(model.parameters()), bucket_cap_mb=bucket_mb, **options)
        train_steps(model, opt, rank, range(steps))
        opt.engine.wait_all()
    else:
        ddp = DecentralizedDataParallel(
            model, lambda named: _sgd([p for _, p in named]), bucket_size_in_mb=bucket_mb, **options
        )
        for step in range(steps):
            x, y = batch(rank, step)
            nn.functional.cross_entropy(ddp(x), y).backward()
        ddp.engine.wait_all()
    return flat(model)


@pytest.mark.parametrize("bucket_mb", [25, SPLIT_BUCKETS_MB], ids=["one-bucket", "split-buckets"])
@pytest.mark.parametrize("wire", [None, "bf16", "int8", "int4", "topk:0.1:int8", "randk:0.1:int4"])
def test_both_front_ends_run_the_same_compressed_update_bit_for_bit(pool, wire, bucket_mb):
    # The same model, optimizer and data on each rank under either front-end: the codecs must see the
    # same chunks (and random-k the same draws), whatever order the module front-end steps buckets in.
    steps = 20
    wrapped = pool(4).run(_front_end_training, "optimizer", wire, bucket_mb, steps)
    module = pool(4).run(_front_end_training, "module", wire, bucket_mb, steps)
    differs = [rank for rank in range(4) if not torch.equal(wrapped[rank], module[rank])]
    assert not differs, (
        f"ranks {differs} differ; largest difference "
        f"{max((wrapped[r] - module[r]).abs().max().item() for r in differs):.3g}"
    )


@pytest.mark.parametrize(
    ("wire", "rule"),
    [("randk:0.1:int4", {"sync_every": 4}), ("topk:0.1:int8", {"gradient_tracking": True})],
    ids=["low-communication", "gradient-tracking"],
)
def test_both_front_ends_agree_with_compression_under_the_other_rules(pool, wire, rule):
    # The anchors' and the trackers' rounds are compressed per bucket too, with the same seeds.
    wrapped = pool(4).run(_front_end_training, "optimizer", wire, SPLIT_BUCKETS_MB, 16, **rule)
    module = pool(4).run(_front_end_training, "module", wire, SPLIT_BUCKETS_MB, 16, **rule)
    for rank in range(4):
        assert torch.equal(wrapped[rank], module[rank]), f"rank {rank}"

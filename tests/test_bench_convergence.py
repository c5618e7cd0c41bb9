"""The convergence driver (``benchmarks/convergence/run.py``): its method grammar, splits and verdicts
without a process group, and each question end to end at a toy size.

Pure: the grammar of ``benchmarks/harness/methods.py`` (names read, round-tripped, rejected by name), the
splits of ``benchmarks/harness/synthetic_task.py`` and the digits task, the paced schedule, how the driver
names the runs a method is compared with, reads its command line, judges its targets and writes its
tables, and that the main job (examples/quickstart.py) trains the benchmarks' task with the methods its
names say. Examples: every question run as a user runs it (a subprocess starting its own local ranks,
with a hard deadline), a few steps each.
"""

from __future__ import annotations

import json
import math
from argparse import Namespace
from dataclasses import asdict, replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import load_script, run_script

from benchmarks.convergence import adam_rules, classification, lm, run
from benchmarks.convergence.questions import CLASSIFICATION_METHODS, RULES
from benchmarks.harness import digits_task, lm_task, methods, runner, synthetic_task
from decent_optim_wrapper import Pacing

ROOT = Path(__file__).resolve().parents[1]
DRIVER = "benchmarks/convergence/run.py"

pytestmark = pytest.mark.pure


@pytest.fixture(scope="module")
def labels() -> torch.Tensor:
    return synthetic_task.make_data()[1]


def class_shares(labels: torch.Tensor, shard: torch.Tensor) -> torch.Tensor:
    return torch.bincount(labels[shard], minlength=10).double() / len(shard)


def test_quickstart_trains_the_benchmark_task_with_the_methods_it_names():
    # The main job keeps its own copy of the task, so that it reads on its own; the convergence
    # benchmark's results are quoted as the main job's task: the two must stay the same, bit for bit.
    quickstart = load_script(ROOT / "examples" / "quickstart.py")
    for ours, theirs in zip(quickstart.make_data(), synthetic_task.make_data(), strict=True):
        assert torch.equal(ours, theirs)
    ours, theirs = quickstart.make_model().state_dict(), synthetic_task.make_model().state_dict()
    assert list(ours) == list(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)
    # its default methods show both front-ends, compressed gossip and the all-reduce baseline
    assert list(quickstart.METHODS) == ["ring", "ring-module", "ring@bf16", "one-peer-exp", "complete", "ddp"]
    for name, (front_end, keywords) in quickstart.METHODS.items():  # each name means what the grammar says
        method = methods.parse_method(name)
        expected = "all-reduce" if method.topology is None else "module" if method.module else "optimizer"
        assert front_end == expected
        assert keywords.get("topology") == method.topology
        assert keywords.get("compression") == method.compression
        assert not method.tracking and method.optimizer is None  # the quickstart trains SGD untracked


@pytest.mark.parametrize("world", [1, 3, 8])
def test_iid_split_is_the_strided_shard_of_before(world):
    # the default split must train on exactly the points (and order) of train_x[rank::world]
    train_x, train_y, _, _ = synthetic_task.make_data()
    shards = synthetic_task.split_data(train_y, world)
    for rank, shard in enumerate(shards):
        assert torch.equal(train_x[shard], train_x[rank::world])
        assert torch.equal(train_y[shard], train_y[rank::world])


@pytest.mark.parametrize(("world", "alpha", "seed"), [(2, 0.1, 0), (8, 0.1, 0), (8, 0.1, 3), (5, 1.0, 1)])
def test_dirichlet_split_is_a_partition(labels, world, alpha, seed):
    shards = synthetic_task.split_data(labels, world, "dirichlet", alpha, min_size=32, seed=seed)
    assert len(shards) == world
    every = torch.cat(shards)
    # each training point exactly once: the sorted concatenation is 0, 1, ..., n - 1
    assert torch.equal(every.sort().values, torch.arange(len(labels)))
    for shard in shards:
        assert torch.equal(shard, shard.sort().values)  # in dataset order


def test_dirichlet_split_is_the_same_on_every_call_and_changes_with_the_seed(labels):
    # every rank computes the partition alone: it must not depend on anything but the arguments
    torch.manual_seed(1234)
    first = synthetic_task.split_data(labels, 8, "dirichlet", 0.1, min_size=32, seed=0)
    torch.manual_seed(99)  # the global random state must neither matter ...
    state = torch.get_rng_state()
    again = synthetic_task.split_data(labels, 8, "dirichlet", 0.1, min_size=32, seed=0)
    assert torch.equal(torch.get_rng_state(), state)  # ... nor be consumed
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    other = synthetic_task.split_data(labels, 8, "dirichlet", 0.1, min_size=32, seed=1)
    assert not all(torch.equal(a, b) for a, b in zip(first, other, strict=True))


def test_dirichlet_split_skews_the_labels(labels):
    # Balanced, a worker's most frequent class holds ~1/10 of its points (the iid split: < 0.15 on
    # 8 workers). With alpha 0.1 most of a class goes to one or two workers: across 5 seeds the
    # smallest such share seen is 0.32, so 0.25 for at least 3 workers in 4 leaves a wide margin.
    shares = []
    for seed in range(5):
        for shard in synthetic_task.split_data(labels, 8, "dirichlet", 0.1, min_size=32, seed=seed):
            shares.append(class_shares(labels, shard).max().item())
    assert sum(s > 0.25 for s in shares) >= 0.75 * len(shares)
    iid = [class_shares(labels, shard).max().item() for shard in synthetic_task.split_data(labels, 8)]
    assert max(iid) < 0.15
    # a large alpha approaches the balanced split
    flat = synthetic_task.split_data(labels, 8, "dirichlet", 1000.0, min_size=32)
    assert max(class_shares(labels, shard).max().item() for shard in flat) < 0.15


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dirichlet_split_gives_every_worker_the_minimum(labels, seed):
    # 16 workers at alpha 0.1: an unconstrained draw leaves some worker below 200 points for these
    # seeds (checked first, so the minimum is really exercised); the split redraws until none is
    unconstrained = synthetic_task.split_data(labels, 16, "dirichlet", 0.1, min_size=1, seed=seed)
    assert min(len(s) for s in unconstrained) < 200
    shards = synthetic_task.split_data(labels, 16, "dirichlet", 0.1, min_size=200, seed=seed)
    assert min(len(s) for s in shards) >= 200
    assert sum(len(s) for s in shards) == len(labels)


def test_dirichlet_split_rejects_what_it_cannot_do(labels, monkeypatch):
    with pytest.raises(ValueError, match=r"alpha must be a positive number, got 0"):
        synthetic_task.split_data(labels, 4, "dirichlet", 0)
    with pytest.raises(ValueError, match=r"need 20000 points; there are 16384"):
        synthetic_task.split_data(labels, 8, "dirichlet", 0.1, min_size=2500)
    monkeypatch.setattr(synthetic_task, "MAX_DIRICHLET_DRAWS", 3)  # a tiny alpha: every draw fails
    with pytest.raises(ValueError, match=r"in 3 draws .* raise alpha"):
        synthetic_task.split_data(labels, 8, "dirichlet", 1e-3, min_size=2000)
    with pytest.raises(ValueError, match=r"unknown split 'skewed'"):
        synthetic_task.split_data(labels, 4, "skewed")


def test_digits_task_is_a_fixed_stratified_split_scaled_to_one():
    train_x, train_y, test_x, test_y = digits_task.make_digits()
    assert train_x.shape == (1437, 64) and test_x.shape == (360, 64)
    assert train_x.dtype == torch.float32 and float(train_x.min()) == 0.0 and float(train_x.max()) == 1.0
    # stratified: every class keeps its share of the 1797 images in the test set (within one image)
    counts = torch.bincount(test_y, minlength=10)
    totals = counts + torch.bincount(train_y, minlength=10)
    assert ((counts - 0.2 * totals).abs() <= 1).all()
    again = digits_task.make_digits()
    assert torch.equal(again[0], train_x) and torch.equal(again[3], test_y)
    first, same, other = (digits_task.make_digits_model(s).state_dict() for s in (1, 1, 2))
    assert all(torch.equal(first[k], same[k]) for k in first)
    assert not torch.equal(first["0.weight"], other["0.weight"])


@pytest.mark.parametrize(
    ("name", "topology", "module", "tracking", "compression", "optimizer"),
    [
        ("ring", "ring", False, False, None, None),
        ("ddp", None, False, False, None, None),
        ("ddp+adamw", None, False, False, None, "adamw"),
        ("ring@bf16", "ring", False, False, "bf16", None),
        ("one-peer-exp@fp16", "one-peer-exp", False, False, "fp16", None),
        ("ring-module", "ring", True, False, None, None),
        ("ring-module@int8+accum-adamw", "ring", True, False, "int8", "accum-adamw"),
        ("alternating-exp-ring@int8+sgd", "alternating-exp-ring", False, False, "int8", "sgd"),
        ("ring-gt", "ring", False, True, None, None),
        ("ring-gt@bf16+adamw", "ring", False, True, "bf16", "adamw"),
        ("one-peer-exp-gt@bf16", "one-peer-exp", False, True, "bf16", None),
        ("ring-module-gt", "ring", True, True, None, None),
        ("ring-module-gt+accum-adamw", "ring", True, True, None, "accum-adamw"),
        ("hierarchical-module-gt@int8+sgd", "hierarchical", True, True, "int8", "sgd"),
    ],
)
def test_method_names_are_read(name, topology, module, tracking, compression, optimizer):
    method = methods.parse_method(name)
    assert (method.topology, method.module, method.tracking, method.compression, method.optimizer) == (
        topology,
        module,
        tracking,
        compression,
        optimizer,
    )
    assert method.name == name  # the name round-trips


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("ddp@bf16", r"'ddp@bf16': ddp takes no compression, got 'bf16'.*Drop '@bf16'"),
        ("ddp@int8+adamw", r"ddp takes no compression, got 'int8'"),
        ("ring@fp8", r"unknown compression 'fp8' after '@'; choose one of bf16, fp16, int8"),
        ("ring@", r"unknown compression '' after '@'"),
        ("ring@bf16-module", r"unknown compression 'bf16-module'"),  # -module comes before @
        ("ring+adam", r"unknown optimizer 'adam' after '\+'"),
        ("ring@bf16+", r"unknown optimizer '' after '\+'"),
        ("torus@bf16", r"'torus@bf16': Unknown topology 'torus'"),
        ("ddp-module", r"Unknown topology 'ddp'"),
        ("ddp-gt", r"'ddp-gt': ddp takes no gradient tracking.*Drop '-gt'.*'ring-gt'"),
        ("ddp-gt+adamw", r"'ddp-gt\+adamw': ddp takes no gradient tracking"),
        ("ring-gt-module", r"'ring-gt-module': '-gt' comes after '-module'; write 'ring-module-gt'$"),
        ("ring-gt-module@bf16+adamw", r"write 'ring-module-gt@bf16\+adamw'$"),
        ("ring-gt-gt", r"'ring-gt-gt': Unknown topology 'ring-gt'"),
        ("ring@bf16-gt", r"unknown compression 'bf16-gt'"),  # -gt comes before @
        ("ring+adamw-gt", r"unknown optimizer 'adamw-gt' after '\+'"),
        ("-gt", r"'-gt': Unknown topology ''"),
    ],
)
def test_bad_method_names_are_rejected_by_name(name, message):
    with pytest.raises(ValueError, match=message):
        methods.parse_method(name)


@pytest.mark.parametrize(
    ("name", "sync_every", "nesterov", "delay"),
    [
        ("ring~h8", 8, False, None),
        ("ring~h8n", 8, True, None),
        ("complete~h8nd0", 8, True, 0),
        ("one-peer-exp-module~h32n@bf16+adamw", 32, True, None),
        ("ring~h4d4", 4, False, 4),
        ("ring~h8n0.3d0", 8, True, 0),
        ("ring~h8n0.5m0.5d0", 8, True, 0),
        ("complete~h8n0.8m0.0", 8, True, None),
    ],
)
def test_low_communication_names_are_read(name, sync_every, nesterov, delay):
    method = methods.parse_method(name)
    assert (method.sync_every, method.nesterov, method.sync_delay) == (sync_every, nesterov, delay)
    assert method.name == name
    options = method.engine_options()
    assert options["sync_every"] == sync_every and options["sync_delay"] == delay
    outer = options["outer_optimizer"]
    assert (outer is not None) == nesterov
    if nesterov:  # DiLoCo's outer optimizer, with the learning rate and momentum the name gives
        group = outer([torch.zeros(1)]).param_groups[0]
        momentum = 0.9 if method.outer_momentum is None else method.outer_momentum
        assert (group["lr"], group["momentum"]) == (method.outer_lr or 0.7, momentum)
        assert group["nesterov"] == (momentum > 0)  # m0.0: plain SGD (Nesterov needs momentum)
    assert "sync_every" not in methods.parse_method("ring").engine_options()  # per-step gossip untouched


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("ddp~h8", r"after '~' write hH"),
        ("ring~h0", r"after '~' write hH"),
        ("ring~8n", r"after '~' write hH"),
        ("ring~h4d5", r"the delay d5 exceeds the round of h4 steps"),
    ],
)
def test_bad_low_communication_names_are_rejected(name, message):
    with pytest.raises(ValueError, match=message):
        methods.parse_method(name)


@pytest.mark.parametrize(
    ("name", "sync_every", "nesterov", "outer_lr", "delay", "optimizer"),
    [
        ("ring~h8n0.1p+adamw", 8, True, 0.1, None, "adamw"),
        ("ring~h8d1p+adamw", 8, False, None, 1, "adamw"),
        ("ring~h8p", 8, False, None, None, None),
        ("one-peer-exp-module~h4n0.3d0p@bf16+adamw-local", 4, True, 0.3, 0, "adamw"),
    ],
)
def test_paced_names_are_read(name, sync_every, nesterov, outer_lr, delay, optimizer):
    method = methods.parse_method(name)
    assert method.paced
    assert (method.sync_every, method.nesterov, method.outer_lr, method.sync_delay, method.optimizer) == (
        sync_every,
        nesterov,
        outer_lr,
        delay,
        optimizer,
    )
    assert method.name == name  # the name round-trips
    options = method.engine_options(world=6)
    assert options["sync_every"] == sync_every and options["sync_delay"] == delay
    pacing = options["pacing"]
    assert isinstance(pacing, Pacing) and pacing.weighting == "samples"
    assert pacing.schedule == methods.HalfFastSchedule(6, sync_every)
    # without 'p' it is the same method, with no pacing at all
    local = name.partition("~")[2]
    unpaced = methods.parse_method(name.replace("~" + local, "~" + local.replace("p", "", 1)))
    assert unpaced == replace(method, paced=False)
    assert "pacing" not in unpaced.engine_options()


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("ring-gt~h8p", r"'ring-gt~h8p': paced rounds \('p'\) take no gradient tracking"),
        ("ring~h8pn", r"after '~' write hH .* p for paced rounds"),
        ("ring~h8pd1", r"after '~' write hH"),  # p comes last
        ("ddp~h8p", r"after '~' write hH"),
        ("ring~p", r"after '~' write hH"),
    ],
)
def test_bad_paced_names_are_rejected(name, message):
    with pytest.raises(ValueError, match=message):
        methods.parse_method(name)


def test_half_fast_schedule_of_eight_ranks_at_h8():
    schedule = methods.HalfFastSchedule(8, 8)
    fast = [schedule(0, r) for r in range(6)]
    slow = [schedule(7, r) for r in range(6)]
    assert fast == [11, 10, 11, 11, 10, 11]  # 4H/3 = 10.67, diffused
    assert slow == [5, 6, 5, 5, 6, 5]
    assert all(schedule(rank, r) == fast[r] for rank in range(4) for r in range(6))  # ranks 0-3 fast
    assert all(schedule(rank, r) == slow[r] for rank in range(4, 8) for r in range(6))  # ranks 4-7 slow
    # 75 rounds (600 steps of DDP): 4,800 inner steps, as DDP's 600 on 8 workers
    assert [schedule.total(rank, 75) for rank in range(8)] == [800] * 4 + [400] * 4


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 8, 16])
@pytest.mark.parametrize("sync_every", [2, 3, 4, 7, 8, 16, 32])
def test_half_fast_schedule_sums_every_round_to_n_h(world, sync_every):
    schedule = methods.HalfFastSchedule(world, sync_every)
    rounds = 120
    counts = [[schedule(rank, r) for r in range(rounds)] for rank in range(world)]
    for r in range(rounds):  # exactly the samples of H steps on every rank, in every round
        assert sum(counts[rank][r] for rank in range(world)) == world * sync_every
    assert all(c >= 1 for row in counts for c in row)
    for rank in range(world):  # a rank's total is the sum of its counts, at every length
        assert all(schedule.total(rank, n) == sum(counts[rank][:n]) for n in (0, 1, 7, rounds))
    half = world // 2
    for rank in range(half):  # the fast half takes twice the slow half's steps, to a step
        fast, slow = sum(counts[rank]), sum(counts[half + rank])
        assert abs(fast - 2 * slow) <= 2
        assert all(abs(sum(counts[rank][:n]) - 4 * sync_every * n / 3) <= 0.5 for n in range(rounds))
    if world % 2:  # the odd one out takes H
        assert counts[-1] == [sync_every] * rounds


def test_half_fast_schedule_per_step_gives_fast_ranks_two_steps_a_round():
    # H = 1: a slow rank cannot take 2/3 of a step, so rounds hold N + N//2 fleet steps: 600 steps of
    # DDP on 4 ranks (2,400 samples) are 400 rounds of 2, 2, 1, 1
    schedule = methods.HalfFastSchedule(4, 1)
    assert [schedule(rank, r) for rank in range(4) for r in (0, 1)] == [2, 2, 2, 2, 1, 1, 1, 1]
    assert schedule.fleet_steps_per_round == 6 and schedule.rounds_for(600) == 400
    assert [schedule.total(rank, 400) for rank in range(4)] == [800, 800, 400, 400]
    assert methods.HalfFastSchedule(5, 1)(4, 0) == 1  # the odd one out: one step
    with pytest.raises(ValueError, match=r"601 steps on 4 ranks are not a whole number of paced rounds"):
        schedule.rounds_for(601)
    with pytest.raises(ValueError, match=r"sync_every >= 1"):
        methods.HalfFastSchedule(4, 0)


def test_paced_runs_train_whole_rounds_of_the_same_samples():
    spec = methods.parse_method("ring~h8n0.1p+adamw")
    schedule, rounds, own = runner.paced_plan(spec, 600, rank=0, world=8)
    assert (schedule, rounds, own) == (methods.HalfFastSchedule(8, 8), 75, 800)
    assert runner.paced_plan(spec, 600, rank=5, world=8)[2] == 400
    assert runner.paced_plan(methods.parse_method("ring~h8n0.1+adamw"), 600, 0, 8) == (None, 0, 600)
    with pytest.raises(ValueError, match=r"601 steps on 8 ranks are not a whole number of paced rounds"):
        runner.paced_plan(spec, 601, rank=0, world=8)
    per_step = methods.parse_method("ring~h1d0p+adamw")
    assert runner.paced_plan(per_step, 600, rank=0, world=4)[1:] == (400, 800)
    # a round's fleet steps [first, last] hold a multiple of the logging period, or not
    assert runner.covers_multiple(0, 7, 600) and runner.covers_multiple(592, 599, 8)
    assert not runner.covers_multiple(8, 15, 600) and runner.covers_multiple(8, 15, 10)


def test_command_line_names_the_split_and_rejects_a_bad_method(capsys):
    args = run.parse_args(["classification"])
    assert (args.splits, args.alpha, args.task, args.seeds) == (["iid", "dirichlet"], 0.1, "synthetic", [0])
    assert args.methods == CLASSIFICATION_METHODS  # the defaults already hold every reference they need
    args = run.parse_args(["classification", "--task", "digits", "--seeds", "0", "1", "--alpha", "0.5"])
    assert (args.task, args.seeds, args.alpha) == ("digits", [0, 1], 0.5)
    assert synthetic_task.split_label("dirichlet", 0.5) == "dirichlet(alpha=0.5)"
    assert synthetic_task.split_label("iid", None) == "iid"
    for question, method, message in [
        ("classification", "ddp@bf16", "ddp takes no compression, got 'bf16'"),
        ("classification", "ddp-gt", "'ddp-gt': ddp takes no gradient tracking"),
        ("lm", "ring", "the language model trains with Adam"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            run.parse_args([question, "--methods", "ring+adamw", method])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_each_method_is_compared_with_its_twins():
    assert classification.ddp_reference("ring-module-gt+accum-adamw") == "ddp+adamw"
    assert classification.ddp_reference("one-peer-exp-gt") == "ddp"
    assert classification.twin("ring-gt@bf16", "compression") == "ring-gt"
    assert classification.twin("ring-gt@bf16", "tracking") == "ring@bf16"
    assert classification.twin("ring-module-gt+accum-adamw", "tracking") == "ring-module+accum-adamw"
    assert classification.twin("ring@bf16", "tracking") is None
    assert classification.twin("ring~h8n0.1p+adamw", "paced") == "ring~h8n0.1+adamw"
    # missing references are added, each once, after the methods asked for; a reference's own too
    assert classification.with_references(["ring-gt@bf16"]) == [
        "ring-gt@bf16",
        "ddp",
        "ring-gt",
        "ring@bf16",
        "ring",
    ]
    assert classification.with_references(["ring~h8n0.1p+adamw"]) == [
        "ring~h8n0.1p+adamw",
        "ddp+adamw",
        "ring~h8n0.1+adamw",
    ]
    assert classification.with_references(CLASSIFICATION_METHODS) == CLASSIFICATION_METHODS
    # the language model: ddp+adamw first, a compressed or paced method's twin after
    assert lm.with_twins(["ring~h8d1@topk:0.03:int4+adamw"]) == [
        "ddp+adamw",
        "ring~h8d1@topk:0.03:int4+adamw",
        "ring~h8d1+adamw",
    ]
    assert lm.with_twins(["ring~h8d1p+adamw"]) == ["ddp+adamw", "ring~h8d1p+adamw", "ring~h8d1+adamw"]


@pytest.mark.parametrize(
    ("split", "name", "vs_ddp", "vs_uncompressed", "vs_untracked", "expected"),
    [
        ("iid", "ring", 0.4, None, None, "met"),
        ("iid", "ring", -0.6, None, None, "MISSED (vs DDP)"),
        ("dirichlet", "ring", -5.0, None, None, "-"),  # untracked: the skew gap is reported, not judged
        ("dirichlet", "ring@bf16", -5.0, 0.2, None, "met"),
        ("dirichlet", "ring-gt", -0.4, None, 4.6, "met"),  # the gain over untracked is not judged
        ("dirichlet", "ring-gt", -0.6, None, 4.4, "MISSED (vs DDP)"),
        ("dirichlet", "one-peer-exp-gt", 0.6, None, 4.4, "MISSED (vs DDP)"),
        ("dirichlet", "ring-module-gt+accum-adamw", -0.6, None, 4.4, "MISSED (vs DDP)"),
        ("dirichlet", "complete-gt", -0.6, None, 0.0, "-"),  # only ring and one-peer-exp are judged
        ("dirichlet", "ring-gt@bf16", -0.4, -0.4, 4.6, "MISSED (vs uncompressed)"),
        ("iid", "ring-gt", 0.0, None, 0.05, "met"),
        ("iid", "ring-gt", 0.0, None, -0.15, "MISSED (vs untracked)"),
        ("iid", "ring-gt@bf16", 0.6, 0.4, 0.2, "MISSED (vs DDP, vs uncompressed, vs untracked)"),
        # formats sending at most 1/64 of fp32's bytes may lose 0.5 points, the others 0.3
        ("iid", "ring~h8n0.1@topk:0.01:int2", 0.0, -0.45, None, "met"),
        ("iid", "ring~h8n0.1@topk:0.03:int4", 0.0, -0.55, None, "MISSED (vs uncompressed)"),
        ("iid", "ring@int4", 0.0, -0.45, None, "MISSED (vs uncompressed)"),
    ],
)
def test_classification_judges_its_targets(split, name, vs_ddp, vs_uncompressed, vs_untracked, expected):
    spec = methods.parse_method(name)
    assert classification.verdict(split, spec, vs_ddp, vs_uncompressed, vs_untracked) == expected


def rows_of(text: str) -> dict[str, list[str]]:
    """A markdown table's rows by their first cell, each row's cells after it."""
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in text.splitlines()]
    return {row[0]: row[1:] for row in rows if len(row) > 1}


def test_classification_table_gives_the_differences_and_the_paced_block():
    def result(
        method: str, accuracy: float, split: str = "dirichlet", steps: list[int] | None = None, **more
    ):
        alpha = 0.1 if split == "dirichlet" else None
        return runner.Result(
            method, [], accuracy=accuracy, final_loss=1.0, bytes_per_step=1.0, split=split, alpha=alpha,
            steps_per_rank=steps or [], **more,
        )  # fmt: skip

    args = SimpleNamespace(steps=10, batch_size=16, lr=0.05, adam_lr=3e-3, task="synthetic")
    rows = rows_of(
        classification.table([result("ring", 0.50), result("ring-gt", 0.55), result("ddp", 0.552)], 8, args)
    )
    assert rows["ring-gt"][4:] == ["-0.20", "-", "+5.00", "met"]
    assert rows["ring"][4:] == ["-5.20", "-", "-", "-"]
    paced = [
        result("ring~h8n0.1p+adamw", 0.550, "iid", [800, 800, 400, 400]),
        result("ddp+adamw", 0.553, "iid"),
        result("ring~h8n0.1+adamw", 0.552, "iid"),
    ]
    text = classification.table(paced, 4, args)
    assert rows_of(text)["ring~h8n0.1p+adamw"][4:] == ["-0.30", "-", "-", "met"]
    assert (
        "  ring~h8n0.1p+adamw: inner steps per worker 400 to 800, 2,400 in all; -0.30 points from ddp+adamw, "
        "-0.20 points from ring~h8n0.1+adamw"
    ) in text
    # over seeds: the means, in the order the methods ran, and the seeds' spread
    runs = [
        result(method, accuracy, "iid", seed=seed)
        for seed, pair in enumerate([(0.95, 0.96), (0.96, 0.97), (0.94, 0.975)])
        for method, accuracy in zip(("ring~h8n0.1", "ddp"), pair, strict=True)
    ]
    merged = classification.mean_over_seeds(runs)
    assert [r.method for r in merged] == ["ring~h8n0.1", "ddp"]
    assert merged[0].accuracy == pytest.approx(0.95) and merged[0].accuracies == [0.95, 0.96, 0.94]
    text = classification.table(merged, 8, replace_task(args, "digits"))
    assert "digits task" in text and "means over 3 seeds" in text
    cells = rows_of(text)["ring~h8n0.1"]
    assert cells[2] == "2.00" and cells[4] == "-1.83" and cells[-1] == "MISSED (vs DDP)"


def replace_task(args: SimpleNamespace, task: str) -> SimpleNamespace:
    return SimpleNamespace(**{**vars(args), "task": task})


def _result(method: str, loss: float, curve: list[tuple[int, float]]) -> lm.LMResult:
    return lm.LMResult(method, "iid", loss, loss, 1.0, 1.0, curve, 4, 3e-3, 100)


@pytest.mark.parametrize(
    ("name", "second_moment"),
    [
        ("ring+adamw", "average"),
        ("ring+adamw-local", "local"),
        ("one-peer-exp~h8n@bf16+adamw-local", "local"),
    ],
)
def test_local_suffix_selects_the_plain_second_moment(name, second_moment):
    method = methods.parse_method(name)
    assert method.engine_options()["second_moment"] == second_moment and method.name == name
    with pytest.raises(ValueError, match=r"ddp takes no '-local'"):
        methods.parse_method("ddp+adamw-local")


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon: torch >= 2.9")
def test_muon_method_steps_muon_on_the_hidden_matrices_and_adamw_on_the_rest():
    assert methods.parse_method("ring~h8+muon").name == "ring~h8+muon"
    model = lm_task.make_lm_model()
    optimizer = methods.optimizer_factory("muon", 0.0, 3e-3)(list(model.named_parameters()))
    muon, adamw = optimizer.parts
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    hidden = {id(p) for g in muon.param_groups for p in g["params"]}
    for name, p in model.named_parameters():  # the embedding (tied with the output) and positions: AdamW
        assert (id(p) in hidden) == (p.ndim == 2 and not name.startswith(("embed", "position"))), name
    # one step of each part is torch's own step on the same gradients
    twin = lm_task.make_lm_model()
    reference = methods.MuonAdamW(list(twin.named_parameters()), lr=3e-3).parts
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        p.grad = q.grad = torch.randn_like(p, generator=torch.Generator().manual_seed(p.numel()))
    optimizer.step()
    for part in reference:
        part.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters(), strict=True))
    # a stock scheduler on the one optimizer drives both parts' learning rates
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5)
    assert scheduler.get_last_lr() == [1.5e-3, 1.5e-3]
    assert muon.param_groups[0]["lr"] == adamw.param_groups[0]["lr"] == 1.5e-3


def test_lm_table_judges_targets_and_gives_the_uncorrected_twin():
    results = [
        _result("ddp+adamw", 2.0, [(10, 2.5), (20, 2.0)]),
        _result("ring+adamw", 2.03, [(10, 2.4), (20, 2.03)]),  # 1.015: met
        _result("ring+adamw-local", 2.2, [(10, 2.6), (20, 2.2)]),
        _result("ring~h8+adamw", 2.12, [(10, 1.9), (20, 2.12)]),  # 1.06 > 1.05: missed; reached at 10
        _result("ring~h8@int8+adamw", 2.14, [(20, 2.14)]),  # 1.07 DDP (missed), 1.0094 its twin (met)
        _result("ring@topk:0.03:int4+adamw", 2.1, [(20, 2.1)]),  # 1.05 DDP, 1.0345 its twin: both missed
        _result("ring~h8d1p+adamw", 2.03, [(20, 2.03)]),  # paced, 1.015: met
        _result("ring-module~h8d1p+adamw", 2.06, [(20, 2.06)]),  # 1.03: missed (2%), though within 5%
        _result("ring~h8d1+adamw", 2.08, [(20, 2.08)]),  # 1.04: met (5%, sync_every 8)
    ]
    results[6].steps_per_rank = [27, 27, 13, 13]
    text = lm.table(results, SimpleNamespace(steps=20, batch_size=16, adam_lr=3e-3, seed=0, warmup=0), 4)
    rows = rows_of(text)
    assert rows["ring+adamw"][3:] == ["1.0150", "1.1000", "-", "not reached", "met"]
    assert rows["ring~h8@int8+adamw"][3:] == ["1.0700", "-", "1.0094", "-", "MISSED"]
    assert rows["ring@topk:0.03:int4+adamw"][3:] == ["1.0500", "-", "1.0345", "-", "MISSED (both)"]
    assert rows["ring+adamw-local"][-1] == "-"  # the uncorrected rule is not judged
    assert rows["ring~h8+adamw"][-2:] == ["10", "MISSED"]
    assert [rows[m][-1] for m in ("ring~h8d1p+adamw", "ring-module~h8d1p+adamw", "ring~h8d1+adamw")] == [
        "met",
        "MISSED",
        "met",
    ]
    assert (
        "  ring~h8d1p+adamw: inner steps per worker 13 to 27, 80 in all; 1.0150x ddp+adamw's, "
        "0.9760x ring~h8d1+adamw's"
    ) in text
    assert "paced within 1.02x" in text
    assert lm.steps_to_reach([(5, 3.0), (10, 1.9), (15, 1.8)], 2.0) == 10


def test_reuse_takes_a_result_of_the_same_flags_and_seeds_divide_by_each_runs_own_ddp(tmp_path):
    earlier = tmp_path / "earlier.json"  # report.save's layout; a bare list (older runs) is read too
    earlier.write_text(json.dumps({"results": [asdict(_result("ddp+adamw", 2.0, [(10, 2.5), (20, 2.0)]))]}))
    args = run.parse_args(
        ["lm", "--workers", "4", "--methods", "ring+adamw", "--reuse", str(earlier), "ddp+adamw"]
    )
    assert args.methods == ["ddp+adamw", "ring+adamw"]
    assert lm.reused(args)["iid", "ddp+adamw"] == _result("ddp+adamw", 2.0, [(10, 2.5), (20, 2.0)])
    for flags in (
        ["--workers", "8", "--reuse", str(earlier), "ddp+adamw"],
        ["--reuse", str(earlier), "ring+adamw"],
    ):
        with pytest.raises(SystemExit):  # ran with 4 workers, asked for 8; no such method in the file
            run.parse_args(["lm", *flags])
    # two seeds: DDP 2.0 and 2.2; the method ends 1.02x and 1.10x its own run's DDP, its twin 1.2x
    seed0 = [
        _result("ddp+adamw", 2.0, []),
        _result("ring~h8d0+adamw", 2.04, []),
        _result("ring~h8d0+adamw-local", 2.4, []),
    ]
    seed1 = [_result("ddp+adamw", 2.2, []), _result("ring~h8d0+adamw", 2.42, [])]
    seed1_more = [_result("ddp+adamw", 2.2, []), _result("ring~h8d0+adamw-local", 2.64, [])]  # --reuse'd
    paths = []
    for name, results in (("s0", seed0), ("s1", seed1), ("s1-more", seed1_more)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps([asdict(r) for r in results]))
    _, text = lm.seeds(Namespace(paths=paths, target=1.05))
    assert text.startswith("2 runs")  # the third file is the second run's, merged
    assert rows_of(text)["ring~h8d0+adamw"] == ["1.020 1.100", "1.060", "1.100", "1 of 2", "1.200"]
    assert "ring~h8d0+adamw-local" not in rows_of(text)  # a twin is a column, not a row


@pytest.mark.examples
@pytest.mark.timeout(300)
def test_adam_rules_with_one_replica_every_unfloored_rule_is_adam_and_gossip_mixes_late(tmp_path):
    # One replica: its own second moment is the average gradient's, so each path of the rules but the
    # floored one (fed g_t x, not g_t^2) is DDP's AdamW, bit for bit.
    one = {"n": 1, "steps": 4, "batch": 2, "lr": 3e-3, "split": "iid", "gossip": None}
    adam = adam_rules.simulate("ddp", **one)
    assert all(
        adam_rules.simulate(r, **one) == adam for r in ("oracle", "oracle-per-tensor", "lag1", "momentum-abs")
    )
    assert adam_rules.simulate("momentum-floor", **one) != adam
    # the complete graph mixed one step late, as the engine does: another run than the exact average
    options = {"rule": "momentum-abs", "n": 3, "steps": 4, "batch": 2, "lr": 3e-3, "split": "iid"}
    exact = adam_rules.simulate(gossip=None, **options)
    assert abs(adam_rules.simulate(gossip="complete", **options) - exact) > 1e-4
    # the question end to end: every rule, ddp first
    out = tmp_path / "rules.json"
    run_script(DRIVER, "adam_rules", "--workers", "2", "--steps", "3", "--json", str(out), deadline_s=280)
    rules = [r["rule"] for r in json.loads(out.read_text())["results"]]
    assert rules[0] == "ddp" and set(rules) == set(RULES)


@pytest.mark.examples
@pytest.mark.timeout(300)
def test_classification_adds_the_references_and_trains_paced_rounds(tmp_path):
    out, table = tmp_path / "convergence.json", tmp_path / "convergence.txt"
    flags = ["--workers", "2", "--steps", "8", "--batch-size", "16", "--splits", "dirichlet"]
    flags += ["--methods", "ring-gt", "ring~h4n0.1p+adamw", "--json", str(out), "--table", str(table)]
    output = run_script(DRIVER, "classification", *flags, deadline_s=280)
    saved = json.loads(out.read_text())
    assert saved["command"].startswith("uv run ") and DRIVER in saved["command"]
    results = {r["method"]: r for r in saved["results"]}
    # ring-gt is compared with DDP and with ring (untracked), the paced method with its unpaced twin
    assert list(results) == ["ring-gt", "ring~h4n0.1p+adamw", "ddp", "ring", "ddp+adamw", "ring~h4n0.1+adamw"]
    assert all((r["split"], r["alpha"]) == ("dirichlet", 0.1) for r in results.values())
    # 2 rounds of H=4 on 2 ranks: the fast rank 5 + 6 steps, the slow one 3 + 2 (DDP's 16 samples)
    assert results["ring~h4n0.1p+adamw"]["steps_per_rank"] == [11, 5]
    assert "Convergence, dirichlet(alpha=0.1) split: 2 workers, 8 steps" in output
    assert rows_of(output)["ring-gt"][-1] in ("met", "MISSED (vs DDP)")  # judged: tracked ring, skewed data
    assert "ring~h4n0.1p+adamw: inner steps per worker 5 to 11" in table.read_text()


@pytest.mark.examples
@pytest.mark.timeout(300)
def test_lm_trains_a_paced_method_by_rounds_and_evaluates_the_average(tmp_path):
    out = tmp_path / "lm.json"
    flags = ["--workers", "2", "--steps", "8", "--eval-every", "3", "--width", "16", "--depth", "1"]
    flags += ["--methods", "ring~h4d1p+adamw", "ring+adamw", "ring+adamw-local", "--json", str(out)]
    output = run_script(DRIVER, "lm", *flags, deadline_s=280)
    results = {r["method"]: r for r in json.loads(out.read_text())["results"]}
    assert list(results) == [
        "ddp+adamw",
        "ring~h4d1p+adamw",
        "ring+adamw",
        "ring+adamw-local",
        "ring~h4d1+adamw",
    ]
    paced = results["ring~h4d1p+adamw"]
    # 2 rounds of 8 steps over the fleet: the fast rank 5 + 6, the slow one 3 + 2 (DDP's 16 samples)
    assert paced["steps_per_rank"] == [11, 5] and results["ddp+adamw"]["steps_per_rank"] == [8, 8]
    # evaluated at the end of the round that holds fleet step 3 (round 1: steps 1-4), then at the end
    assert [step for step, _ in paced["curve"]] == [4, 8]
    assert [step for step, _ in results["ring+adamw"]["curve"]] == [3, 6, 8]
    assert all(math.isfinite(loss) for _, loss in paced["curve"])
    # the rule changes the run: the corrected and uncorrected losses differ
    assert results["ring+adamw"]["validation_loss"] != results["ring+adamw-local"]["validation_loss"]
    assert "Paced rounds" in output and "uncorrected" in output


@pytest.mark.examples
@pytest.mark.timeout(420)
def test_attack_reports_a_lost_plain_job_and_a_held_clipped_one(tmp_path):
    # 4 workers, 20 steps, worker 3 multiplying its model by 100 after each step. Plain gossip loses
    # the job (the attacker's values overflow until nobody around it can heal), reported promptly
    # rather than waiting for the lost rounds; clipped gossip keeps the honest workers within 5%.
    out = tmp_path / "attack.json"
    flags = ["--workers", "4", "--steps", "20", "--methods", "ring", "ring-clipped"]
    output = run_script(
        DRIVER, "attack", *flags, "--attacks", "none", "scaled", "--json", str(out), deadline_s=400
    )
    rows = {(r["method"], r["attack"]): r for r in json.loads(out.read_text())["results"]}
    assert sorted(rows, key=str) == sorted(
        [(m, a) for m in ("ring", "ring-clipped") for a in (None, "scaled")], key=str
    )
    assert all(math.isfinite(rows[(m, None)]["loss"]) for m in ("ring", "ring-clipped"))
    assert "failed" in rows[("ring", "scaled")] and rows[("ring", "scaled")]["loss"] == math.inf
    assert rows[("ring-clipped", "scaled")]["ratio"] <= 1.05
    assert "met" in output and "job lost" in output


@pytest.mark.examples
@pytest.mark.timeout(330)
def test_accelerate_trains_every_kind_of_method(tmp_path):
    pytest.importorskip("accelerate", reason="the [accelerate] extra is not installed")
    out = tmp_path / "records.json"
    flags = ["--workers", "2", "--seeds", "0", "--tasks", "classification", "--classification-steps", "8"]
    flags += ["--every", "4", "--methods", "ddp", "local-sgd", "gossip-ring-d1", "--json", str(out)]
    output = run_script(DRIVER, "accelerate", *flags, deadline_s=300)
    assert "| classification | gossip-ring-d1 |" in output
    by_method = {r["method"]: r for r in json.loads(out.read_text())["results"]}
    assert sorted(by_method) == ["ddp", "gossip-ring-d1", "local-sgd"]
    for method, record in by_method.items():
        assert record["steps"] == 8 and math.isfinite(record["val_loss"]), method
        # DDP's replicas are equal, LocalSGD's after its last mean (step 8 of K = 4), gossip's after
        # global_avg: every rank evaluates the same model.
        assert len(set(record["val_loss_all_ranks"])) == 1, (method, record["val_loss_all_ranks"])

"""The main job's data splits and method names (examples/quickstart.py), without a process group.

Also how the convergence benchmark (benchmarks/convergence.py) names the runs a method is compared
with and judges its targets.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import load_script

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "examples" / "quickstart.py"
CONVERGENCE = ROOT / "benchmarks" / "convergence.py"

pytestmark = pytest.mark.pure


@pytest.fixture(scope="module")
def quickstart():
    return load_script(QUICKSTART)


@pytest.fixture(scope="module")
def convergence():
    with pytest.MonkeyPatch.context() as patch:  # the benchmark imports its sibling `common`
        patch.syspath_prepend(str(CONVERGENCE.parent))
        module = load_script(CONVERGENCE)
    yield module
    sys.modules.pop("common", None)


@pytest.fixture(scope="module")
def labels(quickstart) -> torch.Tensor:
    return quickstart.make_data()[1]


def class_shares(labels: torch.Tensor, shard: torch.Tensor) -> torch.Tensor:
    return torch.bincount(labels[shard], minlength=10).double() / len(shard)


@pytest.mark.parametrize("world", [1, 3, 8])
def test_iid_split_is_the_strided_shard_of_before(quickstart, world):
    # the default split must train on exactly the points (and order) of train_x[rank::world]
    train_x, train_y, _, _ = quickstart.make_data()
    shards = quickstart.split_data(train_y, world)
    for rank, shard in enumerate(shards):
        assert torch.equal(train_x[shard], train_x[rank::world])
        assert torch.equal(train_y[shard], train_y[rank::world])


@pytest.mark.parametrize(("world", "alpha", "seed"), [(2, 0.1, 0), (8, 0.1, 0), (8, 0.1, 3), (5, 1.0, 1)])
def test_dirichlet_split_is_a_partition(quickstart, labels, world, alpha, seed):
    shards = quickstart.split_data(labels, world, "dirichlet", alpha, min_size=32, seed=seed)
    assert len(shards) == world
    every = torch.cat(shards)
    # each training point exactly once: the sorted concatenation is 0, 1, ..., n - 1
    assert torch.equal(every.sort().values, torch.arange(len(labels)))
    for shard in shards:
        assert torch.equal(shard, shard.sort().values)  # in dataset order


def test_dirichlet_split_is_the_same_on_every_call_and_changes_with_the_seed(quickstart, labels):
    # every rank computes the partition alone: it must not depend on anything but the arguments
    torch.manual_seed(1234)
    first = quickstart.split_data(labels, 8, "dirichlet", 0.1, min_size=32, seed=0)
    torch.manual_seed(99)  # the global random state must neither matter ...
    state = torch.get_rng_state()
    again = quickstart.split_data(labels, 8, "dirichlet", 0.1, min_size=32, seed=0)
    assert torch.equal(torch.get_rng_state(), state)  # ... nor be consumed
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    other = quickstart.split_data(labels, 8, "dirichlet", 0.1, min_size=32, seed=1)
    assert not all(torch.equal(a, b) for a, b in zip(first, other, strict=True))


def test_dirichlet_split_skews_the_labels(quickstart, labels):
    # Balanced, a worker's most frequent class holds ~1/10 of its points (the iid split: < 0.15 on
    # 8 workers). With alpha 0.1 most of a class goes to one or two workers: across 5 seeds the
    # smallest such share seen is 0.32, so 0.25 for at least 3 workers in 4 leaves a wide margin.
    shares = []
    for seed in range(5):
        for shard in quickstart.split_data(labels, 8, "dirichlet", 0.1, min_size=32, seed=seed):
            shares.append(class_shares(labels, shard).max().item())
    assert sum(s > 0.25 for s in shares) >= 0.75 * len(shares)
    iid = [class_shares(labels, shard).max().item() for shard in quickstart.split_data(labels, 8)]
    assert max(iid) < 0.15
    # a large alpha approaches the balanced split
    flat = quickstart.split_data(labels, 8, "dirichlet", 1000.0, min_size=32)
    assert max(class_shares(labels, shard).max().item() for shard in flat) < 0.15


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dirichlet_split_gives_every_worker_the_minimum(quickstart, labels, seed):
    # 16 workers at alpha 0.1: an unconstrained draw leaves some worker below 200 points for these
    # seeds (checked first, so the minimum is really exercised); the split redraws until none is
    unconstrained = quickstart.split_data(labels, 16, "dirichlet", 0.1, min_size=1, seed=seed)
    assert min(len(s) for s in unconstrained) < 200
    shards = quickstart.split_data(labels, 16, "dirichlet", 0.1, min_size=200, seed=seed)
    assert min(len(s) for s in shards) >= 200
    assert sum(len(s) for s in shards) == len(labels)


def test_dirichlet_split_rejects_what_it_cannot_do(quickstart, labels, monkeypatch):
    with pytest.raises(ValueError, match=r"alpha must be a positive number, got 0"):
        quickstart.split_data(labels, 4, "dirichlet", 0)
    with pytest.raises(ValueError, match=r"need 20000 points; there are 16384"):
        quickstart.split_data(labels, 8, "dirichlet", 0.1, min_size=2500)
    monkeypatch.setattr(quickstart, "MAX_DIRICHLET_DRAWS", 3)  # a tiny alpha: every draw fails
    with pytest.raises(ValueError, match=r"in 3 draws .* raise alpha"):
        quickstart.split_data(labels, 8, "dirichlet", 1e-3, min_size=2000)
    with pytest.raises(ValueError, match=r"unknown split 'skewed'"):
        quickstart.split_data(labels, 4, "skewed")


def test_command_line_names_the_split(quickstart):
    args = quickstart.parse_args([])
    assert (args.split, args.alpha) == ("iid", 0.1)
    args = quickstart.parse_args(["--split", "dirichlet", "--alpha", "0.5"])
    assert (args.split, args.alpha) == ("dirichlet", 0.5)
    assert quickstart.split_label("dirichlet", 0.5) == "dirichlet(alpha=0.5)"
    assert quickstart.split_label("iid", None) == "iid"


def test_command_line_rejects_a_bad_method_before_starting_workers(quickstart, capsys):
    with pytest.raises(SystemExit) as exit_info:
        quickstart.parse_args(["--methods", "ring", "ddp@bf16"])
    assert exit_info.value.code == 2
    assert "ddp takes no compression, got 'bf16'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        quickstart.parse_args(["--methods", "ring-gt", "ddp-gt"])
    assert "'ddp-gt': ddp takes no gradient tracking" in capsys.readouterr().err


def test_default_methods_show_compressed_gossip(quickstart):
    assert quickstart.METHODS == ("ring", "ring-module", "ring@bf16", "one-peer-exp", "complete", "ddp")
    assert quickstart.parse_args([]).methods == list(quickstart.METHODS)


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
def test_method_names_are_read(quickstart, name, topology, module, tracking, compression, optimizer):
    method = quickstart.parse_method(name)
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
def test_bad_method_names_are_rejected_by_name(quickstart, name, message):
    with pytest.raises(ValueError, match=message):
        quickstart.parse_method(name)


def test_convergence_compares_each_method_with_its_twins(quickstart, convergence):
    assert convergence.ddp_reference(quickstart, "ring-module-gt+accum-adamw") == "ddp+adamw"
    assert convergence.ddp_reference(quickstart, "one-peer-exp-gt") == "ddp"
    assert convergence.uncompressed_twin(quickstart, "ring-gt@bf16") == "ring-gt"
    assert convergence.untracked_twin(quickstart, "ring-gt@bf16") == "ring@bf16"
    assert convergence.untracked_twin(quickstart, "ring-module-gt+accum-adamw") == "ring-module+accum-adamw"
    assert convergence.untracked_twin(quickstart, "ring@bf16") is None
    # missing references are added, each once, after the methods asked for
    assert convergence.with_references(quickstart, ["ring-gt@bf16"]) == [
        "ring-gt@bf16",
        "ddp",
        "ring-gt",
        "ring@bf16",
    ]
    # the defaults already hold every reference they are compared with
    defaults = convergence.METHODS
    assert convergence.with_references(quickstart, defaults) == defaults
    assert {"ring-gt", "one-peer-exp-gt", "ring-gt@bf16", "ring-module-gt+accum-adamw"} <= set(defaults)


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
    ],
)
def test_convergence_judges_its_targets(
    quickstart, convergence, split, name, vs_ddp, vs_uncompressed, vs_untracked, expected
):
    spec = quickstart.parse_method(name)
    assert convergence.verdict(split, spec, vs_ddp, vs_uncompressed, vs_untracked) == expected


def test_convergence_table_shows_the_difference_from_untracked(quickstart, convergence, capsys):
    def result(method: str, accuracy: float, split: str = "dirichlet") -> SimpleNamespace:
        return SimpleNamespace(
            method=method, accuracy=accuracy, final_loss=1.0, bytes_per_step=1.0, split=split, alpha=0.1
        )

    results = [result("ring", 0.50), result("ring-gt", 0.55), result("ddp", 0.552)]
    args = SimpleNamespace(steps=10, batch_size=16, lr=0.05, adam_lr=3e-3)
    convergence.report(quickstart, results, 8, args)
    rows = {line.split("|")[0].strip(): line for line in capsys.readouterr().out.splitlines() if "|" in line}
    assert [cell.strip() for cell in rows["ring-gt"].split("|")[4:]] == ["-0.20", "-", "+5.00", "met"]
    assert [cell.strip() for cell in rows["ring"].split("|")[4:]] == ["-5.20", "-", "-", "-"]

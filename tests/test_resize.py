"""Resuming a checkpoint of N ranks on M ranks: the rule of engine/state/resize.py, pure and on both
front-ends.

At the saved world size and topology each rank loads its own state and continues bit for bit; at
another world size every new rank starts from the float64 mean of the saved replicas, rounded once
to the dtype, with counters kept and gossip, compression references and trackers started afresh.
The expected states are computed here from the saved files (a float64 mean in numpy order), never
by the library.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import batch, flat, tiny_model, train_steps
from resume import RESUME_SEED, Resumable, assert_resume_is_bitwise, checkpoint_files, save_checkpoint

from decent_optim_wrapper import DecentOptimWrapper, DecentralizedDataParallel
from decent_optim_wrapper.engine.state.checkpoint import RunIdentity
from decent_optim_wrapper.engine.state.resize import (
    average_nested,
    average_optimizer_states,
    average_tensors,
    averaged_engine_state,
    check_saved_world,
)

SIZES = (1, 2, 3, 4)
SAVE_AT = 5  # steps before the checkpoint: replicas, moments and references differ between ranks
BUCKET_CAP_MB = 100 * 4 / 2**20  # about 100 fp32 numbers: the tiny model spans several buckets


def _mean(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The float64 mean rounded once to the dtype. The sum of at most 4 fp32 (or bf16) numbers of
    this size is exact in float64 (24-bit mantissas, exponents within 20 bits of each other), so its
    order cannot matter: torch's own reduction must give the library's bits."""
    stacked = torch.stack([t.to(torch.float64) for t in tensors])
    return (stacked.sum(0) / len(tensors)).to(tensors[0].dtype)


# -- pure: the rule on hand-made states -------------------------------------------------------------------


@pytest.mark.pure
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("count", SIZES)
def test_average_tensors_is_the_float64_mean_rounded_once(dtype, count):
    g = torch.Generator().manual_seed(count)
    tensors = [torch.randn(257, generator=g).to(dtype) for _ in range(count)]
    average = average_tensors(tensors)
    assert average.dtype == dtype and torch.equal(average, _mean(tensors))
    assert torch.equal(average_tensors(list(tensors)), average)  # the same bits on every new rank
    if count == 1:
        assert torch.equal(average, tensors[0])


@pytest.mark.pure
def test_average_nested_averages_floating_state_and_keeps_counters():
    g = torch.Generator().manual_seed(0)
    saved = [
        {
            0: {"step": torch.tensor(5.0), "exp_avg": torch.randn(4, generator=g), "count": 3},
            1: {"step": torch.tensor(5, dtype=torch.int64), "momentum_buffer": torch.randn(2, generator=g)},
        }
        for _ in range(3)
    ]
    merged = average_nested(saved)
    assert isinstance(merged, dict)
    assert torch.equal(merged[0]["exp_avg"], _mean([s[0]["exp_avg"] for s in saved]))
    assert torch.equal(merged[1]["momentum_buffer"], _mean([s[1]["momentum_buffer"] for s in saved]))
    assert torch.equal(merged[0]["step"], torch.tensor(5.0)) and merged[0]["count"] == 3
    assert merged[1]["step"].dtype == torch.int64


@pytest.mark.pure
def test_average_optimizer_states_takes_param_groups_from_rank_zero():
    params = [torch.nn.Parameter(torch.ones(3))]
    states = []
    for rank in range(2):
        optimizer = torch.optim.AdamW(params, lr=0.1 * (rank + 1))  # differing groups: rank 0's win
        params[0].grad = torch.full((3,), float(rank + 1))
        optimizer.step()
        states.append(optimizer.state_dict())
    merged = average_optimizer_states(states)
    assert merged["param_groups"] == states[0]["param_groups"]
    assert torch.equal(merged["state"][0]["exp_avg_sq"], _mean([s["state"][0]["exp_avg_sq"] for s in states]))


@pytest.mark.pure
@pytest.mark.parametrize(
    ("second", "needle"),
    [
        ({"step": torch.tensor(4.0), "exp_avg": torch.zeros(2)}, "state[0]['step'] must be the same"),
        ({"step": torch.tensor(5.0), "exp_avg": torch.zeros(3)}, "shape (3,)"),
        ({"step": torch.tensor(5.0)}, "keys ['step']"),
        ({"step": torch.tensor(5.0), "exp_avg": torch.zeros(2), "n": 1}, "keys"),
    ],
)
def test_average_nested_names_what_differs(second, needle):
    first = {"step": torch.tensor(5.0), "exp_avg": torch.zeros(2)}
    with pytest.raises(ValueError, match="saved rank") as info:
        average_nested([{0: first}, {0: second}])
    assert needle in str(info.value)


@pytest.mark.pure
def test_integer_tensors_that_differ_cannot_be_averaged():
    with pytest.raises(ValueError, match=r"counts must be the same on every saved rank.*rank\(s\) \[1\]"):
        average_tensors([torch.tensor([1, 2]), torch.tensor([1, 3])], "counts")


def _run(world_size: int, rank: int = 0, topology: str = "ring") -> RunIdentity:
    return RunIdentity(rank, world_size, 1, topology, [topology, world_size], [["torch.float32", [3]], ["x"]])


def _engine_states(count: int, *, local: bool = False, **changes: Any) -> list[dict[str, Any]]:
    """Engine entries of a checkpoint of ``count`` ranks, as GossipEngine.state_dict() lays them out."""
    g = torch.Generator().manual_seed(count)
    states = []
    for rank in range(count):
        state = {
            **_run(count, rank).as_state(),
            "step": 7,
            "params": [torch.randn(3, generator=g), torch.randn(2, generator=g).to(torch.bfloat16)],
            "gossip": {"step": 6, "buffers": [torch.randn(3, generator=g)]},
            "snapshot": None,
            "mixing_factor": 1.0,
            "compression": "bf16",
            "tracking": {"trackers": [torch.ones(3)], "previous": [torch.ones(3)], "gossip": None},
            "local_steps": None,
        }
        if local:
            outer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))], lr=0.7, momentum=0.9).state_dict()
            outer["state"] = {0: {"momentum_buffer": torch.randn(3, generator=g)}}
            state["local_steps"] = {
                "sync_every": 2,
                "sync_delay": 2,
                "anchors": [torch.randn(3, generator=g), torch.randn(2, generator=g).to(torch.bfloat16)],
                "outer": outer,
                "gossip": {"step": 2, "buffers": [torch.randn(3, generator=g)]},
            }
        states.append(state)
    for key, value in changes.items():
        states[-1][key] = value
    return states


@pytest.mark.pure
def test_same_world_size_and_topology_resumes_each_rank_as_saved():
    assert check_saved_world(_engine_states(3), _run(3, rank=2)) is True
    assert check_saved_world(_engine_states(3), _run(4, rank=2)) is False
    assert check_saved_world(_engine_states(3), _run(2, rank=0)) is False
    other = RunIdentity(0, 3, 1, "complete", ["complete", 3], _run(3).buckets)
    assert check_saved_world(_engine_states(3), other) is False  # another topology: the average


@pytest.mark.pure
@pytest.mark.parametrize("count", SIZES)
@pytest.mark.parametrize("local", [False, True])
def test_averaged_engine_state_follows_the_rule(count, local):
    saved = _engine_states(count, local=local)
    run = _run(3, rank=1, topology="complete")
    state = averaged_engine_state(saved, run)
    assert {k: state[k] for k in ("rank", "world_size", "topology", "schedule", "buckets")} == {
        "rank": 1,
        "world_size": 3,
        "topology": "complete",
        "schedule": run.schedule,
        "buckets": run.buckets,
    }
    assert state["step"] == 7 and state["mixing_factor"] == 1.0
    for b in range(2):
        assert torch.equal(state["params"][b], _mean([s["params"][b] for s in saved]))
    # dropped: gossip in flight, references (with the gossip state), trackers, snapshot
    assert state["gossip"] is None and state["tracking"] is None and state["snapshot"] is None
    local_state = state["local_steps"]
    if not local:
        assert local_state is None
        return
    assert local_state["gossip"] is None and (local_state["sync_every"], local_state["sync_delay"]) == (2, 2)
    for b in range(2):
        assert torch.equal(local_state["anchors"][b], _mean([s["local_steps"]["anchors"][b] for s in saved]))
    momenta = [s["local_steps"]["outer"]["state"][0]["momentum_buffer"] for s in saved]
    assert torch.equal(local_state["outer"]["state"][0]["momentum_buffer"], _mean(momenta))


@pytest.mark.pure
@pytest.mark.parametrize(
    ("states", "needle"),
    [
        ([], "non-empty sequence"),
        ({"rank": 0}, "non-empty sequence"),
        ([{"rank": 0}], "lacks"),
        (_engine_states(3)[:2], "world_size=3, but 2 states"),
        (list(reversed(_engine_states(3))), "saved by rank 2; pass the states in saved-rank order"),
        (_engine_states(3, step=8), "states[2] has step=8 but states[0] has step=7"),
        (_engine_states(3, version=99), "version 99"),
        (_engine_states(2, buckets=[["other"]]), "states[1] has buckets="),
        (_engine_states(2, mixing_factor=0.5), "mixing_factor must be the same"),
    ],
)
def test_bad_checkpoints_are_named(states, needle):
    with pytest.raises(ValueError) as info:
        averaged_engine_state(states, _run(3))
    assert needle in str(info.value)


@pytest.mark.pure
def test_another_layout_is_refused():
    other = RunIdentity(0, 3, 1, "ring", ["ring", 3], [["torch.float32", [4]]])
    with pytest.raises(ValueError, match=r"parameter layout .* differs from this run's"):
        check_saved_world(_engine_states(2), other)


@pytest.mark.pure
def test_a_half_local_steps_checkpoint_is_refused():
    saved = _engine_states(2, local=True)
    saved[1]["local_steps"] = None
    with pytest.raises(ValueError, match=r"only saved ranks \[0\] of 2"):
        averaged_engine_state(saved, _run(3))


# -- multi-process: both front-ends, N -> M -------------------------------------------------------------


@dataclass(frozen=True)
class _Case(Resumable):
    """A ring run of AdamW inside either front-end, with the engine's options; resumes from every file."""

    front_end: str = "optimizer"
    compression: str | None = None
    gradient_tracking: bool = False
    local_steps: bool = False  # sync_every=2 with a Nesterov outer optimizer

    def build(self, seed: int) -> Any:
        model = tiny_model(seed=seed)
        options: dict[str, Any] = {
            "topology": "ring",
            "compression": self.compression,
            "gradient_tracking": self.gradient_tracking,
        }
        if self.local_steps:
            options["sync_every"] = 2
            options["outer_optimizer"] = lambda p: torch.optim.SGD(p, lr=0.7, momentum=0.9, nesterov=True)
        if self.front_end == "module":
            ddp = DecentralizedDataParallel(
                model,
                lambda named: torch.optim.AdamW([p for _, p in named], lr=0.01),
                bucket_size_in_mb=BUCKET_CAP_MB,
                **options,
            )
            return ddp, None
        inner = torch.optim.AdamW(model.parameters(), lr=0.01)
        return model, DecentOptimWrapper(inner, bucket_cap_mb=BUCKET_CAP_MB, **options)

    def train(self, run: Any, steps: range) -> None:
        model, optimizer = run
        rank = dist.get_rank()
        if optimizer is not None:
            train_steps(model, optimizer, rank, steps)
            return
        loss_fn = torch.nn.CrossEntropyLoss()
        for step in steps:
            x, y = batch(rank, step)
            loss_fn(model(x), y).backward()  # the module front-end updates inside backward

    def state_dict(self, run: Any) -> dict[str, Any]:
        model, optimizer = run
        return model.training_state_dict() if optimizer is None else optimizer.state_dict()

    def load_state_dict(self, run: Any, state: dict[str, Any]) -> None:
        raise AssertionError("this run resumes from every rank's file (resume)")

    def resume(self, run: Any, directory: str) -> None:
        count = len(list(Path(directory).glob("rank*.pt")))
        states = [torch.load(f, mmap=True, weights_only=True) for f in checkpoint_files(directory, count)]
        model, optimizer = run
        if optimizer is None:
            model.load_training_state_dicts(states)
        else:
            optimizer.load_state_dicts(states)

    def result(self, run: Any) -> torch.Tensor:
        return flat(run[0])


def _resume_and_report(case: _Case, directory: str) -> tuple[dict[str, Any], bool]:
    """This new rank's state right after resuming, and whether two more steps train it (finite loss)."""
    run = case.build(RESUME_SEED)
    case.resume(run, directory)
    state = copy.deepcopy(case.state_dict(run))  # the optimizer's state dict shares its live tensors
    case.train(run, range(SAVE_AT, SAVE_AT + 2))
    return state, bool(torch.isfinite(flat(run[0])).all())


def _saved(directory: Path, count: int) -> list[dict[str, Any]]:
    return [torch.load(f, weights_only=True) for f in checkpoint_files(directory, count)]


def _assert_equal(got: object, want: object, where: str) -> None:
    """``got`` is ``want`` to the last bit, recursively."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), f"{where}: keys {got} vs {want}"
        for key in want:
            _assert_equal(got[key], want[key], f"{where}[{key!r}]")
    elif isinstance(want, list | tuple):
        assert isinstance(got, list | tuple) and len(got) == len(want), where
        for index, (g, w) in enumerate(zip(got, want, strict=True)):
            _assert_equal(g, w, f"{where}[{index}]")
    elif isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype and torch.equal(got, want), where
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


def _assert_averaged_optimizer(got: dict[str, Any], saved: list[dict[str, Any]], where: str) -> None:
    """Moments are the mean of the saved ranks'; the step count is the saved one; groups rank 0's."""
    assert got["param_groups"] == saved[0]["param_groups"], where
    assert set(got["state"]) == set(saved[0]["state"]), where
    for index, entry in got["state"].items():
        for key, value in entry.items():
            saved_values = [s["state"][index][key] for s in saved]
            want = saved_values[0] if key == "step" else _mean(saved_values)
            assert torch.equal(value, want), f"{where} state[{index}][{key!r}]"


def _assert_follows_the_rule(
    case: _Case, got: dict[str, Any], saved: list[dict[str, Any]], rank: int
) -> None:
    """A new rank's state after a resume at another world size, against the files it was resumed from."""
    decent, saved_decent = got["decent"], [s["decent"] for s in saved]
    buckets = len(saved_decent[0]["params"])
    assert decent["step"] == saved_decent[0]["step"] == SAVE_AT and decent["rank"] == rank
    for b in range(buckets):
        assert torch.equal(decent["params"][b], _mean([s["params"][b] for s in saved_decent])), f"params[{b}]"
    # nothing in flight, no compression reference, no snapshot; trackers start from the next gradient
    assert decent["gossip"] is None and decent["snapshot"] is None
    if case.gradient_tracking and decent["world_size"] > 1:  # tracking is off at world size 1
        assert all(not t.any() for t in decent["tracking"]["trackers"] + decent["tracking"]["previous"])
        assert decent["tracking"]["gossip"] is None
    if case.local_steps:
        local, saved_local = decent["local_steps"], [s["local_steps"] for s in saved_decent]
        assert local["gossip"] is None
        for b in range(buckets):
            assert torch.equal(local["anchors"][b], _mean([s["anchors"][b] for s in saved_local])), (
                f"anchor {b}"
            )
        _assert_averaged_optimizer(local["outer"], [s["outer"] for s in saved_local], "outer")
    if case.front_end == "optimizer":
        _assert_averaged_optimizer(got, saved, "optimizer")
        return
    for b, optimizer in enumerate(got["optimizers"]):
        _assert_averaged_optimizer(optimizer, [s["optimizers"][b] for s in saved], f"optimizers[{b}]")
    for key, value in got["model"].items():
        assert torch.equal(value, _mean([s["model"][key] for s in saved])), f"model[{key!r}]"


def _check_every_resume(pool, case: _Case, directory: Path, pairs: list[tuple[int, int]]) -> None:
    for saved_size in sorted({n for n, _ in pairs}):
        where = directory / f"from{saved_size}"
        where.mkdir()
        save_checkpoint(pool, saved_size, case, where, SAVE_AT)
        saved = _saved(where, saved_size)
        for new_size in [m for n, m in pairs if n == saved_size]:
            results = pool(new_size).run(_resume_and_report, case, str(where))
            for rank, (state, trains) in enumerate(results):
                assert trains, f"{case}: {saved_size} -> {new_size} rank {rank} diverged"
                if new_size == saved_size:
                    _assert_equal(state, saved[rank], f"{case} {saved_size} -> {new_size} rank {rank}")
                else:
                    _assert_follows_the_rule(case, state, saved, rank)


EVERY_PAIR = [(n, m) for n in SIZES for m in SIZES]
SOME_PAIRS = [(4, 2), (2, 3), (1, 4), (3, 1), (3, 3)]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("front_end", ["optimizer", "module"])
def test_resume_n_to_m_starts_from_the_rule(pool, tmp_path, front_end):
    _check_every_resume(pool, _Case(front_end), tmp_path, EVERY_PAIR)


OPTION_CASES = [
    _Case("optimizer", compression="bf16"),
    _Case("module", compression="randk:0.1:int4", local_steps=True),
    _Case("module", gradient_tracking=True),
    _Case("optimizer", compression="bf16", gradient_tracking=True),
    _Case("module", compression="bf16", gradient_tracking=True),
    _Case("optimizer", local_steps=True),
    _Case("module", compression="bf16", local_steps=True),
]


@pytest.mark.parametrize("case", OPTION_CASES, ids=str)
def test_resume_n_to_m_with_the_engines_options(pool, tmp_path, case):
    _check_every_resume(pool, case, tmp_path, SOME_PAIRS)


@pytest.mark.parametrize(
    "case",
    [_Case("optimizer", compression="bf16", gradient_tracking=True), _Case("module", local_steps=True)],
    ids=str,
)
def test_resume_at_the_saved_world_size_continues_bit_for_bit(pool, resume_pool, tmp_path, case):
    assert_resume_is_bitwise(pool, resume_pool, 3, case, tmp_path, SAVE_AT + 3, SAVE_AT)


def _mismatched_resume(directory: str) -> str:
    """Resume a checkpoint of 2 ranks into a model of another shape."""
    model = torch.nn.Linear(6, 9)
    optimizer = DecentOptimWrapper(torch.optim.AdamW(model.parameters()), topology="ring")
    before = flat(model)
    states = [torch.load(f, weights_only=True) for f in checkpoint_files(directory, 2)]
    try:
        optimizer.load_state_dicts(states)
    except ValueError as err:
        assert torch.equal(flat(model), before)
        return str(err)
    return "loaded"


def test_a_checkpoint_of_another_layout_is_refused_before_anything_changes(pool, tmp_path):
    save_checkpoint(pool, 2, _Case(), tmp_path, 2)
    for message in pool(3).run(_mismatched_resume, str(tmp_path)):
        assert "parameter layout" in message and "bucket_cap_mb" in message

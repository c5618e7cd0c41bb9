"""The Accelerate integration inside the real ``accelerate``: 1, 2 and 4 gloo ranks on CPU.

The loop is Accelerate's own (its docs' loop with ``accumulate``, ``backward``, ``clip_grad_norm_``
and a prepared scheduler, on ``accelerate.test_utils``' regression model and data); the only line
that differs between a run with ``accelerate.Accelerator`` and one with
:class:`DecentralizedAccelerator` is the one that builds the accelerator. The pool's ranks look to
Accelerate like processes torchrun started. What each optimizer step did is recorded in the loop and
checked against torch's reference behaviour: a plain ``DecentOptimWrapper`` given the same gradients
and learning rates must step the replica bit for bit.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import launched_by_torchrun

pytest.importorskip("accelerate", reason="the [accelerate] extra is not installed")

pytestmark = pytest.mark.dist

N_SAMPLES, BATCH = 96, 4  # 4 ranks: 6 batches each


def params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def loop(
    directory: str = "",
    *,
    plain: bool = False,
    accumulation: int = 2,
    clip: float | None = 1.0,
    optimizer: str = "sgd",
    mixed_precision: str = "no",
    cpu_scaler: bool = False,
    overflow_at: tuple[int, int] | None = None,
    save_after: int | None = None,
    resume: str | None = None,
    **gossip: Any,
) -> dict[str, Any]:
    """Accelerate's loop on this pool rank; what every optimizer step saw and did, and the accelerator's
    view at the end (the global average, then the replica back)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.test_utils.training import RegressionDataset, RegressionModel
    from accelerate.utils import set_seed
    from torch.utils.data import DataLoader

    from decent_optim_wrapper.integrations.accelerate import DecentralizedAccelerator

    AcceleratorState._reset_state(True)  # the pool's processes outlive one accelerator
    with launched_by_torchrun():
        make = Accelerator if plain else DecentralizedAccelerator
        accelerator = make(
            cpu=True, gradient_accumulation_steps=accumulation, mixed_precision=mixed_precision, **gossip
        )
        if cpu_scaler:
            # Accelerate builds no GradScaler on CPU; one on its public attribute takes the fp16 path:
            # backward of the scaled loss, then AcceleratedOptimizer's scaler.step and scaler.update.
            accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        set_seed(0)
        model = RegressionModel(a=1, b=1)
        if optimizer == "adamw":
            opt: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
        else:
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        loader = DataLoader(RegressionDataset(length=N_SAMPLES, seed=42), batch_size=BATCH)
        # the optimizer first: the accelerator prepares models before optimizers whatever the order
        opt, model, loader, scheduler = accelerator.prepare(opt, model, loader, scheduler)
        seen: dict[str, Any] = {"before": [], "grads": [], "lrs": [], "after": [], "losses": []}
        skip = 0
        if resume is not None:
            accelerator.load_state(resume)
            skip = save_after * accumulation  # type: ignore[operator]
            loader = accelerator.skip_first_batches(loader, skip)
        step = save_after if resume is not None else 0
        for batch in loader:
            with accelerator.accumulate(model):
                output = model(batch["x"])
                loss = torch.nn.functional.mse_loss(output, batch["y"])
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    if clip is not None:
                        accelerator.clip_grad_norm_(model.parameters(), clip)
                    if overflow_at is not None and overflow_at == (accelerator.process_index, step):
                        next(model.parameters()).grad.fill_(float("inf"))
                    seen["before"].append(params(model))
                    seen["grads"].append([p.grad.detach().clone() for p in model.parameters()])
                    seen["lrs"].append(opt.param_groups[0]["lr"])
                opt.step()
                scheduler.step()
                opt.zero_grad()
                if accelerator.sync_gradients:
                    seen["after"].append(params(model))
                    seen["losses"].append(loss.item())
                    step += 1
                    if save_after is not None and resume is None and step == save_after:
                        accelerator.save_state(directory)
        seen["steps"] = step
        seen["wrapped"] = type(model).__name__
        seen["scale"] = None if accelerator.scaler is None else accelerator.scaler.get_scale()
        if not plain:
            (wrapper,) = accelerator.replicas.wrappers
            seen["step_count"] = wrapper.step_count
            seen["config"] = wrapper.engine.config
            with accelerator.averaged():
                seen["averaged"] = params(model)
            seen["reverted"] = params(model)
            accelerator.global_avg()
            seen["averaged_again"] = params(model)
            accelerator.revert_global_avg()
            seen["reverted_again"] = params(model)
        return seen


# -- training on 4 processes: no all-reduce, gossip once per optimizer step, the exact average -------------
def test_four_processes_gossip_once_per_optimizer_step_and_agree_on_the_average(pool: Any) -> None:
    replayed = pool(4).run(replay, topology="ring", timeout=90)
    for rank, result in enumerate(replayed):
        assert result["carried"], f"rank {rank}: the accelerator did not carry every option"
        assert result["steps"] == [True] * 3, f"rank {rank}: steps differ from the plain wrapper's"
    ranks = [result["seen"] for result in replayed]
    assert all(r["wrapped"] == "RegressionModel" for r in ranks)  # no DistributedDataParallel
    # 6 batches per rank, 2 accumulated per step: 3 optimizer steps, each one gossip step of the wrapper
    assert [r["steps"] for r in ranks] == [3] * 4 and [r["step_count"] for r in ranks] == [3] * 4
    assert all(equal(r["before"][0], ranks[0]["before"][0]) for r in ranks)  # rank 0's start everywhere
    assert not torch.equal(torch.stack(ranks[0]["grads"][0]), torch.stack(ranks[1]["grads"][0]))
    for step in range(3):  # the replicas differ during training
        assert not equal(ranks[0]["after"][step], ranks[1]["after"][step]), step
    final = [torch.stack(r["after"][-1]) for r in ranks]
    mean = torch.stack(final).double().mean(0)
    for r in ranks:
        # the same bits on every rank; within rounding of the exact mean: a sum of 4 fp32 values and a
        # division, each rounded once, is within 4 u max|x| (u = 2**-24)
        assert equal(r["averaged"], ranks[0]["averaged"]) and equal(r["averaged_again"], r["averaged"])
        tolerance = 4 * 2.0**-24 * float(torch.stack(final).abs().max())
        assert torch.allclose(torch.stack(r["averaged"]).double(), mean, rtol=0, atol=tolerance)
        # and each rank's own replica comes back bit for bit
        assert equal(r["reverted"], r["after"][-1]) and equal(r["reverted_again"], r["after"][-1])
    # training: the average fits the data better than the start (a=1, b=1 against a=2, b=3)
    start, end = torch.stack(ranks[0]["before"][0]), torch.stack(ranks[0]["averaged"])
    target = torch.tensor([2.0, 3.0])
    assert float((end - target).norm()) < float((start - target).norm())


def replay(accumulation: int = 2, clip: float | None = 1.0, **gossip: Any) -> dict[str, Any]:
    """The loop, then its gradients and learning rates through a plain DecentOptimWrapper with the same
    options: both must step the replica identically."""
    from accelerate.test_utils.training import RegressionModel

    from decent_optim_wrapper import DecentOptimWrapper, GossipConfig

    seen = loop(accumulation=accumulation, clip=clip, **gossip)
    torch.manual_seed(0)
    model = RegressionModel(a=1, b=1)
    with launched_by_torchrun():
        local = int(os.environ["LOCAL_WORLD_SIZE"])
        expected = GossipConfig.from_options(local_world_size=local, **gossip)
        wrapper = DecentOptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1), config=expected)
    steps = []
    for grads, lr, after in zip(seen["grads"], seen["lrs"], seen["after"], strict=True):
        for param, grad in zip(model.parameters(), grads, strict=True):
            param.grad = grad.clone()
        wrapper.param_groups[0]["lr"] = lr
        wrapper.step()
        steps.append(equal(params(model), after))
    return {"carried": seen["config"] == expected, "steps": steps, "seen": seen}


@pytest.mark.parametrize(
    "gossip",
    [
        {"topology": "complete", "sync_every": 2, "sync_delay": 0},
        {"topology": "ring", "compression": "int8"},
    ],
    ids=["low-communication", "compression"],
)
def test_each_option_steps_as_the_wrapper_does_on_the_loops_gradients(
    pool: Any, gossip: dict[str, Any]
) -> None:
    ranks = pool(4).run(replay, timeout=90, **gossip)
    for rank, result in enumerate(ranks):
        assert result["carried"], f"rank {rank}: the accelerator did not carry every option"
        assert result["steps"] == [True] * 3, f"rank {rank}: steps differ from the plain wrapper's"


def test_the_prepared_scheduler_and_accumulation_keep_accelerates_meaning(pool: Any) -> None:
    """Against Accelerate's own run (DDP) at the same world size: as many optimizer steps, the same
    learning rate at each (Accelerate steps a prepared scheduler once per process per optimizer step)."""
    ours = pool(4).run(loop, accumulation=3, topology="ring", timeout=90)
    theirs = pool(4).run(loop, accumulation=3, plain=True, timeout=90)
    assert theirs[0]["wrapped"] == "DistributedDataParallel"
    for mine, reference in zip(ours, theirs, strict=True):
        assert mine["steps"] == reference["steps"] == 2 and mine["step_count"] == 2
        assert mine["lrs"] == reference["lrs"]


def test_world_size_one_equals_accelerate(pool: Any) -> None:
    """One process: gossip has no peer, so the run is Accelerate's, bit for bit (bf16 autocast,
    accumulation, clipping, the scheduler)."""
    options = {"accumulation": 2, "mixed_precision": "bf16"}
    (ours,) = pool(1).run(loop, timeout=90, **options)
    (theirs,) = pool(1).run(loop, plain=True, timeout=90, **options)
    assert len(ours["after"]) == len(theirs["after"]) == 12
    assert all(equal(a, b) for a, b in zip(ours["after"], theirs["after"], strict=True))
    assert ours["lrs"] == theirs["lrs"]


# -- fp16: Accelerate's GradScaler path --------------------------------------------------------------------
def test_scaled_steps_equal_unscaled_ones_and_an_overflow_skips_only_that_ranks_update(pool: Any) -> None:
    """The loss scale is a power of two, so scaled gradients unscale exactly: the same bits as without
    a scaler. A rank whose gradients overflow skips its own update (its scale backs off) and still
    gossips, so its peers neither wait nor skip."""
    plain = pool(2).run(loop, clip=None, timeout=90)
    scaled = pool(2).run(loop, clip=None, cpu_scaler=True, timeout=90)
    for a, b in zip(plain, scaled, strict=True):
        assert all(equal(x, y) for x, y in zip(a["after"], b["after"], strict=True))
    overflow = pool(2).run(loop, clip=None, cpu_scaler=True, overflow_at=(1, 1), timeout=90)
    assert overflow[1]["scale"] == scaled[1]["scale"] / 2 and overflow[0]["scale"] == scaled[0]["scale"]
    assert [r["step_count"] for r in overflow] == [len(overflow[0]["after"])] * 2
    # rank 0 took its update at the overflowing step: its steps up to there are the unscaled run's
    assert all(equal(x, y) for x, y in zip(overflow[0]["after"][:2], plain[0]["after"][:2], strict=True))
    assert not equal(overflow[1]["after"][1], plain[1]["after"][1])


# -- checkpoints -------------------------------------------------------------------------------------------
def test_resume_is_bitwise_and_the_model_files_hold_the_average(
    pool: Any, resume_pool: Any, tmp_path: Path
) -> None:
    from safetensors.torch import load_file

    options = {"optimizer": "adamw", "accumulation": 2, "topology": "ring", "timeout": 90}
    folder = str(tmp_path / "state")
    whole = pool(2).run(loop, folder, save_after=2, **options)
    assert sorted(p.name for p in Path(folder).glob("decent_rank*")) == [
        "decent_rank0-of-2.pt",
        "decent_rank1-of-2.pt",
    ]
    resumed = resume_pool(2).run(loop, folder, save_after=2, resume=folder, **options)
    for rank in range(2):
        assert len(resumed[rank]["after"]) == len(whole[rank]["after"]) - 2
        assert all(
            equal(x, y) for x, y in zip(resumed[rank]["after"], whole[rank]["after"][2:], strict=True)
        ), f"rank {rank} resumed differently"
        assert resumed[rank]["lrs"] == whole[rank]["lrs"][2:]
    # what Accelerate's model file holds is the average of the replicas at the save: (a + b) / 2, exact
    exported = load_file(os.path.join(folder, "model.safetensors"))
    saved = [whole[rank]["after"][1] for rank in range(2)]
    expected = [(x + y) / 2 for x, y in zip(*saved, strict=True)]
    assert equal([exported["a"], exported["b"]], expected)


def test_resume_at_another_world_size_starts_from_the_average(
    pool: Any, resume_pool: Any, tmp_path: Path
) -> None:
    options = {"optimizer": "adamw", "accumulation": 2, "topology": "ring", "timeout": 90}
    folder = str(tmp_path / "state")
    whole = pool(2).run(loop, folder, save_after=2, **options)
    resumed = resume_pool(4).run(loop, folder, save_after=2, resume=folder, **options)
    saved = [whole[rank]["after"][1] for rank in range(2)]
    average = [(x + y) / 2 for x, y in zip(*saved, strict=True)]
    for r in resumed:  # every rank starts from the exact average of the two saved replicas
        assert equal(r["before"][0], average)


# -- refused up front ---------------------------------------------------------------------------------------
@pytest.mark.pure
@pytest.mark.parametrize("argument", ["deepspeed_plugin", "fsdp_plugin", "megatron_lm_plugin"])
def test_sharding_plugins_are_refused_naming_argument_value_and_fix(argument: str) -> None:
    from decent_optim_wrapper.integrations.accelerate import DecentralizedAccelerator

    plugin = object()
    with pytest.raises(ValueError) as error:
        DecentralizedAccelerator(cpu=True, **{argument: plugin})
    message = str(error.value)
    for fragment in (f"{argument}={plugin!r}", f"Pass {argument}=None", "accelerate.Accelerator"):
        assert fragment in message, (fragment, message)


@pytest.mark.pure
def test_a_launch_configuration_that_shards_is_refused() -> None:
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    from decent_optim_wrapper.integrations.accelerate import DecentralizedAccelerator

    for kind in (DistributedType.DEEPSPEED, DistributedType.FSDP, DistributedType.MEGATRON_LM):
        stub: Any = SimpleNamespace(distributed_type=kind, mixed_precision="no")
        with pytest.raises(ValueError, match=rf"distributed type is {kind}.*--use_fsdp.*--multi_gpu"):
            DecentralizedAccelerator._check_supported(stub)
    stub = SimpleNamespace(distributed_type=DistributedType.MULTI_GPU, mixed_precision="fp8")
    with pytest.raises(ValueError, match=r"mixed_precision='fp8'.*Pass mixed_precision='bf16'"):
        DecentralizedAccelerator._check_supported(stub)


@pytest.mark.pure
@pytest.mark.parametrize(
    ("options", "fragments"),
    [
        ({"pacing": "measured"}, ["pacing='measured'", "Pass pacing=None", "round_count"]),
        ({"on_peer_failure": "continue"}, ['on_peer_failure="continue"', 'on_peer_failure="raise"']),
    ],
)
def test_what_the_loop_cannot_follow_is_refused_at_construction(
    options: dict[str, Any], fragments: list[str]
) -> None:
    from decent_optim_wrapper.integrations.accelerate import DecentralizedAccelerator

    with pytest.raises((TypeError, ValueError)) as error:
        DecentralizedAccelerator(cpu=True, **options)
    for fragment in fragments:
        assert fragment in str(error.value), (fragment, str(error.value))


def prepare_wrapped() -> str:
    from accelerate.state import AcceleratorState

    from decent_optim_wrapper import DecentOptimWrapper
    from decent_optim_wrapper.integrations.accelerate import DecentralizedAccelerator

    AcceleratorState._reset_state(True)
    with launched_by_torchrun():
        accelerator = DecentralizedAccelerator(cpu=True)
        model = torch.nn.Linear(2, 1)
        wrapped = DecentOptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1))
        try:
            accelerator.prepare(model, wrapped)
        except TypeError as error:
            return str(error)
        return "accepted"


def test_an_optimizer_wrapped_already_is_refused_with_the_fix(pool: Any) -> None:
    (message,) = pool(1).run(prepare_wrapped, timeout=60)
    assert "already a DecentOptimWrapper" in message and "pass the optimizer it wraps" in message

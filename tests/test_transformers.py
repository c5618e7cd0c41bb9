"""The Hugging Face integration against the real ``transformers.Trainer``: 2 gloo ranks on CPU.

A randomly initialised tiny GPT-2 (no download; ``HF_HUB_OFFLINE=1``) on synthetic token ids. The
Trainer runs inside the pool's ranks, which look to Accelerate like processes torchrun started. A
callback records each rank's parameters and gradients around every optimizer step, so the gossip
rule is checked bit for bit on what the Trainer itself computed: pairs average as ``(a + b) / 2``
(exact in floating point) and SGD adds ``-lr * g`` per parameter, as recomputed here.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers", reason="the [transformers] extra is not installed")
pytest.importorskip("accelerate", reason="the [transformers] extra is not installed")

import transformers
from helpers import FEATURES, launched_by_torchrun

pytestmark = pytest.mark.dist

os.environ["HF_HUB_OFFLINE"] = "1"
N_SEQUENCES, LENGTH, VOCAB = 64, 16, 64


def tiny_gpt2() -> transformers.GPT2LMHeadModel:
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=LENGTH,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def sequences() -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(0, VOCAB, (N_SEQUENCES, LENGTH), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": x, "labels": x} for x in ids]


def params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


class Recorder(transformers.TrainerCallback):
    """Parameters and gradients before each optimizer step, parameters after it, what evaluation saw."""

    def __init__(self) -> None:
        self.before: list[list[torch.Tensor]] = []
        self.grads: list[list[torch.Tensor]] = []
        self.after: list[list[torch.Tensor]] = []
        self.evaluated: list[tuple[int, list[torch.Tensor]]] = []
        self.at_end: list[torch.Tensor] = []

    def on_pre_optimizer_step(
        self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any
    ) -> None:
        self.before.append(params(model))
        self.grads.append([p.grad.detach().clone() for p in model.parameters()])

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
        self.after.append(params(model))

    def on_evaluate(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
        self.evaluated.append((state.global_step, params(model)))

    def on_train_end(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
        self.at_end = params(model)  # before the trainer settles every rank on the average


class CountingTrainer(transformers.Trainer):
    """A Trainer subclass of the kind libraries ship (TRL's trainers override compute_loss too)."""

    def compute_loss(self, *args: Any, **kwargs: Any) -> Any:
        self.losses_computed = getattr(self, "losses_computed", 0) + 1
        return super().compute_loss(*args, **kwargs)


def _decentralized_counting_trainer() -> type:
    from decent_optim_wrapper.integrations.transformers import DecentralizedTrainerMixin

    class Counting(DecentralizedTrainerMixin, CountingTrainer):
        pass

    return Counting


def fit(
    directory: str,
    *,
    trainer_class: str = "decentralized",
    sgd: bool = False,
    resume: str | None = None,
    gossip: dict[str, Any] | None = None,
    **arguments: Any,
) -> dict[str, Any]:
    """Train the tiny GPT-2 in this pool rank; what the recorder saw and the trainer's final model."""
    from accelerate.state import AcceleratorState

    from decent_optim_wrapper.integrations.transformers import DecentralizedTrainer

    DecentralizedCountingTrainer = _decentralized_counting_trainer()
    AcceleratorState._reset_state(True)  # the pool's processes outlive one Trainer: forget the last world
    with launched_by_torchrun():
        model = tiny_gpt2()
        options: dict[str, Any] = {
            "per_device_train_batch_size": 4,
            "max_steps": 8,
            "use_cpu": True,
            "report_to": [],
            "disable_tqdm": True,
            "save_strategy": "no",
            "seed": 0,
            "learning_rate": 1e-3,
        }
        options.update(arguments)
        args = transformers.TrainingArguments(directory, **options)
        recorder = Recorder()
        kwargs: dict[str, Any] = {}
        if sgd:
            kwargs["optimizers"] = (torch.optim.SGD(model.parameters(), lr=0.5), None)
        cls = {
            "decentralized": DecentralizedTrainer,
            "transformers": transformers.Trainer,
            "subclass": DecentralizedCountingTrainer,
        }[trainer_class]
        data = sequences()
        trainer = cls(
            model=model,
            args=args,
            train_dataset=data,
            eval_dataset=data[:16],
            callbacks=[recorder],
            **kwargs,
            **(gossip or {}),
        )
        trainer.train(resume_from_checkpoint=resume)
        return {
            "before": recorder.before,
            "grads": recorder.grads,
            "after": recorder.after,
            "evaluated": recorder.evaluated,
            "at_end": recorder.at_end,
            "final": params(trainer.model),
            "wrapped": type(trainer.model_wrapped).__name__,
            "losses_computed": getattr(trainer, "losses_computed", None),
            "config": _wrapped_config(trainer.optimizer),
            "log_history": trainer.state.log_history,
        }


def _wrapped_config(optimizer: Any) -> Any:
    """The config of the DecentOptimWrapper the Trainer stepped (inside Accelerate's optimizer), if any."""
    from decent_optim_wrapper import DecentOptimWrapper

    inner = getattr(optimizer, "optimizer", optimizer)
    return inner.engine.config if isinstance(inner, DecentOptimWrapper) else None


def sgd_update(start: list[torch.Tensor], grads: list[torch.Tensor], lr: float = 0.5) -> list[torch.Tensor]:
    return [x.add(g, alpha=-lr) for x, g in zip(start, grads, strict=True)]


def average(a: list[torch.Tensor], b: list[torch.Tensor]) -> list[torch.Tensor]:
    return [(x + y) / 2 for x, y in zip(a, b, strict=True)]


def equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_no_allreduce_replicas_follow_gossip(pool: Any, tmp_path: Path) -> None:
    """Gradients differ between ranks (DDP would have all-reduced them), and the replicas follow the
    rule: step 0 is each rank's own SGD step; step 1 takes the gradient at the own replica, mixes in
    the pair's average, and applies it."""
    ranks = pool(2).run(
        fit, str(tmp_path), sgd=True, max_steps=2, max_grad_norm=0.0, lr_scheduler_type="constant", timeout=90
    )
    assert all(r["wrapped"] == "GPT2LMHeadModel" for r in ranks)  # no DistributedDataParallel
    assert equal(ranks[0]["before"][0], ranks[1]["before"][0])  # rank 0's initial values everywhere
    assert not torch.equal(flat(ranks[0]["grads"][0]), flat(ranks[1]["grads"][0]))
    for r in ranks:
        assert equal(r["after"][0], sgd_update(r["before"][0], r["grads"][0]))
        assert equal(r["before"][1], r["after"][0])  # the gradient is taken at the own replica
    mixed = average(ranks[0]["after"][0], ranks[1]["after"][0])
    for rank, r in enumerate(ranks):
        assert equal(r["after"][1], sgd_update(mixed, r["grads"][1])), f"rank {rank}"
    # after train(), every rank holds the exact average of the final replicas
    final = average(ranks[0]["at_end"], ranks[1]["at_end"])
    assert equal(ranks[0]["final"], final) and equal(ranks[1]["final"], final)


def test_evaluation_sees_the_average_and_training_continues_bitwise(pool: Any, tmp_path: Path) -> None:
    evaluated = pool(2).run(fit, str(tmp_path), eval_strategy="steps", eval_steps=2, timeout=90)
    plain = pool(2).run(fit, str(tmp_path), timeout=90)
    assert [step for step, _ in evaluated[0]["evaluated"]] == [2, 4, 6, 8]
    for step, seen in evaluated[0]["evaluated"]:
        replicas = [r["after"][step - 1] for r in evaluated]
        assert not equal(replicas[0], replicas[1])
        assert equal(seen, average(*replicas)), f"evaluation at step {step} did not see the average"
    assert equal(evaluated[1]["evaluated"][0][1], evaluated[0]["evaluated"][0][1])
    for rank in range(2):
        assert equal(evaluated[rank]["at_end"], plain[rank]["at_end"])


def test_resume_equals_uninterrupted_and_checkpoint_holds_the_average(
    pool: Any, resume_pool: Any, tmp_path: Path
) -> None:
    saving = {"save_strategy": "steps", "save_steps": 4}
    whole = pool(2).run(fit, str(tmp_path / "whole"), timeout=90, **saving)
    checkpoint = tmp_path / "whole" / "checkpoint-4"
    assert sorted(p.name for p in checkpoint.glob("decent_rank*")) == [
        "decent_rank0-of-2.pt",
        "decent_rank1-of-2.pt",
    ]
    resumed = resume_pool(2).run(
        fit,
        str(tmp_path / "resumed"),
        resume=str(checkpoint),
        save_strategy="steps",
        save_steps=4,
        timeout=90,
    )
    for rank in range(2):
        assert equal(resumed[rank]["at_end"], whole[rank]["at_end"]), f"rank {rank} resumed differently"
    # the exported model (from_pretrained on the checkpoint) is the average of the replicas at step 4
    exported = transformers.GPT2LMHeadModel.from_pretrained(checkpoint)
    assert equal(params(exported), average(whole[0]["after"][3], whole[1]["after"][3]))


def test_world_size_one_equals_the_trainer(pool: Any, tmp_path: Path) -> None:
    options = {"gradient_accumulation_steps": 2, "max_steps": 4, "timeout": 90}
    (ours,) = pool(1).run(fit, str(tmp_path / "ours"), **options)
    (theirs,) = pool(1).run(fit, str(tmp_path / "theirs"), trainer_class="transformers", **options)
    assert equal(ours["final"], theirs["final"])
    # the mixin on a Trainer subclass: the subclass's own override runs, the result is the same
    (mixed,) = pool(1).run(fit, str(tmp_path / "mixed"), trainer_class="subclass", **options)
    assert equal(mixed["final"], theirs["final"]) and mixed["losses_computed"] == 8


@pytest.mark.pure
def test_sharding_and_deepspeed_are_refused_by_name() -> None:
    from types import SimpleNamespace

    from accelerate.utils import DistributedType
    from transformers.training_args import ParallelMode

    from decent_optim_wrapper.integrations.transformers import DecentralizedTrainerMixin

    stub: Any = SimpleNamespace(
        is_deepspeed_enabled=True,
        is_fsdp_enabled=False,
        accelerator=SimpleNamespace(distributed_type=DistributedType.DEEPSPEED, parallelism_config=None),
        args=SimpleNamespace(parallel_mode=ParallelMode.DISTRIBUTED),
    )
    with pytest.raises(ValueError, match=r"does not support DeepSpeed \(args.deepspeed\), Accelerate's"):
        DecentralizedTrainerMixin._check_supported(stub)
    stub.is_deepspeed_enabled, stub.is_fsdp_enabled = False, True
    stub.accelerator.distributed_type = DistributedType.FSDP
    with pytest.raises(ValueError, match=r"FSDP \(args.fsdp\)"):
        DecentralizedTrainerMixin._check_supported(stub)


# -- every option reaches the engine through the Trainer --------------------------------------------------
def fit_and_replay(directory: str, name: str) -> dict[str, Any]:
    """Train with the feature's options, then replay the Trainer's own gradients through a plain
    DecentOptimWrapper built with the same options: both must step the replica identically."""
    from decent_optim_wrapper import DecentOptimWrapper, GossipConfig

    gossip = FEATURES[name]
    seen = fit(
        directory, sgd=True, max_steps=4, max_grad_norm=0.0, lr_scheduler_type="constant", gossip=gossip
    )
    with launched_by_torchrun():
        model = tiny_gpt2()
        local = int(os.environ.get("LOCAL_WORLD_SIZE") or 1)
        expected = GossipConfig.from_options(local_world_size=local, **gossip)
        wrapper = DecentOptimWrapper(torch.optim.SGD(model.parameters(), lr=0.5), config=expected)
        steps = []
        for grads, after in zip(seen["grads"], seen["after"], strict=True):
            for param, grad in zip(model.parameters(), grads, strict=True):
                param.grad = grad.clone()
            wrapper.step()
            steps.append(equal(params(model), after))
        wrapper.global_avg(may_revert=False)
        return {
            "carried": seen["config"] == expected,
            "steps": steps,
            "final": equal(params(model), seen["final"]),
        }


@pytest.mark.parametrize("name", list(FEATURES))
def test_each_option_runs_inside_the_trainer_as_in_a_plain_loop(pool: Any, tmp_path: Path, name: str) -> None:
    for rank, result in enumerate(pool(2).run(fit_and_replay, str(tmp_path), name, timeout=120)):
        assert result["carried"], f"rank {rank}: the Trainer did not carry every option"
        assert result["steps"] == [True] * 4, f"rank {rank}: steps differ from the plain loop's"
        assert result["final"], f"rank {rank}: the settled average differs"


@pytest.mark.pure
@pytest.mark.parametrize(
    ("options", "fragments"),
    [
        ({"pacing": "measured"}, ["pacing='measured'", "Pass pacing=None", "round_count"]),
        (
            {"on_peer_failure": "continue"},
            ['on_peer_failure="continue"', "node_launcher", 'on_peer_failure="raise"'],
        ),
    ],
)
def test_what_the_trainer_cannot_follow_is_refused_at_construction(
    tmp_path: Path, options, fragments
) -> None:
    from decent_optim_wrapper.integrations.transformers import DecentralizedTrainer

    args = transformers.TrainingArguments(str(tmp_path), use_cpu=True, report_to=[])
    with pytest.raises((TypeError, ValueError)) as error:
        DecentralizedTrainer(model=tiny_gpt2(), args=args, **options)
    for fragment in fragments:
        assert fragment in str(error.value), (fragment, str(error.value))


@pytest.mark.parametrize("log", [True, False])
def test_gossip_metrics_reach_the_log_history_every_logging_steps(
    pool: Any, tmp_path: Path, log: bool
) -> None:
    from decent_optim_wrapper.metrics import METRIC_NAMES

    gossip = {"log_gossip_metrics": True} if log else {}
    for rank, got in enumerate(pool(2).run(fit, str(tmp_path), logging_steps=2, gossip=gossip, timeout=120)):
        training_logs = [entry for entry in got["log_history"] if "loss" in entry]
        assert len(training_logs) == 4, f"rank {rank}: 8 steps, a log every 2: {got['log_history']}"
        with_gossip = [entry for entry in got["log_history"] if "gossip/steps" in entry]
        if not log:  # off by default: the logs hold nothing of gossip
            assert with_gossip == [], rank
            continue
        assert with_gossip == training_logs
        for entry in training_logs:
            assert set(METRIC_NAMES) <= set(entry)
            assert entry["gossip/steps"] == 2 and entry["gossip/rounds"] == 2
            assert entry["gossip/bytes_sent"] == 2 * entry["gossip/bytes_per_step"] > 0
            assert entry["fleet/world_size"] == 2 and entry["gossip/wait_s"] >= 0


@pytest.mark.pure
def test_log_gossip_metrics_must_be_a_bool(tmp_path: Path) -> None:
    from decent_optim_wrapper.integrations.transformers import DecentralizedTrainer

    with pytest.raises(TypeError, match="log_gossip_metrics must be True or False, got 1"):
        DecentralizedTrainer(model=tiny_gpt2(), log_gossip_metrics=1)


# -- a sharded model (decentralized HSDP) inside the Trainer ----------------------------------------------
def local(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each DTensor's local shard (plain tensors as they are): what one rank holds, no collective."""
    return [t.to_local() if hasattr(t, "to_local") else t for t in tensors]


def fit_sharded(directory: str, resume: str | None = None) -> dict[str, Any]:
    """4 ranks as 2 replicas of 2 shards: the tiny GPT-2 sharded by FSDP2 over ``"shard"`` before the
    Trainer sees it, gossip along ``"replicate"`` (``device_mesh=``). Without ``resume``, the Trainer's
    own gradients are replayed through a plain DecentOptimWrapper of the same sharded model."""
    from accelerate.state import AcceleratorState
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from decent_optim_wrapper import DecentOptimWrapper
    from decent_optim_wrapper.integrations.transformers import DecentralizedTrainer

    AcceleratorState._reset_state(True)
    with launched_by_torchrun():
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        model = tiny_gpt2()
        fully_shard(model, mesh=mesh["shard"])
        args = transformers.TrainingArguments(
            directory, per_device_train_batch_size=4, max_steps=4, use_cpu=True, report_to=[],
            disable_tqdm=True, save_strategy="steps", save_steps=2, seed=0, max_grad_norm=0.0,
            lr_scheduler_type="constant",
        )  # fmt: skip
        recorder = Recorder()
        trainer = DecentralizedTrainer(
            model=model,
            args=args,
            train_dataset=sequences(),
            callbacks=[recorder],
            optimizers=(torch.optim.SGD(model.parameters(), lr=0.5), None),
            device_mesh=mesh["replicate"],
        )
        trainer.train(resume_from_checkpoint=resume)
        trainer.save_model(f"{directory}/export")  # every rank: the shards are gathered
        result: dict[str, Any] = {"at_end": local(recorder.at_end), "final": local(params(trainer.model))}
        if resume is not None:
            return result
        plain = tiny_gpt2()
        fully_shard(plain, mesh=mesh["shard"])
        sgd = torch.optim.SGD(plain.parameters(), lr=0.5)
        wrapper = DecentOptimWrapper(sgd, device_mesh=mesh["replicate"], local_world_size=2)
        steps = []
        for grads, after in zip(recorder.grads, recorder.after, strict=True):
            for param, grad in zip(plain.parameters(), grads, strict=True):
                param.grad = grad.clone()
            wrapper.step()
            steps.append(equal(local(params(plain)), local(after)))
        return result | {"steps": steps, "sharded": all(hasattr(p, "to_local") for p in model.parameters())}


def test_a_sharded_model_trains_resumes_and_exports_the_whole_average(
    pool: Any, resume_pool: Any, tmp_path: Path
) -> None:
    """``device_mesh=mesh["replicate"]`` with a model FSDP2 shards over ``mesh["shard"]``: each step
    equals the plain loop's bit for bit; resuming from step 2 ends where the whole run ends; the
    exported model is whole (``from_pretrained``) and its shard s is what ranks s and s + 2 settled on."""
    whole = pool(4).run(fit_sharded, str(tmp_path / "whole"), timeout=180)
    for rank, result in enumerate(whole):
        assert result["sharded"] and result["steps"] == [True] * 4, f"rank {rank}: {result['steps']}"
    resumed = resume_pool(4).run(
        fit_sharded, str(tmp_path / "resumed"), str(tmp_path / "whole" / "checkpoint-2"), timeout=180
    )
    exported = params(transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "whole" / "export"))
    for rank in range(4):
        assert equal(resumed[rank]["at_end"], whole[rank]["at_end"]), f"rank {rank} resumed differently"
        shards = [torch.chunk(p, 2)[rank % 2] for p in exported]
        assert equal(shards, whole[rank]["final"]), f"rank {rank}: the export is not the settled average"
    assert not equal(whole[0]["at_end"], whole[2]["at_end"])  # the replicas differed before settling

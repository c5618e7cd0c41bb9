"""The Lightning strategy against the real Lightning Trainer: 2 gloo ranks on CPU, a small MLP.

Each test runs Lightning's ``Trainer`` inside the pool's ranks, which look to Lightning like processes
started by torchrun (``TORCHELASTIC_RUN_ID`` and friends), so it uses the existing process group
instead of launching processes of its own. What is compared is exact: replicas and averages are
compared bit for bit against an independent computation of the gossip rule (pairs average as
``(a + b) / 2``, exact in floating point), and world size 1 against Lightning's own run.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import FEATURES, launched_by_torchrun

pytest.importorskip("lightning", reason="the [lightning] extra is not installed")

import lightning.pytorch as pl
from torch.utils.data import DataLoader, TensorDataset

pytestmark = pytest.mark.dist

N_SAMPLES, BATCH = 64, 8  # 2 ranks: 4 steps per epoch


def dataset(seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N_SAMPLES, 6, generator=g)
    return TensorDataset(x, (x[:, 0] + x[:, 1] > 0).long() + (x[:, 2] > 1).long())


class Net(pl.LightningModule):
    """A small MLP; records what the tests compare (the replica at each point of interest)."""

    def __init__(self, optimizer: str = "sgd", scheduler: str = "step", manual: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
        self.kind, self.scheduler_kind = optimizer, scheduler
        self.automatic_optimization = not manual
        self.batches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.seen_in_validation: list[torch.Tensor] = []

    def loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | None:
        self.batches.append((batch[0].clone(), batch[1].clone()))
        loss = self.loss(batch)
        self.log("train_loss", loss, sync_dist=True)
        if self.automatic_optimization:
            return loss
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()
        return None

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        if batch_idx == 0:
            self.seen_in_validation.append(flat(self))
        self.log("val_loss", self.loss(batch), sync_dist=True)

    def configure_optimizers(self) -> Any:
        if self.kind == "sgd":
            optimizer: torch.optim.Optimizer = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        elif self.kind == "plain-sgd":
            optimizer = torch.optim.SGD(self.parameters(), lr=0.5)
        elif self.kind == "lbfgs":
            optimizer = torch.optim.LBFGS(self.parameters())
        else:
            optimizer = torch.optim.AdamW(self.parameters(), lr=0.01)
        if self.scheduler_kind == "plateau":
            plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=0, factor=0.5)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": plateau, "monitor": "val_loss"}}
        if self.scheduler_kind == "step":
            step = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": step, "interval": "step"}}
        return optimizer


def flat(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in module.parameters()])


class Replica(pl.Callback):
    """Records this rank's replica where the strategy's own hooks have not acted yet.

    Callback hooks run before the strategy's: at ``on_validation_start`` the replica is not averaged
    yet, at ``on_train_end`` it is not settled to the average yet.
    """

    def __init__(self) -> None:
        self.before_validation: list[torch.Tensor] = []
        self.after_validation: list[torch.Tensor] = []
        self.at_end: torch.Tensor | None = None

    def on_validation_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            self.before_validation.append(flat(module))

    def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
        if len(self.after_validation) < len(self.before_validation):
            self.after_validation.append(flat(module))

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.at_end = flat(module)


def trainer(strategy: Any = "decentralized", **kwargs: Any) -> pl.Trainer:
    import decent_optim_wrapper.integrations.lightning  # noqa: F401 - registers "decentralized"

    options: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": dist.get_world_size(),
        "max_epochs": 2,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        "deterministic": True,
    }
    options.update(kwargs)
    return pl.Trainer(strategy=strategy, **options)


def loaders() -> tuple[DataLoader[Any], DataLoader[Any]]:
    data = dataset()
    return DataLoader(data, batch_size=BATCH), DataLoader(data, batch_size=BATCH)


# -- one step, two steps: the gossip rule, and no gradient all-reduce -----------------------------------
def run_two_steps() -> dict[str, Any]:
    with launched_by_torchrun():
        model = Net("plain-sgd", scheduler="none")
        start = flat(model)
        replica = Replica()
        t = trainer(max_steps=2, callbacks=[replica], limit_val_batches=0)
        t.fit(model, loaders()[0])
        return {"start": start, "batches": model.batches, "end": replica.at_end, "settled": flat(model)}


def sgd_step(params: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor], lr: float) -> torch.Tensor:
    """One plain SGD step of ``Net`` from flat ``params`` on ``batch``, independently of the strategy."""
    model = Net("plain-sgd")
    torch.nn.utils.vector_to_parameters(params.clone(), model.parameters())
    model.zero_grad()
    model.loss(batch).backward()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(p.grad, alpha=-lr)
    return flat(model)


def test_no_allreduce_replicas_follow_gossip(pool: Any) -> None:
    """After one step the replicas differ by their own gradient steps (DDP would make them equal);
    after two, each is the pair's average of step 1 plus its own step 2 from its own replica."""
    ranks = pool(2).run(run_two_steps)
    assert torch.equal(ranks[0]["start"], ranks[1]["start"])  # rank 0's initial values everywhere
    after_1 = [sgd_step(r["start"], r["batches"][0], 0.5) for r in ranks]
    assert not torch.equal(after_1[0], after_1[1])  # different data, no all-reduce: replicas differ
    mixed = (after_1[0] + after_1[1]) / 2
    for rank in range(2):
        # the gradient is taken at the replica (backward before step); the round is mixed, then updated
        expected = sgd_step_from(mixed, after_1[rank], ranks[rank]["batches"][1])
        assert torch.equal(ranks[rank]["end"], expected), f"rank {rank} does not follow the gossip rule"
    # fit ends with every rank holding the exact average of the final replicas
    average = (ranks[0]["end"] + ranks[1]["end"]) / 2
    assert torch.equal(ranks[0]["settled"], average) and torch.equal(ranks[1]["settled"], average)


def sgd_step_from(
    mixed: torch.Tensor, at: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]
) -> torch.Tensor:
    """``mixed - lr * grad(at)``, with the gradient at ``at`` applied as SGD applies it (per parameter)."""
    model = Net("plain-sgd")
    torch.nn.utils.vector_to_parameters(at.clone(), model.parameters())
    model.zero_grad()
    model.loss(batch).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    torch.nn.utils.vector_to_parameters(mixed.clone(), model.parameters())
    with torch.no_grad():
        for p, g in zip(model.parameters(), grads, strict=True):
            p.add_(g, alpha=-0.5)
    return flat(model)


# -- evaluation on the average, then training continues bit for bit ---------------------------------------
def run_with_and_without_validation(validate: bool) -> dict[str, Any]:
    with launched_by_torchrun():
        model = Net("sgd")
        replica = Replica()
        early = pl.callbacks.EarlyStopping("val_loss", patience=100) if validate else None
        t = trainer(
            callbacks=[replica] + ([early] if early else []),
            limit_val_batches=None if validate else 0,
            val_check_interval=2,
            num_sanity_val_steps=2 if validate else 0,
        )
        train, val = loaders()
        t.fit(model, train, val if validate else None)
        return {
            "before": replica.before_validation,
            "after": replica.after_validation,
            "seen": model.seen_in_validation,
            "end": replica.at_end,
            "val_loss": t.callback_metrics.get("val_loss"),
        }


def test_validation_sees_the_average_and_training_continues_bitwise(pool: Any) -> None:
    with_val = pool(2).run(run_with_and_without_validation, True)
    without = pool(2).run(run_with_and_without_validation, False)
    assert len(with_val[0]["before"]) == 4  # every 2 steps, 2 epochs of 4 steps
    for k in range(4):
        average = (with_val[0]["before"][k] + with_val[1]["before"][k]) / 2
        # the sanity check's validation (the initial, equal replicas) is seen first, then these
        for rank in range(2):
            assert torch.equal(with_val[rank]["seen"][k + 1], average), f"validation {k} on rank {rank}"
            # after validation, training resumes from this rank's own replica, bit for bit
            if k < len(with_val[rank]["after"]):
                assert torch.equal(with_val[rank]["after"][k], with_val[rank]["before"][k])
        assert not torch.equal(with_val[0]["before"][k], with_val[1]["before"][k])
    for rank in range(2):
        assert torch.equal(with_val[rank]["end"], without[rank]["end"])
    # sync_dist metrics are the same on every rank (EarlyStopping saw the same values everywhere) ...
    assert torch.equal(with_val[0]["val_loss"], with_val[1]["val_loss"])
    # ... and are the loss of the averaged model on the whole validation set: the last validation ran on
    # the average of the replicas recorded just before it. Lightning averages per-batch means over
    # ranks and steps while this takes the mean of all 64 losses at once; with equal batch sizes the
    # two agree up to float32 rounding of sums of 64 terms, well within 64 * 2**-24 relative.
    model = Net()
    average = (with_val[0]["before"][-1] + with_val[1]["before"][-1]) / 2
    torch.nn.utils.vector_to_parameters(average.clone(), model.parameters())
    x, y = dataset().tensors
    with torch.no_grad():
        expected = torch.nn.functional.cross_entropy(model.net(x), y)
    assert torch.allclose(with_val[0]["val_loss"], expected, rtol=64 * 2**-24, atol=0)


# -- checkpoints: resume equals the uninterrupted run; the exported model is the average --------------------
def run_checkpointed(directory: str, resume_from: str | None) -> dict[str, Any]:
    with launched_by_torchrun():
        model = Net("sgd", scheduler="plateau")
        replica = Replica()
        saver = pl.callbacks.ModelCheckpoint(
            dirpath=directory, monitor="val_loss", save_top_k=-1, filename="{epoch}"
        )
        t = trainer(
            max_epochs=3,
            callbacks=[replica, saver],
            enable_checkpointing=True,
            limit_val_batches=None,
        )
        train, val = loaders()
        t.fit(model, train, val, ckpt_path=resume_from)
        lr = t.optimizers[0].param_groups[0]["lr"] if t.optimizers else None
        return {"before": replica.before_validation, "end": replica.at_end, "lr": lr}


def test_resume_equals_uninterrupted_and_checkpoint_holds_the_average(
    pool: Any, resume_pool: Any, tmp_path: Path
) -> None:
    whole = pool(2).run(run_checkpointed, str(tmp_path / "whole"), None)
    first = tmp_path / "whole" / "epoch=0.ckpt"
    assert first.exists() and Path(f"{first}.rank0").exists() and Path(f"{first}.rank1").exists()
    resumed = resume_pool(2).run(run_checkpointed, str(tmp_path / "resumed"), str(first))
    for rank in range(2):
        assert torch.equal(resumed[rank]["end"], whole[rank]["end"]), f"rank {rank} resumed differently"
    # the checkpoint ModelCheckpoint wrote during validation holds the average the validation saw
    saved = torch.load(first, weights_only=False)["state_dict"]
    model = Net()
    model.load_state_dict(saved)
    average = (whole[0]["before"][0] + whole[1]["before"][0]) / 2
    assert torch.equal(flat(model), average)
    # each rank's part holds its own replica, not the average
    for rank in range(2):
        part = torch.load(f"{first}.rank{rank}", weights_only=False)
        model.load_state_dict(part["state_dict"])
        assert torch.equal(flat(model), whole[rank]["before"][0])


def run_resume_at_other_world_size(path: str) -> str:
    with launched_by_torchrun():
        t = trainer(max_epochs=3, limit_val_batches=0)
        try:
            t.fit(Net("sgd", scheduler="plateau"), loaders()[0], ckpt_path=path)
        except ValueError as err:
            return str(err)
        return "no error"


def test_resume_at_another_world_size_is_refused(pool: Any, tmp_path: Path) -> None:
    pool(2).run(run_checkpointed, str(tmp_path), None)
    (message,) = pool(1).run(run_resume_at_other_world_size, str(tmp_path / "epoch=0.ckpt"))
    assert "world size 2" in message and "rank 0 of 1" in message


# -- world size 1 is Lightning's own run, bit for bit ----------------------------------------------------
def run_alone(strategy: str, manual: bool, precision: str, sampler: bool) -> torch.Tensor:
    with launched_by_torchrun():
        model = Net("adamw" if not manual else "sgd", scheduler="step", manual=manual)
        options: dict[str, Any] = {} if manual else {"gradient_clip_val": 0.05, "accumulate_grad_batches": 2}
        t = trainer(
            strategy, limit_val_batches=0, precision=precision, use_distributed_sampler=sampler, **options
        )
        t.fit(model, loaders()[0])
        return flat(model)


@pytest.mark.parametrize(
    ("manual", "precision", "reference"),
    [
        (False, "32-true", "ddp"),
        (True, "32-true", "ddp"),
        (False, "bf16-mixed", "ddp"),
        (False, "32-true", "auto"),
    ],
)
def test_world_size_one_equals_lightning(pool: Any, manual: bool, precision: str, reference: str) -> None:
    """Against Lightning's DDP at world size 1 and its single-device run. The single-device run keeps the
    loader's own sampler while any multi-process strategy substitutes a DistributedSampler (another
    order even at world size 1), so that comparison turns Lightning's substitution off on both sides."""
    sampler = reference != "auto"
    (ours,) = pool(1).run(run_alone, "decentralized", manual, precision, sampler)
    (theirs,) = pool(1).run(run_alone, reference, manual, precision, sampler)
    assert torch.equal(ours, theirs)


# -- errors at setup, on every rank ------------------------------------------------------------------------
def run_lbfgs() -> str:
    with launched_by_torchrun():
        try:
            trainer(limit_val_batches=0).fit(Net("lbfgs", scheduler="none"), loaders()[0])
        except ValueError as err:
            return str(err)
        return "no error"


def test_lbfgs_is_refused_on_every_rank(pool: Any) -> None:
    messages = pool(2).run(run_lbfgs, timeout=60)
    assert all("LBFGS" in message for message in messages)


class ShardedNet(Net):
    """Shards its layers with FSDP2 in configure_model, as a user of ModelParallelStrategy would: on the
    strategy's ``"shard"`` mesh where it built one (``shard_size``), else over the whole world."""

    def configure_model(self) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh
        fully_shard(self.net, mesh=mesh["shard"] if mesh is not None else init_device_mesh("cpu", (4,)))

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self.loss(batch), sync_dist=True)  # no flat(self): it would gather shards


def run_sharded() -> str:
    with launched_by_torchrun():
        try:
            trainer(limit_val_batches=0).fit(ShardedNet("adamw", scheduler="none"), loaders()[0])
        except ValueError as err:
            return str(err)
        return "no error"


def test_sharded_parameters_are_refused_by_name_on_every_rank(pool: Any) -> None:
    """Without ``shard_size`` (or a mesh) a sharded parameter is refused: gossip would mix shards."""
    messages = pool(4).run(run_sharded, timeout=90)
    for message in messages:
        assert "net.0.weight is a sharded parameter" in message, message
        assert "shard_size=S" in message and 'device_mesh=mesh["replicate"]' in message


def run_uneven_shards() -> str:
    from decent_optim_wrapper.integrations.lightning import DecentralizedStrategy

    with launched_by_torchrun():
        try:
            trainer(DecentralizedStrategy(shard_size=3), limit_val_batches=0).fit(ShardedNet(), loaders()[0])
        except ValueError as err:
            return str(err)
        return "no error"


def test_a_shard_size_that_does_not_divide_the_world_is_refused_on_every_rank(pool: Any) -> None:
    for message in pool(4).run(run_uneven_shards, timeout=90):
        assert "shard_size=3 does not divide the world size 4" in message, message


@pytest.mark.pure
@pytest.mark.parametrize(
    ("options", "fragment"),
    [
        ({"shard_size": 0}, "shard_size must be a positive int"),
        ({"shard_size": True}, "got True"),
        ({"shard_size": 2, "process_group": object()}, "shard_size=2 builds the gossip mesh"),
    ],
)
def test_bad_shard_sizes_are_refused_at_construction(options: dict[str, Any], fragment: str) -> None:
    from decent_optim_wrapper.integrations.lightning import DecentralizedStrategy

    with pytest.raises(ValueError, match=fragment):
        DecentralizedStrategy(**options)


def local_flat(module: torch.nn.Module) -> torch.Tensor:
    """This rank's elements of every parameter (a DTensor's local shard), flat: no collective."""
    return torch.cat(
        [getattr(p, "to_local", lambda p=p: p)().detach().reshape(-1).clone() for p in module.parameters()]
    )


class LocalReplica(pl.Callback):
    """:class:`Replica` for a sharded model: this rank's shards before each validation and at the end."""

    def __init__(self) -> None:
        self.before_validation: list[torch.Tensor] = []
        self.at_end: torch.Tensor | None = None

    def on_validation_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            self.before_validation.append(local_flat(module))

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.at_end = local_flat(module)


def fit_sharded_and_replay() -> dict[str, Any]:
    """4 ranks as 2 replicas of 2 shards: the fit against a plain loop of the same FSDP2 model and a
    DecentOptimWrapper gossiping along ``mesh["replicate"]``, on the batches Lightning fed this rank."""
    from torch.distributed.fsdp import fully_shard

    from decent_optim_wrapper import DecentOptimWrapper
    from decent_optim_wrapper.integrations.lightning import DecentralizedStrategy

    with launched_by_torchrun():
        model = ShardedNet("plain-sgd", scheduler="none")
        replica = LocalReplica()
        strategy = DecentralizedStrategy(shard_size=2)
        trainer(strategy, max_steps=4, callbacks=[replica], limit_val_batches=0).fit(model, loaders()[0])
        mesh = strategy.device_mesh
        assert mesh is not None and mesh.mesh_dim_names == ("replicate", "shard")
        plain = Net("plain-sgd", scheduler="none")
        fully_shard(plain.net, mesh=mesh["shard"])
        sgd = torch.optim.SGD(plain.parameters(), lr=0.5)
        # 4 processes on one node hold 2 replicas of the gossip world: the strategy's local_world_size
        optimizer = DecentOptimWrapper(sgd, device_mesh=mesh["replicate"], local_world_size=2)
        for batch in model.batches:
            optimizer.zero_grad()
            plain.loss(batch).backward()
            optimizer.step()
        own = local_flat(plain)
        optimizer.global_avg(may_revert=False)
        assert replica.at_end is not None
        return {
            "sharded": all(hasattr(p, "to_local") for p in model.parameters()),
            "end": torch.equal(replica.at_end, own),
            "settled": torch.equal(local_flat(model), local_flat(plain)),
        }


def test_a_sharded_model_gossips_its_shards_inside_lightning_as_in_a_plain_loop(pool: Any) -> None:
    """``shard_size=2`` over 4 ranks: FSDP2 in configure_model on the strategy's mesh, gossip between
    the replicas' matching shards, bit for bit the plain loop's (decentralized HSDP)."""
    for rank, result in enumerate(pool(4).run(fit_sharded_and_replay, timeout=120)):
        assert result == {"sharded": True, "end": True, "settled": True}, f"rank {rank}: {result}"


def run_sharded_checkpointed(directory: str, resume_from: str | None) -> dict[str, Any]:
    from decent_optim_wrapper.integrations.lightning import DecentralizedStrategy

    with launched_by_torchrun():
        model = ShardedNet("sgd", scheduler="none")
        replica = LocalReplica()
        saver = pl.callbacks.ModelCheckpoint(dirpath=directory, save_top_k=-1, filename="{epoch}")
        t = trainer(
            DecentralizedStrategy(shard_size=2),
            max_epochs=2,
            callbacks=[replica, saver],
            enable_checkpointing=True,
            limit_val_batches=None,
        )
        train, val = loaders()
        t.fit(model, train, val, ckpt_path=resume_from)
        result = {"before": replica.before_validation, "end": replica.at_end}
        if resume_from is None:  # outside fit, the whole average is placed on a fresh sharded module
            fresh = ShardedNet("sgd", scheduler="none")
            trainer(DecentralizedStrategy(shard_size=2)).validate(
                fresh, val, ckpt_path=f"{directory}/epoch=0.ckpt"
            )
            result["validated"] = local_flat(fresh)
        return result


def test_a_sharded_fit_resumes_bitwise_and_exports_the_whole_average(
    pool: Any, resume_pool: Any, tmp_path: Path
) -> None:
    whole = pool(4).run(run_sharded_checkpointed, str(tmp_path / "whole"), None, timeout=120)
    first = tmp_path / "whole" / "epoch=0.ckpt"
    resumed = resume_pool(4).run(run_sharded_checkpointed, str(tmp_path / "resumed"), str(first), timeout=120)
    for rank in range(4):
        assert torch.equal(resumed[rank]["end"], whole[rank]["end"]), f"rank {rank} resumed differently"
    # the export is the whole model (it loads into an unsharded Net), the average of the replicas:
    # shard s of it (FSDP2 splits dim 0 as torch.chunk does) is the mean of ranks s and s + 2's shards
    saved = torch.load(first, weights_only=False)["state_dict"]
    Net().load_state_dict(saved)
    for shard in range(2):
        exported = torch.cat([torch.chunk(value, 2)[shard].reshape(-1) for value in saved.values()])
        average = (whole[shard]["before"][0] + whole[shard + 2]["before"][0]) / 2
        assert torch.equal(exported, average), f"shard {shard} of the export is not the average"
    for rank in range(4):  # validate(ckpt_path=) puts shard rank % 2 of the export on each rank
        exported = torch.cat([torch.chunk(value, 2)[rank % 2].reshape(-1) for value in saved.values()])
        assert torch.equal(whole[rank]["validated"], exported), f"rank {rank} validated another model"
    for rank in range(4):  # each rank's part holds its own shards of its replica
        part = torch.load(f"{first}.rank{rank}", weights_only=True)["state_dict"]
        assert torch.equal(torch.cat([v.reshape(-1) for v in part.values()]), whole[rank]["before"][0])


@pytest.mark.pure
def test_unsupported_lightning_version_is_named() -> None:
    from decent_optim_wrapper.integrations.common import require_version

    with pytest.raises(RuntimeError, match=r"lightning >= 2.6, < 2.7; found lightning 2.5.1"):
        require_version("lightning", "2.5.1", (2, 6), (2, 7))
    require_version("lightning", "2.6.6", (2, 6), (2, 7))


# -- mixed precision with clipping, and gradient tracking under the closure --------------------------------
def run_mixed(precision: str, tracking: bool) -> dict[str, Any]:
    from decent_optim_wrapper.integrations.lightning import DecentralizedStrategy

    with launched_by_torchrun():
        model = Net("adamw", scheduler="none")
        replica = Replica()
        strategy = DecentralizedStrategy(gradient_tracking=tracking)
        t = trainer(
            strategy, limit_val_batches=0, precision=precision, gradient_clip_val=0.05, callbacks=[replica]
        )
        t.fit(model, loaders()[0])
        return {"end": replica.at_end, "settled": flat(model)}


@pytest.mark.parametrize(("precision", "tracking"), [("16-mixed", False), ("bf16-mixed", True)])
def test_mixed_precision_clipping_and_tracking_train(pool: Any, precision: str, tracking: bool) -> None:
    """16-mixed (a GradScaler on CPU) and bf16-mixed with clipping, the latter with gradient tracking
    (which needs the gradients before the step): training runs, replicas differ, fit ends averaged."""
    ranks = pool(2).run(run_mixed, precision, tracking)
    assert torch.isfinite(ranks[0]["end"]).all() and not torch.equal(ranks[0]["end"], ranks[1]["end"])
    average = (ranks[0]["end"] + ranks[1]["end"]) / 2
    assert torch.equal(ranks[0]["settled"], average) and torch.equal(ranks[1]["settled"], average)


# -- every option reaches the engine through the strategy -------------------------------------------------
def fit_and_replay(name: str) -> dict[str, Any]:
    """Fit with the feature's options, then train a plain DecentOptimWrapper with the same options on the
    batches Lightning fed this rank: both must end at the same replica, bit for bit."""
    from decent_optim_wrapper import DecentOptimWrapper, GossipConfig
    from decent_optim_wrapper.integrations.lightning import DecentralizedStrategy

    gossip = FEATURES[name]
    with launched_by_torchrun():
        model = Net("plain-sgd", scheduler="none")
        replica = Replica()
        strategy = DecentralizedStrategy(**gossip)
        trainer(strategy, max_steps=4, callbacks=[replica], limit_val_batches=0).fit(model, loaders()[0])
        plain = Net("plain-sgd", scheduler="none")
        config = GossipConfig.from_options(local_world_size=dist.get_world_size(), **gossip)
        optimizer = DecentOptimWrapper(torch.optim.SGD(plain.parameters(), lr=0.5), config=config)
        for batch in model.batches:
            optimizer.zero_grad()
            plain.loss(batch).backward()
            optimizer.step()
        own = flat(plain)  # this rank's replica, before fit's end settles every rank on the average
        optimizer.global_avg(may_revert=False)
        assert replica.at_end is not None
        return {
            "carried": strategy.config == config.with_options(local_world_size=None),
            "end": torch.equal(replica.at_end, own),
            "settled": torch.equal(flat(model), flat(plain)),
        }


@pytest.mark.parametrize("name", list(FEATURES))
def test_each_option_runs_inside_lightning_as_in_a_plain_loop(pool: Any, name: str) -> None:
    for rank, result in enumerate(pool(2).run(fit_and_replay, name, timeout=120)):
        assert result["carried"], f"rank {rank}: the strategy did not carry every option"
        assert result["end"], f"rank {rank}: the replica differs from the plain loop's"
        assert result["settled"], f"rank {rank}: the settled average differs from the plain loop's"


@pytest.mark.pure
@pytest.mark.parametrize(
    ("options", "fragments"),
    [
        ({"pacing": "measured"}, ["pacing='measured'", "Pass pacing=None", "round_count"]),
        (
            {"on_peer_failure": "continue"},
            ['on_peer_failure="continue"', "node_launcher", 'on_peer_failure="raise"'],
        ),
        ({"sync_evry": 2}, ["sync_evry", "did you mean 'sync_every'"]),
    ],
)
def test_what_lightning_cannot_follow_is_refused_at_construction(
    options: dict[str, Any], fragments: list[str]
) -> None:
    from decent_optim_wrapper import GossipConfig
    from decent_optim_wrapper.integrations.lightning import DecentralizedStrategy

    with pytest.raises((TypeError, ValueError)) as error:
        DecentralizedStrategy(**options)
    for fragment in fragments:
        assert fragment in str(error.value), (fragment, str(error.value))
    with pytest.raises(ValueError, match="contradicts config="):
        DecentralizedStrategy("complete", config=GossipConfig(topology="ring"))


# -- the gossip counters through the Trainer's loggers ------------------------------------------------------
class Capture(pl.loggers.Logger):
    """A logger that keeps what it is given, on every rank (Lightning's own write on rank 0 only)."""

    def __init__(self) -> None:
        super().__init__()
        self.logged: list[tuple[int | None, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "capture"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.logged.append((step, dict(metrics)))


def fit_logging_gossip_metrics(log: bool, folder: str) -> dict[str, Any]:
    from decent_optim_wrapper.integrations.lightning import DecentralizedStrategy

    with launched_by_torchrun():
        capture = Capture()
        csv = pl.loggers.CSVLogger(folder, name="csv", version=0)
        strategy = DecentralizedStrategy("ring", log_gossip_metrics=log)
        t = trainer(strategy, logger=[capture, csv], max_steps=6, log_every_n_steps=2, limit_val_batches=0)
        t.fit(Net("plain-sgd", scheduler="none"), loaders()[0])
        gossip = [(step, m) for step, m in capture.logged if any(k.startswith("gossip/") for k in m)]
        return {"gossip": gossip, "csv": os.path.join(csv.log_dir, "metrics.csv")}


@pytest.mark.parametrize("log", [True, False])
def test_gossip_metrics_reach_the_trainers_loggers_every_log_every_n_steps(
    pool: Any, tmp_path: Path, log: bool
) -> None:
    from decent_optim_wrapper.metrics import METRIC_NAMES

    ranks = pool(2).run(fit_logging_gossip_metrics, log, str(tmp_path), timeout=180)
    for rank, got in enumerate(ranks):
        if not log:  # off by default: the loggers see nothing of gossip
            assert got["gossip"] == [], rank
            continue
        assert len(got["gossip"]) == 3, f"rank {rank}: 6 steps, a log every 2: {got['gossip']}"
        steps = [step for step, _ in got["gossip"]]
        assert steps == sorted(steps) and len(set(steps)) == 3
        for _, metrics in got["gossip"]:
            assert set(METRIC_NAMES) <= set(metrics)
            assert metrics["gossip/steps"] == 2 and metrics["gossip/rounds"] == 2
            assert metrics["fleet/world_size"] == 2
            assert metrics["gossip/bytes_sent"] == 2 * metrics["gossip/bytes_per_step"] > 0
            assert metrics["gossip/wait_s"] >= 0
    with open(ranks[0]["csv"]) as table:  # rank 0's CSVLogger wrote the same columns
        header = table.readline().strip().split(",")
    assert ("gossip/bytes_sent" in header) == log and ("fleet/world_size" in header) == log


@pytest.mark.pure
def test_log_gossip_metrics_must_be_a_bool() -> None:
    from decent_optim_wrapper.integrations.lightning import DecentralizedStrategy

    with pytest.raises(TypeError, match="log_gossip_metrics must be True or False, got 'yes'"):
        DecentralizedStrategy(log_gossip_metrics="yes")  # type: ignore[arg-type]

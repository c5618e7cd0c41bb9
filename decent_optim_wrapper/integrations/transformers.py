"""Hugging Face ``transformers``: :class:`DecentralizedTrainer`, gossip instead of DDP's all-reduce.

Swap ``transformers.Trainer`` for :class:`DecentralizedTrainer` (same ``TrainingArguments``, launched
by ``torchrun`` or ``accelerate launch``), or put :class:`DecentralizedTrainerMixin` first in the bases
of any ``Trainer`` subclass (e.g. TRL's ``SFTTrainer``). Needs the ``[transformers]`` extra.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

try:
    import accelerate
    import transformers
    from accelerate.utils import DistributedType
    from transformers import Trainer
    from transformers.trainer import SCHEDULER_NAME
    from transformers.training_args import ParallelMode
except ImportError as err:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "decent_optim_wrapper.integrations.transformers needs transformers and accelerate: "
        "pip install 'decent-optim-wrapper[transformers]'"
    ) from err

from decent_optim_wrapper.engine import (
    GossipConfig,
    document_options,
    is_sharded,
    load_local_module_state,
    local_module_state,
)
from decent_optim_wrapper.front_ends import DecentOptimWrapper
from decent_optim_wrapper.integrations.common import (
    Replicas,
    ensure_process_group,
    framework_config,
    replicas_per_node,
    require_version,
    wrap_optimizer,
)

__all__ = ["PART_NAME", "DecentralizedTrainer", "DecentralizedTrainerMixin", "rank_part_name"]

SUPPORTED_TRANSFORMERS = ((5, 0), (6, 0))
SUPPORTED_ACCELERATE = ((1, 10), (2, 0))

#: Each rank's part of a checkpoint folder: ``decent_rank{r}-of-{n}.pt``.
PART_NAME = "decent_rank{rank}-of-{world_size}.pt"

# Accelerate's multi-process modes in which the integration replaces DDP; anything else shards or
# wraps the model in ways gossip of whole replicas cannot follow.
_SUPPORTED_TYPES = {DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU}


def rank_part_name(rank: int, world_size: int) -> str:
    """The file in a checkpoint folder that holds rank ``rank``'s part."""
    return PART_NAME.format(rank=rank, world_size=world_size)


@document_options
class DecentralizedTrainerMixin:
    r"""Makes a ``transformers.Trainer`` (or a subclass of it) train decentralized: gossip, no all-reduce.

    Put it first in the bases: ``class MyTrainer(DecentralizedTrainerMixin, SFTTrainer)``. What changes:

    * the model is prepared by Accelerate (device placement, autocast, compilation) but not wrapped
      in ``DistributedDataParallel``, so no gradient is all-reduced; the optimizer the Trainer builds
      (or the one passed in ``optimizers=``) is wrapped in a
      :class:`~decent_optim_wrapper.DecentOptimWrapper`, and each step runs
      ``x_i <- sum_j W_ij x_j`` (the round launched at the previous step), the optimizer's update
      with this rank's gradient, then launches this step's round;
    * ``evaluate()`` and ``predict()`` run on the exact global average of the replicas; training
      then continues from each rank's own replica, bit for bit. When ``train()`` ends, every rank's
      model is the global average;
    * ``save_model()`` and the model files of every checkpoint hold the global average; each rank
      also writes its part (its replica, its optimizer and gossip state) to
      ``checkpoint-N/decent_rank{r}-of-{n}.pt``, and ``train(resume_from_checkpoint=...)`` resumes
      every rank from its own part;
    * a model sharded by FSDP2 over ``mesh["shard"]`` before it is handed over trains with
      ``device_mesh=mesh["replicate"]`` (decentralized HSDP): each rank's part holds its shards, the
      model files the average gathered whole.

    .. warning:: ``save_model()`` and ``evaluate()`` are collectives during training: call them on
        every rank, as for any distributed Trainer.

    Keyword Args:
        config: the gossip options as one :class:`~decent_optim_wrapper.GossipConfig`; the keywords below
            build it (or change it, if they agree with it). ``local_world_size`` defaults to
            ``$LOCAL_WORLD_SIZE``, else 1. Paced rounds and ``on_peer_failure="continue"`` are refused
            with the fix: the Trainer counts the same steps on every rank, and its launchers (torchrun,
            accelerate launch) stop the job when a process dies.
        log_gossip_metrics: add the wrapped optimizer's
            :meth:`~decent_optim_wrapper.DecentOptimWrapper.metrics` (bytes sent, seconds waiting for
            gossip, guard events, world size, ...: the metrics page of the docs) to every training
            log (each ``logging_steps``, the logs with ``"loss"``), before the Trainer hands them to
            its callbacks: ``state.log_history`` and every ``report_to`` logger (TensorBoard, W&B)
            receive them. Each rank adds its own counters (a local read, no collective); the
            reporting callbacks write rank 0's. Off by default; its cost is within the noise of a step
            (the metrics page gives the figure).
        {gossip_options}

    All other arguments go to the Trainer.
    """

    # what the mixin reads of the Trainer it is mixed into
    args: Any
    accelerator: Any
    model: Any
    optimizer: Any
    lr_scheduler: Any
    is_deepspeed_enabled: bool
    is_fsdp_enabled: bool

    def __init__(
        self, *args: Any, config: GossipConfig | None = None, log_gossip_metrics: bool = False, **kwargs: Any
    ) -> None:
        require_version("transformers", transformers.__version__, *SUPPORTED_TRANSFORMERS)
        require_version("accelerate", accelerate.__version__, *SUPPORTED_ACCELERATE)
        # The gossip options among the Trainer's keywords (the Trainer has none of these names).
        options = {name: kwargs.pop(name) for name in GossipConfig.keywords() if name in kwargs}
        self._gossip_config = framework_config("The Trainer", config, options)
        self._replicas = Replicas()
        if not isinstance(log_gossip_metrics, bool):
            raise TypeError(
                f"log_gossip_metrics must be True or False, got {log_gossip_metrics!r}; pass "
                "log_gossip_metrics=True to add the gossip counters to the Trainer's logs."
            )
        self._log_gossip_metrics = log_gossip_metrics
        super().__init__(*args, **kwargs)
        self._check_supported()

    def _check_supported(self) -> None:
        """Refuse, at construction, what gossip of whole replicas cannot do (never a hang later)."""
        refused = []
        if getattr(self, "is_deepspeed_enabled", False):
            refused.append("DeepSpeed (args.deepspeed)")
        if getattr(self, "is_fsdp_enabled", False) or getattr(self, "is_fsdp_xla_enabled", False):
            refused.append("FSDP (args.fsdp)")
        distributed_type = self.accelerator.distributed_type
        if distributed_type not in _SUPPORTED_TYPES:
            refused.append(f"Accelerate's distributed type {distributed_type}")
        if self.args.parallel_mode == ParallelMode.NOT_DISTRIBUTED:  # nn.DataParallel over several GPUs
            refused.append("torch.nn.DataParallel (one process, several GPUs: launch with torchrun)")
        parallelism = getattr(self.accelerator, "parallelism_config", None)
        if parallelism is not None and (
            getattr(parallelism, "tp_enabled", False) or getattr(parallelism, "cp_enabled", False)
        ):
            refused.append("tensor or context parallelism (parallelism_config)")
        if refused:
            raise ValueError(
                f"{type(self).__name__} trains whole replicas with gossip and does not support "
                f"{', '.join(refused)}. Launch one process per device with torchrun or accelerate "
                "launch, without sharding, or use transformers.Trainer for this setup."
            )

    # -- the optimizer and the model -------------------------------------------------------------------
    @property
    def gossip_config(self) -> GossipConfig:
        """The gossip options the optimizer is wrapped with; processes per node default to
        ``$LOCAL_WORLD_SIZE``."""
        return self._gossip_config

    @property
    def replicas(self) -> Replicas:
        """The wrapped optimizer of the current training (empty outside it) and whether it is averaged."""
        return self._replicas

    def _wrap_model(self, model: Any, training: bool = True, dataloader: Any = None) -> Any:
        """As the Trainer, but for training: prepared without ``DistributedDataParallel``, optimizer wrapped.

        Accelerate's ``prepare_model(..., evaluation_mode=True)`` does everything ``prepare`` does for
        a model (device placement, autocast, compilation) except the data-parallel wrapper, and marks
        the model prepared so the Trainer's later ``prepare`` leaves it alone. The optimizer is
        wrapped only then, because device placement re-binds the parameters.
        """
        wrapped = super()._wrap_model(model, training, dataloader)  # type: ignore[misc]
        if not training or wrapped is not self.model:
            return wrapped
        prepared = self.accelerator.prepare_model(wrapped, evaluation_mode=True)
        self._wrap_optimizer()
        return prepared

    def _wrap_optimizer(self) -> None:
        """Wrap the Trainer's optimizer (or the one passed in ``optimizers=``) to gossip.

        A collective (the wrapper broadcasts rank 0's parameters). At world size 1 without a process
        group, a one-process group is created for the wrapper.
        """
        optimizer = self.optimizer
        inner = getattr(optimizer, "optimizer", None)  # a later train(): Accelerate's optimizer around ours
        for existing in (optimizer, inner):
            if isinstance(existing, DecentOptimWrapper):
                self._replicas.wrappers = [existing]
                return
        ensure_process_group(self.args.world_size, "launch with torchrun or accelerate launch")
        processes = int(os.environ.get("LOCAL_WORLD_SIZE") or 1)
        mesh = self._gossip_config.placement.device_mesh
        shards = dist.get_world_size() // mesh.size() if mesh is not None else 1  # ranks per replica
        local = replicas_per_node(processes, shards)
        config = framework_config("The Trainer", self._gossip_config, {}, local)
        self.optimizer = wrap_optimizer(optimizer, config)
        self._replicas.clear()
        self._replicas.wrappers = [self.optimizer]
        self.optimizer.metrics()  # the first log counts from the first step

    # -- the gossip counters in the Trainer's logs ----------------------------------------------------
    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """The Trainer's log; with ``log_gossip_metrics``, a training log gets the gossip counters first."""
        if self._log_gossip_metrics and self._replicas.training and "loss" in logs:
            logs.update(self._replicas.wrappers[0].metrics())
        super().log(logs, *args, **kwargs)  # type: ignore[misc]

    @property
    def log_gossip_metrics(self) -> bool:
        """Whether each training log gets the gossip counters (:meth:`log`)."""
        return self._log_gossip_metrics

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """Train as the Trainer does; afterwards every rank's model is the global average."""
        output = super().train(*args, **kwargs)  # type: ignore[misc]
        if self._replicas.training:
            self._replicas.settle(self.model)
            self._replicas.clear()
        return output

    # -- evaluation on the global average ----------------------------------------------------------------
    def evaluate(self, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's evaluation, on the exact global average; training continues from the replica."""
        self._replicas.average(self.model)
        try:
            return super().evaluate(*args, **kwargs)  # type: ignore[misc]
        finally:
            self._replicas.restore()

    def predict(self, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's prediction, on the exact global average; training continues from the replica."""
        self._replicas.average(self.model)
        try:
            return super().predict(*args, **kwargs)  # type: ignore[misc]
        finally:
            self._replicas.restore()

    # -- checkpoints ---------------------------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Save the global average (what ``from_pretrained`` loads); a collective during training.

        A sharded model's average is gathered whole on every rank (a collective, also outside
        training), then written by the main process as the Trainer writes any state dict.
        """
        if any(is_sharded(p) for p in self.model.parameters()):
            state = self._replicas.averaged_state_dict(self.model)
            self._save(output_dir if output_dir is not None else self.args.output_dir, state_dict=state)  # type: ignore[attr-defined]
            if self.args.push_to_hub and not _internal_call:  # as the Trainer's save_model
                self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)  # type: ignore[attr-defined]
            return
        self._replicas.average(self.model)
        try:
            super().save_model(output_dir, _internal_call)  # type: ignore[misc]
        finally:
            self._replicas.restore()

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """The Trainer's files (rank 0), plus every rank's part: replica, optimizer and gossip state."""
        super()._save_optimizer_and_scheduler(output_dir)  # type: ignore[misc]
        if not self._replicas.training:
            return
        rank, world_size = dist.get_rank(), dist.get_world_size()
        os.makedirs(output_dir, exist_ok=True)
        part = {
            "rank": rank,
            "world_size": world_size,
            "model": local_module_state(self.model),  # a sharded replica: this rank's shards
            "optimizer": self._replicas.wrappers[0].state_dict(),
        }
        torch.save(part, os.path.join(output_dir, rank_part_name(rank, world_size)))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        """The Trainer's, except for a sharded model: the checkpoint's model files hold the whole
        average, and this rank's part (:meth:`_load_optimizer_and_scheduler`) restores its shards."""
        target = model if model is not None else self.model
        if not any(is_sharded(p) for p in target.parameters()):
            super()._load_from_checkpoint(resume_from_checkpoint, model)  # type: ignore[misc]

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """Restore this rank's part (its replica, optimizer and gossip state) and the scheduler."""
        if checkpoint is None or not self._replicas.training:
            super()._load_optimizer_and_scheduler(checkpoint)  # type: ignore[misc]
            return
        rank, world_size = dist.get_rank(), dist.get_world_size()
        path = os.path.join(checkpoint, rank_part_name(rank, world_size))
        if not os.path.isfile(path):
            found = sorted(name for name in os.listdir(checkpoint) if name.startswith("decent_rank"))
            raise FileNotFoundError(
                f"{path!r} is missing: resume with the world size that saved {checkpoint!r} (its parts: "
                f"{found or 'none'}); this run is rank {rank} of {world_size}. To use the averaged model "
                "elsewhere, load it with from_pretrained(checkpoint)."
            )
        device = self.args.device
        # torch cannot restore storages to an indexed CPU device ("cpu:0")
        part = torch.load(path, map_location="cpu" if device.type == "cpu" else device, weights_only=True)
        load_local_module_state(self.model, part["model"])
        self._replicas.wrappers[0].load_state_dict(part["optimizer"])
        scheduler = os.path.join(checkpoint, SCHEDULER_NAME)
        if os.path.isfile(scheduler):
            self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))


class DecentralizedTrainer(DecentralizedTrainerMixin, Trainer):
    """``transformers.Trainer`` with decentralized (gossip) data parallelism.

    See :class:`DecentralizedTrainerMixin` for what changes and the gossip options; everything else is
    the Trainer's, with the same ``TrainingArguments``.
    """

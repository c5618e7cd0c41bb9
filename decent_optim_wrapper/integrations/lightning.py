"""PyTorch Lightning: :class:`DecentralizedStrategy`, gossip instead of DDP's gradient all-reduce.

``Trainer(strategy=DecentralizedStrategy(topology="ring"), devices=N, num_nodes=M)``, or
``strategy="decentralized"`` once this module is imported (importing it registers the name in
Lightning's ``StrategyRegistry``). The user's ``LightningModule`` is unchanged. Needs the
``[lightning]`` extra (Lightning 2.6).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Literal, Unpack

import torch
from torch.optim import LBFGS, Optimizer

try:
    import lightning
    import lightning.pytorch as pl
    from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
    from lightning.fabric.strategies.registry import _StrategyRegistry
    from lightning.fabric.utilities.types import _PATH
    from lightning.pytorch.plugins.precision import MixedPrecision, Precision
    from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
    from lightning.pytorch.trainer.states import TrainerFn
    from lightning.pytorch.utilities import GradClipAlgorithmType
except ImportError as err:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "decent_optim_wrapper.integrations.lightning needs PyTorch Lightning: "
        "pip install 'decent-optim-wrapper[lightning]'"
    ) from err

from decent_optim_wrapper.checks import is_int
from decent_optim_wrapper.engine import (
    GossipConfig,
    KeywordOptions,
    TopologySpec,
    document_options,
    given,
    is_sharded,
    load_local_module_state,
    local_module_state,
)
from decent_optim_wrapper.front_ends import DecentOptimWrapper
from decent_optim_wrapper.integrations.common import (
    Replicas,
    framework_config,
    replicas_per_node,
    require_version,
    wrap_optimizer,
)

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["DecentralizedStrategy", "rank_part_path"]

SUPPORTED = ((2, 6), (2, 7))


def rank_part_path(filepath: _PATH, rank: int) -> str:
    """Where rank ``rank``'s part of the checkpoint ``filepath`` lives: ``<filepath>.rank<r>``."""
    return f"{os.fspath(filepath)}.rank{rank}"


class _ClosureFirstWrapper(DecentOptimWrapper):
    """A wrapper that runs Lightning's closure (forward, backward) before the step, not inside it.

    That is the order of a hand-written loop (``backward()``, then ``step()``): the gradient is taken
    at the replica as it is, then the previous round is mixed in and the update applied. It also
    lets gradient tracking, which needs final gradients before the step, work under Lightning's
    automatic optimization. An optimizer that evaluates its closure several times (LBFGS) is refused.
    """

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        if closure is None:
            return super().step()
        with torch.enable_grad():
            loss = closure()
        super().step()
        return loss


class _UnscalingMixedPrecision(MixedPrecision):
    """Lightning's mixed precision for an optimizer that takes GradScaler's ``found_inf`` itself.

    The wrapper tells GradScaler it handles scaling (so a rank with inf/NaN gradients still gossips
    instead of skipping ``step()`` and leaving its peers waiting), which makes Lightning's plugin
    skip unscaling and refuse gradient clipping (under ``bf16-mixed`` too, without a scaler). This
    plugin unscales right after the closure, as it does for a plain optimizer, so clipping,
    ``on_before_optimizer_step`` and gradient tracking see the true gradients; GradScaler then
    hands the wrapper only ``found_inf``.
    """

    def optimizer_step(  # type: ignore[override]
        self, optimizer: Any, model: pl.LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        scaler = self.scaler
        if scaler is None:  # bf16-mixed: nothing to unscale
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)

        def unscaling_closure() -> Any:
            result = closure()
            if not (result is None and model.automatic_optimization):  # backward was not skipped
                scaler.unscale_(optimizer)
            return result

        return super().optimizer_step(optimizer, model=model, closure=unscaling_closure, **kwargs)

    def clip_gradients(
        self,
        optimizer: Optimizer,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        # the gradients are unscaled by now (see optimizer_step), so clipping them is correct
        Precision.clip_gradients(self, optimizer, clip_val, gradient_clip_algorithm)


@document_options(leave_out=("rank", "world_size"))  # Lightning's own
class DecentralizedStrategy(DDPStrategy):
    r"""Decentralized data parallelism for Lightning: each rank trains its own replica and gossips.

    Launching, the process group, data sharding (``DistributedSampler``), ``self.log(...,
    sync_dist=True)`` (a real all-reduce), barriers and broadcasts are DDP's; what changes:

    * the model is **not** wrapped in ``DistributedDataParallel`` (no gradient all-reduce), and every
      optimizer ``configure_optimizers`` returns is wrapped in a
      :class:`~decent_optim_wrapper.DecentOptimWrapper` (LR schedulers keep working on the optimizer
      they were built on: the wrapper shares its ``param_groups``). Each step runs
      ``x_i <- sum_j W_ij x_j`` (the round launched at the previous step), then the optimizer's update
      with this rank's gradient, then launches this step's round, as in the wrapper;
    * validation, test and predict inside ``fit`` run on the exact global average of the replicas
      (parameters and floating buffers); training then continues from each rank's own replica, bit
      for bit. When ``fit`` ends, every rank holds the global average;
    * a checkpoint's ``state_dict`` (what ``ModelCheckpoint`` writes, what a user deploys) is the
      global average; each rank also writes its part (its replica, its optimizer and gossip state)
      to ``<checkpoint>.rank<r>``, and ``fit(ckpt_path=...)`` resumes every rank from its own part.

    .. warning:: Every rank must make the same calls (fit, validate, save_checkpoint) as under DDP;
        gossip waits for peers at most ``timeout`` and then raises
        :class:`~decent_optim_wrapper.GossipError`.

    Args:
        config: the gossip options as one :class:`~decent_optim_wrapper.GossipConfig`; the keywords below
            build it (or change it, if they agree with it). ``topology`` may also be passed by position;
            ``local_world_size`` defaults to ``devices``. Paced rounds and ``on_peer_failure="continue"``
            are refused with the fix: Lightning counts the same steps on every rank, and its launchers
            stop the job when a process dies.
        shard_size: shard each replica over this many processes (decentralized HSDP): the strategy
            builds a ``("replicate", "shard")`` device mesh of ``world_size // shard_size`` replicas,
            each of ``shard_size`` consecutive ranks, and hands it to the module as
            ``self.device_mesh``; ``configure_model`` shards with
            ``fully_shard(layer, mesh=self.device_mesh["shard"])`` and gossip runs along
            ``"replicate"``, each rank exchanging its local shards with the same shard of its
            neighbours' replicas. Checkpoints export the whole averaged model (gathered); each rank's
            part holds its local shards. Default ``None``: whole replicas (a sharded parameter is then
            refused with this fix).
        log_gossip_metrics: every ``log_every_n_steps`` optimizer steps, pass the wrapped optimizer's
            :meth:`~decent_optim_wrapper.DecentOptimWrapper.metrics` (bytes sent, seconds waiting for
            gossip, guard events, world size, ...: the metrics page of the docs) to every logger of
            the Trainer (``logger.log_metrics``), at ``trainer.global_step``. Lightning's loggers
            write on rank 0, so they record rank 0's counters; every rank reads its own (a local read,
            no collective). With several optimizers each name gets the prefix ``optimizer<i>/``. Off
            by default; its cost is within the noise of a step (the metrics page gives the figure).
        {gossip_options}

    The other arguments (``accelerator``, ``parallel_devices``, ``cluster_environment``,
    ``checkpoint_io``, ``precision_plugin``, ``process_group_backend``, ``start_method``) are those of
    Lightning's ``DDPStrategy``.
    """

    strategy_name = "decentralized"

    def __init__(
        self,
        topology: TopologySpec | None = None,
        *,
        config: GossipConfig | None = None,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        shard_size: int | None = None,
        log_gossip_metrics: bool = False,
        **options: Unpack[KeywordOptions],
    ) -> None:
        require_version("lightning", lightning.__version__, *SUPPORTED)
        if shard_size is not None and not (is_int(shard_size) and shard_size >= 1):
            raise ValueError(
                f"shard_size must be a positive int (the processes each replica is sharded over) or None, "
                f"got {shard_size!r}; pass e.g. shard_size=2, or None for whole replicas."
            )
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            start_method=start_method,
        )
        # Merged now, so that a bad option fails at construction; the processes per node come at setup.
        self._config = framework_config("Lightning", config, {**given(topology=topology), **options})
        placement = self._config.placement
        if shard_size is not None and (
            placement.device_mesh is not None or placement.process_group is not None
        ):
            raise ValueError(
                f"shard_size={shard_size} builds the gossip mesh, but a device_mesh or process_group was "
                "passed as well; pass one of them (shard_size, or device_mesh= a mesh built after the "
                "process group started)."
            )
        self._shard_size = shard_size
        self._device_mesh: DeviceMesh | None = None
        self._replicas = Replicas()
        if not isinstance(log_gossip_metrics, bool):
            raise TypeError(
                f"log_gossip_metrics must be True or False, got {log_gossip_metrics!r}; pass "
                "log_gossip_metrics=True to log the gossip counters through the Trainer's loggers."
            )
        self._log_gossip_metrics = log_gossip_metrics
        self._steps_since_log = 0

    # -- setup: no DDP, wrapped optimizers -----------------------------------------------------------
    def setup_environment(self) -> None:
        """DDP's (the process group), then with ``shard_size`` the mesh ``configure_model`` shards on."""
        super().setup_environment()
        if self._shard_size is None:
            return
        world_size, shards = self.world_size, self._shard_size
        if world_size % shards:
            raise ValueError(
                f"shard_size={shards} does not divide the world size {world_size} (devices x num_nodes); "
                f"pass a shard_size that divides it (e.g. devices={self.num_processes}), so that every "
                "replica has the same shards."
            )
        from torch.distributed.device_mesh import init_device_mesh

        self._device_mesh = init_device_mesh(
            self.root_device.type, (world_size // shards, shards), mesh_dim_names=("replicate", "shard")
        )
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh  # what LightningModule.device_mesh returns

    @property
    def device_mesh(self) -> DeviceMesh | None:
        """The ``("replicate", "shard")`` mesh built for ``shard_size`` (``None`` for whole replicas)."""
        return self._device_mesh

    def setup(self, trainer: pl.Trainer) -> None:
        plugin = self.precision_plugin
        if type(plugin) is MixedPrecision:
            precision: Literal["16-mixed", "bf16-mixed"] = (
                "16-mixed" if plugin.precision == "16-mixed" else "bf16-mixed"
            )
            self.precision_plugin = _UnscalingMixedPrecision(precision, plugin.device, plugin.scaler)
        module = self.lightning_module
        sharded = module is not None and any(is_sharded(p) for p in module.parameters())
        if trainer.state.fn == TrainerFn.FITTING or not sharded:
            super().setup(trainer)
            return
        # Outside fit, DDP's setup broadcasts rank 0's module to every rank; the ranks of a sharded
        # module hold different shards (each loads its own from a checkpoint), so that step is skipped.
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.setup_precision_plugin()

    def configure_ddp(self) -> None:
        """Nothing to do: the model is not wrapped in ``DistributedDataParallel`` (gossip replaces it)."""

    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        """Build the optimizers and schedulers as Lightning does, then wrap each optimizer to gossip.

        A collective (the wrappers broadcast rank 0's parameters): all ranks build the same optimizers.
        """
        super().setup_optimizers(trainer)
        assert self.lightning_module is not None
        placement = self._config.placement
        gossip_group = placement.device_mesh is not None or placement.process_group is not None
        for name, param in self.lightning_module.named_parameters():
            if is_sharded(param) and self._device_mesh is None and not gossip_group:
                raise ValueError(
                    f"{name} is a sharded parameter (DTensor, e.g. from fully_shard or parallelize_module "
                    "in configure_model), but DecentralizedStrategy was given no mesh to gossip along, so "
                    "it would gossip shards with ranks that hold other shards. Pass shard_size=S "
                    '(the strategy builds a ("replicate", "shard") mesh; shard with '
                    'fully_shard(layer, mesh=self.device_mesh["shard"]) in configure_model), or '
                    'device_mesh=mesh["replicate"] of a mesh you built (the big models page of the docs).'
                )
        for optimizer in self.optimizers:
            if isinstance(optimizer, LBFGS):
                raise ValueError(
                    "DecentralizedStrategy does not support torch.optim.LBFGS: it evaluates its closure "
                    "several times per step, and the strategy runs the closure once before the step. "
                    "Use a first-order optimizer (SGD, Adam, AdamW, ...)."
                )
        config = framework_config("Lightning", self._config, {}, local_world_size=self._replicas_per_node())
        if self._device_mesh is not None:
            config = config.with_options(device_mesh=self._device_mesh["replicate"])
        wrapped = [wrap_optimizer(optimizer, config, _ClosureFirstWrapper) for optimizer in self.optimizers]
        self._replicas.clear()
        self._replicas.wrappers = wrapped
        self.optimizers = list(wrapped)
        self._steps_since_log = 0
        for wrapper in wrapped:
            wrapper.metrics()  # the first log counts from the fit's first step

    def _replicas_per_node(self) -> int:
        """The gossip world's processes per node: every process, or with ``shard_size`` one per replica
        held on the node (a replica of consecutive ranks spans nodes where it is larger than one)."""
        return replicas_per_node(self.num_processes, self._shard_size or 1)

    # -- the gossip counters for the Trainer's loggers -------------------------------------------------
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        """DDP's optimizer step; with ``log_gossip_metrics``, then the counters to the loggers when due."""
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self._log_gossip_metrics:
            self._steps_since_log += 1
            trainer = self.lightning_module.trainer if self.lightning_module is not None else None
            # set by the Trainer's constructor, not declared on the class
            every = max(1, int(getattr(trainer, "log_every_n_steps", 50)))
            if trainer is not None and self._steps_since_log >= every:
                self._steps_since_log = 0
                self._log_metrics(trainer)
        return output

    def _log_metrics(self, trainer: pl.Trainer) -> None:
        """Every wrapper's counters since the last log, to every logger (they write on rank 0)."""
        wrappers = self._replicas.wrappers
        metrics: dict[str, float] = {}
        for index, wrapper in enumerate(wrappers):
            prefix = f"optimizer{index}/" if len(wrappers) > 1 else ""
            metrics.update({prefix + name: float(value) for name, value in wrapper.metrics().items()})
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

    @property
    def log_gossip_metrics(self) -> bool:
        """Whether the gossip counters go to the Trainer's loggers every ``log_every_n_steps`` steps."""
        return self._log_gossip_metrics

    @property
    def config(self) -> GossipConfig:
        """The gossip options every optimizer is wrapped with; processes per node default to ``devices``."""
        return self._config

    @property
    def replicas(self) -> Replicas:
        """The wrapped optimizers of the current fit (empty outside one) and whether they are averaged."""
        return self._replicas

    # -- evaluation on the global average ------------------------------------------------------------
    def _average(self) -> None:
        assert self.lightning_module is not None
        self._replicas.average(self.lightning_module)

    def on_validation_start(self) -> None:
        self._average()

    def on_validation_end(self) -> None:
        self._replicas.restore()

    def on_test_start(self) -> None:
        self._average()

    def on_test_end(self) -> None:
        self._replicas.restore()

    def on_predict_start(self) -> None:
        self._average()

    def on_predict_end(self) -> None:
        self._replicas.restore()

    def on_train_end(self) -> None:
        """Training is over: every rank's model becomes the global average, for good."""
        assert self.lightning_module is not None
        self._replicas.settle(self.lightning_module)

    def teardown(self) -> None:
        self._replicas = Replicas()  # the wrappers belong to the finished fit
        super().teardown()

    # -- checkpoints ---------------------------------------------------------------------------------
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The global average's state dict: what a checkpoint exports (a collective during ``fit``)."""
        assert self.lightning_module is not None
        return self._replicas.averaged_state_dict(self.lightning_module)

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None
    ) -> None:
        """Rank 0 writes ``checkpoint`` (the averaged model); every rank writes its part beside it.

        The part, at :func:`rank_part_path`, holds what this rank needs to resume bit for bit: its
        replica's state dict (parameters and buffers), its optimizers' state dicts (with the gossip
        state in their ``"decent"`` entry) and the precision plugin's state.
        """
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        if not self._replicas.training:
            return
        part = self._rank_part(checkpoint)
        self.checkpoint_io.save_checkpoint(part, rank_part_path(filepath, self.global_rank), storage_options)

    def _rank_part(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        module = self.lightning_module
        assert module is not None
        averaged = self._replicas.averaged
        self._replicas.restore()  # saved during evaluation: this rank's part is its replica, not the average
        try:
            part = {
                "decent_rank": self.global_rank,
                "decent_world_size": self.world_size,
                "state_dict": local_module_state(module),  # a sharded replica: this rank's shards
                "optimizer_states": [optimizer.state_dict() for optimizer in self._replicas.wrappers],
            }
        finally:
            if averaged:
                self._average()
        precision_key = type(self.precision_plugin).__qualname__
        if precision_key in checkpoint:
            part[precision_key] = self.precision_plugin.state_dict()
        return part

    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        """The checkpoint; when resuming ``fit``, with this rank's part (replica, optimizers) in place.

        Outside ``fit`` (validate, test, predict) the checkpoint's averaged model is loaded as is.
        """
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        if not self._fitting():
            return checkpoint
        path = rank_part_path(os.path.realpath(checkpoint_path), self.global_rank)
        if not os.path.exists(path):
            raise FileNotFoundError(
                f"rank {self.global_rank}'s part of checkpoint {os.fspath(checkpoint_path)!r} is missing: "
                f"expected {path!r}. Resume with the world size that saved it (each rank r reads "
                "<checkpoint>.rank<r>), or load the averaged model with LightningModule.load_from_checkpoint."
            )
        part = self.checkpoint_io.load_checkpoint(path, weights_only=weights_only)
        if part.get("decent_world_size") != self.world_size or part.get("decent_rank") != self.global_rank:
            raise ValueError(
                f"{path!r} was saved by rank {part.get('decent_rank')} of world size "
                f"{part.get('decent_world_size')}; this is rank {self.global_rank} of {self.world_size}. "
                "Resume with the world size and ranks that saved the checkpoint."
            )
        for key, value in part.items():
            if not key.startswith("decent_"):
                checkpoint[key] = value
        return checkpoint

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Lightning's, but a sharded model takes this rank's shards (resuming ``fit``) or the whole
        averaged model placed on its mesh (outside ``fit``: ``set_model_state_dict``, a collective)."""
        module = self.lightning_module
        assert module is not None
        if not any(is_sharded(p) for p in module.parameters()):
            super().load_model_state_dict(checkpoint, strict=strict)
        elif self._fitting():
            load_local_module_state(module, checkpoint["state_dict"])
        else:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

            options = StateDictOptions(full_state_dict=True, strict=strict)
            set_model_state_dict(module, checkpoint["state_dict"], options=options)

    def _fitting(self) -> bool:
        module = self.lightning_module
        try:
            return module is not None and module.trainer.state.fn == TrainerFn.FITTING
        except RuntimeError:  # the module is not attached to a Trainer
            return False

    def remove_checkpoint(self, filepath: _PATH) -> None:
        """Rank 0 removes the checkpoint; every rank removes its own part."""
        super().remove_checkpoint(filepath)
        path = rank_part_path(filepath, self.global_rank)
        if os.path.exists(path):
            self.checkpoint_io.remove_checkpoint(path)

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        strategy_registry.register(
            cls.strategy_name,
            cls,
            description="Decentralized (gossip) data parallelism: DecentOptimWrapper instead of DDP",
        )


if DecentralizedStrategy.strategy_name not in StrategyRegistry:
    DecentralizedStrategy.register_strategies(StrategyRegistry)

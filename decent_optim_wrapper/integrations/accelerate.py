"""Hugging Face Accelerate: :class:`DecentralizedAccelerator`, gossip instead of DDP's all-reduce.

Swap ``Accelerator(...)`` for ``DecentralizedAccelerator(..., topology="ring")``; the rest of the loop
(``prepare``, ``backward``, ``accumulate``, ``clip_grad_norm_``, mixed precision, ``save_state`` /
``load_state``, ``accelerate launch``) is unchanged. Needs the ``[accelerate]`` extra.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.optim import Optimizer

try:
    import accelerate
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer, move_to_device
    from accelerate.utils import DistributedType
except ImportError as err:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "decent_optim_wrapper.integrations.accelerate needs accelerate: "
        "pip install 'decent-optim-wrapper[accelerate]'"
    ) from err

from decent_optim_wrapper.engine import GossipConfig, document_options
from decent_optim_wrapper.front_ends import DecentOptimWrapper
from decent_optim_wrapper.integrations.common import (
    Replicas,
    ensure_process_group,
    framework_config,
    require_version,
    wrap_optimizer,
)

__all__ = ["PART_NAME", "DecentralizedAccelerator", "rank_part_name"]

SUPPORTED = ((1, 10), (2, 0))

#: Each rank's part of a ``save_state`` folder: ``decent_rank{r}-of-{n}.pt``.
PART_NAME = "decent_rank{rank}-of-{world_size}.pt"

# Accelerate's modes in which gossip replaces DDP; the others shard or wrap the model in ways gossip of
# whole replicas cannot follow.
_SUPPORTED_TYPES = (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)

# Accelerator arguments that shard the model or hand it to another engine, with the way to go without.
_REFUSED_ARGUMENTS = {
    "deepspeed_plugin": "DeepSpeed",
    "deepspeed_plugins": "DeepSpeed",
    "fsdp_plugin": "FSDP",
    "megatron_lm_plugin": "Megatron-LM",
    "torch_tp_plugin": "tensor parallelism",
    "parallelism_config": "composable parallelism (tensor, context or sharded data parallelism)",
}


def rank_part_name(rank: int, world_size: int) -> str:
    """The file in a ``save_state`` folder that holds rank ``rank``'s part."""
    return PART_NAME.format(rank=rank, world_size=world_size)


class _PartLoadedWrapper(DecentOptimWrapper):
    """A wrapper that lets :meth:`DecentralizedAccelerator.load_state` load each rank's own part.

    Accelerate's ``load_state`` hands every rank's optimizer the state rank 0 wrote (``optimizer.bin``);
    while :attr:`loading_part` is set, that state is left alone, and the accelerator loads this rank's
    part afterwards.
    """

    loading_part = False

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.loading_part:
            return
        super().load_state_dict(state_dict)


@document_options
class DecentralizedAccelerator(Accelerator):  # type: ignore[misc]  # Accelerate ships no types
    r"""``accelerate.Accelerator`` with decentralized (gossip) data parallelism: no gradient all-reduce.

    The loop is Accelerate's; what changes:

    * :meth:`prepare` places the model (device, autocast, compilation) but does not wrap it in
      ``DistributedDataParallel``, so no gradient is all-reduced; each optimizer is wrapped in a
      :class:`~decent_optim_wrapper.DecentOptimWrapper` and then in Accelerate's own
      ``AcceleratedOptimizer`` (so its GradScaler, gradient accumulation and step skipping work as
      before). Each real optimizer step (one per ``gradient_accumulation_steps`` batches) runs
      ``x_i <- sum_j W_ij x_j`` (the round launched at the previous step), the optimizer's update with
      this rank's gradient, then launches this step's round. Models are prepared before optimizers,
      whatever the order of the arguments (device placement re-binds the parameters);
    * :meth:`global_avg` / :meth:`revert_global_avg` (or ``with accelerator.averaged():``) put the
      exact global average of the replicas in every rank's model for evaluation, then restore each
      rank's own replica bit for bit;
    * :meth:`get_state_dict` (and so ``save_model`` and the model files of ``save_state``) is the
      global average; ``save_state`` also writes every rank's part (its replicas, optimizer and gossip
      state, scaler) to ``decent_rank{r}-of-{n}.pt``, and ``load_state`` resumes every rank from its
      own part, bit for bit; at another world size, from the exact average of the saved parts.

    A rank whose fp16 gradients overflow skips its local update but still gossips (its peers wait for
    it), so ``optimizer_step_was_skipped`` stays False and LR schedulers step on every rank alike.

    .. warning:: ``prepare`` (of an optimizer), ``global_avg``, ``get_state_dict``, ``save_model`` and
        ``save_state`` are collectives while optimizers are prepared: call them on every rank.

    Keyword Args:
        config: the gossip options as one :class:`~decent_optim_wrapper.GossipConfig`; the keywords below
            build it (or change it, if they agree with it). ``local_world_size`` defaults to
            ``$LOCAL_WORLD_SIZE``, else 1. Paced rounds and ``on_peer_failure="continue"`` are refused
            with the fix: the loop counts the same steps on every rank, and ``accelerate launch`` stops
            the job when a process dies.
        {gossip_options}

    All other arguments go to ``Accelerator``; DeepSpeed, FSDP, Megatron-LM and tensor, context or
    sharded parallelism are refused.
    """

    def __init__(self, *args: Any, config: GossipConfig | None = None, **kwargs: Any) -> None:
        require_version("accelerate", accelerate.__version__, *SUPPORTED)
        for name, what in _REFUSED_ARGUMENTS.items():
            if kwargs.get(name) is not None:
                raise ValueError(
                    f"DecentralizedAccelerator trains whole replicas with gossip and cannot serve {what}: "
                    f"got {name}={kwargs[name]!r}. Pass {name}=None and launch one process per device "
                    "(accelerate launch --multi_gpu, or torchrun), or use accelerate.Accelerator for this "
                    "setup."
                )
        # The gossip options among the keywords (Accelerator has none of these names).
        options = {name: kwargs.pop(name) for name in GossipConfig.keywords() if name in kwargs}
        self._gossip_config = framework_config("Accelerate", config, options)
        self._replicas = Replicas()
        self._gossip_models: list[torch.nn.Module] = []
        super().__init__(*args, **kwargs)
        self._check_supported()

    def _check_supported(self) -> None:
        """Refuse what the launch configuration asks for and gossip of whole replicas cannot do."""
        distributed_type = self.distributed_type
        if distributed_type not in _SUPPORTED_TYPES:
            raise ValueError(
                f"DecentralizedAccelerator trains whole replicas with gossip, but Accelerate's distributed "
                f"type is {distributed_type} (from the launch configuration: accelerate config, or "
                "accelerate launch --use_deepspeed / --use_fsdp / --use_megatron_lm). Launch one process per "
                "device without them (accelerate launch --multi_gpu, or torchrun), or use "
                "accelerate.Accelerator for this setup."
            )
        if self.mixed_precision == "fp8":
            raise ValueError(
                "DecentralizedAccelerator does not support mixed_precision='fp8' (its backends wrap the "
                "optimizer themselves). Pass mixed_precision='bf16' or 'fp16'."
            )

    @property
    def gossip_config(self) -> GossipConfig:
        """The gossip options every optimizer is wrapped with (processes per node from the launch)."""
        return self._gossip_config

    @property
    def replicas(self) -> Replicas:
        """The wrapped optimizers and whether the models hold the global average."""
        return self._replicas

    # -- prepare: no DDP, wrapped optimizers ----------------------------------------------------------
    def prepare(self, *args: Any, device_placement: list[bool] | None = None) -> Any:
        """As ``Accelerator.prepare``, with models prepared before optimizers; the results in order."""
        order = sorted(range(len(args)), key=lambda i: not isinstance(args[i], torch.nn.Module))
        placements = None if device_placement is None else [device_placement[i] for i in order]
        if device_placement is not None and len(device_placement) != len(args):
            placements = device_placement  # Accelerate's own error names the mismatch
            order = list(range(len(args)))
        prepared = super().prepare(*(args[i] for i in order), device_placement=placements)
        if len(args) == 1:
            return prepared
        result: list[Any] = [None] * len(args)
        for position, index in enumerate(order):
            result[index] = prepared[position]
        return tuple(result)

    def prepare_model(
        self, model: torch.nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False
    ) -> torch.nn.Module:
        """Accelerate's preparation of ``model`` (placement, autocast, compilation) without DDP.

        As DDP does, every rank starts from rank 0's parameters and buffers (a broadcast: a collective).
        """
        prepared: torch.nn.Module = super().prepare_model(model, device_placement, evaluation_mode=True)
        if all(prepared is not seen for seen in self._gossip_models):
            if dist.is_initialized() and dist.get_world_size() > 1:
                with torch.no_grad():
                    for tensor in [*prepared.parameters(), *prepared.buffers()]:
                        dist.broadcast(tensor.data, src=0)
            self._gossip_models.append(prepared)
        return prepared

    def prepare_optimizer(self, optimizer: Optimizer, device_placement: bool | None = None) -> Any:
        """``optimizer`` wrapped to gossip, inside Accelerate's ``AcceleratedOptimizer``.

        A collective (the wrapper broadcasts rank 0's parameters). Prepare the model first (or in the
        same ``prepare`` call): device placement re-binds its parameters.
        """
        if isinstance(optimizer, AcceleratedOptimizer):  # prepared already
            return super().prepare_optimizer(optimizer, device_placement)
        if isinstance(optimizer, DecentOptimWrapper):
            raise TypeError(
                "optimizer is already a DecentOptimWrapper; pass the optimizer it wraps to prepare(): "
                "DecentralizedAccelerator wraps it with its own gossip options (config= and keywords)."
            )
        if device_placement is None:
            device_placement = self.device_placement
        if device_placement:  # what AcceleratedOptimizer would do, on the state of the optimizer inside
            optimizer.load_state_dict(move_to_device(optimizer.state_dict(), self.device))
        ensure_process_group(self.num_processes, "launch with accelerate launch or torchrun")
        local = os.environ.get("LOCAL_WORLD_SIZE")
        config = framework_config("Accelerate", self._gossip_config, {}, int(local) if local else 1)
        wrapper = wrap_optimizer(optimizer, config, _PartLoadedWrapper)
        self._replicas.wrappers.append(wrapper)
        return super().prepare_optimizer(wrapper, device_placement=False)

    # -- the global average -----------------------------------------------------------------------------
    def _every_model(self) -> torch.nn.Module:
        """Every prepared model in one module, whose floating buffers are averaged with the parameters."""
        return torch.nn.ModuleList(self._gossip_models)

    def global_avg(self, may_revert: bool = True) -> None:
        """Set every rank's models to the exact global average of the replicas (parameters and floating
        buffers); with ``may_revert``, :meth:`revert_global_avg` restores the replicas bit for bit.
        Without it (the end of training), the average is kept and training would continue from it.

        .. warning:: A collective: call it on every rank.
        """
        if may_revert:
            self._replicas.average(self._every_model())
        else:
            self._replicas.settle(self._every_model())

    def revert_global_avg(self) -> None:
        """Restore each rank's own replicas (and the gossip in flight) bit for bit (local)."""
        if not self._replicas.averaged:
            raise RuntimeError(
                "revert_global_avg() with nothing to revert: call global_avg() (may_revert=True) first."
            )
        self._replicas.restore()

    @contextlib.contextmanager
    def averaged(self) -> Iterator[None]:
        """``with accelerator.averaged():`` evaluate the global average; the replicas come back after.

        .. warning:: A collective: enter it on every rank.
        """
        was_averaged = self._replicas.averaged
        self._replicas.average(self._every_model())
        try:
            yield
        finally:
            if not was_averaged:
                self._replicas.restore()

    # -- checkpoints ---------------------------------------------------------------------------------------
    def get_state_dict(self, model: torch.nn.Module, unwrap: bool = True) -> dict[str, Any]:
        """The state dict of the global average of ``model`` (copied): what ``save_model`` and the model
        files of ``save_state`` hold. A collective while optimizers are prepared."""
        with self.averaged():
            state: dict[str, Any] = super().get_state_dict(model, unwrap)
            # copies: the parameters are views into the gossip buckets, which safetensors would take for
            # tied weights
            return {key: value.clone() if torch.is_tensor(value) else value for key, value in state.items()}

    def save_state(
        self, output_dir: str | None = None, safe_serialization: bool = True, **kwargs: Any
    ) -> Any:
        """Accelerate's ``save_state`` (model files: the global average), and every rank's part beside it:
        its replicas, its optimizers with their gossip state, and its scaler. A collective."""
        averaged = self._replicas.averaged
        self._replicas.restore()  # a rank's part is its replica, not the average
        handle = self.register_save_state_pre_hook(self._save_part)
        try:
            return super().save_state(output_dir, safe_serialization, **kwargs)
        finally:
            handle.remove()
            if averaged:
                self._replicas.average(self._every_model())

    def _save_part(self, models: list[torch.nn.Module], weights: list[Any], output_dir: str) -> None:
        if not self._replicas.training:
            return
        rank, world_size = dist.get_rank(), dist.get_world_size()
        part = {
            "rank": rank,
            "world_size": world_size,
            "models": [{key: value.clone() for key, value in m.state_dict().items()} for m in models],
            "optimizers": [wrapper.state_dict() for wrapper in self._replicas.wrappers],
            "scaler": None if self.scaler is None else self.scaler.state_dict(),
        }
        torch.save(part, os.path.join(output_dir, rank_part_name(rank, world_size)))

    def load_state(
        self, input_dir: str | None = None, load_kwargs: dict[str, Any] | None = None, **kwargs: Any
    ) -> Any:
        """Accelerate's ``load_state`` (schedulers, samplers, RNG states, custom objects), with this rank's
        own part in place of the model and optimizer files: its replicas, optimizers, gossip in flight
        and scaler, so the run continues bit for bit. At another world size every rank starts from the
        exact average of the saved parts
        (:meth:`~decent_optim_wrapper.DecentOptimWrapper.load_state_dicts`)."""
        if not self._replicas.training:
            return super().load_state(input_dir, load_kwargs, **kwargs)
        parts: list[list[dict[str, Any]]] = []
        handle = self.register_load_state_pre_hook(
            lambda models, folder: parts.append(self._load_models(models, folder))
        )
        staged = [w for w in self._replicas.wrappers if isinstance(w, _PartLoadedWrapper)]
        for part_loaded in staged:
            part_loaded.loading_part = True
        try:
            loaded = super().load_state(input_dir, load_kwargs, **kwargs)
        finally:
            handle.remove()
            for part_loaded in staged:
                part_loaded.loading_part = False
        (saved,) = parts
        if len(saved) == 1:
            for wrapper, state in zip(self._replicas.wrappers, saved[0]["optimizers"], strict=True):
                wrapper.load_state_dict(state)
        else:
            for index, wrapper in enumerate(self._replicas.wrappers):
                wrapper.load_state_dicts([part["optimizers"][index] for part in saved])
        if self.scaler is not None and saved[0]["scaler"] is not None:
            self.scaler.load_state_dict(saved[0]["scaler"])
        return loaded

    def _load_models(self, models: list[torch.nn.Module], folder: str) -> list[dict[str, Any]]:
        """Accelerate's load pre-hook: the models from this rank's part (at another world size, the
        average of the saved parts), taken off ``models`` so Accelerate does not load its model files
        (the average) over them. Returns the parts read."""
        rank, world_size = dist.get_rank(), dist.get_world_size()
        device = self.device
        location = "cpu" if device.type == "cpu" else device  # torch cannot restore to "cpu:0"
        own = os.path.join(folder, rank_part_name(rank, world_size))
        if os.path.isfile(own):
            parts = [torch.load(own, map_location=location, weights_only=True)]
        else:
            parts = self._saved_parts(folder, location)
        wrappers = self._replicas.wrappers
        if len(parts[0]["models"]) != len(models) or len(parts[0]["optimizers"]) != len(wrappers):
            raise ValueError(
                f"{folder!r} holds {len(parts[0]['models'])} models and {len(parts[0]['optimizers'])} "
                f"optimizers per rank, but this run prepared {len(models)} and {len(wrappers)}: prepare "
                "the same objects as the run that saved it."
            )
        from decent_optim_wrapper.engine import average_nested

        for index, model in enumerate(models):
            states = [part["models"][index] for part in parts]
            state = states[0] if len(states) == 1 else average_nested(states, "model")
            model.load_state_dict(cast(dict[str, Any], state))
        models.clear()  # loaded: Accelerate's hook contract
        return parts

    @staticmethod
    def _saved_parts(folder: str, location: Any) -> list[dict[str, Any]]:
        """Every saved rank's part, in rank order, of the one world size that saved ``folder``."""
        names = sorted(name for name in os.listdir(folder) if name.startswith("decent_rank"))
        sizes = {name.rsplit("-of-", 1)[-1].removesuffix(".pt") for name in names}
        if len(sizes) != 1:
            raise FileNotFoundError(
                f"{folder!r} holds no complete set of parts saved by DecentralizedAccelerator.save_state "
                f"(found {names or 'none'}): resume from a folder that save_state wrote."
            )
        saved = int(sizes.pop())
        paths = [os.path.join(folder, rank_part_name(r, saved)) for r in range(saved)]
        missing = [p for p in paths if not os.path.isfile(p)]
        if missing:
            raise FileNotFoundError(f"{folder!r} lacks parts {missing} of the {saved} ranks that saved it.")
        return [torch.load(p, map_location=location, weights_only=True) for p in paths]

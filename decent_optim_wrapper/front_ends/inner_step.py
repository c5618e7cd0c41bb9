"""Running an inner optimizer's step the way torch's own machinery expects.

Two ``torch.optim`` protocols a front-end that steps optimizers of its own must honour: GradScaler's
(:func:`scaled_step` hands ``grad_scale``/``found_inf`` to an optimizer that takes the scaling
itself, or unscales and skips here) and the global step hooks (they fire once per training step,
for the front-end, never again for the optimizers it steps inside: :func:`global_step_hooks_suspended`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.optim.optimizer as torch_optimizer
from torch.optim import Optimizer

__all__ = [
    "fire_global_step_post_hooks",
    "fire_global_step_pre_hooks",
    "global_step_hooks_suspended",
    "scaled_step",
    "unscale_grads_",
]


def scaled_step(
    optimizer: Optimizer,
    closure: Callable[[], float] | None,
    grad_scale: torch.Tensor | None,
    found_inf: torch.Tensor | None,
    step: Callable[[torch.Tensor | None], None] | None = None,
) -> float | None:
    """Run ``optimizer``'s step under GradScaler's protocol, without firing global step hooks.

    ``step(scale)``, if given, takes the step in place of ``optimizer.step()`` (never a skipped
    one), once the gradients are final: ``scale`` is the factor they are still multiplied by (a
    fused optimizer unscales inside its step), else None. A ``closure`` is then evaluated first, as
    the optimizer would, and the step runs without it. Returns what the step (or the closure)
    returns, or None when the step was skipped (inf/NaN gradients).
    """
    loss = None
    if step is not None and closure is not None:
        with torch.enable_grad():
            loss = closure()
        closure = None
    if found_inf is not None and getattr(optimizer, "_step_supports_amp_scaling", False):
        inner: Any = optimizer
        # The optimizer would skip a step with inf/NaN itself; a step taken for it must be skipped
        # here, so it needs the decision now (one host read, only with ``step``).
        if step is not None and bool(found_inf.item()):
            return loss
        inner.grad_scale, inner.found_inf = grad_scale, found_inf
        try:
            if step is None:
                return _step(optimizer, closure)
            with global_step_hooks_suspended():
                step(grad_scale)
            return loss
        finally:
            del inner.grad_scale, inner.found_inf
    if found_inf is not None and bool(found_inf.item()):
        return loss
    if grad_scale is not None:
        unscale_grads_(optimizer.param_groups, grad_scale)
    if step is not None:
        with global_step_hooks_suspended():
            step(None)
        return loss
    return _step(optimizer, closure)


def _step(optimizer: Optimizer, closure: Callable[[], float] | None) -> float | None:
    with global_step_hooks_suspended():
        return optimizer.step(closure) if closure is not None else optimizer.step()


@torch.no_grad()
def unscale_grads_(param_groups: list[dict[str, Any]], grad_scale: torch.Tensor) -> None:
    """Divide every gradient by ``grad_scale`` with ``GradScaler.unscale_``'s arithmetic.

    That is: multiply by the fp32 reciprocal of the scale, so results match the bare optimizer's.
    """
    inv_scale = grad_scale.double().reciprocal().float()
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for group in param_groups:
        for param in group["params"]:
            if param.grad is not None:
                by_device.setdefault(param.grad.device, []).append(param.grad)
    for device, grads in by_device.items():
        torch._foreach_mul_(grads, inv_scale.to(device))


def _global_hook_registries() -> tuple[dict[Any, Any], dict[Any, Any]] | None:
    """torch's module-level registries of global optimizer step hooks, or None if torch moved them."""
    registries = tuple(
        getattr(torch_optimizer, name, None)
        for name in ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks")
    )
    if all(isinstance(r, dict) for r in registries):
        return registries  # type: ignore[return-value]
    return None


#: The registries :func:`global_step_hooks_suspended` empties for an inner step; a unit test fails if
#: a torch release moves them (then the hooks would fire for the inner step too).
GLOBAL_HOOK_REGISTRIES = _global_hook_registries()


def fire_global_step_pre_hooks(optimizer: Optimizer) -> None:
    """Fire torch's global optimizer step pre-hooks once, as ``optimizer.step()`` would."""
    if GLOBAL_HOOK_REGISTRIES is not None:
        for hook in list(GLOBAL_HOOK_REGISTRIES[0].values()):
            hook(optimizer, (), {})


def fire_global_step_post_hooks(optimizer: Optimizer) -> None:
    """Fire torch's global optimizer step post-hooks once, as ``optimizer.step()`` would."""
    if GLOBAL_HOOK_REGISTRIES is not None:
        for hook in list(GLOBAL_HOOK_REGISTRIES[1].values()):
            hook(optimizer, (), {})


@contextmanager
def global_step_hooks_suspended() -> Iterator[None]:
    """Keep torch's global optimizer step hooks from firing for an inner optimizer's step.

    ``Optimizer.step`` of every optimizer class fires the hooks registered with
    ``torch.optim.optimizer.register_optimizer_step_pre_hook``/``post_hook``. The front-end fires
    them once per training step, so the optimizers it steps inside must not fire them again, or
    code that counts steps that way (torch's profiler does) over-counts. torch offers no switch for
    this, so the module-level registries are emptied for the duration of the inner step (its
    per-instance hooks and an LR scheduler's step tracking still run) and restored afterwards, with
    any hook registered meanwhile kept. Not thread-safe: another thread stepping another optimizer
    at the same moment would miss them.
    """
    if GLOBAL_HOOK_REGISTRIES is None:
        yield
        return
    saved = [dict(r) for r in GLOBAL_HOOK_REGISTRIES]
    for registry in GLOBAL_HOOK_REGISTRIES:
        registry.clear()
    try:
        yield
    finally:
        for registry, hooks in zip(GLOBAL_HOOK_REGISTRIES, saved, strict=True):
            added = dict(registry)
            registry.clear()
            registry.update(hooks)
            registry.update(added)

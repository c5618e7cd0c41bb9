"""How a front-end runs a wrapped optimizer's step the way torch's own machinery expects.

Two protocols of ``torch.optim`` that a front-end stepping an inner optimizer must honour:

* **GradScaler.** ``scaler.step(opt)`` on an optimizer that sets ``_step_supports_amp_scaling``
  (as both front-ends do) hands over ``grad_scale`` and ``found_inf`` instead of unscaling and
  skipping the step itself. :func:`scaled_step` passes them on to an inner optimizer that takes the
  scaling itself (``fused=True`` Adam/AdamW/SGD: the kernel unscales and skips on inf, no host
  sync), and otherwise unscales here and reads ``found_inf`` once, the sync GradScaler itself makes
  for such optimizers.
* **Global step hooks.** ``register_optimizer_step_pre_hook``/``post_hook`` fire for every
  optimizer's ``step``; a front-end's own step already fires them, so the inner step must not.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.optim.optimizer as torch_optimizer
from torch.optim import Optimizer

__all__ = ["global_step_hooks_suspended", "scaled_step", "unscale_grads_"]


def scaled_step(
    optimizer: Optimizer,
    closure: Callable[[], float] | None,
    grad_scale: torch.Tensor | None,
    found_inf: torch.Tensor | None,
) -> float | None:
    """Run ``optimizer``'s step under GradScaler's protocol, without firing global step hooks.

    Returns what the step returns, or None when it was skipped (inf/NaN gradients).
    """
    if found_inf is not None and getattr(optimizer, "_step_supports_amp_scaling", False):
        inner: Any = optimizer
        inner.grad_scale, inner.found_inf = grad_scale, found_inf
        try:
            return _step(optimizer, closure)
        finally:
            del inner.grad_scale, inner.found_inf
    if found_inf is not None and bool(found_inf.item()):
        return None
    if grad_scale is not None:
        unscale_grads_(optimizer.param_groups, grad_scale)
    return _step(optimizer, closure)


def _step(optimizer: Optimizer, closure: Callable[[], float] | None) -> float | None:
    with global_step_hooks_suspended():
        return optimizer.step(closure) if closure is not None else optimizer.step()


@torch.no_grad()
def unscale_grads_(param_groups: list[dict[str, Any]], grad_scale: torch.Tensor) -> None:
    """Divide every gradient by ``grad_scale`` with GradScaler.unscale_'s arithmetic.

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


@contextmanager
def global_step_hooks_suspended() -> Iterator[None]:
    """Keep torch's global optimizer step hooks from firing for the inner optimizer's step.

    ``Optimizer.step`` of every optimizer class fires the hooks registered with
    ``torch.optim.optimizer.register_optimizer_step_pre_hook``/``post_hook``. They already fire for
    the wrapper's ``step()``, so the inner step must not fire them again, or code that counts steps
    that way double-counts. torch offers no switch for this, so the module-level registries are
    emptied for the duration of the inner step (its per-instance hooks and an LR scheduler's step
    tracking still run) and restored afterwards, with any hook registered meanwhile kept.
    Not thread-safe: another thread stepping another optimizer at the same moment would miss them.
    """
    registries = [
        getattr(torch_optimizer, name, None)
        for name in ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks")
    ]
    if not all(isinstance(r, dict) for r in registries):  # a torch that keeps them elsewhere
        yield
        return
    saved = [dict(r) for r in registries]  # type: ignore[arg-type]
    for registry in registries:
        registry.clear()  # type: ignore[union-attr]
    try:
        yield
    finally:
        for registry, hooks in zip(registries, saved, strict=True):
            added = dict(registry)  # type: ignore[arg-type]
            registry.clear()  # type: ignore[union-attr]
            registry.update(hooks)  # type: ignore[union-attr]
            registry.update(added)  # type: ignore[union-attr]

r"""Adam's second moment of the average gradient, estimated from one rank's own gradients.

Under all-reduce, Adam normalises each coordinate by the second moment of the *average* gradient
of ``n`` ranks, :math:`E[\bar g^2] = \mu^2 + \sigma^2 / n` (true gradient :math:`\mu`, per-rank noise
variance :math:`\sigma^2`). Under gossip each rank's ``exp_avg_sq`` is fed its own gradient, whose
second moment is :math:`\mu^2 + \sigma^2`: where noise dominates a coordinate the normalised step is
up to :math:`\sqrt n` times smaller than all-reduce's, and averaging the replicas does not undo it
(the loss gap grows with ``n``). No bytes are needed to remove that bias. The momentum of the
previous step, :math:`\hat m_{t-1}`, is built from earlier gradients whose noise is independent of
:math:`g_t`'s, so :math:`g_t \hat m_{t-1}` estimates the signal :math:`\mu^2`, and Adam's own
:math:`s_t` estimates :math:`\mu^2 + \sigma^2`. The rule (``second_moment="average"``), per
coordinate, for an Adam-family optimizer with decay rates :math:`\beta_1, \beta_2`:

.. math::
    s_t &= \beta_2 s_{t-1} + (1 - \beta_2)\, g_t^2
        &&\text{(the optimizer's own exp\_avg\_sq, kept as it is)} \\
    c_t &= \beta_2 c_{t-1} + (1 - \beta_2)\, g_t\, \hat m_{t-1}
        &&\text{(exp\_avg\_signal; } \hat m_0 := g_1\text{)} \\
    v_t &= \tfrac{1}{n}\, s_t + \left(1 - \tfrac{1}{n}\right) |c_t|
        &&\text{(what the step divides by, bias-corrected as the optimizer does)}

with :math:`\hat m_k = m_k / (1 - \beta_1^k)`. Where the true gradient changes slowly, :math:`v_t`
is in expectation :math:`\mu^2 + \sigma^2 / n`, all-reduce's. Why :math:`|c_t|` and not
:math:`\max(c_t, 0)`: :math:`c_t` turns negative where the mean gradient alternates in sign from
step to step (a sharp direction at a large learning rate). All-reduce's second moment is large
there, and treating the coordinate as pure noise (:math:`s_t / n`) would take steps up to
:math:`\sqrt n` times larger than all-reduce's exactly where the loss is sharpest; the magnitude
keeps part of that signal. On a coordinate with no signal, :math:`|c_t|` adds a small positive bias
of the order of the estimate's own noise: a slightly smaller step, never a larger one. Step 1 is
the optimizer's own (:math:`c_1 = s_1`). ``n`` is the
number of ranks whose replicas are averaged (the gossip world size; after a lost peer, the
survivors'). At ``n = 1`` nothing changes.

The library takes the step of torch's Adam and AdamW (and their subclasses that keep Adam's
``step``) itself, with this denominator, in :mod:`~decent_optim_wrapper.engine.rules.adam_step`: the
optimizer's ``step``, ``exp_avg`` and ``exp_avg_sq`` are torch's own, bit for bit, for every
combination torch supports (single-tensor, foreach, fused, capturable, differentiable; amsgrad,
maximize, L2 weight decay, complex parameters, GradScaler), and :math:`v_t` is a sum of
non-negative terms. The optimizer's per-instance step hooks fire around it as around its own
step. Costs: one tensor of state per parameter (``exp_avg_signal``, saved and averaged with the
optimizer's state), no bytes on the wire; on a CPU the step is about as fast as torch's own
(chunked so that its passes stay in cache). A subclass that overrides ``step`` is stepped as it
is (its statistics this rank's own, named once in the log), as are other optimizers (SGD,
Adagrad, Lion, ...).

An optimizer whose moments do not move every step cannot be corrected from outside its step: the
library's AccumAdam and AccumAdamW take the rule themselves, counted in rounds, through the
param-group option ``second_moment_ranks``. The rule sets it before every step (``n`` with
``"average"``, 1 otherwise, so a shrinking world or ``"local"`` reverts it), and any optimizer whose
``defaults`` carry that key is treated the same way.
"""

from __future__ import annotations

import inspect

import torch
from loguru import logger
from torch.optim import Optimizer

from decent_optim_wrapper.engine.rules.adam_step import SIGNAL, adam_step_with_rule

__all__ = ["RANKS_OPTION", "SECOND_MOMENTS", "SIGNAL", "SecondMomentRule", "check_second_moment", "corrects"]

#: ``"average"``: Adam's second moment estimates the average gradient's (the rule above);
#: ``"local"``: each rank's own gradients, as torch's optimizer computes it alone (decent-dp and
#: decent-optim-wrapper 0.1.1).
SECOND_MOMENTS = ("average", "local")

_named: set[tuple[str, str]] = set()  # optimizer classes the rule skipped (and why), named once


def check_second_moment(second_moment: object) -> str:
    """Return ``second_moment`` if it names a rule, else raise a ``ValueError`` naming the choices."""
    if not isinstance(second_moment, str) or second_moment not in SECOND_MOMENTS:
        raise ValueError(
            f"second_moment must be one of {', '.join(repr(s) for s in SECOND_MOMENTS)}, got "
            f"{second_moment!r}: 'average' (default) gives Adam the second moment of the average gradient, "
            "'local' this rank's own (the behaviour of decent-dp and decent-optim-wrapper 0.1.1)."
        )
    return second_moment


#: The param-group option of optimizers that apply the rule inside their own step (AccumAdam(W)):
#: the number of ranks ``n`` whose average gradient the second moment should follow.
RANKS_OPTION = "second_moment_ranks"


def corrects(optimizer: Optimizer) -> bool:
    """Whether the rule applies to ``optimizer``: torch's Adam or AdamW, or a subclass of either, or
    an optimizer that takes ``n`` itself (``second_moment_ranks`` in its defaults)."""
    return isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW) or _takes_ranks(optimizer)


def _takes_ranks(optimizer: Optimizer) -> bool:
    return RANKS_OPTION in optimizer.defaults


class SecondMomentRule:
    """Takes an Adam-family optimizer's step with the rule's denominator, as the module docstring says.

    Args:
        second_moment: ``"average"`` or ``"local"`` (then :meth:`applies` only to optimizers that
            take the count themselves, which it sets to 1).
    """

    def __init__(self, second_moment: str) -> None:
        self.second_moment = check_second_moment(second_moment)

    def applies(self, optimizer: Optimizer, world_size: int) -> bool:
        """Whether :meth:`step` differs from ``optimizer.step()`` at this world size.

        An optimizer outside the Adam family, or an Adam subclass with a ``step`` of its own, is
        named once in the log (per class). One that takes ``second_moment_ranks`` always applies:
        its count must be set (to 1 where the rule is off).
        """
        if _takes_ranks(optimizer):
            return True
        if self.second_moment != "average" or world_size <= 1:
            return False
        why = _why_not(optimizer)
        if why is None:
            return True
        name = type(optimizer).__name__
        if (name, why) not in _named:
            _named.add((name, why))
            logger.info(
                f"second_moment='average' applies to torch's Adam and AdamW (and subclasses that keep their "
                f"step); {name} ({why}) steps as it is, its statistics from this rank's gradients."
            )
        return False

    @torch.no_grad()
    def step(self, optimizer: Optimizer, world_size: int, grad_scale: torch.Tensor | None = None) -> None:
        """Take ``optimizer``'s step with the rule (where :meth:`applies`), in place of ``optimizer.step()``.

        Call it once the gradients are final; ``grad_scale``: they are still multiplied by it (a
        fused optimizer unscales inside its step). The optimizer's per-instance step hooks fire
        around it. Local: no collectives.
        """
        if _takes_ranks(optimizer):  # it applies the rule in its own step
            ranks = world_size if self.second_moment == "average" else 1
            for group in optimizer.param_groups:
                group[RANKS_OPTION] = ranks
            if grad_scale is not None:
                raise RuntimeError(f"{type(optimizer).__name__} does not unscale gradients in its step.")
            optimizer.step()
            return
        if not self.applies(optimizer, world_size):
            optimizer.step()
            return

        def rule_step(opt: Optimizer) -> None:
            adam_step_with_rule(opt, world_size, grad_scale)

        # torch's own wrapper of a step: the profiler's record and the per-instance step hooks.
        Optimizer.profile_hook_step(rule_step)(optimizer)
        # An LR scheduler built on this optimizer wraps its ``step`` to record the call (torch has no
        # public hook for it) and warns at its own step if none was made: this step is that call.
        if hasattr(optimizer.step, "_wrapped_by_lr_sched"):
            setattr(optimizer, "_opt_called", True)  # noqa: B010


def _why_not(optimizer: Optimizer) -> str | None:
    """Why the library cannot take ``optimizer``'s step with the rule, or None where it can."""
    if not corrects(optimizer):
        return "not torch's Adam or AdamW"
    if not _steps_as_adam(optimizer):
        return "a step() of its own"
    patched = vars(optimizer).get("step")  # an LR scheduler's wrapper only records the call
    if patched is not None and not hasattr(patched, "_wrapped_by_lr_sched"):
        return "a step() patched onto the instance"
    for group in optimizer.param_groups:
        hyper = [group["lr"], *group["betas"], group["weight_decay"]]
        if group.get("differentiable") and any(
            isinstance(h, torch.Tensor) and h.requires_grad for h in hyper
        ):
            return "hyperparameters that take gradients through the step"
    return None


def _steps_as_adam(optimizer: Optimizer) -> bool:
    """Whether ``optimizer``'s class runs torch's ``Adam.step`` (or AdamW's), not a step of its own."""
    own = inspect.unwrap(type(optimizer).step)  # torch wraps steps in hooks and grad-mode decorators
    return any(own is inspect.unwrap(cls.step) for cls in (torch.optim.Adam, torch.optim.AdamW))

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

The optimizer takes its own step: just before it, its ``exp_avg_sq`` entry is replaced by a tensor
holding the value from which its update :math:`v \leftarrow \beta_2 v + (1 - \beta_2) g^2` lands on
:math:`v_t`, and just after it, its own tensor, advanced to :math:`s_t` with the optimizer's own
operations, is put back. So torch's Adam and AdamW (single-tensor, foreach or fused; amsgrad,
maximize, L2 weight decay, complex parameters) and their subclasses run unchanged, and their
``exp_avg_sq`` is their own, bit for bit. The algebra rounds once more than a direct computation of
:math:`v_t` (a few ulp of :math:`(1-\beta_2) g_t^2 / v_t`). Costs: one tensor of state per parameter
(``exp_avg_signal``, saved and averaged with the optimizer's state), one transient tensor per
parameter during the step (two with a GradScaler's scale or L2 decay), about eight elementwise passes
(foreach kernels, one launch per group, device and dtype), no bytes on the wire. Other optimizers
(SGD, Adagrad, Lion, ...) are stepped as they are; each such class is named once in the log.

An optimizer whose moments do not move every step cannot be corrected from outside its step: the
library's AccumAdam and AccumAdamW take the rule themselves, counted in rounds, through the
param-group option ``second_moment_ranks``. The rule sets it before every step (``n`` with
``"average"``, 1 otherwise, so a shrinking world or ``"local"`` reverts it), and any optimizer whose
``defaults`` carry that key is treated the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from loguru import logger
from torch.optim import Optimizer

__all__ = ["RANKS_OPTION", "SECOND_MOMENTS", "SIGNAL", "SecondMomentRule", "check_second_moment", "corrects"]

#: ``"average"``: Adam's second moment estimates the average gradient's (the rule above);
#: ``"local"``: each rank's own gradients, as torch's optimizer computes it alone (decent-dp and
#: decent-optim-wrapper 0.1.1).
SECOND_MOMENTS = ("average", "local")

_named: set[str] = set()  # optimizer classes the rule skipped, named once


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
    """Sets an Adam-family optimizer's ``exp_avg_sq`` before its step, as the module docstring says.

    Args:
        second_moment: ``"average"`` or ``"local"`` (then :meth:`prepare` does nothing).
    """

    def __init__(self, second_moment: str) -> None:
        self.second_moment = check_second_moment(second_moment)

    def applies(self, optimizer: Optimizer, world_size: int) -> bool:
        """Whether :meth:`prepare` would change ``optimizer``'s state at this world size.

        An optimizer outside the Adam family is named once in the log (per class). One that takes
        ``second_moment_ranks`` always applies: its count must be set (to 1 where the rule is off).
        """
        if _takes_ranks(optimizer):
            return True
        if self.second_moment != "average" or world_size <= 1:
            return False
        if corrects(optimizer):
            return True
        name = type(optimizer).__name__
        if name not in _named:
            _named.add(name)
            logger.info(
                f"second_moment='average' applies to torch's Adam and AdamW (and their subclasses); {name} "
                "steps as it is, its statistics from this rank's gradients."
            )
        return False

    @torch.no_grad()
    def prepare(
        self, optimizer: Optimizer, world_size: int, grad_scale: torch.Tensor | None = None
    ) -> Callable[[], None]:
        """Set ``optimizer``'s second moments so that its next step divides by the rule's :math:`v_t`.

        Call it right before the step, once the gradients are final; ``grad_scale``: the gradients
        are still multiplied by it (a fused optimizer unscales inside its step). Returns what to call
        right after the step: it writes the optimizer's own :math:`s_t` back and starts the signal
        of parameters that took their first step.
        """
        if not self.applies(optimizer, world_size):
            return _nothing
        if _takes_ranks(optimizer):  # it applies the rule in its own step
            ranks = world_size if self.second_moment == "average" else 1
            for group in optimizer.param_groups:
                group[RANKS_OPTION] = ranks
            return _nothing
        inv_scale = None if grad_scale is None else grad_scale.double().reciprocal().float()
        finishes = [_prepare_group(optimizer, g, world_size, inv_scale) for g in optimizer.param_groups]

        def finish() -> None:
            for finish_group in finishes:
                finish_group()

        return finish


def _nothing() -> None:
    return None


#: The optimizer-state key of the signal estimate :math:`c_t`.
SIGNAL = "exp_avg_signal"


def _real(t: torch.Tensor) -> torch.Tensor:
    return torch.view_as_real(t) if torch.is_complex(t) else t


class _Batch:
    """The started parameters of one param group on one device and dtype, as foreach lists."""

    def __init__(self) -> None:
        self.states: list[dict[str, Any]] = []
        self.grads: list[torch.Tensor] = []  # the gradient the moments see (unscaled, with L2)
        self.exp_avgs: list[torch.Tensor] = []
        self.exp_avg_sqs: list[torch.Tensor] = []  # s_{t-1}, set aside during the step
        self.signals: list[torch.Tensor] = []
        self.cross: list[float] = []  # (1 - b2) / (1 - b1^(t-1)), negated with maximize


def _prepare_group(
    optimizer: Optimizer, group: dict[str, Any], n: int, inv_scale: torch.Tensor | None
) -> Callable[[], None]:
    params = [p for p in group["params"] if p.grad is not None and not p.grad.is_sparse]
    if not params:
        return _nothing
    beta1, beta2 = (float(b) for b in group["betas"])
    # L2 weight decay (Adam's, not AdamW's decoupled one) is added to the gradient the moments see;
    # maximize negates it, which only flips the sign of g m.
    decoupled = isinstance(optimizer, torch.optim.AdamW) or bool(group.get("decoupled_weight_decay", False))
    l2 = 0.0 if decoupled else float(group.get("weight_decay", 0.0))
    sign = -1.0 if group.get("maximize", False) else 1.0
    started = [p for p in params if SIGNAL in optimizer.state.get(p, {})]
    fresh = [p for p in params if SIGNAL not in optimizer.state.get(p, {})]
    # One read of the step counters per group (they may live on the device: fused, capturable).
    done = (
        torch.stack(
            [torch.as_tensor(optimizer.state[p]["step"]).detach().cpu().double() for p in started]
        ).tolist()
        if started
        else []
    )
    batches: dict[tuple[torch.device, torch.dtype], _Batch] = {}
    for param, steps_done in zip(started, done, strict=True):
        state = optimizer.state[param]
        batch = batches.setdefault((param.device, state["exp_avg_sq"].dtype), _Batch())
        assert param.grad is not None
        batch.states.append(state)
        batch.grads.append(_real(param.grad))
        batch.exp_avgs.append(_real(state["exp_avg"]))
        batch.exp_avg_sqs.append(state["exp_avg_sq"])
        batch.signals.append(_real(state[SIGNAL]))
        batch.cross.append(sign * (1 - beta2) / (1 - beta1**steps_done))
        if l2 != 0.0 or inv_scale is not None:  # a gradient of its own, kept for finish()
            grad = (
                batch.grads[-1].mul(inv_scale.to(param.device)) if inv_scale is not None else batch.grads[-1]
            )
            batch.grads[-1] = grad.add(_real(param), alpha=l2) if l2 != 0.0 else grad
    for batch in batches.values():
        squares = [_real(s) for s in batch.exp_avg_sqs]
        # c_t = b2 c_{t-1} + (1 - b2) g_t m_hat_{t-1}
        torch._foreach_mul_(batch.signals, beta2)
        torch._foreach_addcmul_(batch.signals, batch.grads, batch.exp_avgs, batch.cross)
        # The optimizer computes b2 v + (1 - b2) g^2 from the v it finds; for it to land on
        # v_t = s_t / n + (1 - 1/n) |c_t|, with s_t = b2 s + (1 - b2) g^2, it must find
        # v = s / n + (1 - 1/n) / b2 (|c_t| - (1 - b2) g^2): a tensor of its own, in s's place.
        pre_step = torch._foreach_abs(batch.signals)
        torch._foreach_addcmul_(pre_step, batch.grads, batch.grads, -(1 - beta2))
        torch._foreach_mul_(pre_step, (1 - 1 / n) / beta2)
        torch._foreach_add_(pre_step, squares, alpha=1 / n)
        for state, square, value in zip(batch.states, batch.exp_avg_sqs, pre_step, strict=True):
            state["exp_avg_sq"] = torch.view_as_complex(value) if torch.is_complex(square) else value

    def finish() -> None:
        # s_t with the optimizer's own operations, back in its own tensor.
        for batch in batches.values():
            squares = [_real(s) for s in batch.exp_avg_sqs]
            torch._foreach_mul_(squares, beta2)
            torch._foreach_addcmul_(squares, batch.grads, batch.grads, 1 - beta2)
            for state, square in zip(batch.states, batch.exp_avg_sqs, strict=True):
                state["exp_avg_sq"] = square
        # A parameter's first step: c_1 = (1 - beta2) g_1^2 = s_1 (m_hat_0 := g_1).
        for param in fresh:
            state = optimizer.state.get(param, {})
            if "exp_avg_sq" in state:
                state[SIGNAL] = state["exp_avg_sq"].clone()

    return finish

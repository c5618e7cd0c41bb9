r"""Adam and AdamW whose moments move once per ``accum_iter`` steps, from the round's mean gradient.

In decentralized training every step is a local step on a small per-rank batch; AccumAdam(W) keeps
the parameter update of every step but estimates the moments from ``accum_iter`` gradients at a
time, as a large-batch optimizer would (the algorithm of decent-dp, Wang et al., "From
Promise to Practice: Realizing High-performance Decentralized Training", ICLR 2025).
``accum_iter=1`` is exactly Adam (AccumAdam) and AdamW (AccumAdamW).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from numbers import Real
from typing import Any, ClassVar, overload

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.optim.optimizer import ParamsT, _default_to_fused_or_foreach

from decent_optim_wrapper.checks import is_int

__all__ = ["AccumAdam", "AccumAdamW"]


def _is_real(value: object) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool)


def _check_hyperparameters(group: dict[str, Any], where: str) -> None:
    """Raise a ``TypeError``/``ValueError`` naming the first bad hyperparameter of ``group``."""
    for name in ("lr", "eps", "weight_decay"):
        if name not in group:
            continue
        value = group[name]
        if not _is_real(value):
            raise TypeError(
                f"{where}{name} must be a Python float, got {value!r} ({type(value).__name__}); "
                f"pass a number, e.g. {name}=float({name})."
            )
        # `not value >= 0` also rejects NaN, which compares false with everything
        if not value >= 0:
            raise ValueError(f"{where}{name} must be >= 0, got {value!r}; pass a non-negative {name}.")
    if "betas" in group:
        betas = group["betas"]
        if not isinstance(betas, Sequence) or len(betas) != 2:
            raise TypeError(
                f"{where}betas must be a pair (beta1, beta2), got {betas!r}; e.g. betas=(0.9, 0.999)."
            )
        for index, beta in enumerate(betas):
            if not _is_real(beta):
                raise TypeError(
                    f"{where}betas[{index}] must be a Python float, got {beta!r} ({type(beta).__name__}); "
                    "pass numbers, e.g. betas=(0.9, 0.999)."
                )
            if not 0 <= beta < 1:
                raise ValueError(
                    f"{where}betas[{index}] must be in [0, 1), got {beta!r}; "
                    "pass moment decay rates below 1, e.g. betas=(0.9, 0.999)."
                )
    if "accum_iter" in group:
        accum_iter = group["accum_iter"]
        if not is_int(accum_iter):
            raise TypeError(
                f"{where}accum_iter must be an int, got {accum_iter!r} ({type(accum_iter).__name__}); "
                "pass the number of steps per moment update, e.g. accum_iter=4."
            )
        if accum_iter < 1:
            raise ValueError(
                f"{where}accum_iter must be >= 1, got {accum_iter}; "
                "pass accum_iter=1 for plain Adam, or more steps per moment update."
            )
    if "second_moment_ranks" in group:
        ranks = group["second_moment_ranks"]
        if not is_int(ranks):
            raise TypeError(
                f"{where}second_moment_ranks must be an int, got {ranks!r} ({type(ranks).__name__}); "
                "pass the number of replicas whose average the update should follow, e.g. 4, or 1 for "
                "this rank's own statistics."
            )
        if ranks < 1:
            raise ValueError(
                f"{where}second_moment_ranks must be >= 1, got {ranks}; pass 1 for this rank's own "
                "statistics, or the number of replicas averaged."
            )
    if "foreach" in group and group["foreach"] not in (None, True, False):
        raise TypeError(f"{where}foreach must be True, False or None, got {group['foreach']!r}.")


@dataclass
class _Bucket:
    """Tensors that take one update together: same device, dtype and step count."""

    params: list[Tensor] = field(default_factory=list)
    grads: list[Tensor] = field(default_factory=list)
    exp_avgs: list[Tensor] = field(default_factory=list)
    exp_avg_sqs: list[Tensor] = field(default_factory=list)
    accum_grads: list[Tensor] = field(default_factory=list)
    states: list[dict[str, Any]] = field(default_factory=list)  # for the signal, with ranks > 1


#: The state key of the signal estimate :math:`c` of ``second_moment_ranks > 1``; the engine's rule
#: for torch's Adam (:mod:`~decent_optim_wrapper.engine.rules.adam_step`) keeps its estimate under it too.
SIGNAL = "exp_avg_signal"


@dataclass(frozen=True)
class _AccumHyper:
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    accum_iter: int
    decoupled: bool
    ranks: int = 1  # second_moment_ranks: n


# The op sequences below repeat torch.optim.adam's `_multi_tensor_adam` and `_single_tensor_adam`
# (non-capturable, non-amsgrad, non-maximize) op for op, down to the overload (a list of scalars
# where torch passes a list), so the same kernels round the same way: that is what makes
# accum_iter=1 bitwise equal to torch.optim.Adam/AdamW (tests/test_accum_adam.py checks it on CPU,
# and on CUDA where there is a GPU).


def _bias_corrections(hyper: _AccumHyper, step: int) -> tuple[float, float]:
    """``(-lr / (1 - beta1^k), sqrt(1 - beta2^k))`` for round ``k = ceil(step / accum_iter)``.

    Computed in Python floats as torch does (it raises ``beta`` to the step read back as a float).
    """
    rounds = float(-(-step // hyper.accum_iter))
    bias_correction1 = 1 - hyper.beta1**rounds
    bias_correction2 = 1 - hyper.beta2**rounds
    step_size = (hyper.lr / bias_correction1) * -1
    return step_size, bias_correction2**0.5


def _multi_tensor_update(bucket: _Bucket, step: int, hyper: _AccumHyper) -> None:
    params, grads, exp_avgs, exp_avg_sqs = bucket.params, bucket.grads, bucket.exp_avgs, bucket.exp_avg_sqs
    beta1, beta2 = hyper.beta1, hyper.beta2
    if hyper.weight_decay != 0:
        if hyper.decoupled:
            torch._foreach_mul_(params, 1 - hyper.lr * hyper.weight_decay)
        else:
            # A new list: the L2 term must not leak into the user's p.grad
            grads = list(torch._foreach_add(grads, params, alpha=hyper.weight_decay))
    step_size, bias_correction2_sqrt = _bias_corrections(hyper, step)
    n = len(params)

    if hyper.accum_iter == 1:
        # Every step closes a round whose mean gradient is this one: the moments move in place.
        torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
        denom = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(denom, [bias_correction2_sqrt] * n)
        torch._foreach_add_(denom, hyper.eps)
        torch._foreach_addcdiv_(params, exp_avgs, denom, [step_size] * n)
        return

    # alpha=1/accum_iter rounds once more than dividing each gradient would (exact for powers of
    # two), and keeps accum_grad in decent-dp's convention: the running mean, not the sum.
    torch._foreach_add_(bucket.accum_grads, grads, alpha=1.0 / hyper.accum_iter)
    exp_avgs_now = torch._foreach_lerp(exp_avgs, grads, 1 - beta1)
    denom = torch._foreach_mul(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(denom, grads, grads, 1 - beta2)
    del grads
    torch._foreach_sqrt_(denom)
    torch._foreach_div_(denom, [bias_correction2_sqrt] * n)
    torch._foreach_add_(denom, hyper.eps)
    torch._foreach_addcdiv_(params, exp_avgs_now, denom, [step_size] * n)
    del exp_avgs_now, denom

    if step % hyper.accum_iter == 0:
        mean_grads = bucket.accum_grads
        torch._foreach_lerp_(exp_avgs, mean_grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, mean_grads, mean_grads, 1 - beta2)
        torch._foreach_zero_(mean_grads)


def _as_real(t: Tensor) -> Tensor:
    return torch.view_as_real(t) if torch.is_complex(t) else t


def _store_signal(state: dict[str, Any], real: Tensor) -> None:
    """Keep ``real`` (a parameter's (re, im) pairs where it is complex) shaped like the parameter."""
    state[SIGNAL] = torch.view_as_complex(real) if torch.is_complex(state["exp_avg"]) else real


def _average_rule_update(bucket: _Bucket, step: int, hyper: _AccumHyper) -> None:
    """The update with ``n = second_moment_ranks > 1``: the step divides by an estimate of the second
    moment of the average of ``n`` replicas' gradients (see :class:`AccumAdamW`). Foreach kernels
    whatever ``foreach`` says: there is no torch op sequence to match here."""
    params, grads, exp_avgs, exp_avg_sqs = bucket.params, bucket.grads, bucket.exp_avgs, bucket.exp_avg_sqs
    beta1, beta2, n = hyper.beta1, hyper.beta2, hyper.ranks
    if hyper.weight_decay != 0:
        if hyper.decoupled:
            torch._foreach_mul_(params, 1 - hyper.lr * hyper.weight_decay)
        else:
            grads = list(torch._foreach_add(grads, params, alpha=hyper.weight_decay))
    step_size, bias_correction2_sqrt = _bias_corrections(hyper, step)
    done = (step - 1) // hyper.accum_iter  # rounds completed before this step's
    round_ends = step % hyper.accum_iter == 0
    if hyper.accum_iter > 1:
        torch._foreach_add_(bucket.accum_grads, grads, alpha=1.0 / hyper.accum_iter)
    exp_avgs_now = torch._foreach_lerp(exp_avgs, grads, 1 - beta1)
    squares_now = torch._foreach_mul(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(squares_now, grads, grads, 1 - beta2)
    signals: list[Tensor] = []
    if done >= 1:  # a previous round's momentum exists: the estimate's partner
        for state, square in zip(bucket.states, exp_avg_sqs, strict=True):
            if SIGNAL not in state:  # the rule switched on mid-run: start from this rank's own v
                _store_signal(state, square.clone())
            signals.append(_as_real(state[SIGNAL]))
        # c~ = b2 c + (1 - b2) g m_hat, with m_hat the momentum of the completed rounds
        cross = (1 - beta2) / (1 - beta1**done)
        signals_now = torch._foreach_mul(signals, beta2)
        torch._foreach_addcmul_(signals_now, grads, exp_avgs, cross)
        # v~ = s~ / n + (1 - 1/n) |c~|
        denom = list(torch._foreach_abs(signals_now))
        torch._foreach_mul_(denom, 1 - 1 / n)
        torch._foreach_add_(denom, squares_now, alpha=1 / n)
    else:  # the first round: the optimizer's own v~ (c starts as v at its end)
        denom = list(squares_now)
    torch._foreach_sqrt_(denom)
    torch._foreach_div_(denom, [bias_correction2_sqrt] * len(params))
    torch._foreach_add_(denom, hyper.eps)
    torch._foreach_addcdiv_(params, exp_avgs_now, denom, [step_size] * len(params))
    del denom
    if not round_ends:
        return
    mean_grads = grads if hyper.accum_iter == 1 else bucket.accum_grads
    # c <- b2 c + (1 - b2) a m_hat, before m moves; with accum_iter=1 the round's mean is this step's
    # gradient, so c~ and m~ are already the new values
    if done >= 1 and hyper.accum_iter == 1:
        torch._foreach_copy_(signals, signals_now)
    elif done >= 1:
        torch._foreach_mul_(signals, beta2)
        torch._foreach_addcmul_(signals, mean_grads, exp_avgs, cross)
    if hyper.accum_iter == 1:
        torch._foreach_copy_(exp_avgs, exp_avgs_now)
    else:
        torch._foreach_lerp_(exp_avgs, mean_grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, mean_grads, mean_grads, 1 - beta2)
    if done == 0:  # c_1 = v_1
        for state, square in zip(bucket.states, exp_avg_sqs, strict=True):
            _store_signal(state, square.clone())
    if hyper.accum_iter > 1:
        torch._foreach_zero_(bucket.accum_grads)


def _single_tensor_update(bucket: _Bucket, step: int, hyper: _AccumHyper) -> None:
    beta1, beta2 = hyper.beta1, hyper.beta2
    step_size, bias_correction2_sqrt = _bias_corrections(hyper, step)
    round_ends = step % hyper.accum_iter == 0
    for param, grad, exp_avg, exp_avg_sq, accum_grad in zip(
        bucket.params, bucket.grads, bucket.exp_avgs, bucket.exp_avg_sqs, bucket.accum_grads, strict=True
    ):
        if hyper.weight_decay != 0:
            if hyper.decoupled:
                param.mul_(1 - hyper.lr * hyper.weight_decay)
            else:
                grad = grad.add(param, alpha=hyper.weight_decay)  # a new tensor: p.grad stays as it was
        if hyper.accum_iter == 1:
            exp_avg.lerp_(grad, 1 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(hyper.eps)
            param.addcdiv_(exp_avg, denom, value=step_size)
            continue
        accum_grad.add_(grad, alpha=1.0 / hyper.accum_iter)
        exp_avg_now = exp_avg.lerp(grad, 1 - beta1)
        exp_avg_sq_now = exp_avg_sq.mul(beta2).addcmul_(grad, grad, value=1 - beta2)
        denom = (exp_avg_sq_now.sqrt() / bias_correction2_sqrt).add_(hyper.eps)
        param.addcdiv_(exp_avg_now, denom, value=step_size)
        if round_ends:
            exp_avg.lerp_(accum_grad, 1 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(accum_grad, accum_grad, value=1 - beta2)
            accum_grad.zero_()


class _AccumAdamBase(Optimizer):
    """The shared machinery; subclasses choose L2 (Adam) or decoupled (AdamW) weight decay."""

    _decoupled: ClassVar[bool]

    def __init__(
        self,
        params: ParamsT,
        lr: float,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
        accum_iter: int,
        *,
        foreach: bool | None,
        second_moment_ranks: int,
    ) -> None:
        defaults: dict[str, Any] = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "accum_iter": accum_iter,
            "foreach": foreach,
            "second_moment_ranks": second_moment_ranks,
        }
        _check_hyperparameters(defaults, where="")
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group, rejecting bad hyperparameters it sets (the defaults were checked)."""
        if isinstance(param_group, dict):
            _check_hyperparameters(param_group, where=f"param group {len(self.param_groups)}: ")
        super().add_param_group(param_group)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("foreach", None)
            group.setdefault("second_moment_ranks", 1)  # state dicts from before the option
            for param in group["params"]:
                param_state = self.state.get(param, {})
                # a checkpoint may hold the step as a number; keep it a CPU tensor like a fresh state
                if param_state and not torch.is_tensor(param_state["step"]):
                    param_state["step"] = torch.tensor(int(param_state["step"]), dtype=torch.int64)

    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Perform one optimization step.

        Args:
            closure: Re-evaluates the model and returns the loss; run with gradients enabled.

        Returns:
            The closure's loss, or ``None`` without a closure.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with torch.no_grad():
            for group in self.param_groups:
                self._step_group(group)
        return loss

    def _step_group(self, group: dict[str, Any]) -> None:
        # Parameters that missed a step (no gradient) are at another step count, hence in another
        # round; bucketing by step count keeps each foreach call to one bias correction and one
        # round boundary. Steps live on the CPU, so reading them costs no device sync.
        buckets: dict[tuple[torch.device, torch.dtype, int], _Bucket] = {}
        steps: list[Tensor] = []
        params_with_grad: list[Tensor] = []
        for param in group["params"]:
            grad = param.grad
            if grad is None:
                continue
            if grad.is_sparse:
                raise RuntimeError(
                    f"{type(self).__name__} does not support sparse gradients (parameter of shape "
                    f"{tuple(param.shape)}); use torch.optim.SparseAdam for sparse embeddings."
                )
            state = self.state[param]
            if not state:
                state["step"] = torch.tensor(0, dtype=torch.int64)
                state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                state["accum_grad"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            tensors = [param, grad, state["exp_avg"], state["exp_avg_sq"], state["accum_grad"]]
            if torch.is_complex(param):
                # complex numbers as (re, im) pairs, as torch's Adam treats them
                tensors = [torch.view_as_real(t) for t in tensors]
            step = int(state["step"]) + 1
            key = (tensors[0].device, tensors[0].dtype, step)
            bucket = buckets.setdefault(key, _Bucket())
            for values, tensor in zip(
                (bucket.params, bucket.grads, bucket.exp_avgs, bucket.exp_avg_sqs, bucket.accum_grads),
                tensors,
                strict=True,
            ):
                values.append(tensor)
            bucket.states.append(state)
            steps.append(state["step"])
            params_with_grad.append(param)
        if not steps:
            return
        torch._foreach_add_(steps, 1)

        foreach = group["foreach"]
        if foreach is None:  # torch's own rule, so the default is the path torch.optim.Adam takes
            _, foreach = _default_to_fused_or_foreach(params_with_grad, differentiable=False, use_fused=False)
        beta1, beta2 = group["betas"]
        hyper = _AccumHyper(
            lr=group["lr"],
            beta1=beta1,
            beta2=beta2,
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            accum_iter=group["accum_iter"],
            decoupled=self._decoupled,
            ranks=group["second_moment_ranks"],
        )
        if hyper.ranks > 1:
            update = _average_rule_update
        else:
            update = _multi_tensor_update if foreach else _single_tensor_update
        for (_, _, step), bucket in buckets.items():
            update(bucket, step, hyper)


class AccumAdamW(_AccumAdamBase):
    r"""AdamW (decoupled weight decay) whose moments move once per ``accum_iter`` steps.

    At step :math:`t = 1, 2, \dots` of a parameter :math:`p` with gradient :math:`g`, learning rate
    :math:`\gamma`, weight decay :math:`\lambda` and :math:`N` = ``accum_iter``:

    .. math::
        p &\leftarrow p\,(1 - \gamma\lambda) \\
        a &\leftarrow a + g / N \\
        \tilde m &= m + (1 - \beta_1)(g - m), \qquad \tilde v = \beta_2 v + (1 - \beta_2)\, g^2 \\
        k &= \lceil t / N \rceil \\
        p &\leftarrow p - \frac{\gamma}{1 - \beta_1^k} \cdot
            \frac{\tilde m}{\sqrt{\tilde v} / \sqrt{1 - \beta_2^k} + \epsilon} \\
        \text{if } t \bmod N = 0: \quad
            m &\leftarrow m + (1 - \beta_1)(a - m), \quad v \leftarrow \beta_2 v + (1 - \beta_2)\, a^2,
            \quad a \leftarrow 0

    starting from :math:`m = v = a = 0`. Every step moves the parameters, with moments
    :math:`\tilde m, \tilde v` that add the current gradient to those of the last completed round;
    the moments themselves move once per round, from the round's mean gradient :math:`a`, and the
    bias correction counts rounds (:math:`k`), not steps. This is the accumulation of decent-dp
    (Wang et al., "From Promise to Practice: Realizing High-performance Decentralized Training",
    ICLR 2025): moments estimated from ``accum_iter`` small local batches at a time. With
    ``accum_iter=1`` it is ``torch.optim.AdamW`` bit for bit (same op sequence as torch's).

    Args:
        params: Parameters or param groups, as for any ``torch.optim.Optimizer``.
        lr: Learning rate :math:`\gamma`, ``>= 0``.
        betas: :math:`(\beta_1, \beta_2)`, each in ``[0, 1)``.
        eps: :math:`\epsilon`, added to the denominator, ``>= 0``.
        weight_decay: :math:`\lambda`, ``>= 0``, decoupled from the gradient.
        accum_iter: :math:`N`, steps per moment update, ``>= 1``; decent-dp suggests scaling it with
            the number of workers.
        foreach: Use the ``torch._foreach_*`` kernels (few launches for many tensors). ``None`` picks
            them as torch's Adam does: on CUDA and other foreach devices, not on CPU.
        second_moment_ranks: :math:`n`, the number of replicas whose average this one follows
            (``>= 1``). Both front-ends set it every step (the gossip world size with
            ``second_moment="average"``, 1 with ``"local"``); at 1 the update is the one above.

    With :math:`n > 1` the step divides by an estimate of the second moment of the *average* of
    :math:`n` replicas' gradients instead of this replica's own (the rule of
    :mod:`decent_optim_wrapper.engine.rules.second_moment`, counted in rounds): a signal estimate
    :math:`c`, kept per round from the round's mean gradient and the momentum of the rounds before,

    .. math::
        \hat m &= m / (1 - \beta_1^{k-1}), \qquad
            \tilde c = \beta_2 c + (1 - \beta_2)\, g\, \hat m, \qquad
            \tilde v_n = \tilde v / n + (1 - 1/n)\, |\tilde c| \\
        \text{if } t \bmod N = 0: \quad c &\leftarrow \beta_2 c + (1 - \beta_2)\, a\, \hat m
            \quad (\text{before } m \text{ moves})

    and :math:`\tilde v_n` in place of :math:`\tilde v` in the step. In the first round (no
    :math:`\hat m` yet) the step divides by :math:`\tilde v`, and at its end :math:`c = v`. The
    estimate is ``exp_avg_signal`` in the state (one more tensor per parameter); this path always
    uses the foreach kernels.

    Raises:
        TypeError: A hyperparameter of the wrong type (e.g. a tensor ``lr``, a float ``accum_iter``).
        ValueError: A hyperparameter out of range. Both name the argument, its value and the fix;
            param groups passed later (``add_param_group``) are checked the same way.

    The state of each parameter is ``step`` (an ``int64`` tensor on the CPU, so reading it never
    waits for the device), ``exp_avg`` (:math:`m`), ``exp_avg_sq`` (:math:`v`), ``accum_grad``
    (:math:`a`) and, with :math:`n > 1`, ``exp_avg_signal`` (:math:`c`); ``state_dict()`` and
    ``load_state_dict()`` round-trip it exactly::

        {"state": {0: {"step": tensor(6), "exp_avg": ..., "exp_avg_sq": ..., "accum_grad": ...}},
         "param_groups": [{"lr": 0.001, "betas": (0.9, 0.999), "eps": 1e-08, "weight_decay": 0,
                           "accum_iter": 4, "foreach": None, "second_moment_ranks": 1,
                           "params": [0]}]}

    .. note:: decent-dp 0.2.3 stores :math:`\beta_1 m` and :math:`\beta_2 v` (it applies the next
        step's decay when it stores them): the same trajectory, but its checkpoints' ``exp_avg`` and
        ``exp_avg_sq`` are not interchangeable with these.
    """

    _decoupled = True

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0,
        accum_iter: int = 4,
        *,
        foreach: bool | None = None,
        second_moment_ranks: int = 1,
    ) -> None:
        super().__init__(
            params,
            lr,
            betas,
            eps,
            weight_decay,
            accum_iter,
            foreach=foreach,
            second_moment_ranks=second_moment_ranks,
        )


class AccumAdam(_AccumAdamBase):
    r"""Adam (L2 weight decay in the gradient) whose moments move once per ``accum_iter`` steps.

    At step :math:`t = 1, 2, \dots` of a parameter :math:`p` with gradient :math:`g`, learning rate
    :math:`\gamma`, weight decay :math:`\lambda` and :math:`N` = ``accum_iter``:

    .. math::
        g' &= g + \lambda p \\
        a &\leftarrow a + g' / N \\
        \tilde m &= m + (1 - \beta_1)(g' - m), \qquad \tilde v = \beta_2 v + (1 - \beta_2)\, g'^2 \\
        k &= \lceil t / N \rceil \\
        p &\leftarrow p - \frac{\gamma}{1 - \beta_1^k} \cdot
            \frac{\tilde m}{\sqrt{\tilde v} / \sqrt{1 - \beta_2^k} + \epsilon} \\
        \text{if } t \bmod N = 0: \quad
            m &\leftarrow m + (1 - \beta_1)(a - m), \quad v \leftarrow \beta_2 v + (1 - \beta_2)\, a^2,
            \quad a \leftarrow 0

    starting from :math:`m = v = a = 0`. :math:`g'` is a temporary: ``p.grad`` stays as the backward
    pass wrote it (decent-dp 0.2.3 adds :math:`\lambda p` into ``p.grad`` in place). Every step
    moves the parameters, with moments :math:`\tilde m, \tilde v` that add the current gradient to
    those of the last completed round; the moments themselves move once per round, from the round's
    mean gradient :math:`a`, and the bias correction counts rounds (:math:`k`), not steps. This is the
    accumulation of decent-dp (Wang et al., "From Promise to Practice: Realizing High-performance
    Decentralized Training", ICLR 2025). With ``accum_iter=1`` it is ``torch.optim.Adam`` with the
    same ``weight_decay`` (same op sequence as torch's; the tests check it bit for bit).

    Args:
        params: Parameters or param groups, as for any ``torch.optim.Optimizer``.
        lr: Learning rate :math:`\gamma`, ``>= 0``.
        betas: :math:`(\beta_1, \beta_2)`, each in ``[0, 1)``.
        eps: :math:`\epsilon`, added to the denominator, ``>= 0``.
        weight_decay: :math:`\lambda`, ``>= 0``, an L2 term in the gradient the moments see.
        accum_iter: :math:`N`, steps per moment update, ``>= 1``; decent-dp suggests scaling it with
            the number of workers.
        foreach: Use the ``torch._foreach_*`` kernels (few launches for many tensors). ``None`` picks
            them as torch's Adam does: on CUDA and other foreach devices, not on CPU.
        second_moment_ranks: :math:`n`, as in :class:`AccumAdamW` (the moments see :math:`g'`).

    Raises:
        TypeError: A hyperparameter of the wrong type (e.g. a tensor ``lr``, a float ``accum_iter``).
        ValueError: A hyperparameter out of range. Both name the argument, its value and the fix;
            param groups passed later (``add_param_group``) are checked the same way.

    The state of each parameter is as in :class:`AccumAdamW`: ``step`` (CPU ``int64`` tensor),
    ``exp_avg`` (:math:`m`), ``exp_avg_sq`` (:math:`v`), ``accum_grad`` (:math:`a`), and with
    :math:`n > 1` ``exp_avg_signal`` (:math:`c`).
    """

    _decoupled = False

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        accum_iter: int = 4,
        *,
        foreach: bool | None = None,
        second_moment_ranks: int = 1,
    ) -> None:
        super().__init__(
            params,
            lr,
            betas,
            eps,
            weight_decay,
            accum_iter,
            foreach=foreach,
            second_moment_ranks=second_moment_ranks,
        )

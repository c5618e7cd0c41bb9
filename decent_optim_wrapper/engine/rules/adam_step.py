r"""Adam's and AdamW's step with the second-moment rule's denominator, taken by the library.

The rule (:mod:`~decent_optim_wrapper.engine.rules.second_moment`) changes one thing in Adam's update:
what it divides by. Per coordinate, with the optimizer's own moments :math:`m_t, s_t`, the signal
:math:`c_t` and ``n`` ranks,

.. math::
    g'_t &= \pm g_t \;(+\, \lambda\, x_{t-1} \text{ with L2 decay})
        &&\text{(exactly the gradient torch's moments see: maximize, L2, unscaled)} \\
    c_t &= \beta_2 c_{t-1} + \tfrac{1 - \beta_2}{1 - \beta_1^{t-1}}\, g'_t\, m_{t-1}
        &&\text{(before } m \text{ moves)} \\
    m_t, s_t &= \text{torch's own}, \text{ bit for bit} \\
    v_t &= \tfrac{1}{n} s_t + \left(1 - \tfrac{1}{n}\right) |c_t|
        \;\;(v_t := s_t \text{ on a parameter's first step, and then } c_t := s_t) \\
    x_t &= x_{t-1}\,(1 - \eta\lambda)_{\text{AdamW}}
        - \frac{\eta}{1 - \beta_1^t}\, \frac{m_t}{\sqrt{v_t / (1 - \beta_2^t)} + \epsilon}

(with ``amsgrad``, :math:`\max` over the :math:`v_t` so far in ``max_exp_avg_sq``). torch's step
divides by its own ``exp_avg_sq`` and offers no other denominator; handing it a substitute from
which its update lands on :math:`v_t` needs a value that is negative wherever
:math:`v_t < (1 - \beta_2) g'^2`, so the step is taken here, and every value it takes a square root
of is a sum of non-negative terms.

What stays torch's, bit for bit: ``step``, ``exp_avg`` and ``exp_avg_sq``. For single-tensor,
foreach, capturable and differentiable Adam they are computed with torch's own operations in
torch's order (``lerp_``, ``mul_``, ``addcmul_``; the single-tensor or foreach form torch would pick,
tensor betas handled as torch handles them); for fused Adam, torch's fused kernel moves them
itself, through the functional :func:`torch.optim.adam.adam` with ``lr=0`` (which leaves the
parameters as they are), and the parameter update follows here. For fp16 and bf16 state the
rule's denominator is formed in fp32, as torch's fused kernel forms its own. A differentiable
group whose hyperparameters take gradients through the step is left to torch
(:mod:`~decent_optim_wrapper.engine.rules.second_moment` decides).

Cost: one state tensor (``exp_avg_signal``), no bytes. On a CPU (one thread per process, as
``torchrun`` sets) each parameter is processed in chunks of :data:`CHUNK_NUMEL` elements (small ones
packed together), every operation of the step on one chunk before the next, so the intermediate
passes stay in cache and the temporaries are chunk-sized: the step is faster than torch's
single-tensor or foreach step where the state does not fit in the cache, and costs the signal's
one pass where it does (``benchmarks/costs/run.py second_moment``). On an accelerator the parameters
of a group are processed as foreach lists, one kernel per operation, with the temporaries of torch's
foreach step. The step reads the step counters on the host, once per param group and device (the
rule's bias corrections are host scalars): no CUDA-graph capture.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim import Optimizer
from torch.optim.adam import adam as functional_adam

from decent_optim_wrapper.checks import is_int
from decent_optim_wrapper.optim.accum_adam import SIGNAL  # the state key of the signal estimate c_t

__all__ = ["CHUNK_NUMEL", "SIGNAL", "adam_step_with_rule"]


#: How many elements of a parameter the step processes at a time on a CPU. 1 MiB per fp32 tensor,
#: so the five tensors a chunk touches stay in a core's L2 cache between the step's operations; a
#: multiple of 64 (why: ``_parts``).
CHUNK_NUMEL = 1 << 18


@dataclass(frozen=True)
class _GroupHyper:
    """One param group's hyperparameters: host scalars for the rule, torch's own for its moments."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    decoupled: bool
    maximize: bool
    amsgrad: bool
    ranks: int
    #: the betas as torch's step uses them in the moments (a float, or a 0-dim tensor)
    torch_betas: tuple[float | torch.Tensor, float | torch.Tensor]


@dataclass
class _Tensors:
    """Parallel lists of real tensors (complex ones viewed as pairs of reals) for foreach ops."""

    params: list[torch.Tensor]
    grads: list[torch.Tensor]
    exp_avgs: list[torch.Tensor]
    exp_avg_sqs: list[torch.Tensor]
    signals: list[torch.Tensor]  # empty on a first step
    max_sqs: list[torch.Tensor]  # empty without amsgrad
    done: list[float]  # steps taken before this one, per parameter
    single: bool = False  # torch would take the single-tensor step (else foreach)
    complex_: bool = False  # the real views are of complex tensors
    chunkable: bool = True  # views may be taken (not under autograd: differentiable)

    def chunks(self) -> Iterator[_Tensors]:
        """The same tensors as views of at most about ``CHUNK_NUMEL`` elements: a large parameter
        cut into chunks, consecutive small ones packed together (fewer calls for the same work)."""
        pack: list[tuple[int, list[torch.Tensor]]] = []
        packed = 0
        for i in range(len(self.params)):
            columns = [self.params[i], self.grads[i], self.exp_avgs[i], self.exp_avg_sqs[i]]
            columns += [x[i] for x in (self.signals, self.max_sqs) if x]
            numel = columns[0].numel()
            if numel <= CHUNK_NUMEL or not all(t.is_contiguous() for t in columns):
                if pack and packed + numel > CHUNK_NUMEL:
                    yield self._rows(pack)
                    pack, packed = [], 0
                pack.append((i, columns))
                packed += numel
                continue
            flat = [t.view(-1) for t in columns]
            for start in range(0, numel, CHUNK_NUMEL):
                yield self._rows([(i, [t[start : start + CHUNK_NUMEL] for t in flat])])
        if pack:
            yield self._rows(pack)

    def _rows(self, rows: list[tuple[int, list[torch.Tensor]]]) -> _Tensors:
        """The parameters ``rows`` names (index, their columns' views), as lists of their own."""
        columns = list(zip(*(row for _, row in rows), strict=True))
        p, g, m, s = (list(column) for column in columns[:4])
        rest = iter(columns[4:])
        c = list(next(rest)) if self.signals else []
        mx = list(next(rest)) if self.max_sqs else []
        done = [self.done[i] for i, _ in rows]
        return _Tensors(p, g, m, s, c, mx, done, self.single, self.complex_, self.chunkable)


def _real(t: torch.Tensor) -> torch.Tensor:
    return torch.view_as_real(t) if torch.is_complex(t) else t


def _grad(param: torch.Tensor) -> torch.Tensor:
    assert param.grad is not None
    return param.grad


def _scalar(value: float | torch.Tensor) -> float:
    return float(value.item()) if isinstance(value, torch.Tensor) else float(value)


def _as_torch_uses(value: float | torch.Tensor) -> float | torch.Tensor:
    """A hyperparameter as torch's step takes it: a 1-element tensor as a 0-dim one."""
    return value.squeeze() if isinstance(value, torch.Tensor) and value.dim() != 0 else value


def adam_step_with_rule(optimizer: Optimizer, ranks: int, grad_scale: torch.Tensor | None = None) -> None:
    """Take ``optimizer``'s step (torch's Adam or AdamW) with the rule's denominator for ``ranks``.

    ``grad_scale``: the gradients are still multiplied by it (GradScaler with a fused optimizer,
    which unscales inside its step); otherwise they must be final. At ``ranks=1`` the update is
    Adam's own (the signal is kept up to date). Local: no collectives.
    """
    if not is_int(ranks) or ranks < 1:
        raise ValueError(f"ranks must be an int >= 1, got {ranks!r}")
    for group in optimizer.param_groups:
        with torch.set_grad_enabled(bool(group.get("differentiable", False))):
            _step_group(optimizer, group, ranks, grad_scale)


def _step_group(
    optimizer: Optimizer, group: dict[str, Any], ranks: int, grad_scale: torch.Tensor | None
) -> None:
    params = [p for p in group["params"] if p.grad is not None]
    if not params:
        return
    _check_group(group, params)
    for param in params:
        if not optimizer.state.get(param):
            _init_state(optimizer.state[param], param, group)
    beta1, beta2 = group["betas"]
    hyper = _GroupHyper(
        lr=_scalar(group["lr"]),
        beta1=_scalar(beta1),
        beta2=_scalar(beta2),
        eps=float(group["eps"]),
        weight_decay=_scalar(group["weight_decay"]),
        # torch's AdamW sets the group's flag; an AdamW group may turn it off (then L2 decay)
        decoupled=bool(group.get("decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW))),
        maximize=bool(group.get("maximize", False)),
        amsgrad=bool(group.get("amsgrad", False)),
        ranks=ranks,
        torch_betas=(_as_torch_uses(beta1), _as_torch_uses(beta2)),
    )
    states = [optimizer.state[p] for p in params]
    batches = _batches(params, states, hyper, _single_tensor(group, params), not group.get("differentiable"))
    inv_scale = None if grad_scale is None else grad_scale.double().reciprocal().float()
    if group.get("fused") and all(_chunked(batch) for _, batch in batches):
        # torch's fused kernel moves the moments chunk by chunk, in cache with the rest of the step
        # (the kernel's arithmetic does not depend on where a chunk starts: multiples of 64).
        for state in states:
            state["step"] += 1
        for started, batch in batches:
            for part in _parts(batch):
                if started:
                    _advance_signal(hyper, part, _moment_gradients(hyper, part, inv_scale))
                scratch = [torch.zeros((), dtype=torch.float32) for _ in part.params]  # lr=0: unused
                moments = (part.params, part.grads, part.exp_avgs, part.exp_avg_sqs, scratch)
                _fused_moments(group, hyper, grad_scale, *moments)
                _decay_and_update(hyper, part, started)
    elif group.get("fused"):
        for started, batch in batches:
            if started:  # c_t needs m_{t-1}: before torch moves it
                for part in _parts(batch):
                    _advance_signal(hyper, part, _moment_gradients(hyper, part, inv_scale))
        grads = [_grad(p) for p in params]
        steps = [s["step"] for s in states]
        _fused_moments(
            group,
            hyper,
            grad_scale,
            params,
            grads,
            [s["exp_avg"] for s in states],
            [s["exp_avg_sq"] for s in states],
            steps,
        )
        for started, batch in batches:
            for part in _parts(batch):
                _decay_and_update(hyper, part, started)
    else:
        for state in states:
            state["step"] += 1
        for started, batch in batches:
            for part in _parts(batch):
                _own_step(hyper, part, started)
    for state in states:
        if SIGNAL not in state:  # c_1 = s_1: the first step divided by the optimizer's own s
            state[SIGNAL] = state["exp_avg_sq"].detach().clone()


def _check_group(group: dict[str, Any], params: list[torch.Tensor]) -> None:
    """The errors torch's Adam raises for a group before it steps, raised the same way."""
    for param in params:
        if _grad(param).is_sparse:
            raise RuntimeError("Adam does not support sparse gradients, please consider SparseAdam instead")
        if group.get("fused") and not torch.is_floating_point(param):
            raise RuntimeError(
                "`fused=True` requires all the params to be floating point Tensors of supported devices, "
                f"but one is {param.dtype} on {param.device.type}"
            )
    if group.get("foreach") and isinstance(group["lr"], torch.Tensor) and not group.get("capturable"):
        raise RuntimeError("lr as a Tensor is not supported for capturable=False and foreach=True")


def _single_tensor(group: dict[str, Any], params: list[torch.Tensor]) -> bool:
    """Whether torch's Adam takes this group's step tensor by tensor (else with foreach kernels)."""
    foreach, fused = group.get("foreach"), group.get("fused")
    if foreach is None and fused is None:  # torch's default: foreach where its kernels exist
        foreach = not group.get("differentiable") and all(
            type(p) in (torch.Tensor, torch.nn.Parameter) and p.device.type in ("cuda", "xpu") for p in params
        )
    if foreach and isinstance(group["lr"], torch.Tensor) and not group.get("capturable"):
        foreach = False
    return not foreach


def _steps_done(states: list[dict[str, Any]]) -> list[float]:
    """Each parameter's step count before this step: one host read per device the counters are on."""
    by_device: dict[torch.device, list[int]] = {}
    for i, state in enumerate(states):
        by_device.setdefault(state["step"].device, []).append(i)
    done = [0.0] * len(states)
    for indices in by_device.values():
        values = torch.stack([states[i]["step"].detach() for i in indices]).cpu().tolist()
        for i, value in zip(indices, values, strict=True):
            done[i] = float(value)
    return done


def _batches(
    params: list[torch.Tensor],
    states: list[dict[str, Any]],
    hyper: _GroupHyper,
    single: bool,
    chunkable: bool,
) -> list[tuple[bool, _Tensors]]:
    """The parameters by (device, dtype, whether their signal has started), as foreach lists."""
    done = _steps_done(states)
    lists: dict[tuple[torch.device, torch.dtype, bool], list[int]] = {}
    for i, (param, state) in enumerate(zip(params, states, strict=True)):
        lists.setdefault((param.device, param.dtype, SIGNAL in state), []).append(i)
    return [
        (
            started,
            _Tensors(
                params=[_real(params[i]) for i in indices],
                grads=[_real(_grad(params[i])) for i in indices],
                exp_avgs=[_real(states[i]["exp_avg"]) for i in indices],
                exp_avg_sqs=[_real(states[i]["exp_avg_sq"]) for i in indices],
                signals=[_real(states[i][SIGNAL]) for i in indices] if started else [],
                max_sqs=[_real(states[i]["max_exp_avg_sq"]) for i in indices] if hyper.amsgrad else [],
                done=[done[i] for i in indices],
                single=single,
                complex_=dtype.is_complex,
                chunkable=chunkable,
            ),
        )
        for (_, dtype, started), indices in lists.items()
    ]


def _chunked(batch: _Tensors) -> bool:
    return batch.chunkable and batch.params[0].device.type == "cpu" and torch.get_num_threads() == 1


def _decay_and_update(hyper: _GroupHyper, part: _Tensors, started: bool) -> None:
    """AdamW's decoupled decay, then the update, once the moments have moved (torch decays first;
    under decoupled decay the moments do not read the parameters, so the result is the same)."""
    if hyper.decoupled and hyper.weight_decay != 0:
        torch._foreach_mul_(part.params, 1 - hyper.lr * hyper.weight_decay)
    _update_params(hyper, part, started)


def _parts(batch: _Tensors) -> Iterator[_Tensors]:
    """Chunks on a single-threaded CPU (cache-sized), the whole lists elsewhere (one kernel per
    operation).

    Bit for bit: torch's vectorised CPU loops run blocks of up to 64 elements and the rest
    element by element, which can round differently (a fused multiply-add); a chunk that is a
    multiple of the block leaves every element on the path it takes in a whole tensor. With more
    threads torch splits each tensor among them at a point that need not be a multiple of the
    block, so chunks would move elements between the paths: whole tensors then. Under autograd
    (differentiable) no views are taken either.
    """
    if _chunked(batch):
        yield from batch.chunks()
    else:
        yield batch


def _init_state(state: dict[str, Any], param: torch.Tensor, group: dict[str, Any]) -> None:
    """A parameter's first state, as torch's Adam creates it (same keys, dtypes and devices)."""
    fused, capturable = bool(group.get("fused")), bool(group.get("capturable"))
    if fused or capturable:
        dtype = torch.float32 if fused else _step_dtype()
        state["step"] = torch.zeros((), dtype=dtype, device=param.device)
    else:
        state["step"] = torch.tensor(0.0, dtype=_step_dtype())
    state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
    state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
    if group.get("amsgrad", False):
        state["max_exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)


def _step_dtype() -> torch.dtype:
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def _moment_gradients(
    hyper: _GroupHyper, part: _Tensors, inv_scale: torch.Tensor | None
) -> list[torch.Tensor]:
    """The gradient torch's moments see, computed with torch's operations in torch's order.

    Single-tensor Adam negates and adds L2 decay tensor by tensor, to a complex gradient before
    viewing it as real; foreach Adam with foreach kernels, after the real view (the two round
    differently); each is followed here."""
    grads = part.grads
    if inv_scale is not None:
        grads = list(torch._foreach_mul(grads, inv_scale.to(grads[0].device)))
    l2 = hyper.weight_decay != 0 and not hyper.decoupled
    if part.single:
        if hyper.maximize:
            grads = [torch.neg(g) for g in grads]
        if l2 and part.complex_:
            grads = [
                torch.view_as_real(_complex(g).add(_complex(p), alpha=hyper.weight_decay)).view(g.shape)
                for g, p in zip(grads, part.params, strict=True)
            ]
        elif l2:
            grads = [g.add(p, alpha=hyper.weight_decay) for g, p in zip(grads, part.params, strict=True)]
        return grads
    if hyper.maximize:
        grads = list(torch._foreach_neg(grads))
    if l2:
        grads = list(torch._foreach_add(grads, part.params, alpha=hyper.weight_decay))
    return grads


def _complex(real: torch.Tensor) -> torch.Tensor:
    """The complex tensor whose real view (or a flat chunk of it: even offset and length) is ``real``."""
    return torch.view_as_complex(real if real.dim() > 1 and real.shape[-1] == 2 else real.view(-1, 2))


def _advance_signal(hyper: _GroupHyper, part: _Tensors, grads: list[torch.Tensor]) -> None:
    """:math:`c_t = \\beta_2 c_{t-1} + (1 - \\beta_2) g'_t \\hat m_{t-1}`, before ``exp_avg`` moves."""
    cross = [(1 - hyper.beta2) / (1 - hyper.beta1**done) for done in part.done]
    torch._foreach_mul_(part.signals, hyper.beta2)
    torch._foreach_addcmul_(part.signals, grads, part.exp_avgs, cross)


def _own_step(hyper: _GroupHyper, part: _Tensors, started: bool) -> None:
    """Single-tensor or foreach Adam with the rule's denominator: torch's moments, bit for bit."""
    grads = _moment_gradients(hyper, part, None)
    if started:
        _advance_signal(hyper, part, grads)
    beta1, beta2 = hyper.torch_betas
    if part.single:  # torch's per-tensor kernels (a foreach kernel on an accelerator may round otherwise)
        for exp_avg, exp_avg_sq, grad in zip(part.exp_avgs, part.exp_avg_sqs, grads, strict=True):
            # a tensor beta1 is cast to the parameter's device and dtype first, as torch does
            weight = 1 - (beta1.to(grad.device, grad.dtype) if isinstance(beta1, torch.Tensor) else beta1)
            exp_avg.lerp_(grad, weight)
            # torch passes a tensor beta2's ``1 - beta2`` as the value too (its stubs want a number)
            exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)  # type: ignore[arg-type]
    else:
        weight = 1 - (beta1.to(grads[0].device) if isinstance(beta1, torch.Tensor) else beta1)
        torch._foreach_lerp_(part.exp_avgs, grads, weight)  # type: ignore[arg-type]  # as torch: a tensor
        torch._foreach_mul_(part.exp_avg_sqs, beta2)
        if isinstance(beta2, torch.Tensor):  # foreach addcmul takes a number only: torch scales first
            torch._foreach_addcmul_(part.exp_avg_sqs, torch._foreach_mul(grads, 1 - beta2), grads, 1.0)
        else:
            torch._foreach_addcmul_(part.exp_avg_sqs, grads, grads, 1 - beta2)
    del grads
    _decay_and_update(hyper, part, started)


def _update_params(hyper: _GroupHyper, part: _Tensors, started: bool) -> None:
    """The parameter update of the rule (the decoupled decay is done): torch's on a first step."""
    steps = [done + 1 for done in part.done]
    step_sizes = [hyper.lr / (1 - hyper.beta1**t) for t in steps]
    corrections = [(1 - hyper.beta2**t) ** 0.5 for t in steps]  # as torch computes it
    n = hyper.ranks
    # For fp16 and bf16 state the denominator is formed in fp32, as torch's fused kernel forms its
    # own: fp16's smallest number is 6e-8, so eps and small second moments would round to 0.
    low = part.exp_avg_sqs[0].dtype in (torch.float16, torch.bfloat16)
    if not started or n == 1:  # v_t = s_t: torch's own update, in torch's foreach order
        if hyper.amsgrad:
            torch._foreach_maximum_(part.max_sqs, part.exp_avg_sqs)
            squares = part.max_sqs
        else:
            squares = part.exp_avg_sqs
        denominators = torch._foreach_sqrt([t.float() for t in squares] if low else squares)
        torch._foreach_div_(denominators, corrections)
        torch._foreach_add_(denominators, hyper.eps)
        torch._foreach_addcdiv_(part.params, part.exp_avgs, denominators, [-size for size in step_sizes])
        return
    # u = |c_t| + s_t / (n - 1) = v_t * n / (n - 1): a sum of non-negative terms.
    u = list(torch._foreach_abs(part.signals))
    if low:
        u = [t.float() for t in u]
    torch._foreach_add_(u, part.exp_avg_sqs, alpha=1 / (n - 1))
    if hyper.amsgrad:
        torch._foreach_mul_(u, 1 - 1 / n)  # v_t itself, whose running maximum is kept
        torch._foreach_maximum_(part.max_sqs, u)
        torch._foreach_copy_(u, part.max_sqs)
        torch._foreach_sqrt_(u)
        torch._foreach_div_(u, corrections)
        torch._foreach_add_(u, hyper.eps)
        torch._foreach_addcdiv_(part.params, part.exp_avgs, u, [-size for size in step_sizes])
        return
    # sqrt(v / bc2) + eps = k (sqrt(u) + eps / k) with k = sqrt(1 - 1/n) / sqrt(bc2): two passes
    # fewer than forming v, dividing by the correction and adding eps.
    scales = [math.sqrt(1 - 1 / n) / correction for correction in corrections]
    torch._foreach_sqrt_(u)
    torch._foreach_add_(u, [hyper.eps / k for k in scales])
    torch._foreach_addcdiv_(
        part.params, part.exp_avgs, u, [-size / k for size, k in zip(step_sizes, scales, strict=True)]
    )


def _fused_moments(
    group: dict[str, Any],
    hyper: _GroupHyper,
    grad_scale: torch.Tensor | None,
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    steps: list[torch.Tensor],
) -> None:
    """torch's fused kernel moves ``steps``, ``exp_avgs`` and ``exp_avg_sqs`` (through the functional
    Adam); its parameter update is given ``lr=0``, which leaves the parameters as they are (it
    divides by ``sqrt(s) + eps``, finite wherever the bare fused step is)."""
    functional_adam(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        [],
        steps,
        foreach=False,
        capturable=bool(group.get("capturable", False)),
        differentiable=False,
        fused=True,
        grad_scale=grad_scale,
        found_inf=None,
        has_complex=any(torch.is_complex(p) for p in params),
        decoupled_weight_decay=hyper.decoupled,
        amsgrad=False,
        beta1=hyper.torch_betas[0],
        beta2=hyper.torch_betas[1],
        lr=0.0,
        weight_decay=hyper.weight_decay,
        eps=hyper.eps,
        maximize=hyper.maximize,
    )

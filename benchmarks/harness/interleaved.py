"""Variants (ways of doing the same work) timed interleaved, the order rotating every repetition so that a
drift of the machine affects them all alike, on the CPU or a GPU, and compared as ratios of medians."""

import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from decent_optim_wrapper.engine.rules.second_moment import SecondMomentRule

Variant = Callable[[int], object]


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def timed_on(device: torch.device, fn: Callable[[], object]) -> float:
    """Seconds ``fn()`` took, the device synchronised before and after (a GPU runs asynchronously)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda _: None
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)  # inside the timing: the work queued by fn() is what is timed, not its launch
    return time.perf_counter() - start


def median_seconds(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """The median of ``repeats`` timings on ``device`` after one untimed call (first calls allocate)."""
    return statistics.median([timed_on(device, fn) for _ in range(repeats + 1)][1:])


def interleave(
    variants: Mapping[str, Variant], iters: int, warmup: int, timer: Any = timed
) -> dict[str, list[float]]:
    """Seconds of each variant (``variant(repetition)``) in each of ``iters`` repetitions after ``warmup``
    untimed ones, the order rotating by one every repetition. A variant that times itself (to leave
    the network out) returns its seconds: a float, or a dict of parts (recorded as ``name.part``)."""
    names, times = list(variants), {}
    for i in range(warmup + iters):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            out: list[object] = []
            took = timer(lambda fn=variants[name], i=i, out=out: out.append(fn(i)))
            own = out[0] if isinstance(out[0], dict | float) else took
            for part, seconds in (own if isinstance(own, dict) else {"": own}).items():
                times.setdefault(f"{name}.{part}".rstrip("."), []).extend([seconds] if i >= warmup else [])
    return times


def ratio(times: Mapping[str, list[float]], name: str, against: str) -> dict[str, Any]:
    """``name`` against ``against``: its median ms, the ratio of medians, the median paired ratio."""
    paired = statistics.median(a / b for a, b in zip(times[name], times[against], strict=True))
    of_medians = statistics.median(times[name]) / statistics.median(times[against])
    ms = 1e3 * statistics.median(times[name])
    return {"ms": ms, "vs": against, "ratio_of_medians": of_medians, "median_paired_ratio": paired}


def rule_against_torch(
    params: list[torch.Tensor], flags: dict[str, bool], warmup: int, iters: int, timer: Any = timed
) -> dict[str, list[float]]:
    """Seconds of torch's AdamW step (``"torch"``) and of the Adam rule's step for n = 2 (``"rule"``) on
    the same parameters and gradients, interleaved, after ``warmup`` untimed ones."""
    torch_opt, rule_opt = (torch.optim.AdamW(params, lr=1e-4, **flags) for _ in range(2))
    rule = SecondMomentRule("average")
    steps = {"torch": lambda _: torch_opt.step(), "rule": lambda _: rule.step(rule_opt, 2)}
    return interleave(steps, iters, warmup, timer)

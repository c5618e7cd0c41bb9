"""An independent implementation of the sparse and low-bit wire formats, written from their rule.

The rule (decent_optim_wrapper.engine.wire.chunk_codec's docstring): chunks of ``C`` (the last zero-padded),
``k = max(1, round(density C))`` kept per chunk (top-k by magnitude, random-k at
``floor((j C + v_j) / k)`` with ``v = torch.randint(0, C, (m, k))`` from a CPU generator seeded with
the round's seed, or every element), values in fp32 then either rounded to a 16-bit float or
quantized with ``s = bf16(max |kept|)``, ``delta = s * fp32(1 / L)``, ``c = clamp(round(v / delta), -L, L)``,
``L = 2^(b-1) - 1``, decoded as ``c delta``. Written with numpy and a Python loop over chunks; only the
bf16 conversion and the random draw come from torch (the draw is the rule itself).
"""

from __future__ import annotations

import math

import numpy as np
import torch

BITS = {"int8": 8, "int4": 4, "int2": 2}


def round_seed(step: int, bucket: int) -> int:
    """The documented seed of a bucket's round."""
    return (step * 65537 + bucket) % (1 << 63)


def _bf16(x: np.ndarray) -> np.ndarray:
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).to(torch.bfloat16).float().numpy()


def reference_quantize(
    values: torch.Tensor, selection: str, density: float, wire: str, chunk: int = 256, seed: int = 0
) -> torch.Tensor:
    """What ``values`` decodes to after one trip through the format, in ``values``' dtype."""
    n = values.numel()
    kept = chunk if selection == "all" else max(1, round(density * chunk))
    chunks = math.ceil(n / chunk)
    padded = np.zeros(chunks * chunk, dtype=np.float32)
    padded[:n] = values.to(torch.float32).numpy()
    out = np.zeros(chunks * chunk, dtype=np.float32)
    draws = None
    if selection == "randk":
        generator = torch.Generator().manual_seed(seed)
        draws = torch.randint(0, chunk, (chunks, kept), generator=generator).numpy()
    for c in range(chunks):
        row = padded[c * chunk : (c + 1) * chunk]
        if selection == "all":
            positions = np.arange(chunk)
        elif selection == "topk":
            positions = np.argsort(-np.abs(row), kind="stable")[:kept]
        else:
            assert draws is not None
            positions = np.array([(j * chunk + int(draws[c, j])) // kept for j in range(kept)])
        picked = row[positions]
        if wire == "bf16":
            decoded = _bf16(picked)
        elif wire == "fp16":
            decoded = np.clip(picked, -65504.0, 65504.0).astype(np.float16).astype(np.float32)
        else:
            levels = np.float32(2 ** (BITS[wire] - 1) - 1)
            scale = _bf16(np.array([np.abs(picked).max()]))[0]
            step = np.float32(scale) * np.float32(1.0 / float(levels))
            if step > 0:
                codes = np.clip(np.round(picked / step), -levels, levels).astype(np.float32)
            else:
                codes = np.zeros_like(picked)
            decoded = codes * step
        out[c * chunk + positions] = decoded
    return torch.from_numpy(out[:n]).to(values.dtype)

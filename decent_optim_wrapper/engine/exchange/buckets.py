"""Flat parameter buckets: parameters become views into a few contiguous tensors.

One flat tensor per (device, dtype) run, capped in size, lets gossip move and mix a whole bucket
with one collective and one kernel instead of one per parameter. A bucket never mixes dtypes or
devices: casting a bf16 parameter to fp32, or moving it, would silently change the user's model.
A sharded parameter (DTensor) contributes its local shard (:mod:`~.shards`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from loguru import logger

from decent_optim_wrapper.engine.exchange.shards import is_sharded, local_tensor

__all__ = [
    "Bucket",
    "BucketSpec",
    "build_buckets",
    "check_named_params",
    "check_saved_tensors",
    "current",
    "misfit",
    "plan_buckets",
]

# Offsets inside a bucket are rounded up to this many bytes so that each parameter's view starts
# on a boundary vectorised kernels like; the padding stays zero through mixing and averaging.
ALIGN_BYTES = 64


@dataclass(frozen=True)
class BucketSpec:
    """Where a bucket's parameters go: indices into the parameter list, and their offsets.

    ``number`` is the bucket's place in the order it was planned in (the parameters' order), kept
    when a front-end lists the buckets in another order: compressed rounds seed their random draws
    with it, so a bucket compresses the same in either list.
    """

    dtype: torch.dtype
    device: torch.device
    param_indices: tuple[int, ...]
    offsets: tuple[int, ...]
    numel: int
    number: int = 0


def _aligned(numel: int, element_size: int) -> int:
    step = max(1, ALIGN_BYTES // element_size)
    return math.ceil(numel / step) * step


def plan_buckets(params: Sequence[torch.Tensor], cap_bytes: int, first: int = 0) -> list[BucketSpec]:
    """Group ``params`` into buckets: by (device, dtype) in order of first appearance, then by size.

    A bucket closes once adding the next parameter would exceed ``cap_bytes``; a parameter larger
    than the cap gets a bucket of its own. Order inside a bucket follows ``params``. A sharded
    parameter counts with its local shard. The buckets are numbered from ``first`` in the order
    returned.
    """
    params = [local_tensor(p) for p in params]
    runs: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for index, param in enumerate(params):
        runs.setdefault((param.device, param.dtype), []).append(index)

    specs: list[BucketSpec] = []
    for (device, dtype), indices in runs.items():
        element_size = torch.empty((), dtype=dtype).element_size()
        current: list[int] = []
        offsets: list[int] = []
        used = 0
        for index in indices:
            size = _aligned(params[index].numel(), element_size)
            if current and (used + size) * element_size > cap_bytes:
                specs.append(
                    BucketSpec(dtype, device, tuple(current), tuple(offsets), used, first + len(specs))
                )
                current, offsets, used = [], [], 0
            current.append(index)
            offsets.append(used)
            used += size
        if current:
            specs.append(BucketSpec(dtype, device, tuple(current), tuple(offsets), used, first + len(specs)))
    return specs


def _dense_strides(param: torch.Tensor) -> tuple[int, ...] | None:
    """Strides that lay ``param`` densely in a flat buffer (row-major or channels-last), else None."""
    if param.is_contiguous():
        return param.stride()
    for memory_format, ndim in ((torch.channels_last, 4), (torch.channels_last_3d, 5)):
        if param.dim() == ndim and param.is_contiguous(memory_format=memory_format):
            return param.stride()
    return None


class Bucket:
    """A flat tensor that owns the storage of several parameters.

    After :meth:`bind`, ``param.data`` of every member is a view into :attr:`data`, so an optimizer
    stepping the parameters writes into the bucket and gossip on the bucket updates the parameters.
    With ``as_views=False`` the parameters keep their own storage instead, and :meth:`pull` /
    :meth:`push` copy them into and out of :attr:`data` around every use of the bucket. A bucket
    holding a sharded parameter (DTensor) holds its local shard, and always copies.

    Args:
        spec: the layout from :func:`plan_buckets`.
        params: the full parameter list ``spec`` indexes into.
        names: a readable name per parameter (same indexing), used in error messages.
        as_views: make the parameters views of the bucket (no copies).
    """

    def __init__(
        self, spec: BucketSpec, params: Sequence[torch.Tensor], names: Sequence[str], as_views: bool = True
    ) -> None:
        self.spec = spec  #: The layout (dtype, device, size, which parameters).
        self.params = [params[i] for i in spec.param_indices]  #: The member parameters, in bucket order.
        self.names = [names[i] for i in spec.param_indices]  #: Their names, for error messages.
        #: Whether the parameters are views of :attr:`data` (never sharded ones: FSDP2 owns their storage).
        self.as_views = as_views and not any(is_sharded(p) for p in self.params)
        #: The shape of each parameter's part of the bucket (its local shard's, if sharded).
        self.shapes = [local_tensor(p).shape for p in self.params]
        self.data = torch.zeros(spec.numel, dtype=spec.dtype, device=spec.device)  #: The flat tensor.
        self._views: list[torch.Tensor] = []  # each parameter's slice of data, shaped like it
        self._checkouts = 0  # how many blocks of current() hold the bucket now (they nest)
        self._written = False  # whether one of them writes: the outermost copies data back

    @torch.no_grad()
    def bind(self) -> None:
        """Copy every parameter into the bucket and make ``param.data`` a view of its slice."""
        for param, name, offset in zip(self.shards(), self.names, self.spec.offsets, strict=True):
            strides = _dense_strides(param)
            if strides is None:
                raise ValueError(
                    f"Parameter {name} (shape {tuple(param.shape)}, stride {param.stride()}) is not dense "
                    "in memory, so it cannot become a view of a flat bucket. Call .contiguous() on it "
                    "(e.g. re-create the Parameter) before building the optimizer."
                )
            view = self.data.as_strided(param.shape, strides, self.data.storage_offset() + offset)
            view.copy_(param.data)
            if self.as_views:
                param.data = view
            self._views.append(view)

    @torch.no_grad()
    def pull(self) -> None:
        """Copy the parameters into :attr:`data` (nothing to do when they are views of it)."""
        if not self.as_views:
            torch._foreach_copy_(self._views, [p.data for p in self.shards()])

    @torch.no_grad()
    def push(self) -> None:
        """Copy :attr:`data` into the parameters (nothing to do when they are views of it)."""
        if not self.as_views:
            torch._foreach_copy_([p.data for p in self.shards()], self._views)

    def check_out(self, write: bool) -> None:
        """Enter a block that reads :attr:`data` (and writes it, with ``write``): the outermost block
        pulls the parameters in; a nested one finds them there already."""
        if self._checkouts == 0:
            self.pull()
        self._checkouts += 1
        self._written |= write

    def check_in(self) -> None:
        """Leave a block of :meth:`check_out`: the outermost pushes :attr:`data` back if a block wrote."""
        self._checkouts -= 1
        if self._checkouts == 0 and self._written:
            self._written = False
            self.push()

    def shards(self) -> list[torch.Tensor]:
        """The tensors the bucket holds: each parameter, or its local shard if it is sharded."""
        return [local_tensor(p) for p in self.params]

    def slices(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's slice of ``flat`` (a tensor laid out like :attr:`data`), shaped like it."""
        return [
            flat[offset : offset + shape.numel()].view(shape)
            for shape, offset in zip(self.shapes, self.spec.offsets, strict=True)
        ]

    def check_views(self) -> None:
        """Raise if a parameter no longer points into this bucket (e.g. ``model.to()`` after wrapping)."""
        if not self.as_views:
            return
        for param, name, view in zip(self.params, self.names, self._views, strict=True):
            moved = param.data_ptr() != view.data_ptr() or param.device != view.device
            if moved or param.shape != view.shape:
                raise RuntimeError(
                    f"Parameter {name} no longer lives in its gossip bucket (its storage was replaced, "
                    "e.g. by model.to()/.cuda()/.half() or by assigning param.data after the wrapper was "
                    "built), so gossip would no longer reach it. Move and cast the model before building "
                    "the optimizer and the wrapper, and update parameters in place (param.copy_(...))."
                )

    def signature(self) -> tuple[object, ...]:
        """What must agree across ranks and checkpoints: dtype, device type, shapes and offsets."""
        shapes = tuple(tuple(shape) for shape in self.shapes)
        return (str(self.spec.dtype), self.spec.device.type, self.spec.numel, shapes, self.spec.offsets)

    def __repr__(self) -> str:
        return (
            f"Bucket(dtype={self.spec.dtype}, device={self.spec.device}, params={len(self.params)}, "
            f"numel={self.spec.numel})"
        )


@contextmanager
def current(buckets: Iterable[Bucket], *, write: bool) -> Iterator[None]:
    """Bring every bucket's :attr:`~Bucket.data` up to date to read it and, with ``write``, copy it back.

    Where ``params_as_views=False`` (and a sharded parameter, whose storage FSDP2 owns) costs its
    copies: the parameters are pulled into their buckets when the block starts and pushed back when it
    ends, if it or a block inside it writes. Blocks nest: only the outermost copies, so the engine
    holds one block around each phase of a bucket (its mix, its launch with the folds and outer step
    of low-communication gossip, a global average, a checkpoint, the settling of rounds after a lost
    peer), and the parts it calls read and write :attr:`~Bucket.data` as they would a view. The
    parameters are pushed back when the block ends by an error too: with views they would hold what
    the block wrote, and recovery then starts from the same values either way. With views (the
    default) nothing is copied.
    """
    buckets = list(buckets)
    entered: list[Bucket] = []
    try:
        for bucket in buckets:
            bucket.check_out(write)
            entered.append(bucket)
        yield
    finally:
        for bucket in entered:
            bucket.check_in()


def build_buckets(
    params: Sequence[torch.Tensor],
    names: Sequence[str],
    cap_bytes: int,
    as_views: bool = True,
    *,
    reverse: bool = False,
    first: int = 0,
) -> list[Bucket]:
    """Plan buckets for ``params`` and create them; :meth:`Bucket.bind` then moves the parameters in.

    With ``reverse``, the buckets are planned (and numbered from ``first``) in ``params``' order and
    listed last first: a module front-end steps them as backward produces gradients, and each bucket
    holds the same parameters at the same offsets as the optimizer front-end's, so that a compressed
    round sees the same chunks under both.
    """
    specs = plan_buckets(params, cap_bytes, first)
    buckets = [Bucket(spec, params, names, as_views) for spec in (specs[::-1] if reverse else specs)]
    for bucket in buckets:
        logger.debug(
            "bucket {}: {} params, {} elements, dtype={}, device={}",
            bucket.spec.number,
            len(bucket.params),
            bucket.spec.numel,
            bucket.spec.dtype,
            bucket.spec.device,
        )
    return buckets


def check_named_params(
    named_params: Sequence[tuple[str, torch.Tensor]],
) -> tuple[list[torch.Tensor], list[str]]:
    """Reject what a flat bucket cannot hold; return the parameters and their names, in order."""
    params: list[torch.Tensor] = []
    names: list[str] = []
    seen: dict[int, str] = {}
    for name, param in named_params:
        if not isinstance(param, torch.Tensor):
            raise TypeError(
                f"{name} is a {type(param).__name__}, not a tensor; pass (name, parameter) pairs."
            )
        if id(param) in seen:
            raise ValueError(
                f"{name} is the same tensor as {seen[id(param)]}: a parameter may appear in only one "
                "place in the optimizer's param_groups. Remove the duplicate."
            )
        if param.is_sparse or param.layout != torch.strided:
            raise ValueError(
                f"{name} has layout {param.layout}; flat buckets hold dense (strided) parameters only. "
                "Keep sparse parameters out of the wrapped optimizer."
            )
        if not (param.is_floating_point() or param.is_complex()):
            raise TypeError(
                f"{name} has dtype {param.dtype}; gossip averages floating-point parameters only."
            )
        seen[id(param)] = name
        params.append(param)
        names.append(name)
    if not params:
        raise ValueError(
            "There are no parameters to gossip (every param group is empty); wrap an optimizer built "
            "from model.parameters()."
        )
    return params, names


def check_saved_tensors(
    what: str,
    saved: object,
    layout: Sequence[tuple[torch.Size, torch.dtype]],
    *,
    optional: bool = False,
) -> None:
    """Raise ``ValueError`` if ``saved`` (a checkpoint's tensors, one per bucket) does not fit ``layout``.

    ``layout`` holds each bucket's (shape, dtype). With ``optional``, an entry may be None (nothing
    saved for that bucket) and the list may stop early (a prefix of the buckets).
    """
    count_ok = isinstance(saved, list | tuple) and (
        len(saved) <= len(layout) if optional else len(saved) == len(layout)
    )
    if not count_ok:
        count = len(saved) if isinstance(saved, list | tuple) else type(saved).__name__
        raise ValueError(
            f"checkpoint's {what} hold {count} tensors but this run has {len(layout)} buckets; the "
            "checkpoint is corrupt or comes from a different parameter layout."
        )
    assert isinstance(saved, list | tuple)
    for index, (tensor, (shape, dtype)) in enumerate(zip(saved, layout, strict=False)):
        got = None if tensor is None and optional else misfit(tensor, shape, dtype)
        if got is not None:
            raise ValueError(
                f"checkpoint's {what}[{index}] has {got} but bucket {index} has shape {tuple(shape)}, "
                f"dtype {dtype}; the checkpoint is corrupt or comes from a different parameter layout."
            )


def misfit(saved: object, shape: torch.Size, dtype: torch.dtype) -> str | None:
    """How a checkpoint's ``saved`` tensor fails to fit one of ``shape`` and ``dtype``; None if it fits."""
    if not isinstance(saved, torch.Tensor):
        return f"a {type(saved).__name__}, not a tensor"
    if saved.shape != shape or saved.dtype != dtype:
        return f"shape {tuple(saved.shape)}, dtype {saved.dtype}"
    return None

"""Signatures: what a joiner must share with the running job, and the first difference, by name.

A signature is a tuple of ``(field, value)`` pairs (the engine's layout, the front-end's optimizer);
a field may hold :class:`SignatureEntry` items (a parameter, named and compared by shape and dtype)
or, in a job of nodes, a signature per shard. :func:`mismatch` says why an applicant cannot join.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeGuard

__all__ = ["SignatureEntry", "mismatch"]


@dataclass(frozen=True)
class SignatureEntry:
    """One item of a signature field, compared by its ``fields`` and named by ``label`` in a rejection.

    A parameter is ``SignatureEntry("parameter 'fc1.weight'", (("shape", (64, 32)), ("dtype",
    "torch.float32")))``: a joiner whose ``fc1.weight`` is (48, 32) is told so by name, while a name
    alone (another front-end, a compiled model's prefix) never makes two entries differ.
    """

    label: str = field(compare=False)
    fields: tuple[tuple[str, object], ...]


def mismatch(ours: tuple[tuple[str, object], ...], theirs: tuple[tuple[str, object], ...]) -> str:
    """Why an applicant's signature cannot join (the first field, and the first entry in it, that
    differs: a parameter by its name and shapes), or ``""``."""
    reason = _difference(ours, theirs)
    if reason:
        return f"its {reason}; start it with the job's code, model and options"
    extra = [name for name, _ in theirs if name not in dict(ours)]
    return f"it passes options the job does not know ({extra}); run the job's own code" if extra else ""


def _difference(ours: tuple[tuple[str, object], ...], theirs: tuple[tuple[str, object], ...]) -> str:
    """The first field of ``ours`` (the job's) that ``theirs`` (the applicant's, ``here``) does not
    match, and how, or ``""``."""
    yours = dict(theirs)
    for name, value in ours:
        other = yours.get(name, "<missing>")
        if other == value:
            continue
        inner = _difference(value, other) if _is_signature(value) and _is_signature(other) else ""
        if inner:  # a node's signature holds one per shard
            return f"{name}'s {inner}"
        where, here, there = _first_difference(other, value, name)
        if isinstance(here, SignatureEntry) and isinstance(there, SignatureEntry):
            job = dict(there.fields)
            changes = [
                f"{key} {_brief(mine)} here and {_brief(job.get(key))} in the job"
                for key, mine in here.fields
                if job.get(key) != mine
            ]
            return f"{here.label} differs from the running job's: it has {', and '.join(changes)}"
        if _entries(here) and _entries(there) and len(here) != len(there):  # one has more parameters
            longer, side = (here, "here") if len(here) > len(there) else (there, "in the job")
            return (
                f"{where} differ from the running job's: {len(here)} here, {len(there)} in the job; the "
                f"first without a counterpart is {longer[min(len(here), len(there))].label} {side}"
            )
        return f"{where} differs from the running job's ({_brief(here)} here, {_brief(there)} in the job)"
    return ""


def _is_signature(value: object) -> TypeGuard[tuple[tuple[str, object], ...]]:
    """Whether ``value`` is a signature itself: (name, value) pairs (a node's holds one per shard)."""
    return (
        isinstance(value, tuple)
        and len(value) > 0
        and all(isinstance(e, tuple) and len(e) == 2 and isinstance(e[0], str) for e in value)
    )


def _entries(value: object) -> TypeGuard[tuple[SignatureEntry, ...]]:
    """Whether ``value`` is a field of :class:`SignatureEntry` items (the parameters)."""
    return isinstance(value, tuple) and all(isinstance(e, SignatureEntry) for e in value)


def _first_difference(here: object, there: object, path: str) -> tuple[str, object, object]:
    """The innermost entry of two nested tuples/lists where they differ, and its path (a tuple of plain
    values, such as a shape, is one entry; so is a :class:`SignatureEntry`)."""
    if (
        isinstance(here, tuple | list)
        and isinstance(there, tuple | list)
        and any(isinstance(v, tuple | list | SignatureEntry) for v in here)
    ):
        for index, (a, b) in enumerate(zip(here, there, strict=False)):
            if a != b:
                return _first_difference(a, b, f"{path}[{index}]")
    return path, here, there


def _brief(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."

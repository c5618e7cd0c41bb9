"""What a number argument must be, for the checks that name the argument in their errors.

``bool`` is a subclass of ``int`` in Python, so ``isinstance(True, int)`` holds; an option that takes a
count or a factor refuses ``True``/``False`` (almost always a misplaced flag) with the same message as
any other wrong type.
"""

from __future__ import annotations

from typing import TypeGuard

__all__ = ["is_int", "is_real"]


def is_int(value: object) -> TypeGuard[int]:
    """Whether ``value`` is an ``int`` and not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_real(value: object) -> TypeGuard[int | float]:
    """Whether ``value`` is an ``int`` or a ``float`` and not a ``bool``."""
    return isinstance(value, int | float) and not isinstance(value, bool)

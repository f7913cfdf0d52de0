"""The scalar argument checks of the package: flags, counts and optional numbers.

Each raises ``TypeError`` (wrong type) or ``ValueError`` (out of range) with a message
that names the argument. An int is an ``int`` that is not a ``bool``: ``True`` is not a
count. Imports nothing of kvarena, so every layer (``cache``, ``attention``) uses it.
"""

from __future__ import annotations

import numbers

__all__ = ["INT_LIMIT", "is_int", "is_integral", "check_bool", "check_int", "check_opt_int", "check_opt_float"]

#: Largest meaningful window / chunk / sink count: lengths are int32.
INT_LIMIT = 2**31 - 1


def is_int(value) -> bool:
    """Whether ``value`` is an int and not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_integral(value) -> bool:
    """Whether ``value`` is a ``numbers.Integral`` (an int, a numpy int, ...) and not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_bool(name: str, value) -> bool:
    """``value`` if it is a bool; else ``TypeError`` naming ``name``.

    One check for every flag of the package (``1``, ``"no"`` or ``None`` are not bools).
    """
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected a bool (True or False), got {value!r}")
    return value


def check_int(name: str, value, minimum: int) -> int:
    """``value`` itself if it is an int (not a bool) ``>= minimum``; else ``TypeError`` /
    ``ValueError`` naming ``name``.

    One check for every count argument of the package.
    """
    if not is_int(value):
        raise TypeError(f"{name}: expected an int >= {minimum}, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value}")
    return value


def check_opt_int(name: str, value, minimum: int) -> int | None:
    """``value`` itself if it is None or an int (not a bool) ``>= minimum``; else
    ``TypeError`` / ``ValueError`` naming ``name``."""
    if value is None:
        return None
    if not is_int(value):
        raise TypeError(f"{name}: expected None or an int >= {minimum}, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name}: expected None or an int >= {minimum}, got {value}")
    return value


def check_opt_float(name: str, value) -> float | None:
    """None, or ``value`` (an int or float, not a bool) as a float; else ``TypeError``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected None or a float, got {value!r}")
    return float(value)

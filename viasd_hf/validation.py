"""Type checks for fields read from users and files: ``bool`` is an ``int`` in Python, but never a count or a threshold."""

from __future__ import annotations

import numbers
from typing import Any


def is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)

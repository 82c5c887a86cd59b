"""Type checks for fields read from users and files: ``bool`` is an ``int`` in Python, but never a count or a threshold.

``check_fields`` walks a table of field types in order and raises for the first field whose value is of
the wrong type, through ``wrong_type``, so every such error reads alike: what the field must be, and the
value and type it got.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any


def is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def wrong_type(field: str, expected: str, value: Any, error: type[Exception] = TypeError, advice: str = "") -> Exception:
    """``error`` saying ``field`` must be ``expected``, with the value it got and that value's type (and ``advice``)."""
    message = f"{field} must be {expected}, got {value!r} ({type(value).__name__})"
    return error(f"{message}; {advice}" if advice else message)


@dataclass(frozen=True)
class FieldType:
    """The values a field accepts (``accepts``) and how an error names them (``expected``: "an int")."""

    accepts: Callable[[Any], bool]
    expected: str

    def or_none(self, spelled: str = "None") -> FieldType:
        """The same values or ``None``, named ``"<expected> or <spelled>"`` (``"null"`` in a file's fields)."""
        return FieldType(lambda value: value is None or self.accepts(value), f"{self.expected} or {spelled}")


def instance_of(*types: type, expected: str) -> FieldType:
    return FieldType(lambda value: isinstance(value, types), expected)


INT = FieldType(is_int, "an int")
REAL = FieldType(is_real, "a number")
BOOL = instance_of(bool, expected="True or False")
STR = instance_of(str, expected="a string")
JSON_OBJECT = instance_of(dict, expected="a JSON object (dict)")

FieldTypes = Iterable[tuple[tuple[str, ...], FieldType]]


def check_fields(obj: Any, field_types: FieldTypes, field: str, error: type[Exception] = TypeError) -> None:
    """Raise ``error`` for the first of ``obj``'s attributes, in ``field_types`` order, of a type its ``FieldType`` refuses.

    ``field`` names an attribute in the message, ``{}`` standing for its name: ``"ViaSDConfig.{}"``,
    ``"routing mask field {!r}"``.
    """
    for names, field_type in field_types:
        for name in names:
            value = getattr(obj, name)
            if not field_type.accepts(value):
                raise wrong_type(field.format(name), field_type.expected, value, error)

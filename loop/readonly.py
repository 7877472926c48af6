"""``ReadOnly``: a public, read-only view of one private attribute.

The actors' wrapped objects expose much of their state this way (``state``, ``param_version``,
``paused``, ...). One line each instead of a four-line property, with the type kept for checkers:
``state = ReadOnly[ControllerState]("_state")``.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar, overload

T = TypeVar("T")


class ReadOnly(Generic[T]):
    """Reads ``attr`` of the instance; assigning or deleting the public name raises."""

    def __init__(self, attr: str, doc: str | None = None) -> None:
        self.attr = attr
        self.__doc__ = doc
        self.name = attr

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, objtype: type | None = None) -> ReadOnly[T]: ...
    @overload
    def __get__(self, obj: object, objtype: type | None = None) -> T: ...
    def __get__(self, obj: object | None, objtype: type | None = None) -> Any:
        if obj is None:
            return self
        return getattr(obj, self.attr)

    def __set__(self, obj: object, value: object) -> None:
        raise AttributeError(f"{type(obj).__name__}.{self.name} is read-only (set {self.attr})")

    def __delete__(self, obj: object) -> None:
        raise AttributeError(f"{type(obj).__name__}.{self.name} is read-only")

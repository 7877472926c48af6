"""Finding a policy by name: the decorator registry, entry points, and `module:Class` strings."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any, TypeVar

from policies.base import DynamicSchedulePolicyBase

ENTRY_POINT_GROUP = "tidal.policies"

_REGISTRY: dict[str, type[DynamicSchedulePolicyBase]] = {}

P = TypeVar("P", bound=type[DynamicSchedulePolicyBase])


class UnknownPolicyError(KeyError):
    """No policy under that name; the message lists the known ones."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


def register_policy(name: str) -> Callable[[P], P]:
    """Class decorator: make a policy buildable as ``build_policy(name, ...)``."""

    def decorator(cls: P) -> P:
        if not (isinstance(cls, type) and issubclass(cls, DynamicSchedulePolicyBase)):
            raise TypeError(f"register_policy({name!r}): {cls!r} is not a DynamicSchedulePolicyBase subclass")
        existing = _REGISTRY.get(name)
        if existing is not None and existing is not cls and _qualname(existing) != _qualname(cls):
            raise ValueError(f"policy name {name!r} is already registered to {_qualname(existing)}")
        _REGISTRY[name] = cls
        return cls

    return decorator


def _qualname(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _entry_point_names() -> dict[str, Any]:
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def registered_policies() -> list[str]:
    """Names usable in ``dynamic_schedule_policy``: decorated classes plus entry points."""
    return sorted(set(_REGISTRY) | set(_entry_point_names()))


def _known() -> str:
    return ", ".join(registered_policies())


def resolve_policy_class(name: str) -> type[DynamicSchedulePolicyBase]:
    """Registered name → entry point of group `tidal.policies` → `module:Class`."""
    if name in _REGISTRY:
        return _REGISTRY[name]
    ep = _entry_point_names().get(name)
    if ep is not None:
        cls = ep.load()
        register_policy(name)(cls)
        return cls
    if ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise UnknownPolicyError(f"policy {name!r}: cannot import module {module_name!r} ({exc})") from None
        cls = getattr(module, attr, None)
        if not (isinstance(cls, type) and issubclass(cls, DynamicSchedulePolicyBase)):
            raise UnknownPolicyError(f"policy {name!r}: {attr!r} is not a DynamicSchedulePolicyBase subclass")
        return cls
    raise UnknownPolicyError(f"unknown dynamic scheduling policy {name!r}; known: {_known()} (or module:Class)")


def build_policy(name: str, **kwargs: Any) -> DynamicSchedulePolicyBase:
    """Instantiate a policy by name, forwarding ``kwargs`` to its constructor."""
    return resolve_policy_class(name)(**kwargs)

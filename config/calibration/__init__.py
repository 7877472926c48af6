"""Calibration files: the twin's switch costs, each number with the source it came from.

Owns the file format (``tidal-calibration/1``, YAML files in this folder or anywhere), its
loader and writer, and ``apply_calibration``, which ``sim.calibration`` uses to fill the switch
costs the ``sim`` section leaves unset. A cost is ``fixed_s + per_gb_s × weight GB`` (the weights one GPU of
a replica holds), so a file measured on one model size serves another. ``weight_sync`` (optional)
is the per-GB model of a weight sync by transport: ``broadcast_sync_s`` is then the entry of
``sim.broadcast_transport`` and ``hybrid_sync_s`` the one of ``sim.hybrid_transport`` (over
``costs``; a key the ``sim`` section sets itself still wins)::

    format: tidal-calibration/1
    name: h200-torch
    device: NVIDIA H200
    measured: 2026-12-01
    weight_gb: 15.23              # the size the costs are quoted at unless sim.calibration_weight_gb says
    costs:
      deactivate_s: {fixed_s: 0.05, per_gb_s: 0.002, source: "measured by benchmarks/gpu_check.py on ..."}
    weight_sync:                  # optional: seconds of one sync by transport
      collective: {fixed_s: 0.01, per_gb_s: 0.05, source: "..."}

Keys of ``costs``: ``CALIBRATED_KEYS`` (``sim.*`` names); of ``weight_sync``: ``TRANSPORTS``; a
file may give any subset of either (not nothing). Must not import pydantic, anything else of ours,
Ray or torch (``config.schema`` imports it).
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

FORMAT = "tidal-calibration/1"
CALIBRATION_DIR = Path(__file__).resolve().parent
CALIBRATED_KEYS = ("deactivate_s", "hybrid_sync_s", "activate_s", "rebalance_s", "broadcast_sync_s")
"""The ``sim.*`` switch costs a calibration may set."""
STANDALONE_TRANSPORTS = ("collective", "object_store")
"""``sim.broadcast_transport``'s values (``cluster.weight_sync``'s transports to standalone replicas)."""
HYBRID_TRANSPORTS = ("in_rank", "object_store")
"""``sim.hybrid_transport``'s values (to the hybrid replica a trainer rank hosts)."""
TRANSPORTS = ("collective", "in_rank", "object_store")
"""The keys of a calibration's ``weight_sync``: the transports of ``cluster.weight_sync``."""
SYNC_KEYS = {"broadcast_sync_s": ("broadcast_transport", "collective", STANDALONE_TRANSPORTS),
             "hybrid_sync_s": ("hybrid_transport", "in_rank", HYBRID_TRANSPORTS)}
"""``sim.*`` sync cost → (the ``sim`` key naming its transport, that key's default, its values)."""


class CalibrationError(ValueError):
    """A calibration file that is missing or malformed; the message is one line."""


@dataclass(frozen=True)
class Cost:
    """One switch cost: ``fixed_s + per_gb_s × weight GB`` seconds, and where that came from."""

    fixed_s: float
    per_gb_s: float
    source: str

    def seconds(self, weight_gb: float) -> float:
        return self.fixed_s + self.per_gb_s * weight_gb


@dataclass(frozen=True)
class Calibration:
    """A parsed calibration file."""

    name: str
    device: str
    measured: str
    weight_gb: float
    """Weights per GPU of a replica the costs are quoted at when no other size is given."""
    costs: dict[str, Cost]
    note: str = ""
    weight_sync: dict[str, Cost] = field(default_factory=dict)
    """Transport (``TRANSPORTS``) → the seconds of one weight sync with it (per-GB model)."""

    def switch_costs(self, weight_gb: float | None = None) -> dict[str, float]:
        """``sim.*`` key → seconds at ``weight_gb`` (default: the file's own ``weight_gb``)."""
        size = self.weight_gb if weight_gb is None else weight_gb
        return {key: cost.seconds(size) for key, cost in self.costs.items()}

    def sync_seconds(self, transport: str, weight_gb: float | None = None) -> float:
        """Seconds of one weight sync with ``transport`` at ``weight_gb`` (default: the file's)."""
        if transport not in self.weight_sync:
            raise CalibrationError(f"calibration {self.name}: no weight_sync entry for transport {transport!r} "
                                   f"(it has: {', '.join(self.weight_sync) or 'none'})")
        return self.weight_sync[transport].seconds(self.weight_gb if weight_gb is None else weight_gb)


def list_calibrations() -> list[str]:
    """The names of the calibration files shipped in this folder."""
    return sorted(p.stem for p in CALIBRATION_DIR.glob("*.yaml"))


def resolve_calibration_path(name_or_path: str | os.PathLike[str]) -> Path:
    """An existing file, else a name in this folder (``qwen35-35b-judgement``)."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    shipped = CALIBRATION_DIR / (str(name_or_path).removesuffix(".yaml") + ".yaml")
    if shipped.is_file():
        return shipped
    raise CalibrationError(f"no file or calibration named {str(name_or_path)!r} "
                           f"(shipped: {', '.join(list_calibrations()) or 'none'})")


def _number(value: Any, where: str, *, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or value in (float("inf"), float("-inf")):
        raise CalibrationError(f"{where}: must be a number (got {value!r})")
    if value < 0 or (positive and value == 0):
        raise CalibrationError(f"{where}: must be {'> 0' if positive else '>= 0'} (got {value!r})")
    return float(value)


def _costs(entries: Any, known: tuple[str, ...], where: str, what: str) -> dict[str, Cost]:
    """A ``costs`` or ``weight_sync`` mapping: name → ``Cost``, each with its source."""
    if entries is None:
        return {}
    if not isinstance(entries, Mapping):
        raise CalibrationError(f"{where}: must be a mapping of {', '.join(known)}")
    parsed = {}
    for key, entry in entries.items():
        at = f"{where}.{key}"
        if key not in known:
            raise CalibrationError(f"{at}: unknown {what} (known: {', '.join(known)})")
        if not isinstance(entry, Mapping) or set(entry) - {"fixed_s", "per_gb_s", "source"}:
            raise CalibrationError(f"{at}: must be a mapping of fixed_s, per_gb_s and source")
        source = entry.get("source")
        if not isinstance(source, str) or not source.strip():
            raise CalibrationError(f"{at}.source: every number needs its source")
        parsed[key] = Cost(_number(entry.get("fixed_s", 0.0), f"{at}.fixed_s"),
                           _number(entry.get("per_gb_s", 0.0), f"{at}.per_gb_s"), source.strip())
    return parsed


def parse_calibration(doc: Any, *, where: str = "calibration") -> Calibration:
    """Check a calibration document (a mapping, as read from YAML) and return it parsed."""
    if not isinstance(doc, Mapping):
        raise CalibrationError(f"{where}: must hold a mapping, not {type(doc).__name__}")
    if doc.get("format") != FORMAT:
        raise CalibrationError(f"{where}: format must be {FORMAT!r} (got {doc.get('format')!r})")
    unknown = set(doc) - {"format", "name", "device", "measured", "weight_gb", "costs", "weight_sync", "note"}
    if unknown:
        raise CalibrationError(f"{where}: unknown key {sorted(unknown)[0]!r}")
    costs = _costs(doc.get("costs"), CALIBRATED_KEYS, f"{where}: costs", "switch cost")
    sync = _costs(doc.get("weight_sync"), TRANSPORTS, f"{where}: weight_sync", "transport")
    if not costs and not sync:
        raise CalibrationError(f"{where}: costs must be a non-empty mapping of {', '.join(CALIBRATED_KEYS)} "
                               f"(or weight_sync one of {', '.join(TRANSPORTS)})")
    text = {k: doc.get(k) for k in ("name", "device", "measured", "note")}
    for k in ("name", "device", "measured"):  # YAML reads an unquoted 2026-12-01 as a date
        if not isinstance(text[k], (str, datetime.date)) or not str(text[k]).strip():
            raise CalibrationError(f"{where}: {k} must be a non-empty string")
    return Calibration(name=str(text["name"]), device=str(text["device"]), measured=str(text["measured"]),
                       weight_gb=_number(doc.get("weight_gb"), f"{where}: weight_gb", positive=True),
                       costs=costs, note=str(text["note"] or ""), weight_sync=sync)


def load_calibration(name_or_path: str | os.PathLike[str]) -> Calibration:
    """Read and check a calibration file (a path, or a name shipped in this folder)."""
    path = resolve_calibration_path(name_or_path)
    try:
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise CalibrationError(f"cannot read {path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise CalibrationError(f"{path}: malformed YAML ({getattr(exc, 'problem', None) or exc})") from None
    return parse_calibration(doc, where=str(path))


def dump_calibration(cal: Calibration) -> str:
    """The YAML text of ``cal`` (``load_calibration`` reads it back to an equal ``Calibration``)."""
    def plain(costs: dict[str, Cost]) -> dict[str, dict[str, Any]]:
        return {k: {"fixed_s": c.fixed_s, "per_gb_s": c.per_gb_s, "source": c.source} for k, c in costs.items()}

    doc: dict[str, Any] = {"format": FORMAT, "name": cal.name, "device": cal.device, "measured": cal.measured,
                           "weight_gb": cal.weight_gb}
    if cal.costs:
        doc["costs"] = plain(cal.costs)
    if cal.weight_sync:
        doc["weight_sync"] = plain(cal.weight_sync)
    if cal.note:
        doc["note"] = cal.note
    head = "# A Tidal calibration file: the twin's switch costs (seconds = fixed_s + per_gb_s × weight GB).\n"
    return head + yaml.safe_dump(doc, sort_keys=False, allow_unicode=True, width=100)


def apply_calibration(data: Any) -> Any:
    """A ``sim`` section's raw mapping with the switch costs of its ``calibration`` filled in.

    The calibration fills the switch costs the section does not set itself (a key written in a
    preset or given with ``--set`` wins, like over any default); they are computed at
    ``calibration_weight_gb`` when given, else at the file's own ``weight_gb``. Where the file has a
    ``weight_sync`` model, ``broadcast_sync_s`` and ``hybrid_sync_s`` are its entries for the
    section's ``broadcast_transport`` and ``hybrid_transport`` (over the file's ``costs``); a
    transport the model lacks is an error. Anything that is not a mapping naming a calibration is
    returned unchanged.
    """
    if not isinstance(data, Mapping) or data.get("calibration") is None:
        return data
    name = data["calibration"]
    if not isinstance(name, str) or not name.strip():
        raise CalibrationError(f"calibration: must be a file or a calibration name (got {name!r})")
    size = data.get("calibration_weight_gb")
    if size is not None:
        size = _number(size, "calibration_weight_gb", positive=True)
    cal = load_calibration(name)
    filled = cal.switch_costs(size)
    if cal.weight_sync:
        for key, (transport_key, default, known) in SYNC_KEYS.items():
            if key in data:
                continue
            transport = data.get(transport_key, default)
            if transport not in known:
                raise CalibrationError(f"{transport_key}: unknown transport {transport!r} (known: {', '.join(known)})")
            if transport not in cal.weight_sync:
                raise CalibrationError(f"{transport_key}: calibration {cal.name} has no weight_sync entry for "
                                       f"{transport!r} (it has: {', '.join(cal.weight_sync)}); set {key} or "
                                       f"another transport")
            filled[key] = cal.sync_seconds(transport, size)
    return {**filled, **data}

"""The config reference (every key, default, limits, meaning) rendered from the schema itself.

The table lives in docs/config.md between START_MARK and END_MARK; `python -m config.reference`
(default target docs/config.md) rewrites it in place, and tests/test_readme.py keeps it in step.
"""

from __future__ import annotations

from collections.abc import Iterator

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from config.schema import TidalConfig


def _limits(field: FieldInfo) -> str:
    parts = []
    for meta in field.metadata:
        for attr, sym in (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<")):
            value = getattr(meta, attr, None)
            if value is not None:
                parts.append(f"{sym} {value}")
    return ", ".join(parts)


def _default(field: FieldInfo) -> str:
    if field.default is PydanticUndefined:
        return "(section)" if field.default_factory else "(required)"
    value = field.default
    if isinstance(value, bool):
        return str(value).lower()
    return "null" if value is None else repr(value).replace("'", "")


def _is_section(field: FieldInfo) -> bool:
    ann = field.annotation
    return isinstance(ann, type) and issubclass(ann, BaseModel)


def iter_fields(model: type[BaseModel] = TidalConfig, prefix: str = "") -> Iterator[tuple[str, FieldInfo]]:
    """(dotted key, field) for every leaf of the schema, in declaration order."""
    for name, field in model.model_fields.items():
        if _is_section(field):
            yield from iter_fields(field.annotation, f"{prefix}{name}.")  # type: ignore[arg-type]
        else:
            yield f"{prefix}{name}", field


def markdown_reference() -> str:
    """A markdown table: key | default | limits | meaning."""
    rows = ["| key | default | limits | meaning |", "|---|---|---|---|"]
    for key, field in iter_fields():
        meaning = " ".join((field.description or "").split()).replace("|", "\\|")
        rows.append(f"| `{key}` | `{_default(field)}` | {_limits(field)} | {meaning} |")
    return "\n".join(rows) + "\n"


START_MARK = "<!-- config-reference:start -->"
END_MARK = "<!-- config-reference:end -->"


def splice_into(text: str) -> str:
    """``text`` with the part between the markers replaced by the current reference table."""
    head, start, rest = text.partition(START_MARK)
    _, end, tail = rest.partition(END_MARK)
    if not start or not end:
        raise ValueError(f"markers {START_MARK} … {END_MARK} not found")
    return f"{head}{START_MARK}\n{markdown_reference()}{END_MARK}{tail}"


if __name__ == "__main__":  # python -m config.reference docs/config.md  (rewrites the table in place)
    import sys
    from pathlib import Path

    target = Path(sys.argv[1] if len(sys.argv) > 1 else "docs/config.md")
    target.write_text(splice_into(target.read_text(encoding="utf-8")), encoding="utf-8")

"""Tidal's Prefect server as it ran before it was tuned: for the benchmarks' "before" sides.

Owns: which packages the tuned server runs on that an untuned one did not (``NEW_PACKAGES``), a
folder of stand-ins that make their import fail (``hide``), and Prefect's own values of what
``flows.prefect_server.BATCHED_WRITES`` sets (``prefect_default_writes``, read from Prefect's
settings models). Must not: start anything.
"""

from __future__ import annotations

from pathlib import Path

NEW_PACKAGES = ("uvloop", "httptools")
"""The event loop and HTTP parser of Tidal's server (``flows.prefect_app.server_command``)."""


def hide(folder: str | Path, by: str) -> str:
    """Write into ``folder`` one module per ``NEW_PACKAGES`` whose import fails; return ``folder``
    (put it first on a ``PYTHONPATH`` and those packages are as if not installed)."""
    for name in NEW_PACKAGES:
        Path(folder, f"{name}.py").write_text(f"raise ImportError('{name} is hidden by {by}')\n", encoding="utf-8")
    return str(folder)


def prefect_default_writes() -> dict[str, str]:
    """Prefect's own defaults for every setting ``BATCHED_WRITES`` changes, as environment values."""
    from prefect.settings.models.server.services import (
        ServerServicesEventPersisterSettings,
        ServerServicesTaskRunRecorderSettings,
    )

    models = {"TASK_RUN_RECORDER": ServerServicesTaskRunRecorderSettings,
              "EVENT_PERSISTER": ServerServicesEventPersisterSettings}
    return {f"PREFECT_SERVER_SERVICES_{service}_{field.upper()}": str(model.model_fields[field].default)
            for service, model in models.items() for field in ("batch_size", "flush_interval")}

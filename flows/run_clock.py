"""A run's real wall clock: one span per driver session (a run, then each resume), in the run folder.

Owns ``<run>/sessions.json`` (``[{"started_at": t, "ended_at": t}, ...]``, wall-clock seconds) and
reading back the summed elapsed time that ``tidal runs`` shows beside the summed step times. Must
not: touch the store (the folder is the run's own record) or raise on a missing or broken file
when reading (an old run simply has no clock).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

SESSIONS_FILE = "sessions.json"


def _write(path: Path, sessions: list[dict[str, float]]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(sessions) + "\n", encoding="utf-8")
    os.replace(tmp, path)  # a reader never sees half a file


def read_sessions(out_dir: str | os.PathLike[str]) -> list[dict[str, float]]:
    """The run's sessions, oldest first; ``[]`` when the file is missing or unreadable."""
    try:
        data = json.loads((Path(out_dir) / SESSIONS_FILE).read_text(encoding="utf-8"))
        return [{"started_at": float(s["started_at"]), "ended_at": float(s["ended_at"])} for s in data]
    except (OSError, ValueError, TypeError, KeyError):
        return []


def elapsed_s(out_dir: str | os.PathLike[str]) -> float | None:
    """Summed wall clock of every session (start to its last tick); None without a clock file."""
    sessions = read_sessions(out_dir)
    if not sessions:
        return None
    return sum(max(0.0, s["ended_at"] - s["started_at"]) for s in sessions)


class SessionClock:
    """This driver session's span, after the earlier sessions' ones: each ``tick`` moves its end
    to now and writes the file (a killed driver's span ends at its last tick: its last committed
    step). Nothing is written before the first tick."""

    def __init__(self, out_dir: str | os.PathLike[str], started_at: float | None = None) -> None:
        self.path = Path(out_dir) / SESSIONS_FILE
        self.sessions = read_sessions(out_dir)
        start = time.time() if started_at is None else started_at
        self.sessions.append({"started_at": start, "ended_at": start})

    def tick(self, now: float | None = None) -> None:
        self.sessions[-1]["ended_at"] = max(self.sessions[-1]["started_at"], time.time() if now is None else now)
        _write(self.path, self.sessions)

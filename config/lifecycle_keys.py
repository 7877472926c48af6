"""Config section for a driver's lifecycle: its lease on the run and what its terminal shows.

Owns: `lifecycle.*` with its limits. Must not: import anything of ours (the lease itself is
`storage.lease`, the driver side `flows.lifecycle`, the display `flows.progress`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class LifecycleSection(BaseModel):
    """`lifecycle.*`: one driver per run (a lease in the store) and the terminal's display."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)

    lease_timeout_s: float = Field(30.0, gt=0, le=86_400)
    """A driver whose heartbeat is older than this is dead: `tidal runs` shows its run as
    `interrupted` and the next `tidal resume` takes its lease over (on the same host, a driver
    whose process is gone is dead at once)."""

    heartbeat_interval_s: float = Field(5.0, gt=0, le=3_600)
    """How often the driver renews its lease."""

    progress: Literal["auto", "live", "lines"] = "auto"
    """Terminal display of `tidal run` / `resume`: `live` = a rich live display (start-up stages,
    step bar with ETA, phase, last step's numbers), `lines` = one plain line per step, `auto` =
    live on a terminal, lines otherwise."""

    @model_validator(mode="after")
    def _heartbeat_within_timeout(self) -> LifecycleSection:
        if self.heartbeat_interval_s >= self.lease_timeout_s:
            raise ValueError(f"lifecycle.heartbeat_interval_s ({self.heartbeat_interval_s}) must be below "
                             f"lifecycle.lease_timeout_s ({self.lease_timeout_s})")
        return self

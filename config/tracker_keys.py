"""`trainer.logger` and `tracking.*`: which experiment trackers get every committed step's metrics.

Owns the tracker names (verl's `trainer.logger` values Tidal supports), the rule that a single
name means a one-item list (as in verl), and where the W&B and MLflow backends write. Must not
import a tracker package: the trackers themselves live in ``flows.trackers`` and load lazily.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict

TrackerName = Literal["console", "file", "tensorboard", "wandb", "mlflow"]
"""One backend of `trainer.logger` (verl's names)."""


def _as_list(value: object) -> object:
    """verl accepts `logger: console` as well as `logger: [console, wandb]`; duplicates go."""
    if isinstance(value, str):
        value = [value]
    if isinstance(value, (list, tuple)):
        return list(dict.fromkeys(value))
    return value


TrackerList = Annotated[list[TrackerName], BeforeValidator(_as_list)]
"""`trainer.logger`: a list of tracker names, or one name."""

DEFAULT_LOGGER: list[str] = ["console", "file"]
"""`trainer.logger` by default: the terminal and `<run>/metrics.jsonl` (pydantic copies it per config)."""


class TrackingSection(BaseModel):
    """`tracking.*`: where the W&B and MLflow trackers of `trainer.logger` write."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)

    wandb_mode: Literal["offline", "online"] = "offline"
    """W&B mode: `offline` writes the run under `<run>/wandb/` and needs no network or account
    (upload it later with `wandb sync`); `online` streams to the W&B server (needs a login)."""

    mlflow_tracking_uri: str | None = None
    """MLflow tracking URI; null = a SQLite file in the run folder (`<run>/mlflow.db`; MLflow's
    plain-folder store is in maintenance mode). `$MLFLOW_TRACKING_URI` does not override this."""

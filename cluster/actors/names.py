"""The names of a run's actors inside its Ray namespace (any process finds them by name)."""

from __future__ import annotations

ROLLOUT_SERVICE = "rollout"
TRAINER = "trainer"
CONTROLLER = "controller"


def replica_name(replica_id: str) -> str:
    """A standalone replica's actor name (replacements included: ``replica:standalone-I.rK``)."""
    return f"replica:{replica_id}"

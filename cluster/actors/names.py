"""The names of a run's actors inside its Ray namespace (any process finds them by name)."""

from __future__ import annotations

ROLLOUT_SERVICE = "rollout"
TRAINER = "trainer"
CONTROLLER = "controller"


def replica_name(replica_id: str) -> str:
    """A standalone replica's actor name (replacements included: ``replica:standalone-I.rK``)."""
    return f"replica:{replica_id}"



def actor_gone(name: str, lookup_error: ValueError) -> Exception:
    """What to raise when ``ray.get_actor(name, ...)`` found no such actor in a running run.

    An actor that died (killed, out of memory, its node lost) is no longer found by name: that is
    the run losing an actor, at whichever moment of a phase it happened, so it is Ray's
    ``RayActorError`` (what ``flows.errors.actor_lost`` reads), not the ``ValueError`` of a name
    that was never registered.
    """
    import ray

    return ray.exceptions.RayActorError(error_msg=f"the run's actor {name!r} is gone ({lookup_error})")

"""The names of a run's actors inside its Ray namespace (any process finds them by name)."""

from __future__ import annotations

ROLLOUT_SERVICE = "rollout"
TRAINER = "trainer"
CONTROLLER = "controller"


def replica_name(replica_id: str) -> str:
    """A standalone replica's actor name (replacements included: ``replica:standalone-I.rK``)."""
    return f"replica:{replica_id}"


def run_actor(name: str, namespace: str) -> object:
    """The handle of the run's actor ``name``. An actor that died (killed, out of memory, its node
    lost) is no longer found by name: that is the run losing an actor at whichever moment of a
    phase it happened, so it is raised as Ray's ``RayActorError`` (what ``flows.errors.actor_lost``
    reads), not as the ``ValueError`` of a name that was never registered."""
    import ray

    try:
        return ray.get_actor(name, namespace=namespace)
    except ValueError as e:
        raise ray.exceptions.RayActorError(error_msg=f"the run's actor {name!r} is gone ({e})") from e

"""The Ray actors of one run, one module each, named inside the run's Ray namespace.

- ``ReplicaActor`` (``replica``): one standalone rollout replica.
- ``TrainerActor`` (``trainer``): the train backend *and* the hybrid replicas' engines, in one
  process, so lending the trainer's GPU to rollout really time-shares the same device.
- ``RolloutService`` (``rollout_service``): load balancer + message queue + rollouter in one event
  loop; with replica starters it also replaces dead standalone replicas.
- ``ControllerActor`` (``controller_actor``): the typed API of a step around the
  ``DynamicResourceController``, and the owner of the run's replica membership.
- ``RemoteEngine`` (``remote_engine``): what the rollouter calls ``generate`` on.

Any process finds an actor with ``ray.get_actor(name, namespace=run_uid)`` (``names``).
Constructors take plain values and factories, never the whole config (``cluster.builders``).
"""

from cluster.actors.controller_actor import ControllerActor, ControllerHost, call
from cluster.actors.names import CONTROLLER, ROLLOUT_SERVICE, TRAINER, actor_gone, replica_name
from cluster.actors.remote_engine import RemoteEngine, actor_is_dead, kill_actor
from cluster.actors.replica import ReplicaActor, generate_each
from cluster.actors.rollout_service import RolloutService
from cluster.actors.trainer import TrainerActor

__all__ = [
    "CONTROLLER",
    "ROLLOUT_SERVICE",
    "TRAINER",
    "ControllerActor",
    "ControllerHost",
    "RemoteEngine",
    "ReplicaActor",
    "RolloutService",
    "TrainerActor",
    "actor_gone",
    "actor_is_dead",
    "call",
    "generate_each",
    "kill_actor",
    "replica_name",
]

"""A run's actor that died is looked up by name as a lost actor (exit 3), whichever moment of a
phase the lookup falls on: the CI run where the trainer was killed between two phases exited 1
with Ray's ``ValueError`` of an unknown name."""

from __future__ import annotations

import time
import types

import ray

from cluster.actors import TRAINER
from tasks.phases import _actor
from flows.errors import actor_lost


@ray.remote(num_cpus=0)
class _Named:
    def ping(self) -> str:
        return "pong"


def test_a_killed_named_actor_is_found_as_a_lost_actor_not_an_unknown_name(ray_address):
    namespace = "test-actor-lookup"
    actor = _Named.options(name=TRAINER, namespace=namespace, lifetime="detached").remote()
    run = types.SimpleNamespace(namespace=namespace, ray_address=ray_address)
    assert ray.get(_actor(run, TRAINER).ping.remote()) == "pong"
    ray.kill(actor, no_restart=True)
    for _ in range(100):  # the name is released once the GCS has seen the death
        try:
            _actor(run, TRAINER)
        except ray.exceptions.RayActorError as exc:
            lost = actor_lost(exc, uid="u1", last_step=2, storage_arg="sqlite:///s.db")
            break
        time.sleep(0.1)
    else:
        raise AssertionError("the killed actor was still found by name")
    assert lost is not None and lost.exit_code == 3
    assert "the run's actor 'trainer' is gone" in str(lost) and str(lost).endswith(
        "resume with: tidal resume u1 --storage 'sqlite:///s.db'")

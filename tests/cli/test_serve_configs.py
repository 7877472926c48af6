"""`python -m flows.serve` checks every deployment's config as `tidal run` would, before serving."""

from __future__ import annotations

from flows.serve import config_errors, deployment_specs


def test_every_shipped_deployment_has_a_config_that_loads():
    assert config_errors(deployment_specs()) == []


def test_a_deployment_with_a_bad_override_or_policy_is_named_with_the_key_in_one_line():
    specs = [
        {"name": "good", "parameters": {"config": "tiny-cpu", "overrides": []}},
        {"name": "bad-key", "parameters": {"config": "tiny-cpu", "overrides": ["async_training.staleness=1"]}},
        {"name": "bad-policy", "parameters": {"config": "tiny-cpu",
                                              "overrides": ["async_training.dynamic_schedule_policy=greedy"]}},
    ]
    errors = config_errors(specs)
    assert [e.split(":")[0] for e in errors] == ["training-run/bad-key", "training-run/bad-policy"]
    assert "async_training.staleness: unknown key" in errors[0] and "greedy" in errors[1]
    assert all("\n" not in e for e in errors)

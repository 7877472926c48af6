"""Prefect tasks: one thin adapter per phase of a training step.

Holds `should_deactivate`, `wait_for_samples`, `train`, `broadcast_sync`, `should_activate`, `hybrid_sync`,
`lend`, `update_after_step` and `commit` (``tasks.phases``) — each a few lines around one actor call;
retries only on the questions, which the controller answers once per step.
May import: cluster, policies, metrics, storage, config, loop. Must not: import flows or hold logic
that belongs in the controller or a policy.
"""

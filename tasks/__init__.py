"""Prefect tasks: one thin adapter per phase of a training step.

Holds `begin_step`, `wait_and_deactivate`, `train`, `broadcast_sync`, `after_sync`, `hybrid_sync`,
`lend`, `end_step` and `commit_step` (``tasks.phases``) — each a few lines around one actor call;
retries only on the questions, which the controller answers once per step.
May import: cluster, policies, metrics, storage, config, loop. Must not: import flows or hold logic
that belongs in the controller or a policy.
"""

"""Prefect tasks: one thin adapter per phase of a training step.

Will hold `should_deactivate`, `wait_for_samples`, `train`, `broadcast_sync`, `should_activate`,
`hybrid_sync`, `activate`, `update_policy` and `commit_step` — each 5-15 lines around one actor
call or one pure function; retries only on idempotent calls.
May import: cluster, policies, metrics, storage, config. Must not: import flows or hold logic
that belongs in the controller or a policy.
"""

"""Scheduling policies: when to lend trainer GPUs to rollout and when to take them back.

Owns: the policy API (base class, context, hook order), the registry (decorator, entry-point
group `tidal.policies`, `module:Class` strings), the built-ins `default`, `fixed_ratio`,
`static_fully_async`, `predictive`, and the opt-in guard rails.
Must not: import Ray, torch or anything of ours but `config`; read the clock (time arrives as
`ctx.now`); log; do I/O. A policy's whole memory is its `state_dict()`.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING

from policies.base import DynamicScheduleContext, DynamicSchedulePolicyBase
from policies.builtin import (
    DefaultDynamicSchedulePolicy,
    FixedRatioDynamicSchedulePolicy,
    StaticFullyAsyncPolicy,
)
from policies.guard import GuardedPolicy
from policies.predictive import PredictiveDynamicSchedulePolicy
from policies.registry import (
    ENTRY_POINT_GROUP,
    UnknownPolicyError,
    build_policy,
    register_policy,
    registered_policies,
    resolve_policy_class,
)

if TYPE_CHECKING:
    from config import TidalConfig


def policy_from_config(cfg: TidalConfig) -> DynamicSchedulePolicyBase:
    """Build the configured policy, wrapped in guard rails only when some are switched on."""
    a = cfg.async_training
    options: dict[str, object] = {
        "deactivate_ratio": a.dynamic_schedule_deactivate_ratio,
        "only_hybrid": cfg.only_hybrid,
    }
    cls = resolve_policy_class(a.dynamic_schedule_policy)
    if a.dynamic_schedule_prior_switch_s is not None:
        if "prior_switch_s" not in inspect.signature(cls).parameters:
            raise UnknownPolicyError(
                f"async_training.dynamic_schedule_prior_switch_s: policy {a.dynamic_schedule_policy!r} takes no "
                "switch-cost prior (`default` and `predictive` do); unset it"
            )
        options["prior_switch_s"] = a.dynamic_schedule_prior_switch_s
    policy = cls(**options)
    if a.dynamic_schedule_min_dwell_s > 0:
        policy = GuardedPolicy(policy, min_dwell_s=a.dynamic_schedule_min_dwell_s)
    return policy


def context_from_config(cfg: TidalConfig, **runtime: object) -> DynamicScheduleContext:
    """A context with the run's static fields filled in; runtime fields as keyword arguments."""
    return DynamicScheduleContext(
        required_samples=cfg.required_samples,
        trigger_parameter_sync_step=cfg.async_training.trigger_parameter_sync_step,
        buffer_samples=cfg.buffer_samples,
        only_hybrid=cfg.only_hybrid,
        standalone_replicas=cfg.standalone_replicas,
        hybrid_replicas=cfg.hybrid_replicas,
        **runtime,  # type: ignore[arg-type]
    )


__all__ = [
    "ENTRY_POINT_GROUP",
    "DefaultDynamicSchedulePolicy",
    "PredictiveDynamicSchedulePolicy",
    "DynamicScheduleContext",
    "DynamicSchedulePolicyBase",
    "FixedRatioDynamicSchedulePolicy",
    "GuardedPolicy",
    "StaticFullyAsyncPolicy",
    "UnknownPolicyError",
    "build_policy",
    "context_from_config",
    "policy_from_config",
    "register_policy",
    "registered_policies",
    "resolve_policy_class",
]

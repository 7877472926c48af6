"""Setups a plan compares: every static split of the same GPUs, and the dynamic variants."""

from __future__ import annotations

from typing import Any

from config import ConfigError, TidalConfig, to_plain, validate

MAX_GPUS_PER_NODE = 64  # the schema's limit on n_gpus_per_node


def _nodes(gpus: int, per_node: int) -> tuple[int, int]:
    """(nnodes, n_gpus_per_node) for ``gpus``: keep the node size when it divides, else one node."""
    if gpus == 0:
        return 0, per_node
    if gpus % per_node == 0:
        return gpus // per_node, per_node
    if gpus <= MAX_GPUS_PER_NODE:
        return 1, gpus
    raise ConfigError(f"cannot lay out {gpus} GPUs on nodes of {per_node} (or one node of at most {MAX_GPUS_PER_NODE})")


def _rebuild(cfg: TidalConfig, changes: dict[str, dict[str, Any]]) -> TidalConfig:
    data = to_plain(cfg)
    for section, values in changes.items():
        data[section].update(values)
    return validate(data)


def with_split(cfg: TidalConfig, train_gpus: int, rollout_gpus: int) -> TidalConfig:
    """``cfg`` with ``train_gpus`` trainer GPUs and ``rollout_gpus`` standalone rollout GPUs."""
    t_nodes, t_per = _nodes(train_gpus, cfg.trainer.n_gpus_per_node)
    r_nodes, r_per = _nodes(rollout_gpus, cfg.rollout.n_gpus_per_node)
    return _rebuild(
        cfg,
        {
            "trainer": {"nnodes": t_nodes, "n_gpus_per_node": t_per},
            "rollout": {"nnodes": r_nodes, "n_gpus_per_node": r_per},
        },
    )


def with_policy(cfg: TidalConfig, policy: str, *, dynamic: bool | None = None) -> TidalConfig:
    """``cfg`` running ``policy``; ``dynamic`` switches dynamic resource scheduling on or off."""
    a: dict[str, Any] = {"dynamic_schedule_policy": policy}
    if dynamic is not None:
        a["use_dynamic_resource_scheduling"] = dynamic
    return _rebuild(cfg, {"async_training": a})


def static_splits(cfg: TidalConfig) -> list[tuple[str, TidalConfig]]:
    """Every static split ``train + rollout`` of ``cfg``'s GPUs, in replica-size steps.

    Each has at least one trainer replica's worth of GPUs and one rollout replica, dynamic
    scheduling off and policy ``static_fully_async``. Labels read ``static 8+24``.
    """
    total, step = cfg.trainer_gpus + cfg.standalone_gpus, cfg.gpus_per_replica
    static = with_policy(cfg, "static_fully_async", dynamic=False)
    return [
        (f"static {train}+{total - train}", with_split(static, train, total - train))
        for train in range(step, total - step + 1, step)
    ]

"""What the simulator needs from a config, as one flat dataclass of plain numbers.

``spec_from_config`` is the only place that reads a ``TidalConfig``; the simulator itself is built
from a ``SimSpec`` (so tests vary it with ``dataclasses.replace``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, make_dataclass

from config import ConfigError, TidalConfig
from config.schema import SimSection


@dataclass(frozen=True)
class _RunShape:
    """Sizes and staleness rules of one simulated run (``SimSpec`` adds the cost model)."""

    steps: int
    """Tidal steps (weight syncs) to simulate."""
    prompts: int = 0
    """Prompts the rollouter may start (the data budget); at least what ``steps`` steps train
    on. 0 = exactly that."""
    required_samples: int = 16
    """Samples per micro-step."""
    trigger_parameter_sync_step: int = 4
    """Micro-steps per step."""
    max_required_samples: int = 96
    """Queue capacity and the cap on samples started per param version."""
    buffer_samples: int = 32
    """step_required_samples × staleness_threshold (a policy input)."""
    n: int = 8
    """Responses per sample."""
    concurrent_samples_per_replica: int = 8
    """Rollouter concurrency per active replica."""
    standalone_replicas: int = 1
    hybrid_replicas: int = 0
    gpus_per_replica: int = 1
    trainer_gpus: int = 1
    standalone_gpus: int = 1
    partial_rollout: bool = True
    enable_rebalance: bool = True
    overlap_hybrid_sync: bool = False
    """Sync the lent hybrids during the broadcast (``dynamic_schedule_overlap_hybrid_sync``)."""
    only_hybrid: bool = False
    response_length: int = 4096
    """Hard cap on response tokens."""
    standalone_deaths: tuple[tuple[float, int], ...] = ()
    """``(virtual second, standalone number)``: that standalone replica dies then. It leaves the
    balancer for good (no replacement), and what it was generating is retried elsewhere. Once all
    have died the policy's context says ``standalone_lost`` (``LostStandaloneGuard`` then lends
    after every sync). Not a config key: scenarios set it with ``dataclasses.replace``. A run
    whose last standalone dies while the hybrids sleep and the trainer waits refills as production
    does (``loop.guards.stranded_refill``, asked after each ``STRANDED_POLL_S`` slice of the wait)."""
    admission_lookahead: int = 0
    """Length-aware admission (issue 45 item 3, a twin study; not a config key): the rollouter
    draws this many upcoming prompts ahead and starts the one predicted to run longest first; 0 =
    first come, first started (off). The prediction is the sample's true mean response length
    times a log-normal error of ``admission_predict_sigma`` (what earlier epochs measured of the
    same prompt; 0 = known exactly, an upper bound)."""
    admission_predict_sigma: float = 0.0
    route_by_length: bool = False
    """Length-aware routing (twin study, not a config key): while hybrids are lent, a sample
    predicted longer than the length model's mean goes to the least-loaded standalone, a shorter
    one to the least-loaded lent hybrid (each only while that side holds fewer than
    ``concurrent_samples_per_replica`` a replica; else least-loaded over all), so a take-back
    aborts less. Retries keep the same rule."""

    @property
    def operation_s(self) -> dict[str, float]:
        """What each switch operation (``loop.switches``, by name) costs the twin: the calibrated
        switch seconds (config ``sim.deactivate_s``, ``hybrid_sync_s``, ``activate_s``,
        ``rebalance_s``) are a take-back's sleep, a hybrid sync's load, a lend's route and a
        rebalance's drain; every other operation is free."""
        return {"sleep": self.deactivate_s, "load_weights": self.hybrid_sync_s, "add": self.activate_s,
                "drain": self.rebalance_s}

    @property
    def step_required_samples(self) -> int:
        return self.required_samples * self.trigger_parameter_sync_step

    @property
    def total_gpus(self) -> int:
        return self.trainer_gpus + self.standalone_gpus

    @property
    def total_samples(self) -> int:
        """Prompts the rollouter may start: the data budget, never less than the steps need."""
        return max(self.prompts, self.steps * self.step_required_samples)


_SIM_KEYS = tuple(name for name in SimSection.model_fields if name not in ("calibration", "calibration_weight_gb"))
"""SimSpec's cost model: the ``sim.*`` keys, but the calibration's (they fill the others when the
config loads; the simulator never reads them). Same names in the config and in SimSpec."""

SimSpec = make_dataclass(
    "SimSpec",
    [(name, SimSection.model_fields[name].annotation, field(default=SimSection.model_fields[name].default))
     for name in _SIM_KEYS],
    bases=(_RunShape,), frozen=True,
)
SimSpec.__module__ = __name__  # for pickling (make_dataclass takes ``module=`` only from Python 3.12)
SimSpec.__doc__ = """One simulated run: the sizes and staleness rules of ``_RunShape``, then the cost model
(seconds, tokens): every ``sim.*`` key but the calibration's, with the type and default that
``config.schema.SimSection`` gives it and documents (that class is the one owner of the list)."""


def data_budget(cfg: TidalConfig) -> int:
    """Prompts in the run: ``rollout.total_rollout_steps``, else the task's prompts × epochs."""
    return cfg.rollout.total_rollout_steps or cfg.task.num_prompts * cfg.rollout.total_epochs


def resolve_steps(cfg: TidalConfig, steps: int | None = None) -> int:
    """``steps``, else ``trainer.total_training_steps``, else the data budget in whole steps."""
    if steps is not None:
        if steps < 1:
            raise ConfigError(f"steps: must be >= 1 (got {steps})")
        return steps
    if cfg.trainer.total_training_steps is not None:
        return cfg.trainer.total_training_steps
    prompts = data_budget(cfg)
    if prompts < cfg.step_required_samples:
        raise ConfigError(
            f"rollout.total_rollout_steps: {prompts} prompts do not fill one step of "
            f"{cfg.step_required_samples} samples"
        )
    return prompts // cfg.step_required_samples


# SimSpec fields that are ``TidalConfig`` properties (the run's sizes) of the same name.
_RUN_SIZES = (
    "required_samples", "max_required_samples", "buffer_samples", "standalone_replicas", "hybrid_replicas",
    "gpus_per_replica", "trainer_gpus", "standalone_gpus", "only_hybrid",
)


def spec_from_config(cfg: TidalConfig, steps: int | None = None) -> SimSpec:
    """Flatten a config into a ``SimSpec``; ``steps`` overrides the config's step budget."""
    a, r = cfg.async_training, cfg.actor_rollout_ref.rollout
    return SimSpec(
        steps=resolve_steps(cfg, steps),
        prompts=data_budget(cfg),
        trigger_parameter_sync_step=a.trigger_parameter_sync_step,
        n=r.n,
        concurrent_samples_per_replica=a.concurrent_samples_per_replica,
        partial_rollout=a.partial_rollout,
        enable_rebalance=a.dynamic_schedule_enable_rebalance,
        overlap_hybrid_sync=a.dynamic_schedule_overlap_hybrid_sync,
        response_length=r.response_length,
        **{name: getattr(cfg, name) for name in _RUN_SIZES},
        **{name: getattr(cfg.sim, name) for name in _SIM_KEYS},
    )

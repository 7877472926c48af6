"""What the simulator needs from a config, as one flat dataclass of plain numbers.

``spec_from_config`` is the only place that reads a ``TidalConfig``; the simulator itself is built
from a ``SimSpec`` (so tests vary it with ``dataclasses.replace``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from config import ConfigError, TidalConfig
from config.schema import SimSection


@dataclass(frozen=True)
class SimSpec:
    """One simulated run: sizes, staleness rules and the cost model (seconds, tokens)."""

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
    only_hybrid: bool = False
    initial_hybrid_active: bool = False
    prompt_tokens: int = 256
    response_length: int = 4096
    """Hard cap on response tokens."""
    response_len_mean_start: float = 1024.0
    response_len_mean_end: float = 1024.0
    response_len_sigma: float = 0.6
    prompt_len_sigma: float = 0.5
    decode_step_base_s: float = 0.02
    decode_step_per_seq_s: float = 1e-4
    max_num_seqs: int = 256
    hybrid_max_num_seqs: int = 0
    """A hybrid replica's ``max_num_seqs`` (0 = ``max_num_seqs``)."""
    speculative_speedup: float = 1.0
    """Tokens per sequence per decode iteration (MTP); divides both iteration costs."""
    prefill_tokens_per_s: float = 50000.0
    hybrid_throughput_factor: float = 0.8
    train_tokens_per_gpu_s: float = 5000.0
    train_step_overhead_s: float = 0.0
    broadcast_sync_s: float = 5.0
    hybrid_sync_s: float = 3.0
    activate_s: float = 0.5
    deactivate_s: float = 3.0
    rebalance_s: float = 0.5
    step_overhead_s: float = 0.0
    task_overhead_s: float = 0.0
    """Control-plane seconds before each phase of a step (in Tidal one Prefect task per
    ``loop`` intent: begin, wait-and-deactivate, every train micro-step, broadcast, the lend
    question, hybrid sync, lend, update); ``step_overhead_s`` is then the rest (flow run, commit).
    Config key ``sim.task_overhead_s``; ``benchmarks/bench_emulated.py`` measures it."""
    sync_aborts: bool = True
    """The broadcast sync aborts what the routable replicas are generating and resumes it after
    (re-prefilling it), as verl's partial rollout does; False = Tidal's engines: the standalone
    replicas only stall for ``broadcast_sync_s`` while loading and keep their requests. Config key
    ``sim.sync_aborts`` (the presets are calibrated with True); ``benchmarks/bench_emulated.py`` uses both."""
    standalone_deaths: tuple[tuple[float, int], ...] = ()
    """``(virtual second, standalone number)``: that standalone replica dies then. It leaves the
    balancer for good (no replacement), and what it was generating is retried elsewhere. Once all
    have died the policy's context says ``standalone_lost`` (``LostStandaloneGuard`` then lends
    after every sync). Not a config key: scenarios set it with ``dataclasses.replace``. Not
    modelled: production's stranded refill, so a run whose last standalone dies while the hybrids
    are asleep and the queue is short stalls (``SimulationStalled``)."""

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
# SimSpec fields that are ``sim.*`` keys of the same name (the cost model): all but the calibration's.
_SIM_KEYS = tuple(f.name for f in fields(SimSpec) if f.name in SimSection.model_fields)


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
        response_length=r.response_length,
        **{name: getattr(cfg, name) for name in _RUN_SIZES},
        **{name: getattr(cfg.sim, name) for name in _SIM_KEYS},
    )

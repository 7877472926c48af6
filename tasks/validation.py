"""The `validate` task: one validation pass on the run's routable standalone replicas.

A thin adapter: the run's resolved config gives the validation dataset, the scorer and
``rollout.val_kwargs``; ``data.validation`` does the work. Never retried (it generates).
"""

from __future__ import annotations

import logging
from pathlib import Path

import ray

from cluster.actors import ROLLOUT_SERVICE
from cluster.data_builders import dataset_for, response_length, sample_scorer, tokenizer_for
from config import load_config
from config.loader import RESOLVED_FILENAME
from data.validation import run_validation, val_sampling
from tasks.phases import _actor, phase
from tasks.run_ref import RunRef

log = logging.getLogger(__name__)


@phase("validate")
def validate(run: RunRef, step: int, before_train: bool = False) -> dict[str, float]:
    """``val-core/<data_source>/reward/mean@<n>`` of the current weights (suffixed
    ``/before_train`` for the pass before step 1); {} when no standalone replica is routable."""
    cfg = load_config(Path(run.output_dir) / RESOLVED_FILENAME)
    tokenizer = tokenizer_for(cfg)
    dataset = dataset_for(cfg, tokenizer, split="val")
    if dataset is None:
        return {}
    service = _actor(run, ROLLOUT_SERVICE)
    handles = ray.get(service.standalone_handles.remote())
    routable = ray.get(service.stats.remote())["standalone_replicas"]
    replicas = {rid: (lambda reqs, h=handles[rid]: ray.get(h.generate_batch.remote(list(reqs))))
                for rid in routable if rid in handles}
    if not replicas:
        log.warning("step %d: no routable standalone replica, validation skipped", step)
        return {}
    vk = cfg.actor_rollout_ref.rollout.val_kwargs
    sampling = val_sampling(max_new_tokens=response_length(cfg),
                            temperature=vk.temperature, top_p=vk.top_p, do_sample=vk.do_sample)
    metrics = run_validation(dataset, replicas, sample_scorer(cfg, dataset, tokenizer), n=vk.n, sampling=sampling,
                             tag=f"{step}{'b' if before_train else ''}")
    suffix = "/before_train" if before_train else ""
    return {f"{key}{suffix}": value for key, value in metrics.items()}

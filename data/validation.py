"""Validation: every validation prompt's ``n`` responses, scored, averaged per ``data_source``.

Owns: the validation requests (ids ``val{tag}-p{index}-r{j}``, sampling from
``rollout.val_kwargs``, a fixed seed per request so a repeated validation is comparable), spreading
them over the standalone replicas, and the metrics ``val-core/<data_source>/reward/mean@<n>``.
Must not: read a config, import Ray (the caller hands in the replicas' batch calls), or touch the
rollouter's prompts (validation prompts are never trained on and never counted as consumed).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Mapping, Sequence

from data.datasets import RLDataset
from data.reward import SampleScorer
from data.types import GenerationRequest, GenerationResult, Response, Sample, SamplingSpec

GenerateBatch = Callable[[Sequence[GenerationRequest]], Sequence["GenerationResult | BaseException"]]
"""One replica's ``generate_batch`` (blocking): results in request order, an exception per failure."""


def val_sampling(*, max_new_tokens: int, temperature: float, top_p: float, do_sample: bool) -> SamplingSpec:
    """``rollout.val_kwargs`` as a request's sampling; ``do_sample=false`` is greedy."""
    return SamplingSpec(max_new_tokens=max_new_tokens, temperature=temperature if do_sample else 0.0,
                        top_p=top_p if do_sample else 1.0)


def validation_requests(dataset: RLDataset, *, n: int, sampling: SamplingSpec, tag: str) -> list[GenerationRequest]:
    """``n`` requests per validation prompt, in dataset order."""
    out = []
    for row in dataset.rows:
        for j in range(n):
            rid = f"val{tag}-p{row.index}-r{j}"
            seed = int.from_bytes(hashlib.blake2b(f"val:{row.index}:{j}".encode(), digest_size=4).digest(), "big")
            out.append(GenerationRequest(rid, list(row.prompt_tokens), dataclasses.replace(sampling, seed=seed & 0x7FFFFFFF)))
    return out


def run_validation(dataset: RLDataset, replicas: Mapping[str, GenerateBatch], scorer: SampleScorer, *, n: int,
                   sampling: SamplingSpec, tag: str, attempts: int = 3) -> dict[str, float]:
    """Generate on ``replicas`` (requests dealt round-robin), score, and return
    ``val-core/<data_source>/reward/mean@<n>`` per source. A request that comes back aborted (a
    replica paused for a sync) is sent again, up to ``attempts`` times in all; then it fails. A
    replica whose call raises (it died: a killed replica's actor call fails) is left out from
    then on, and its requests go to the others in the next attempt."""
    if not replicas:
        raise RuntimeError("validation needs at least one standalone replica")
    pending = validation_requests(dataset, n=n, sampling=sampling, tag=tag)
    done: dict[str, GenerationResult] = {}
    ids = sorted(replicas)
    for attempt in range(attempts):
        if not pending:
            break
        shares = {rid: pending[k::len(ids)] for k, rid in enumerate(ids)}
        pending = []
        for rid, share in shares.items():
            try:
                results = replicas[rid](share) if share else []
            except Exception as exc:  # noqa: BLE001 - the replica is gone; its share is re-dealt
                ids.remove(rid)
                if attempt == attempts - 1 or not ids:
                    raise RuntimeError(f"validation failed: replica {rid} failed ({exc!r}) and "
                                       f"{'no replica is left' if not ids else 'no attempt is left'}") from None
                pending.extend(share)
                continue
            for request, result in zip(share, results):
                if isinstance(result, BaseException) or result.finish_reason == "abort":
                    if attempt == attempts - 1:
                        raise RuntimeError(f"validation request {request.request_id} failed on {rid}: {result!r}")
                    pending.append(request)
                else:
                    done[request.request_id] = result
    return validation_metrics(dataset, done, scorer, n=n, tag=tag)


def validation_metrics(dataset: RLDataset, results: Mapping[str, GenerationResult], scorer: SampleScorer, *,
                       n: int, tag: str) -> dict[str, float]:
    """Score each prompt's ``n`` results as one sample; the mean score per ``data_source``."""
    by_source: dict[str, list[float]] = {}
    for row in dataset.rows:
        responses = [Response(tokens=list(results[f"val{tag}-p{row.index}-r{j}"].tokens)) for j in range(n)]
        sample = scorer(Sample(f"val{tag}-p{row.index}", 0, row.index, list(row.prompt_tokens), responses, 0))
        by_source.setdefault(row.data_source, []).extend(sample.scores or [])
    return {f"val-core/{source}/reward/mean@{n}": sum(v) / len(v) for source, v in sorted(by_source.items())}

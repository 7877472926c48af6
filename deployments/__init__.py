"""Prefect deployments of the `training-run` flow: ``deployments/prefect.yaml``.

Owns: the deployment definitions (one per preset: ``training-run/tiny-cpu`` on CPU,
``training-run/gpu-vllm`` on a CUDA node), their shared ``definitions:`` (the ``tidal-process``
process work pool, tags, entrypoint) and their parameters (``config``: preset or YAML path;
``overrides``: ``key=value`` strings, as ``tidal run --set``). ``prefect deploy --prefect-file
deployments/prefect.yaml --all`` registers them for a worker; ``python -m flows.serve`` serves
the same ones without a work pool. docs/deployment.md has the commands.
Must not: hold flow or task logic (that lives in ``flows`` and ``tasks``).
May import: flows, config. Nothing imports this package.
"""

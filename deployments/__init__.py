"""Prefect deployments (to be built; see issue 5): `prefect.yaml` and the `serve` entry.

May import: flows. Nothing imports this package.
"""

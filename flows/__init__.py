"""Prefect flows (`training_step`, `training_run`, `simulate`) and the `tidal` command line.

A flow reads like a table of contents of DESIGN §2; the CLI is parse → build → run → clean up.
May import: tasks, cluster, config, storage, sim, policies, metrics. Must not: be imported by any
package below it.
"""

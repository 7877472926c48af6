"""Config section `ray.placement.*`: where a run's actors go on a multi-node Ray cluster.

Owns the schema of these keys (node role labels, the wait for placement groups). Must not import
Ray, torch or anything of Tidal's outside `config`; the placement itself is `cluster/placement.py`.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class PlacementSection(BaseModel):
    """`ray.placement.*`: node roles and how long placement may take.

    On a cluster whose nodes carry the role label (``ray start --labels='tidal.io/role=trainer'``),
    the trainer's ranks (and its hybrid replicas) are placed on trainer nodes and each standalone
    replica on a rollout node, through placement groups (one bundle per trainer node, one per GPU
    of a replica). A cluster without the label anywhere (a local one-node cluster) is placed
    without roles. Actors ask for Ray's ``GPU`` where the cluster advertises it, else for the
    emulated ``tidal_gpu``.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)

    role_label: str = Field("tidal.io/role", min_length=1, max_length=317)
    """Node label key naming a node's role; its values are `trainer_role` and `rollout_role`."""

    trainer_role: str = Field("trainer", min_length=1, max_length=63)
    """Label value of the nodes that host the trainer and its hybrid replicas."""

    rollout_role: str = Field("rollout", min_length=1, max_length=63)
    """Label value of the nodes that host the standalone replicas."""

    timeout_s: float = Field(20.0, gt=0.0, le=3600.0)
    """Seconds the run waits for its placement groups to be placed before it fails (exit 2)
    naming what could not be placed; never an endless wait on an unschedulable group."""

"""Initial schema: runs, steps and everything a step commits.

Revision ID: 0001
Revises:
Create Date: 2026-05-20
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

# In creation order; downgrade drops them in reverse (children first).
TABLES = (
    "runs",
    "steps",
    "policy_states",
    "metrics",
    "switch_events",
    "decisions",
    "checkpoints",
    "consumed_prompts",
)


def _id() -> sa.Column:
    return sa.Column("id", sa.Integer(), nullable=False)


def _timestamps() -> list[sa.Column]:
    now = sa.text("CURRENT_TIMESTAMP")
    return [
        sa.Column("created", sa.DateTime(timezone=True), server_default=now, nullable=False),
        sa.Column("updated", sa.DateTime(timezone=True), server_default=now, nullable=False),
    ]


def _step_columns() -> list[sa.Column]:
    return [
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
    ]


def _step_key(table: str) -> sa.ForeignKeyConstraint:
    return sa.ForeignKeyConstraint(
        ["run_id", "step"],
        ["steps.run_id", "steps.step"],
        name=f"fk_{table}_run_id_step_steps",
        ondelete="CASCADE",
    )


def _step_table(
    table: str, *columns: sa.Column, unique: tuple[str, ...] = (), index: bool = False
) -> None:
    """Create a table of per-step records: id, (run_id, step), ``columns``, the timestamps, the
    primary key, a unique constraint on ``unique`` (if any) and the foreign key to the step; with
    ``index``, an index on (run_id, step). Constraint names follow the models' naming convention."""
    constraints: list[sa.Constraint] = [sa.PrimaryKeyConstraint("id", name=f"pk_{table}")]
    if unique:
        constraints.append(sa.UniqueConstraint(*unique, name=f"uq_{table}_{'_'.join(unique)}"))
    op.create_table(table, _id(), *_step_columns(), *columns, *_timestamps(), *constraints, _step_key(table))
    if index:
        op.create_index(f"ix_{table}_run_id_step", table, ["run_id", "step"])


def upgrade() -> None:
    op.create_table(
        "runs",
        _id(),
        sa.Column("uid", sa.String(64), nullable=False),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("project", sa.String(200), nullable=False),
        sa.Column("policy", sa.String(200), nullable=False),
        sa.Column("seed", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("config_json", sa.JSON(), nullable=False),
        sa.Column("output_dir", sa.String(1024), nullable=False),
        *_timestamps(),
        sa.PrimaryKeyConstraint("id", name="pk_runs"),
        sa.UniqueConstraint("uid", name="uq_runs_uid"),
        sa.CheckConstraint("status IN ('running', 'finished', 'failed')", name="ck_runs_status"),
    )
    op.create_table(
        "steps",
        _id(),
        *_step_columns(),
        sa.Column("param_version", sa.Integer(), nullable=False),
        sa.Column("started_at", sa.Double(), nullable=False),
        sa.Column("finished_at", sa.Double(), nullable=False),
        sa.Column("wall_s", sa.Double(), nullable=False),
        sa.Column("hybrid_active_after", sa.Boolean(), nullable=False),
        sa.Column("controller_state_json", sa.JSON(), nullable=False),
        sa.Column("data_position_json", sa.JSON(), nullable=False),
        *_timestamps(),
        sa.PrimaryKeyConstraint("id", name="pk_steps"),
        sa.UniqueConstraint("run_id", "step", name="uq_steps_run_id_step"),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name="fk_steps_run_id_runs", ondelete="CASCADE"
        ),
    )
    _step_table("policy_states", sa.Column("state_json", sa.JSON(), nullable=False), unique=("run_id", "step"))
    _step_table(
        "metrics",
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("value", sa.Double(), nullable=True),
        unique=("run_id", "step", "name"),
    )
    _step_table(
        "switch_events",
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("started_at", sa.Double(), nullable=False),
        sa.Column("duration_s", sa.Double(), nullable=False),
        sa.Column("phases_json", sa.JSON(), nullable=False),
        sa.Column("aborted", sa.Integer(), nullable=False),
        index=True,
    )
    _step_table(
        "decisions",
        sa.Column("hook", sa.String(64), nullable=False),
        sa.Column("answer_json", sa.JSON(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("inputs_json", sa.JSON(), nullable=False),
        sa.Column("duration_s", sa.Double(), nullable=False),
        index=True,
    )
    _step_table(
        "checkpoints",
        sa.Column("path", sa.String(1024), nullable=False),
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        unique=("run_id", "step"),
    )
    _step_table(
        "consumed_prompts",
        sa.Column("epoch", sa.Integer(), nullable=False),
        sa.Column("prompt_index", sa.Integer(), nullable=False),
        unique=("run_id", "epoch", "prompt_index"),
        index=True,
    )

def downgrade() -> None:
    # Dropping a table drops its indexes too.
    for table in reversed(TABLES):
        op.drop_table(table)

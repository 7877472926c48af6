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
    op.create_table(
        "policy_states",
        _id(),
        *_step_columns(),
        sa.Column("state_json", sa.JSON(), nullable=False),
        *_timestamps(),
        sa.PrimaryKeyConstraint("id", name="pk_policy_states"),
        sa.UniqueConstraint("run_id", "step", name="uq_policy_states_run_id_step"),
        _step_key("policy_states"),
    )
    op.create_table(
        "metrics",
        _id(),
        *_step_columns(),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("value", sa.Double(), nullable=True),
        *_timestamps(),
        sa.PrimaryKeyConstraint("id", name="pk_metrics"),
        sa.UniqueConstraint("run_id", "step", "name", name="uq_metrics_run_id_step_name"),
        _step_key("metrics"),
    )
    op.create_table(
        "switch_events",
        _id(),
        *_step_columns(),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("started_at", sa.Double(), nullable=False),
        sa.Column("duration_s", sa.Double(), nullable=False),
        sa.Column("phases_json", sa.JSON(), nullable=False),
        sa.Column("aborted", sa.Integer(), nullable=False),
        *_timestamps(),
        sa.PrimaryKeyConstraint("id", name="pk_switch_events"),
        _step_key("switch_events"),
    )
    op.create_index("ix_switch_events_run_id_step", "switch_events", ["run_id", "step"])
    op.create_table(
        "decisions",
        _id(),
        *_step_columns(),
        sa.Column("hook", sa.String(64), nullable=False),
        sa.Column("answer_json", sa.JSON(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("inputs_json", sa.JSON(), nullable=False),
        sa.Column("duration_s", sa.Double(), nullable=False),
        *_timestamps(),
        sa.PrimaryKeyConstraint("id", name="pk_decisions"),
        _step_key("decisions"),
    )
    op.create_index("ix_decisions_run_id_step", "decisions", ["run_id", "step"])
    op.create_table(
        "checkpoints",
        _id(),
        *_step_columns(),
        sa.Column("path", sa.String(1024), nullable=False),
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        *_timestamps(),
        sa.PrimaryKeyConstraint("id", name="pk_checkpoints"),
        sa.UniqueConstraint("run_id", "step", name="uq_checkpoints_run_id_step"),
        _step_key("checkpoints"),
    )
    op.create_table(
        "consumed_prompts",
        _id(),
        *_step_columns(),
        sa.Column("epoch", sa.Integer(), nullable=False),
        sa.Column("prompt_index", sa.Integer(), nullable=False),
        *_timestamps(),
        sa.PrimaryKeyConstraint("id", name="pk_consumed_prompts"),
        sa.UniqueConstraint(
            "run_id", "epoch", "prompt_index", name="uq_consumed_prompts_run_id_epoch_prompt_index"
        ),
        _step_key("consumed_prompts"),
    )
    op.create_index("ix_consumed_prompts_run_id_step", "consumed_prompts", ["run_id", "step"])


def downgrade() -> None:
    # Dropping a table drops its indexes too.
    for table in reversed(TABLES):
        op.drop_table(table)

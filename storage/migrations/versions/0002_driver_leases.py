"""Driver leases (one driver per run) and the ``interrupted`` run status.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

OLD_STATUSES = "status IN ('running', 'finished', 'failed')"
NEW_STATUSES = "status IN ('running', 'finished', 'failed', 'interrupted')"


def _status_check(condition: str) -> None:
    with op.batch_alter_table("runs") as batch:  # SQLite rebuilds the table; PostgreSQL alters it
        batch.drop_constraint("ck_runs_status", type_="check")
        batch.create_check_constraint("ck_runs_status", condition)


def upgrade() -> None:
    now = sa.text("CURRENT_TIMESTAMP")
    op.create_table(
        "driver_leases",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("created", sa.DateTime(timezone=True), server_default=now, nullable=False),
        sa.Column("updated", sa.DateTime(timezone=True), server_default=now, nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("driver_id", sa.String(64), nullable=False),
        sa.Column("host", sa.String(255), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("pid_started", sa.BigInteger(), nullable=False),
        sa.Column("acquired_at", sa.Double(), nullable=False),
        sa.Column("heartbeat_at", sa.Double(), nullable=False),
        sa.Column("timeout_s", sa.Double(), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name="fk_driver_leases_run_id_runs", ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name="pk_driver_leases"),
        sa.UniqueConstraint("run_id", name="uq_driver_leases_run_id"),
    )
    _status_check(NEW_STATUSES)


def downgrade() -> None:
    op.execute("UPDATE runs SET status = 'running' WHERE status = 'interrupted'")
    _status_check(OLD_STATUSES)
    op.drop_table("driver_leases")

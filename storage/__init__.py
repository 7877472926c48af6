"""The SQL store (to be built; see issue 5): SQLAlchemy 2 models, store functions, migrations.

Will own: runs, steps, policy states, metrics, switch events, checkpoints and consumed prompts;
SQLite (WAL, busy timeout) by default and PostgreSQL by URL. Store functions take a Session,
flush and never commit: the caller owns the transaction.
May import: config. Must not: import Ray, torch, cluster, tasks or flows.
"""

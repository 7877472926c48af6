"""Fault campaign, invalid input: bad CLI calls (store URLs, unknown runs, simulate options,
missing files, unknown keys) exit 2 with one line, start nothing and write no run row.

Complements tests/cli/test_cli_bad_input.py (malformed configs through `config check` and
`tidal run`); together they hold well over 30 cases. Every call here runs the real `main` in
process with the flow entry points replaced by tripwires, so "nothing started" is checked, not
assumed: no training flow, no simulator run, no store file or output folder created.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.ports import free_port
from flows.cli import main
from storage import create_run, list_runs, make_engine, migrate, session_scope

SECRET = "s3cr3t-pw"


@pytest.fixture
def tripwires(monkeypatch):
    """Fail the test if a training run or a simulation is started."""
    started: list[str] = []

    def trip(name):
        def _called(*args, **kwargs):
            started.append(name)
            raise AssertionError(f"{name} was started on bad input")
        return _called

    import flows.simulate
    import flows.training_run

    monkeypatch.setattr(flows.training_run, "training_run", trip("training_run"))
    monkeypatch.setattr(flows.simulate, "simulate_main", trip("simulate_main"))
    return started


@pytest.fixture
def store(tmp_path):
    """A migrated SQLite store holding one run whose resolved config file is missing."""
    url = f"sqlite:///{tmp_path}/store.db"
    engine = make_engine(url)
    migrate(engine)
    with session_scope(engine) as s:
        create_run(s, uid="orphan", name="o", project="p", policy="default", seed=0, config={},
                   output_dir=str(tmp_path / "gone"))
    engine.dispose()
    return url


def _listing(folder: Path) -> list[str]:
    """What is in ``folder``, without SQLite's WAL side files (reading a store makes them)."""
    return sorted(p.name for p in folder.iterdir() if not p.name.endswith(("-wal", "-shm")))


def _run_ids(url: str) -> list[str]:
    engine = make_engine(url)
    try:
        with session_scope(engine) as s:
            return [r.uid for r in list_runs(s)]
    finally:
        engine.dispose()


# (id, argv with {tmp}, {store}, {port} placeholders, text the one-line reason must contain)
BAD_CALLS = [
    ("resume-malformed-url", ["resume", "r1", "--storage", "not a url"], "not a database URL"),
    ("resume-unsupported-backend", ["resume", "r1", "--storage", "mysql://u@localhost/db"], "unsupported store backend 'mysql'"),
    ("resume-unreachable-postgres", ["resume", "r1", "--storage", f"postgresql://u:{SECRET}@127.0.0.1:{{port}}/db"], "cannot open the store"),
    ("resume-missing-sqlite-file", ["resume", "r1", "--storage", "sqlite:///{tmp}/nowhere/store.db"], "no store at"),
    ("resume-unknown-run", ["resume", "no-such-run", "--storage", "{store}"], "no such run"),
    ("resume-run-without-its-config", ["resume", "orphan", "--storage", "{store}"], "resolved config"),
    ("resume-missing-argument", ["resume"], "Missing argument"),
    ("runs-malformed-url", ["runs", "--storage", "::::"], "not a database URL"),
    ("runs-unsupported-backend", ["runs", "--storage", "oracle://x"], "unsupported store backend 'oracle'"),
    ("runs-unreachable-postgres", ["runs", "--storage", f"postgres://u:{SECRET}@127.0.0.1:{{port}}/db"], "cannot open the store"),
    ("runs-missing-sqlite-file", ["runs", "--storage", "sqlite:///{tmp}/none.db"], "no store at"),
    ("runs-not-a-tidal-store", ["runs", "--storage", "sqlite:///{tmp}/other.db"], "no such table"),
    ("report-unknown-run", ["report", "no-such-run", "--storage", "{store}"], "no such run"),
    ("report-malformed-url", ["report", "r1", "--storage", "not a url"], "not a database URL"),
    ("report-missing-sqlite-file", ["report", "r1", "--storage", "sqlite:///{tmp}/none.db"], "no store at"),
    ("simulate-steps-not-a-number", ["simulate", "tiny-cpu", "--steps", "abc"], "--steps"),
    ("simulate-steps-negative", ["simulate", "tiny-cpu", "--steps", "-3"], "--steps"),
    ("simulate-seed-negative", ["simulate", "tiny-cpu", "--seed", "-1"], "--seed"),
    ("simulate-seed-not-a-number", ["simulate", "tiny-cpu", "--seed", "x1"], "--seed"),
    ("simulate-unknown-policy", ["simulate", "tiny-cpu", "--policy", "greedy"], "unknown dynamic scheduling policy 'greedy'"),
    ("simulate-policy-module-missing", ["simulate", "tiny-cpu", "--policy", "no_such_mod:Pol"], "cannot import module"),
    ("simulate-missing-file", ["simulate", "{tmp}/missing.yaml"], "no file or preset named"),
    ("simulate-unknown-top-level-key", ["simulate", "tiny-cpu", "--set", "bogus=1"], "bogus: unknown key"),
    ("run-missing-file", ["run", "{tmp}/missing.yaml"], "no file or preset named"),
    ("run-unknown-top-level-key", ["run", "tiny-cpu", "--set", "bogus=1"], "bogus: unknown key"),
    ("run-wrong-type", ["run", "tiny-cpu", "--set", "trainer.total_training_steps=many"], "total_training_steps"),
    ("run-unreachable-postgres", ["run", "tiny-cpu", "--set", f"storage.url=postgresql://u:{SECRET}@127.0.0.1:{{port}}/db"], "cannot open the store"),
    ("run-store-folder-impossible", ["run", "tiny-cpu", "--set", "storage.url=sqlite:///{tmp}/afile/store.db"], "cannot create the store's folder"),
    ("config-show-unknown-preset", ["config", "show", "no-such-preset"], "no file or preset named"),
]


@pytest.mark.parametrize(("argv", "expected"), [c[1:] for c in BAD_CALLS], ids=[c[0] for c in BAD_CALLS])
def test_a_bad_cli_call_exits_2_in_one_line_and_starts_nothing(tmp_path, capsys, monkeypatch, tripwires, store,
                                                              argv, expected):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("a file where a folder is needed\n")
    (tmp_path / "other.db").touch()
    if "psycopg" in expected or any("postgres" in a for a in argv):
        pytest.importorskip("psycopg", reason="psycopg 3 is not installed")
    port = free_port()  # nothing listens here
    argv = [a.replace("{tmp}", str(tmp_path)).replace("{store}", store).replace("{port}", str(port)) for a in argv]
    argv += ["--set", f"trainer.default_local_dir={tmp_path}/runs"] if argv[0] in ("run", "simulate") else []
    before = _listing(tmp_path)

    code = main(argv)

    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    assert err.count("\n") == 1 and err.startswith("tidal: error: "), err
    assert expected in err, err
    assert "Traceback" not in err and SECRET not in err and SECRET not in out
    assert tripwires == []
    assert _listing(tmp_path) == before  # no store file, no run folder
    assert not (tmp_path / "nowhere").exists()
    assert _run_ids(store) == ["orphan"]  # no run row written


def test_the_tripwires_do_fire(tmp_path, capsys, tripwires, monkeypatch):
    """The guard above can fail: a good `tidal run` reaches the (tripwired) training flow."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(AssertionError, match="training_run was started"):
        main(["run", "tiny-cpu", "--set", f"storage.url=sqlite:///{tmp_path}/s.db",
              "--set", f"trainer.default_local_dir={tmp_path}/runs"])
    assert tripwires == ["training_run"]


def test_a_nonzero_exit_code_of_a_command_is_passed_through(monkeypatch, capsys):
    """`raise typer.Exit(n)` inside a command must come back from `main` as n (it used to be 0)."""
    import flows.simulate

    monkeypatch.setattr(flows.simulate, "simulate_main", lambda **kwargs: 3)
    assert main(["simulate", "tiny-cpu", "--steps", "1"]) == 3


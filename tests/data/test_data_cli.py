"""`tidal data …` builds datasets; `tidal config check` / `tidal run` refuse bad data or a reward
function that cannot load: exit 2, one line, nothing written."""

from __future__ import annotations

import pytest
from data_support import GSM8K_DIR, row

from config import ConfigError, load_config
from data.datasets import write_rows
from data.reward import default_compute_score
from flows.cli import main


def one_error_line(capsys) -> str:
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("tidal: error: "), err
    return err.removeprefix("tidal: error: ").rstrip("\n")


def test_tidal_data_gsm8k_converts_the_real_file_to_verl_parquet(tmp_path, capsys):
    src = GSM8K_DIR / "test.jsonl"
    if not src.is_file():
        pytest.skip(f"GSM8K is not at {src} (set TIDAL_GSM8K_DIR)")
    dest = tmp_path / "gsm8k" / "test.parquet"
    assert main(["data", "gsm8k", str(src), str(dest), "--limit", "300", "--split", "test"]) == 0
    assert capsys.readouterr().out == f"wrote {dest}\n"
    import pyarrow.parquet as pq

    rows = pq.read_table(dest).to_pylist()
    assert len(rows) == 300
    first = rows[0]
    assert (first["data_source"], first["ability"], first["reward_model"], first["extra_info"]["split"],
            first["extra_info"]["index"]) == ("openai/gsm8k", "math", {"style": "rule", "ground_truth": "18"}, "test", 0)
    assert first["prompt"][0]["role"] == "user"
    assert first["prompt"][0]["content"].startswith("Janet")
    assert first["prompt"][0]["content"].endswith('output the final answer after "####".')
    # every converted ground truth is what the strict scorer finds in the reference solution
    assert all(default_compute_score(r["data_source"], r["extra_info"]["answer"], r["reward_model"]["ground_truth"],
                                     {}) == 1.0 for r in rows)


@pytest.mark.parametrize("case", ["missing-src", "no-final-answer", "bad-dest"])
def test_tidal_data_gsm8k_with_bad_input_exits_2_and_writes_nothing(tmp_path, capsys, case):
    src = tmp_path / "gsm8k.jsonl"
    dest = tmp_path / "out" / ("x.csv" if case == "bad-dest" else "x.parquet")
    if case != "missing-src":
        src.write_text('{"question": "q?", "answer": "42"}\n' if case == "no-final-answer"
                       else '{"question": "q?", "answer": "so #### 42"}\n')
    assert main(["data", "gsm8k", str(src), str(dest)]) == 2
    assert one_error_line(capsys) == {
        "missing-src": f"gsm8k: {src}: no such file",
        "no-final-answer": f"gsm8k: {src}:1: column 'answer' does not end in '#### <number>'",
        "bad-dest": f"{dest}: only .parquet and .jsonl files are written",
    }[case]
    assert not (tmp_path / "out").exists()


def bad_data(tmp_path, case: str) -> list[str]:
    path = tmp_path / ("nope.parquet" if case == "missing-file" else "d.jsonl")
    if case == "missing-column":
        write_rows([{k: v for k, v in row().items() if k != "data_source"}], path)
    elif case == "empty-file":
        path.write_text("")
    elif case == "over-long":
        write_rows([row("1+1=" * 10)], path)
    return [f"data.train_files={path}"]


@pytest.mark.parametrize(("case", "expected"), [
    ("missing-file", "data.train_files: {d}/nope.parquet: no such file"),
    ("missing-column", "data.train_files: {d}/d.jsonl:1: missing column 'data_source'"),
    ("empty-file", "data.train_files: {d}/d.jsonl: the file has no rows"),
    ("over-long", "data.train_files: {d}/d.jsonl:1: column 'prompt': prompt has 41 tokens > max_prompt_length 12 "
                  "(set data.filter_overlong_prompts or data.truncation)"),
])
def test_tidal_config_check_of_a_config_with_bad_data_exits_2_in_one_line(tmp_path, capsys, case, expected):
    argv = ["config", "check", "tiny-cpu"]
    for item in bad_data(tmp_path, case):
        argv += ["--set", item]
    assert main(argv) == 2
    assert one_error_line(capsys) == expected.format(d=tmp_path)


def test_data_lengths_that_do_not_fit_the_model_are_refused(capsys):
    assert main(["config", "check", "tiny-cpu", "--set", "data.max_response_length=250"]) == 2
    assert one_error_line(capsys) == ("data.max_prompt_length + max_response_length (12+250) exceeds "
                                      "model.max_seq_len=24")


def test_tidal_run_with_bad_data_starts_nothing_and_writes_no_run(tmp_path, capsys):
    db = tmp_path / "store.db"
    argv = ["run", "tiny-cpu", "--set", f"storage.url=sqlite:///{db}", "--set", f"trainer.default_local_dir={tmp_path}/runs"]
    for item in bad_data(tmp_path, "missing-column"):
        argv += ["--set", item]
    assert main(argv) == 2
    assert one_error_line(capsys) == f"data.train_files: {tmp_path}/d.jsonl:1: missing column 'data_source'"
    assert not db.exists()
    assert not (tmp_path / "runs").exists()


def test_a_good_dataset_and_reward_function_pass_the_check(tmp_path, capsys):
    data = write_rows([row(), row("2+2=", "4")], tmp_path / "d.parquet")
    fn = tmp_path / "r.py"
    fn.write_text("def judge(*a):\n    return 1.0\n")
    assert main(["config", "check", "tiny-cpu", "--set", f"data.train_files={data}", "--set", f"data.val_files={data}",
                 "--set", f"custom_reward_function.path={fn}", "--set", "custom_reward_function.name=judge"]) == 0
    assert capsys.readouterr().out.startswith("ok: tiny-cpu: ")


@pytest.mark.parametrize("case", ["path-missing", "name-missing", "import-fails", "no-built-in-scorer"])
def test_tidal_config_check_refuses_a_reward_function_that_cannot_load(tmp_path, capsys, case):
    fn = tmp_path / "r.py"
    fn.write_text("raise ImportError('no numpy here')\n" if case == "import-fails" else "def other(*a):\n    return 1.0\n")
    sets = [f"custom_reward_function.path={tmp_path / 'nope.py' if case == 'path-missing' else fn}"]
    if case == "no-built-in-scorer":
        sets = [f"data.train_files={write_rows([row(source='my/data')], tmp_path / 'd.jsonl')}"]
    argv = ["config", "check", "tiny-cpu"]
    for item in sets:
        argv += ["--set", item]
    assert main(argv) == 2
    line = one_error_line(capsys)
    assert line == {
        "path-missing": f"custom_reward_function.path: {tmp_path}/nope.py: no such file",
        "name-missing": f"custom_reward_function.name: {fn} has no function 'compute_score'",
        "import-fails": f"custom_reward_function.path: {fn}: importing it failed: ImportError: no numpy here",
        "no-built-in-scorer": line,
    }[case]
    if case == "no-built-in-scorer":
        assert line.startswith("no built-in scorer for data_source 'my/data'")


def test_the_data_keys_take_one_file_or_a_list_and_check_their_rules(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # relative files are made absolute against the working directory
    cfg = load_config("tiny-cpu", ["data.train_files=a.parquet"])
    assert cfg.data.train_files == [f"{tmp_path}/a.parquet"]
    assert load_config("tiny-cpu", ["data.train_files=[a.parquet, /d/b.jsonl]"]).data.train_files == [
        f"{tmp_path}/a.parquet", "/d/b.jsonl"]
    assert (cfg.data.prompt_key, cfg.data.truncation, cfg.data.shuffle, cfg.data.train_max_samples,
            cfg.custom_reward_function.name, cfg.trainer.test_freq, cfg.trainer.val_before_train,
            cfg.actor_rollout_ref.rollout.val_kwargs.n) == ("prompt", "error", True, -1, "compute_score", -1, True, 1)
    for bad, words in [("data.train_files=a.csv", "only .parquet and .jsonl"), ("data.truncation=cut", "truncation"),
                       ("data.train_max_samples=0", "0 rows"),
                       ("actor_rollout_ref.rollout.val_kwargs.n=4", "greedy responses would all be the same"),
                       ("custom_reward_function.timeout_s=0", "timeout_s")]:
        with pytest.raises(ConfigError) as err:
            load_config("tiny-cpu", [bad])
        assert words in str(err.value)

"""The dataset class loads verl's row schema from parquet and jsonl, applies the chat template,
filters, truncates, shuffles with the seed and caps; the default job's prompts are unchanged."""

from __future__ import annotations

import pytest
from data_support import bpe_tokenizer, row

from data.datasets import DatasetError, RLDataset, read_rows, task_rows, truncate, write_rows
from data.problems import CharTokenizer, epoch_order, make_problems, prompt_stream


def load(files, tokenizer=None, **kw):
    kw.setdefault("max_prompt_length", 64)
    return RLDataset.from_files([str(f) for f in files], tokenizer or CharTokenizer(), **kw)


def test_parquet_and_jsonl_give_the_same_rows(tmp_path):
    rows = task_rows("arith", 5, seed=3)
    a = load([write_rows(rows, tmp_path / "d.parquet")])
    b = load([write_rows(rows, tmp_path / "d.jsonl")])
    as_tuples = [(r.index, r.data_source, r.prompt, r.ground_truth, r.ability, r.extra_info, r.prompt_tokens)
                 for r in a.rows]
    assert as_tuples == [(r.index, r.data_source, r.prompt, r.ground_truth, r.ability, r.extra_info, r.prompt_tokens)
                         for r in b.rows]
    p = make_problems("arith", 5, seed=3)
    assert as_tuples[0] == (0, "tidal/arith", [{"role": "user", "content": p[0].prompt}], p[0].answer, "tidal",
                            {"index": 0, "split": "train"}, tuple(CharTokenizer().encode(p[0].prompt)))


def test_a_list_of_files_is_read_in_order_with_one_index_sequence(tmp_path):
    first = write_rows([row("1+1=", "2"), row("2+2=", "4")], tmp_path / "a.parquet")
    second = write_rows([row("3+3=", "6")], tmp_path / "b.jsonl")
    ds = load([first, second])
    assert [(r.index, r.ground_truth, r.origin) for r in ds.rows] == [
        (0, "2", f"{first}:1"), (1, "4", f"{first}:2"), (2, "6", f"{second}:1")]


def test_the_tokenizers_chat_template_is_applied_with_the_generation_prompt(tmp_path):
    tok = bpe_tokenizer()
    ds = load([write_rows([row("12+7=")], tmp_path / "d.parquet")], tok)
    ids = list(ds[0].prompt_tokens)
    assert tok.decode(ids) == "<|im_start|>user\n12+7=<|im_end|>\n<|im_start|>assistant\n"
    assert ids == tok.encode("<|im_start|>user\n12+7=<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)


def test_a_plain_string_prompt_is_encoded_as_is(tmp_path):
    tok = bpe_tokenizer()
    ds = load([write_rows([{**row(), "prompt": "12+7="}], tmp_path / "d.jsonl")], tok)
    assert list(ds[0].prompt_tokens) == tok.encode("12+7=")


@pytest.mark.parametrize(("mode", "expected"), [
    ("left", "cdefg"), ("right", "abcd"), ("middle", "aefg"),
])
def test_each_truncation_mode_keeps_its_part_of_an_over_long_prompt(tmp_path, mode, expected):
    tok = CharTokenizer()
    ds = load([write_rows([{**row(), "prompt": "abcdefg"}], tmp_path / "d.jsonl")], tok,
              max_prompt_length=5, truncation=mode)
    # the character tokenizer prepends <bos>: "<bos>abcdefg" is 8 tokens; middle keeps 2 + 3
    assert tok.decode(ds[0].prompt_tokens) == expected
    assert len(ds[0].prompt_tokens) == 5
    assert truncate(list(range(8)), 5, mode) == {"left": [3, 4, 5, 6, 7], "right": [0, 1, 2, 3, 4],
                                                 "middle": [0, 1, 5, 6, 7]}[mode]


def test_truncation_leaves_a_prompt_that_fits_alone():
    assert truncate([1, 2, 3], 3, "error") == [1, 2, 3]


def test_filter_overlong_prompts_drops_them_and_the_indices_stay_contiguous(tmp_path):
    rows = [row("1+1="), {**row(), "prompt": "x" * 40}, row("2+2=", "4")]
    ds = load([write_rows(rows, tmp_path / "d.jsonl")], max_prompt_length=10, filter_overlong_prompts=True)
    assert [(r.index, r.ground_truth) for r in ds.rows] == [(0, "19"), (1, "4")]
    assert ds.filtered == 1


def test_shuffle_follows_the_seed_and_can_be_switched_off(tmp_path):
    path = write_rows(task_rows("count", 20, seed=0), tmp_path / "d.parquet")
    seeded = [i for _, i, _ in load([path], seed=7).prompt_stream(epochs=2)]
    assert seeded == [i for _, i in epoch_order(20, epochs=2, seed=7)]
    assert seeded != [i for _, i, _ in load([path], seed=8).prompt_stream(epochs=2)]
    assert [i for _, i, _ in load([path], shuffle=False).prompt_stream(epochs=2)] == list(range(20)) * 2


def test_train_max_samples_keeps_a_seeded_subset_in_file_order(tmp_path):
    path = write_rows([row(f"{i}+0=", str(i)) for i in range(30)], tmp_path / "d.jsonl")
    a = [r.ground_truth for r in load([path], max_samples=5, seed=1).rows]
    assert a == [r.ground_truth for r in load([path], max_samples=5, seed=1).rows]
    assert len(a) == 5 and a == sorted(a, key=int)
    assert [r.ground_truth for r in load([path], max_samples=5, shuffle=False).rows] == ["0", "1", "2", "3", "4"]


def test_resume_skips_the_consumed_prompts_and_stops_where_the_whole_run_would(tmp_path):
    ds = load([write_rows(task_rows("count", 10, seed=0), tmp_path / "d.parquet")])
    whole = [(e, i) for e, i, _ in ds.prompt_stream(epochs=2, limit=15)]
    resumed = [(e, i) for e, i, _ in ds.prompt_stream(epochs=2, skip=whole[:6], limit=15)]
    assert resumed == whole[6:]


def test_the_built_in_task_as_a_dataset_gives_the_old_prompt_stream():
    problems = make_problems("copy", 50, seed=2)
    rows = [(f"task:{i}", r) for i, r in enumerate(task_rows("copy", 50, seed=2), 1)]
    ds = RLDataset(rows, CharTokenizer(), max_prompt_length=12, seed=4)
    assert list(ds.prompt_stream(epochs=3, limit=120)) == list(
        prompt_stream(problems, CharTokenizer(), epochs=3, seed=4, limit=120))


def test_the_default_job_trains_on_the_same_prompts_in_the_same_order():
    from cluster.builders import prompt_budget, prompts_for
    from config import load_config

    cfg = load_config("tiny-cpu", [])
    t = cfg.task
    old = prompt_stream(make_problems(t.name, t.num_prompts, t.seed), CharTokenizer(),
                        epochs=cfg.rollout.total_epochs, seed=cfg.trainer.seed, limit=prompt_budget(cfg))
    assert prompts_for(cfg, [(0, 5)]) == [p for p in old if p[:2] != (0, 5)]


@pytest.mark.parametrize(("case", "expected"), [
    ("missing-file", "data.train_files: {dir}/nope.parquet: no such file"),
    ("empty-file", "data.train_files: {dir}/d.jsonl: the file has no rows"),
    ("missing-column", "data.train_files: {dir}/d.jsonl:2: missing column 'reward_model'"),
    ("missing-ground-truth", "data.train_files: {dir}/d.jsonl:1: missing column 'reward_model.ground_truth'"),
    ("bad-prompt", "data.train_files: {dir}/d.jsonl:1: column 'prompt' must be a string or a non-empty list of "
                   "{{role, content}} messages"),
    ("over-long", "data.train_files: {dir}/d.jsonl:1: column 'prompt': prompt has 41 tokens > max_prompt_length 10 "
                  "(set data.filter_overlong_prompts or data.truncation)"),
    ("not-json", "data.train_files: {dir}/d.jsonl:1: not JSON (Expecting value)"),
])
def test_every_dataset_error_is_one_line_naming_the_file_row_and_column(tmp_path, case, expected):
    path = tmp_path / ("nope.parquet" if case == "missing-file" else "d.jsonl")
    content = {
        "empty-file": [],
        "missing-column": [row(), {k: v for k, v in row().items() if k != "reward_model"}],
        "missing-ground-truth": [{**row(), "reward_model": {"style": "rule"}}],
        "bad-prompt": [{**row(), "prompt": [{"role": "user"}]}],
        "over-long": [{**row(), "prompt": "x" * 40}],
    }
    if case == "not-json":
        path.write_text("oops\n")
    elif case != "missing-file":
        write_rows(content[case], path) if content[case] else path.write_text("\n")
    with pytest.raises(DatasetError) as err:
        load([path], max_prompt_length=10)
    assert str(err.value) == expected.format(dir=tmp_path)


def test_read_rows_names_each_row_by_file_and_line(tmp_path):
    path = write_rows([row(), row("2+2=", "4")], tmp_path / "d.jsonl")
    assert [origin for origin, _ in read_rows(str(path))] == [f"{path}:1", f"{path}:2"]

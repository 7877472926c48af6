"""The built-in scorers on real GSM8K answers, the custom-reward loader, the per-call timeout, and
scoring where the sample completes (the rollouter), each failure in one line."""

from __future__ import annotations

import asyncio
import importlib.util
import textwrap
import time

import pytest
from data_support import gsm8k_test_rows

from data.problems import EOS, CharTokenizer, Problem, reward
from data.reward import (
    RewardConfigError,
    RewardFailed,
    SampleScorer,
    call_with_timeout,
    default_compute_score,
    gsm8k_answer,
    load_reward_function,
    score_gsm8k,
    score_math,
    score_tidal,
)
from data.types import GenerationRequest, GenerationResult, Response, Sample, SamplingSpec
from flows.errors import EXIT_REWARD_FAILED, reward_failure
from rollout.load_balancer import LoadBalancer
from rollout.message_queue import MessageQueue
from rollout.rollouter import Rollouter

HAS_MATH_VERIFY = importlib.util.find_spec("math_verify") is not None


def real_answers():
    """(correct response, wrong response, ground truth) from GSM8K's first test question."""
    item = gsm8k_test_rows(1)[0]
    truth = gsm8k_answer(item["answer"])
    wrong = item["answer"].rsplit("####", 1)[0] + f"#### {int(truth) + 1}"
    return item["answer"], wrong, truth


def test_the_gsm8k_scorer_takes_the_strict_final_answer_of_a_real_solution():
    right, wrong, truth = real_answers()
    assert truth == "18"
    assert (score_gsm8k(right, truth), score_gsm8k(wrong, truth)) == (1.0, 0.0)
    assert default_compute_score("openai/gsm8k", right, truth, {}) == 1.0
    assert score_gsm8k(right.replace("#### ", "answer: "), truth) == 0.0  # strict: no #### -> 0
    assert gsm8k_answer("so #### 1,234.") == "1234"


@pytest.mark.skipif(not HAS_MATH_VERIFY, reason="math-verify is not installed (optional extra)")
def test_the_math_scorer_verifies_a_real_gsm8k_answer():
    right, wrong, truth = real_answers()
    final = right.rsplit("####", 1)[1].strip()
    assert score_math(f"The answer is $\\boxed{{{final}}}$", truth) == 1.0
    assert score_math(f"The answer is $\\boxed{{{int(final) + 1}}}$", truth) == 0.0
    assert default_compute_score("lighteval/MATH", f"$\\boxed{{{final}}}$", truth, {}) == 1.0


@pytest.mark.skipif(HAS_MATH_VERIFY, reason="math-verify is installed: the missing-package message cannot show")
def test_math_scoring_without_math_verify_says_what_to_install():
    with pytest.raises(RewardConfigError) as err:
        score_math("\\boxed{18}", "18")
    assert str(err.value) == ("math scoring needs the optional package math-verify (pip install math-verify), "
                              "or set custom_reward_function.path")


@pytest.mark.parametrize("response", ["cccc", "ccc", "ccccc", "", "cab", "c"])
def test_the_tidal_scorer_on_text_equals_the_token_rule_for_a_response_ended_by_eos(response):
    tok = CharTokenizer()
    ids = [*tok.encode(response, bos=False), EOS]
    assert score_tidal(tok.decode(ids), "cccc") == reward(Problem(0, "c4=", "cccc"), ids, tok)


def test_scoring_built_in_task_samples_equals_the_trainers_token_rule_on_any_response():
    import random

    tok = CharTokenizer()
    rng = random.Random(0)
    problems = [Problem(i, "", answer) for i, answer in enumerate(["cccc", "19", "abc"])]
    rows = {p.index: ("tidal/count", p.answer, {}) for p in problems}
    alphabet = [0, 1, EOS, *tok.encode("abc19", bos=False)]
    for _ in range(300):
        p = rng.choice(problems)
        ids = [rng.choice(alphabet) for _ in range(rng.randint(0, 6))]
        if rng.random() < 0.5:  # mostly the answer, then something
            ids = [*tok.encode(p.answer, bos=False), *ids]
        s = Sample("e0-p0", 0, p.index, [1], [Response(tokens=ids)], 0)
        assert SampleScorer(rows, tok)(s).scores == [reward(p, ids, tok)], ids


def test_a_data_source_without_a_built_in_scorer_is_named():
    with pytest.raises(RewardConfigError) as err:
        default_compute_score("my/dataset", "x", "y", {})
    assert str(err.value).startswith("no built-in scorer for data_source 'my/dataset' (built-in: openai/gsm8k, tidal/*")


# ------------------------------------------------------------------------------ the loader


def write_module(tmp_path, body: str):
    path = tmp_path / "my_reward.py"
    path.write_text(textwrap.dedent(body))
    return path


def test_a_custom_function_is_loaded_by_path_and_name(tmp_path):
    path = write_module(tmp_path, """
        def judge(data_source, solution_str, ground_truth, extra_info):
            return {"score": float(solution_str == ground_truth), "length": len(solution_str)}
    """)
    fn = load_reward_function(str(path), "judge")
    assert fn("s", "ab", "ab", {}) == {"score": 1.0, "length": 2}


def test_the_loader_names_a_missing_file_and_a_missing_function(tmp_path):
    path = write_module(tmp_path, "def other(*a):\n    return 0.0\n")
    with pytest.raises(RewardConfigError) as missing_path:
        load_reward_function(str(tmp_path / "nope.py"))
    with pytest.raises(RewardConfigError) as missing_name:
        load_reward_function(str(path))
    assert str(missing_path.value) == f"custom_reward_function.path: {tmp_path}/nope.py: no such file"
    assert str(missing_name.value) == f"custom_reward_function.name: {path} has no function 'compute_score'"


# ------------------------------------------------------------------------------ scoring samples


def sample(uid="e0-p3", index=3, texts=("19", "18")) -> Sample:
    tok = CharTokenizer()
    return Sample(uid, 0, index, [1], [Response(tokens=[*tok.encode(t, bos=False), EOS]) for t in texts], 0)


ROWS = {3: ("tidal/arith", "19", {"index": 3})}


def test_a_finished_sample_gets_one_score_per_response_and_the_extras_are_logged(tmp_path):
    fn = load_reward_function(str(write_module(tmp_path, """
        def compute_score(data_source, solution_str, ground_truth, extra_info):
            return {"score": float(solution_str == ground_truth), "index": extra_info["index"], "note": "x"}
    """)))
    scorer = SampleScorer(ROWS, CharTokenizer(), fn=fn, fn_name="my_reward.py:compute_score")
    s = scorer(sample())
    assert (s.scores, s.reward_extras) == ([1.0, 0.0], [{"index": 3.0}, {"index": 3.0}])
    assert scorer.drain_metrics() == {"reward_extra/index/mean": 3.0}
    assert scorer.drain_metrics() == {}


def test_the_built_in_scorer_is_the_default():
    assert SampleScorer(ROWS, CharTokenizer())(sample()).scores == [1.0, score_tidal("18", "19")]


@pytest.mark.parametrize(("body", "expected"), [
    ("    raise KeyError('answer')\n",
     "reward function my_reward.py:compute_score on sample e0-p3 response 0 raised KeyError: 'answer'"),
    ("    import time\n    time.sleep(30)\n",
     "reward function my_reward.py:compute_score on sample e0-p3 response 0 hung: no answer within 0.2 s "
     "(custom_reward_function.timeout_s)"),
    ("    return 'yes'\n",
     "reward function my_reward.py:compute_score on sample e0-p3 response 0 returned str, not a float or a dict "
     "with 'score'"),
    ("    return {'acc': 1.0}\n",
     "reward function my_reward.py:compute_score on sample e0-p3 response 0 returned a dict without 'score'"),
], ids=["raises", "hangs", "not-a-number", "dict-without-score"])
def test_a_failing_reward_function_fails_in_one_line_naming_the_function_and_the_sample(tmp_path, body, expected):
    fn = load_reward_function(str(write_module(tmp_path, "def compute_score(a, b, c, d):\n" + body)))
    scorer = SampleScorer(ROWS, CharTokenizer(), fn=fn, fn_name="my_reward.py:compute_score", timeout_s=0.2)
    t0 = time.monotonic()
    with pytest.raises(RewardFailed) as err:
        scorer(sample())
    assert time.monotonic() - t0 < 5.0
    assert str(err.value) == expected
    failure = reward_failure(RuntimeError("step failed").with_traceback(None))
    assert failure is None
    wrapped = RuntimeError("the step failed")
    wrapped.__cause__ = err.value
    assert (str(reward_failure(wrapped)), reward_failure(wrapped).exit_code) == (expected, EXIT_REWARD_FAILED)


def test_a_reward_error_carried_as_a_ray_style_cause_is_found():
    class TaskError(Exception):
        def __init__(self, cause):
            super().__init__("long traceback text\nmore")
            self.cause = cause

    assert str(reward_failure(TaskError(RewardFailed("reward function f on sample e0-p1 hung")))) == \
        "reward function f on sample e0-p1 hung"


def test_call_with_timeout_returns_the_value_or_gives_up_on_time():
    assert call_with_timeout(lambda: 7, 1.0) == 7
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        call_with_timeout(lambda: time.sleep(10), 0.1)
    assert time.monotonic() - t0 < 2.0


# ------------------------------------------------------------------------------ in the rollouter


class OneTokenEngine:
    """Answers every request with the tokens of "19" and <eos> (finish: stop)."""

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        ids = [*CharTokenizer().encode("19", bos=False), EOS]
        return GenerationResult(request.request_id, ids, [0.0] * len(ids), "stop", 0, len(request.prompt_tokens))


def run_rollouter(score, count=2):
    async def scenario():
        lb = LoadBalancer(["r"])
        queue = MessageQueue(8)
        ro = Rollouter(((0, i, [1, 5]) for i in range(count)), n=2, sampling=SamplingSpec(max_new_tokens=4), lb=lb,
                       engine_for={"r": OneTokenEngine()}.__getitem__, queue=queue, max_required_samples=8,
                       concurrent_samples_per_replica=4, score=score)
        ro.start()
        try:
            await asyncio.wait_for(ro.wait_exhausted(), 10)
            return sorted((s.uid, s.scores) for s in queue.drain())
        finally:
            await ro.stop()

    return asyncio.run(scenario())


def test_the_rollouter_scores_each_sample_before_it_is_queued():
    rows = {i: ("tidal/arith", "19" if i == 0 else "7", {}) for i in range(2)}
    assert run_rollouter(SampleScorer(rows, CharTokenizer())) == [
        ("e0-p0", [1.0, 1.0]), ("e0-p1", [0.0, 0.0])]


def test_a_reward_function_that_hangs_fails_the_rollouter_in_one_line_and_nothing_waits_forever(tmp_path):
    fn = load_reward_function(str(write_module(tmp_path, "import time\ndef compute_score(*a):\n    time.sleep(60)\n")))
    rows = {i: ("tidal/arith", "19", {}) for i in range(2)}
    scorer = SampleScorer(rows, CharTokenizer(), fn=fn, fn_name="my_reward.py:compute_score", timeout_s=0.2)
    t0 = time.monotonic()
    with pytest.raises(RewardFailed) as err:
        run_rollouter(scorer)
    assert time.monotonic() - t0 < 8.0
    assert str(err.value).startswith("reward function my_reward.py:compute_score on sample e0-p")
    assert str(err.value).endswith(" response 0 hung: no answer within 0.2 s (custom_reward_function.timeout_s)")

"""Reward functions: verl's ``compute_score`` signature, the built-in scorers, the per-call timeout.

Owns: loading ``custom_reward_function.path`` + ``.name``; the built-ins chosen by ``data_source``
(``openai/gsm8k``: strict ``#### n``; math datasets through ``math-verify``, an optional extra;
``tidal/*``: the built-in tasks' rule); running one call with a timeout in a daemon thread (a hung
function never hangs the run); ``SampleScorer``, which scores a finished sample's responses where
the sample completes (the rollouter) and attaches ``Sample.scores`` / ``Sample.reward_extras``.
Must not: read a config, import Ray or the train backends.

Signature: ``fn(data_source, solution_str, ground_truth, extra_info) -> float | dict``; a dict has
``score`` plus numeric extras (logged as ``reward_extra/<key>/mean``).
"""

from __future__ import annotations

import importlib.util
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from data.problems import CharTokenizer
from data.types import Sample

ScoreFn = Callable[[str, str, Any, dict[str, Any]], "float | dict[str, Any]"]

MATH_SOURCES = frozenset({
    "lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500", "math_dapo",
    "BytedTsinghua-SIA/DAPO-Math-17k", "open-r1/DAPO-Math-17k-Processed", "math",
})
"""``data_source`` values scored by ``math-verify``."""


class RewardConfigError(ValueError):
    """A reward function that cannot be loaded (bad input: exit 2 before anything starts)."""


class RewardFailed(RuntimeError):
    """A reward call raised, hung past its timeout or returned something that is not a score;
    ``str()`` is one line naming the function and the sample."""


# ------------------------------------------------------------------------------ built-ins


_GSM8K_STRICT = re.compile(r"#### (-?[0-9.,]+)")


def gsm8k_answer(text: str) -> str | None:
    """The number after the last ``#### `` in ``text`` (commas dropped), None without one."""
    found = _GSM8K_STRICT.findall(text)
    if not found:
        return None
    return found[-1].replace(",", "").rstrip(".")


def score_gsm8k(solution_str: str, ground_truth: Any) -> float:
    """1.0 when the response's strict ``#### n`` equals the ground truth, else 0.0 (verl's
    ``gsm8k`` scorer, strict mode, format score 0)."""
    answer = gsm8k_answer(solution_str[-300:])  # the answer is at the end; bounds the regex's work
    return 1.0 if answer is not None and answer == str(ground_truth).replace(",", "").strip() else 0.0


def score_math(solution_str: str, ground_truth: Any) -> float:
    """1.0 when ``math-verify`` finds the response's final answer equal to the ground truth."""
    try:
        from math_verify import parse, verify
    except ImportError:
        raise RewardConfigError("math scoring needs the optional package math-verify "
                                "(pip install math-verify), or set custom_reward_function.path") from None
    # math-verify's own timeouts use signal.alarm, which works only in a main thread; the call
    # runs in a worker thread under our timeout instead, so its own are switched off.
    gold = parse(str(ground_truth), parsing_timeout=None)
    got = parse(solution_str, parsing_timeout=None)
    return 1.0 if verify(gold, got, timeout_seconds=None) else 0.0


def score_tidal(solution_str: str, ground_truth: Any) -> float:
    """The built-in tasks' dense rule on text: matched prefix of the answer, plus one for nothing
    after it, over (answer length + 1); exactly the answer = 1.0 (``data.problems.reward``'s
    rule, with the end of the text standing in for the end-of-sequence token)."""
    answer = str(ground_truth)
    matched = 0
    for got, want in zip(solution_str, answer):
        if got != want:
            break
        matched += 1
    if matched == len(answer) and len(solution_str) == len(answer):
        matched += 1
    return matched / (len(answer) + 1)


def default_compute_score(data_source: str, solution_str: str, ground_truth: Any,
                          extra_info: dict[str, Any] | None = None) -> float:
    """The built-in scorer for ``data_source``."""
    if data_source == "openai/gsm8k":
        return score_gsm8k(solution_str, ground_truth)
    if data_source in MATH_SOURCES:
        return score_math(solution_str, ground_truth)
    if data_source.startswith("tidal/"):
        return score_tidal(solution_str, ground_truth)
    raise RewardConfigError(f"no built-in scorer for data_source {data_source!r} (built-in: openai/gsm8k, "
                            f"tidal/*, {', '.join(sorted(MATH_SOURCES))}); set custom_reward_function.path")


def check_builtin(data_sources: Sequence[str]) -> None:
    """Fail before the run when some row's ``data_source`` has no built-in scorer, or needs
    ``math-verify`` and it is not installed."""
    for source in sorted(set(data_sources)):
        if source in MATH_SOURCES and importlib.util.find_spec("math_verify") is None:
            raise RewardConfigError(f"data_source {source!r} is scored with math-verify, which is not installed "
                                    "(pip install math-verify), or set custom_reward_function.path")
        if source != "openai/gsm8k" and source not in MATH_SOURCES and not source.startswith("tidal/"):
            default_compute_score(source, "", "")


# ------------------------------------------------------------------------------ loading


def load_reward_function(path: str, name: str = "compute_score") -> ScoreFn:
    """``name`` from the Python file ``path``; a missing file or function is a ``RewardConfigError``."""
    file = Path(path).expanduser()
    key = "custom_reward_function.path"
    if not file.is_file():
        raise RewardConfigError(f"{key}: {path}: no such file")
    spec = importlib.util.spec_from_file_location(f"tidal_custom_reward_{abs(hash(str(file.resolve())))}", file)
    if spec is None or spec.loader is None:
        raise RewardConfigError(f"{key}: {path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - the user's file failed to import: bad input, one line
        raise RewardConfigError(f"{key}: {path}: importing it failed: {type(exc).__name__}: "
                                f"{' '.join(str(exc).split())}") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise RewardConfigError(f"custom_reward_function.name: {path} has no function {name!r}")
    return fn


def call_with_timeout(fn: Callable[[], Any], timeout_s: float) -> Any:
    """``fn()`` in a daemon thread, waited for at most ``timeout_s``: a ``TimeoutError`` then,
    the thread left behind (it cannot be killed, and as a daemon it does not keep the process
    alive); the function's own exception is re-raised."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            box["error"] = exc

    thread = threading.Thread(target=target, name="tidal-reward", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TimeoutError(f"no answer within {timeout_s:g} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


# ------------------------------------------------------------------------------ scoring samples


UNKNOWN = "\ufffd"
"""Stands for a special token inside a built-in-task response, and for a missing end of sequence."""


def response_text(tokenizer: Any, tokens: Sequence[int]) -> str:
    """The ``solution_str`` of a response: an HF tokenizer's decode without special tokens; for the
    built-in character tokenizer the text up to ``<eos>`` with every other special token, and a
    missing ``<eos>``, shown as U+FFFD, so that ``score_tidal`` on it equals the token rule of
    ``data.problems.reward`` exactly (a stray ``<bos>`` breaks the match, a response cut by
    the length budget lacks the end)."""
    if not isinstance(tokenizer, CharTokenizer):
        return tokenizer.decode(list(tokens), skip_special_tokens=True)
    out = []
    for i in tokens:
        if i == tokenizer.eos_id:
            return "".join(out)
        out.append(tokenizer.itos[i] if i >= 3 else UNKNOWN)
    return "".join(out) + UNKNOWN


class SampleScorer:
    """Scores every response of a finished sample with one function, each call under the timeout.

    ``rows`` maps a prompt index to ``(data_source, ground_truth, extra_info)``.
    """

    def __init__(self, rows: Mapping[int, tuple[str, Any, dict[str, Any]]], tokenizer: Any, *,
                 fn: ScoreFn | None = None, fn_name: str = "default_compute_score", timeout_s: float = 30.0) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self._rows = rows
        self._tokenizer = tokenizer
        self._fn = fn or default_compute_score
        self._name = fn_name
        self._timeout_s = float(timeout_s)
        self._extras: dict[str, list[float]] = {}

    def __call__(self, sample: Sample) -> Sample:
        """Set ``sample.scores`` (one float per response) and ``sample.reward_extras``; raise
        ``RewardFailed`` when a call fails."""
        row = self._rows.get(sample.prompt_index)
        if row is None:
            raise RewardFailed(f"sample {sample.uid}: no dataset row with index {sample.prompt_index}")
        source, truth, extra = row
        scores, extras = [], []
        for j, response in enumerate(sample.responses):
            text = response_text(self._tokenizer, response.tokens)
            score, more = self._one(sample.uid, j, source, text, truth, extra)
            scores.append(score)
            extras.append(more)
            for k, v in more.items():
                self._extras.setdefault(k, []).append(v)
        sample.scores, sample.reward_extras = scores, extras
        return sample

    def _one(self, uid: str, j: int, source: str, text: str, truth: Any,
             extra: dict[str, Any]) -> tuple[float, dict[str, float]]:
        where = f"reward function {self._name} on sample {uid} response {j}"
        try:
            out = call_with_timeout(lambda: self._fn(source, text, truth, dict(extra)), self._timeout_s)
        except TimeoutError:
            raise RewardFailed(f"{where} hung: no answer within {self._timeout_s:g} s "
                               "(custom_reward_function.timeout_s)") from None
        except Exception as exc:  # noqa: BLE001 - any failure of the user's function, in one line
            raise RewardFailed(f"{where} raised {type(exc).__name__}: {' '.join(str(exc).split())}") from None
        if isinstance(out, Mapping):
            if "score" not in out:
                raise RewardFailed(f"{where} returned a dict without 'score'")
            more = {str(k): float(v) for k, v in out.items() if k != "score" and isinstance(v, (int, float))}
            out = out["score"]
        else:
            more = {}
        if isinstance(out, bool) or not isinstance(out, (int, float)):
            raise RewardFailed(f"{where} returned {type(out).__name__}, not a float or a dict with 'score'")
        return float(out), more

    def drain_metrics(self) -> dict[str, float]:
        """``reward_extra/<key>/mean`` over the responses scored since the last drain."""
        out = {f"reward_extra/{k}/mean": sum(v) / len(v) for k, v in sorted(self._extras.items()) if v}
        self._extras = {}
        return out

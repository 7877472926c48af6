"""What every engine shares in ``cluster.engines.base``: request ids, request and state-dict checks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from cluster.engines.base import check_request, check_state_dict, request_sample_uid
from data.types import GenerationRequest, SamplingSpec


def test_a_response_id_names_its_sample_and_any_other_id_is_its_own_sample():
    ids = ["e0-p3-r0", "e12-p7-r15", "s-r2", "e0-p3", "a-rx", "-r1", "plain"]
    assert [request_sample_uid(i) for i in ids] == ["e0-p3", "e12-p7", "s", "e0-p3", "a-rx", "", "plain"]


def test_the_budget_is_clamped_to_the_free_positions_only_where_the_engine_has_a_context_limit():
    req = GenerationRequest("r", [1, 2, 3, 4], SamplingSpec(max_new_tokens=10))
    assert [check_request(req, max_seq_len=8), check_request(req, max_seq_len=64), check_request(req)] == [4, 10, 10]


@pytest.mark.parametrize(("prompt", "spec", "message"), [
    ([], SamplingSpec(4), "empty prompt"),
    ([1] * 9, SamplingSpec(4), "exceeds max_seq_len=8"),
    ([1, 40], SamplingSpec(4), "outside the vocabulary of 40"),
    ([1], SamplingSpec(-1), "bad sampling"),
    ([1], SamplingSpec(4, temperature=-0.5), "bad sampling"),
    ([1], SamplingSpec(4, top_p=0.0), "bad sampling"),
])
def test_a_bad_request_is_refused_naming_the_request_and_the_reason(prompt, spec, message):
    with pytest.raises(ValueError, match=f"^bad-1: .*{message}"):
        check_request(GenerationRequest("bad-1", prompt, spec), max_seq_len=8, vocab_size=40)


def test_a_state_dict_must_have_exactly_the_expected_names_and_shapes():
    shapes = {"w": (2, 3), "b": (3,)}
    tensor = lambda *shape: SimpleNamespace(shape=shape)  # noqa: E731 - only .shape is read
    check_state_dict({"w": tensor(2, 3), "b": tensor(3)}, shapes)
    with pytest.raises(ValueError, match=r"missing \['b'\], unexpected \['c'\]"):
        check_state_dict({"w": tensor(2, 3), "c": tensor(3)}, shapes)
    with pytest.raises(ValueError, match=r"'w' has shape \(3, 2\), expected \(2, 3\)"):
        check_state_dict({"w": tensor(3, 2), "b": tensor(3)}, shapes)

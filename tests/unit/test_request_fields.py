"""Request fields validated at the server edge: what pydantic turns client text into."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from cadence.openai_schema.requests import MAX_LOGIT_BIAS, ChatCompletionRequest, CompletionRequest

MESSAGES = [{"role": "user", "content": "hi"}]


def test_logit_bias_keys_become_token_ids() -> None:
    body = ChatCompletionRequest.model_validate_json(
        json.dumps({"messages": MESSAGES, "logit_bias": {"5": 1, " 7 ": -100, "0012": 0.5}})
    )
    assert body.logit_bias == {5: 1.0, 7: -100.0, 12: 0.5}


@pytest.mark.parametrize(
    "bias",
    [
        {"²": 1},  # a digit to str.isdigit, not to int()
        {"٣": 1},  # Arabic-Indic three: int() reads it, OpenAI's API would not
        {"1" * 5000: 1},  # int() refuses more than 4300 digits
        {"x5": 1},
        {"-1": 1},
        {"": 1},
        {"5": 101},
        {str(i): 1 for i in range(MAX_LOGIT_BIAS + 1)},
    ],
)
def test_bad_logit_bias_is_refused_by_validation(bias: dict[str, float]) -> None:
    for model, fields in ((ChatCompletionRequest, {"messages": MESSAGES}), (CompletionRequest, {"prompt": "x"})):
        with pytest.raises(ValidationError) as refused:
            model.model_validate_json(json.dumps({**fields, "logit_bias": bias}))
        assert refused.value.errors()[0]["loc"][0] == "logit_bias"


def test_the_most_logit_bias_entries_are_accepted() -> None:
    bias = {str(i): 1 for i in range(MAX_LOGIT_BIAS)}
    body = CompletionRequest.model_validate_json(json.dumps({"prompt": "x", "logit_bias": bias}))
    assert body.logit_bias == dict.fromkeys(range(MAX_LOGIT_BIAS), 1.0)

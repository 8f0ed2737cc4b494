"""The HTTP answer for errors raised while a request is in the engine."""

from __future__ import annotations

import pytest

from cadence.server.output_fanout import RequestRejectedError
from cadence.server.serving import as_api_error


@pytest.mark.parametrize(
    ("reason", "status", "retry_after"),
    [
        # Grammar failures of a request the API already checked, in the engine's words.
        ("the grammar did not compile within 5 s", 503, "7"),
        ("the output left its grammar: token 17 does not fit the grammar", 500, None),
        # What only the engine knows about the request itself.
        ("logit_bias token id 512 is outside the vocabulary", 400, None),
    ],
)
def test_engine_rejections(reason: str, status: int, retry_after: str | None) -> None:
    error = as_api_error(RequestRejectedError(reason), retry_after=7)
    assert error.status == status
    assert reason in error.message
    assert (error.headers or {}).get("Retry-After") == retry_after

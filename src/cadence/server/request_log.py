"""The one log line per finished request: its id (which carries the client's
X-Request-Id), token counts, timings and finish reasons; the prompt and output text only
with `--log-prompts`, since they may be anyone's private data."""

from __future__ import annotations

import logging
from typing import Any

from cadence.engine.outputs import RequestOutput

logger = logging.getLogger("cadence.requests")


def log_finished(summary: dict[str, Any], output: RequestOutput, log_prompts: bool) -> None:
    if not logger.isEnabledFor(logging.INFO):
        return
    fields = {**summary, "sequences": [dict(sequence) for sequence in summary["sequences"]]}
    if log_prompts:
        fields["prompt"] = output.prompt
        for sequence in fields["sequences"]:
            sequence["text"] = output.outputs[sequence["index"]].text
    parts = []
    for sequence in fields["sequences"]:
        ttft = "-" if sequence["ttft_s"] is None else f"{sequence['ttft_s']:.3f} s"
        parts.append(
            f"#{sequence['index']} {sequence['finish_reason']}, {sequence['tokens']} tokens, "
            f"TTFT {ttft}, E2E {sequence['e2e_s']:.3f} s"
        )
    logger.info(
        "%s: %d prompt tokens; %s",
        summary["request_id"],
        summary["prompt_tokens"],
        "; ".join(parts),
        extra={"fields": fields},
    )

"""Fault injection: requests the harness breaks on purpose, and how the server answered them.

Aborts disconnect a stream after a few chunks; malformed requests send bodies a server
must refuse with a 4xx and an error body. Afterwards the server should be idle again:
no running or waiting requests left behind (read from its /metrics).
"""

from __future__ import annotations

import json
import random
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from cadence.loadgen.datasets import SampleRequest
from cadence.loadgen.records import RequestKind, RequestRecord
from cadence.loadgen.request import Target


def _with(**changes: Any) -> Callable[[dict[str, Any]], bytes]:
    return lambda body: json.dumps({**body, **changes}).encode()


def _without(field: str) -> Callable[[dict[str, Any]], bytes]:
    return lambda body: json.dumps({k: v for k, v in body.items() if k != field}).encode()


def _cut_json(body: dict[str, Any]) -> bytes:
    text = json.dumps(body).encode()
    return text[: len(text) // 2]


@dataclass(frozen=True)
class MalformedCase:
    name: str
    make: Callable[[dict[str, Any]], bytes]  # from a valid body to the bytes sent


def malformed_cases(target: Target) -> list[MalformedCase]:
    """Invalid requests every OpenAI-compatible server must refuse, in the order they are sent."""
    chat = target.endpoint == "chat"
    prompt_field = "messages" if chat else "prompt"
    # The field the body sends: a server reads max_completion_tokens before max_tokens.
    length_field = "max_completion_tokens" if chat else "max_tokens"
    return [
        MalformedCase(f"negative {length_field}", _with(**{length_field: -1})),
        MalformedCase("temperature not a number", _with(temperature="hot")),
        MalformedCase(f"no {prompt_field}", _without(prompt_field)),
        MalformedCase("body is not JSON", _cut_json),
        MalformedCase("top_p above 1", _with(top_p=2.0)),
        MalformedCase("unknown model", _with(model="no-such-model-loadgen")),
    ]


def assign_kinds(count: int, abort_fraction: float, malformed_fraction: float, seed: int) -> list[RequestKind]:
    """Which requests are broken on purpose: exactly round(fraction * count) of each, spread by `seed`."""
    for name, value in (("--abort-fraction", abort_fraction), ("--malformed-fraction", malformed_fraction)):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{name} must be in [0, 1]")
    if abort_fraction + malformed_fraction > 1.0:
        raise ValueError("--abort-fraction and --malformed-fraction add up to more than 1")
    aborts, malformed = round(abort_fraction * count), round(malformed_fraction * count)
    kinds: list[RequestKind] = ["abort"] * aborts
    kinds += ["malformed"] * malformed
    kinds += ["normal"] * (count - len(kinds))
    random.Random(seed).shuffle(kinds)
    return kinds


def abort_point(sample: SampleRequest, rng: random.Random) -> int:
    """After how many text chunks to disconnect: somewhere in the first half of the answer."""
    return rng.randint(1, max(1, sample.output_len // 2))


def _is_error_body(body: Any) -> bool:
    if not isinstance(body, dict):
        return False
    inner = body.get("error", body)
    return isinstance(inner, dict) and bool(inner.get("message"))


def fault_report(records: Sequence[RequestRecord], cases: Sequence[MalformedCase]) -> dict[str, Any]:
    """Per malformed case, the statuses the server answered with; and what aborts got."""
    by_case: dict[str, list[RequestRecord]] = {}
    malformed = [r for r in records if r.kind == "malformed"]
    for i, record in enumerate(malformed):
        by_case.setdefault(cases[i % len(cases)].name, []).append(record)
    report: dict[str, Any] = {"malformed": {}, "aborted": {}}
    for name, group in by_case.items():
        statuses = Counter(str(r.status) for r in group)
        refused = [r for r in group if r.status is not None and 400 <= r.status < 500]
        report["malformed"][name] = {
            "sent": len(group),
            "statuses": dict(statuses),
            "refused_with_4xx": len(refused),
            "with_error_body": sum(1 for r in refused if _is_error_body(r.error_body)),
            "example_message": next((r.error for r in group if r.error), ""),
        }
    aborted = [r for r in records if r.kind == "abort"]
    report["aborted"] = {
        "sent": len(aborted),
        "disconnected_mid_stream": sum(1 for r in aborted if r.error.startswith("aborted by the harness")),
        "finished_before_the_cut": sum(1 for r in aborted if r.success),
        "failed_otherwise": sum(1 for r in aborted if not r.success and not r.error.startswith("aborted")),
    }
    return report

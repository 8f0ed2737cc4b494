"""The streaming loop without a network: engine outputs in, SSE frames out, in any order."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import pytest
from transformers import AutoTokenizer

from cadence.engine.output_processor import OutputProcessor
from cadence.engine.protocol import EngineCoreOutput
from cadence.engine.sampling_params import SamplingParams
from cadence.server.request_stream import RequestStream
from cadence.server.serving import ChoiceCursor, RequestGroup, stream_events, take_delta


class RecordingClient:
    """Stands in for AsyncEngineClient: remembers aborts."""

    def __init__(self) -> None:
        self.aborted: list[str] = []

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


@pytest.fixture()
def processor(tiny_model_dir: Callable[[str], str]) -> OutputProcessor:
    return OutputProcessor(AutoTokenizer.from_pretrained(tiny_model_dir("llama")))


def make_group(processor: OutputProcessor, params: SamplingParams) -> tuple[RequestGroup, RecordingClient]:
    client = RecordingClient()
    processor.add_request("r", "hi", [5, 6], params)
    group = RequestGroup(client, priority=0)  # type: ignore[arg-type]
    changed = asyncio.Event()
    group._changed = changed
    group.streams.append(RequestStream(processor.states["r"].output, processor, changed, client.abort))
    return group, client


def frames_for(group: RequestGroup, n: int) -> Callable[[], list[str]]:
    cursors = [ChoiceCursor() for _ in range(n)]

    def on_update() -> list[str]:
        frames = []
        for index, cursor in enumerate(cursors):
            delta = take_delta(group.streams[0], index, cursor, with_logprobs=False)
            if delta is not None:
                finish = delta.finish_reason if cursor.finished else None
                frames.append(json.dumps({"index": index, "text": delta.text, "finish_reason": finish}))
        return frames

    return on_update


def step(processor: OutputProcessor, group: RequestGroup, outputs: list[EngineCoreOutput]) -> None:
    processor.process(outputs)
    group._changed.set()


def parse(frames: list[str]) -> list[dict | str]:
    payloads = [f.removeprefix("data: ").strip() for f in frames]
    return [p if p == "[DONE]" else json.loads(p) for p in payloads]


def test_a_slow_consumer_still_gets_the_last_frames(processor: OutputProcessor) -> None:
    """The request finishes while the generator is suspended at a yield."""

    async def run() -> tuple[list[dict | str], RequestGroup]:
        group, _ = make_group(processor, SamplingParams(n=2, max_tokens=2))
        step(processor, group, [EngineCoreOutput("r", 0, [40]), EngineCoreOutput("r", 1, [41])])
        events = stream_events(group, frames_for(group, 2), list)
        got = [await events.__anext__()]
        # The client is slow: before it asks for more, the engine finishes both choices.
        step(
            processor,
            group,
            [
                EngineCoreOutput("r", 0, [42], finish_reason="length"),
                EngineCoreOutput("r", 1, [43], finish_reason="length"),
            ],
        )
        got += [frame async for frame in events]
        return parse(got), group

    payloads, group = asyncio.run(run())
    assert payloads[-1] == "[DONE]"
    chunks = [p for p in payloads if isinstance(p, dict)]
    for index, completion in enumerate(group.streams[0].output.outputs):
        mine = [c for c in chunks if c["index"] == index]
        assert "".join(c["text"] for c in mine) == completion.text
        assert [c["finish_reason"] for c in mine if c["finish_reason"]] == ["length"]


def test_a_stop_string_is_never_sent_even_in_part(processor: OutputProcessor) -> None:
    tokenizer = processor.tokenizer
    assert tokenizer is not None
    text = "Paris is the capital of France, and Berlin is the capital of Germany."
    ids = tokenizer.encode(text)
    stop = "capital of Germany"  # several tokens, and "capital of " appears earlier too
    group, client = make_group(processor, SamplingParams(max_tokens=len(ids), stop=[stop]))
    cursor = ChoiceCursor()
    sent = ""
    for token in ids:
        processor.process([EngineCoreOutput("r", 0, [token])])
        delta = take_delta(group.streams[0], 0, cursor, with_logprobs=False)
        if delta is not None:
            sent += delta.text
            # Nothing sent may be the start of the stop string.
            assert not any(sent.endswith(stop[:k]) for k in range(1, len(stop) + 1)), sent
        if cursor.finished:
            break
    assert sent == text[: text.index(stop)]
    assert group.streams[0].output.outputs[0].finish_reason == "stop"


def test_closing_the_stream_aborts_the_request(processor: OutputProcessor) -> None:
    async def run() -> RecordingClient:
        group, client = make_group(processor, SamplingParams(max_tokens=8))
        step(processor, group, [EngineCoreOutput("r", 0, [40])])
        events = stream_events(group, frames_for(group, 1), list)
        await events.__anext__()
        await events.aclose()  # what a disconnect does
        return client

    assert asyncio.run(run()).aborted == ["r"]

"""POST /v1/chat/completions: messages through the chat template, n, logprobs, streaming."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import Response

from cadence.engine.outputs import CompletionOutput, PositionLogprobs
from cadence.openai_schema.requests import ChatCompletionRequest
from cadence.openai_schema.responses import (
    ChatChoice,
    ChatChoiceLogprobs,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatDelta,
    ChatResponseMessage,
    ChatStreamChoice,
)
from cadence.server.engine_client import AsyncEngineClient
from cadence.server.logprobs_format import chat_logprobs
from cadence.server.prompts import PromptBuilder
from cadence.server.request_limits import RequestLimits
from cadence.server.serving import (
    ChoiceCursor,
    ChunkWriter,
    EventStreamResponse,
    RequestGroup,
    json_response,
    new_id,
    stream_events,
    take_delta,
)


class ChatHandler:
    """Serves one model's chat completions endpoint."""

    def __init__(
        self, client: AsyncEngineClient, prompts: PromptBuilder, model_name: str, limits: RequestLimits
    ) -> None:
        self.client = client
        self.prompts = prompts
        self.model_name = model_name
        self.limits = limits

    async def create(self, body: ChatCompletionRequest, raw_request: Request) -> Response:
        requested_param = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
        most = self.limits.tokens_per_sequence(body.n, 1, body.requested_max_tokens, requested_param)
        prompt = await self.prompts.from_messages(body.messages, body.add_generation_prompt)
        # Chat has no default length of its own: the answer may use whatever context is
        # left, up to what the server allows a request.
        max_tokens = self.prompts.max_tokens(
            prompt, body.requested_max_tokens, most, prompt_param="messages", requested_param=requested_param
        )
        top_logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = self.prompts.sampling_params(body, max_tokens, top_logprobs)
        group = RequestGroup(self.client, body.priority)
        group.submit(new_id("chatcmpl", raw_request), [prompt], [params])
        if body.stream:
            stream = _ChatStream(self, body, group)
            return EventStreamResponse(stream_events(group, stream.on_update, stream.on_finish), group)
        (output,) = await group.run_to_end(raw_request)
        return json_response(
            ChatCompletionResponse(
                id=group.request_id,
                created=group.created,
                model=self.model_name,
                choices=[self._choice(body, c) for c in output.outputs],
                usage=group.usage(),
            )
        )

    @staticmethod
    def _choice(body: ChatCompletionRequest, completion: CompletionOutput) -> ChatChoice:
        return ChatChoice(
            index=completion.index,
            message=ChatResponseMessage(content=completion.text),
            logprobs=_logprobs(body, completion.token_ids, completion.logprobs),
            finish_reason=completion.finish_reason,
            stop_reason=completion.stop_reason,
        )


def _logprobs(
    body: ChatCompletionRequest, token_ids: list[int], positions: list[PositionLogprobs] | None
) -> ChatChoiceLogprobs | None:
    if not body.logprobs:
        return None
    return ChatChoiceLogprobs(content=chat_logprobs(token_ids, positions or [], body.top_logprobs or 0), refusal=None)


class _ChatStream:
    """Builds the SSE frames of one streamed chat call."""

    def __init__(self, handler: ChatHandler, body: ChatCompletionRequest, group: RequestGroup) -> None:
        self.handler = handler
        self.body = body
        self.group = group
        self.cursors = [ChoiceCursor() for _ in range(body.n)]
        self.writer = ChunkWriter(group, ChatCompletionStreamResponse, handler.model_name, body.stream_options)

    def on_update(self) -> list[str]:
        frames = []
        (stream,) = self.group.streams
        for cursor, completion in zip(self.cursors, stream.output.outputs):
            delta = take_delta(stream, completion.index, cursor, self.body.logprobs)
            if delta is None:
                continue
            # The role goes in the first chunk alone (a delta's unset keys are not sent).
            message = ChatDelta(role="assistant", content=delta.text) if delta.first else ChatDelta(content=delta.text)
            choice = ChatStreamChoice(
                index=completion.index,
                delta=message,
                logprobs=_logprobs(self.body, delta.token_ids, delta.logprobs),
                finish_reason=delta.finish_reason,
                stop_reason=delta.stop_reason,
            )
            frames.append(self.writer.chunk([choice]))
        return frames

    def on_finish(self) -> list[str]:
        return self.writer.finish()

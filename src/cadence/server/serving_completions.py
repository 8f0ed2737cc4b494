"""POST /v1/completions: prompts as text or token ids, echo, logprobs, n, streaming."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import Response

from cadence.engine.outputs import PositionLogprobs, RequestOutput
from cadence.openai_schema.requests import CompletionRequest
from cadence.openai_schema.responses import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    CompletionStreamChoice,
    CompletionStreamResponse,
)
from cadence.server.engine_client import AsyncEngineClient
from cadence.server.errors import bad_request
from cadence.server.logprobs_format import completion_logprobs, prompt_logprobs
from cadence.server.prompts import Prompt, PromptBuilder
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
from cadence.server.structured_requests import GrammarChecker, requested_constraint

# OpenAI's default when a completions request names no max_tokens.
DEFAULT_MAX_TOKENS = 16


class CompletionHandler:
    """Serves one model's legacy completions endpoint."""

    def __init__(
        self,
        client: AsyncEngineClient,
        prompts: PromptBuilder,
        model_name: str,
        limits: RequestLimits,
        grammars: GrammarChecker,
    ) -> None:
        self.client = client
        self.prompts = prompts
        self.model_name = model_name
        self.limits = limits
        self.grammars = grammars

    async def create(self, body: CompletionRequest, raw_request: Request) -> Response:
        requested = body.max_tokens if "max_tokens" in body.model_fields_set else None
        # Checked before tokenizing: refusing costs nothing then.
        most = self.limits.tokens_per_sequence(body.n, len(body.prompts()), requested, "max_tokens")
        if body.prompt_logprobs is not None and body.stream:
            raise bad_request("prompt_logprobs are not available when stream is true", "prompt_logprobs")
        constraint = requested_constraint(body)
        if constraint is not None:
            await self.grammars.check(constraint)
        prompts = [await self.prompts.from_completion_prompt(p) for p in body.prompts()]
        default = min(DEFAULT_MAX_TOKENS, most)
        params = [
            self.prompts.sampling_params(
                body,
                self.prompts.max_tokens(p, requested, default),
                body.logprobs,
                self._prompt_logprobs(body),
                None if constraint is None else constraint.params,
            )
            for p in prompts
        ]
        group = RequestGroup(self.client, body.priority)
        group.submit(new_id("cmpl", raw_request), prompts, params)
        if body.stream:
            stream = _CompletionStream(self, body, group, prompts)
            return EventStreamResponse(stream_events(group, stream.on_update, stream.on_finish), group)
        outputs = await group.run_to_end(raw_request)
        choices = []
        for i, (prompt, output) in enumerate(zip(prompts, outputs)):
            choices.extend(self._choices(body, i, prompt, output))
        return json_response(
            CompletionResponse(
                id=group.request_id,
                created=group.created,
                model=self.model_name,
                choices=choices,
                usage=group.usage(),
            )
        )

    @staticmethod
    def _prompt_logprobs(body: CompletionRequest) -> int | None:
        # Echo with logprobs scores the prompt too, as OpenAI does; vLLM's prompt_logprobs
        # asks for the same scores, and the engine computes the wider of the two.
        wanted = [k for k in (body.logprobs if body.echo else None, body.prompt_logprobs) if k is not None]
        return max(wanted) if wanted else None

    def _choices(
        self, body: CompletionRequest, prompt_index: int, prompt: Prompt, output: RequestOutput
    ) -> list[CompletionChoice]:
        choices = []
        scored_prompt = None
        if body.prompt_logprobs is not None:
            scored_prompt = prompt_logprobs(output.prompt_token_ids, output.prompt_logprobs, body.prompt_logprobs)
        for completion in output.outputs:
            text = completion.text
            logprobs: CompletionLogprobs | None = None
            if body.logprobs is not None:
                token_ids = list(completion.token_ids)
                positions: list[PositionLogprobs | None] = list(completion.logprobs or [])
                if body.echo:
                    token_ids = output.prompt_token_ids + token_ids
                    positions = list(output.prompt_logprobs or []) + positions
                logprobs, _ = completion_logprobs(token_ids, positions, 0, self.prompts.token_text)
            if body.echo:
                text = (prompt.text or "") + text
            choices.append(
                CompletionChoice(
                    index=prompt_index * body.n + completion.index,
                    text=text,
                    logprobs=logprobs,
                    finish_reason=completion.finish_reason,
                    stop_reason=completion.stop_reason,
                    prompt_logprobs=scored_prompt,
                )
            )
        return choices


class _CompletionStream:
    """Builds the SSE frames of one streamed completions call."""

    def __init__(
        self, handler: CompletionHandler, body: CompletionRequest, group: RequestGroup, prompts: list[Prompt]
    ) -> None:
        self.handler = handler
        self.body = body
        self.group = group
        self.prompts = prompts
        self.cursors = [[ChoiceCursor() for _ in range(body.n)] for _ in prompts]
        self.writer = ChunkWriter(group, CompletionStreamResponse, handler.model_name, body.stream_options)

    def on_update(self) -> list[str]:
        frames = []
        want_logprobs = self.body.logprobs is not None
        for i, (stream, prompt) in enumerate(zip(self.group.streams, self.prompts)):
            output = stream.output
            for cursor, completion in zip(self.cursors[i], output.outputs):
                delta = take_delta(stream, completion.index, cursor, want_logprobs)
                if delta is None:
                    continue
                text = delta.text
                token_ids = delta.token_ids
                positions: list[PositionLogprobs | None] = list(delta.logprobs or [])
                if self.body.echo and delta.first:
                    text = (prompt.text or "") + text
                    token_ids = output.prompt_token_ids + token_ids
                    positions = list(output.prompt_logprobs or []) + positions
                logprobs: CompletionLogprobs | None = None
                if want_logprobs:
                    logprobs, cursor.text_offset = completion_logprobs(
                        token_ids, positions, cursor.text_offset, self.handler.prompts.token_text
                    )
                choice = CompletionStreamChoice(
                    index=i * self.body.n + completion.index,
                    text=text,
                    logprobs=logprobs,
                    finish_reason=delta.finish_reason,
                    stop_reason=delta.stop_reason,
                )
                frames.append(self.writer.chunk([choice]))
        return frames

    def on_finish(self) -> list[str]:
        return self.writer.finish()

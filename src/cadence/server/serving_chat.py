"""POST /v1/chat/completions: messages through the chat template, tools, constrained
output, reasoning, n, logprobs, streaming."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import Response

from cadence.engine.outputs import PositionLogprobs
from cadence.openai_schema.requests import ChatCompletionRequest
from cadence.openai_schema.responses import (
    ChatChoice,
    ChatChoiceLogprobs,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatStreamChoice,
)
from cadence.server.chat_options import ChatOptions
from cadence.server.chat_output import ChoiceReader, OutputReading, finish_reason, tool_specs
from cadence.server.engine_client import AsyncEngineClient
from cadence.server.errors import bad_request
from cadence.server.logprobs_format import chat_logprobs, prompt_logprobs
from cadence.server.prompts import Prompt, PromptBuilder
from cadence.server.reasoning import get_reasoning_parser
from cadence.server.reasoning.base import ReasoningParser
from cadence.server.reasoning_grammar import after_reasoning
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
from cadence.server.structured_requests import Constraint, GrammarChecker, requested_constraint
from cadence.server.tool_calls import ToolPlan, plan_tools
from cadence.server.tool_parsers import get_tool_parser
from cadence.server.tool_parsers.base import ToolParser
from cadence.structured_outputs.grammar import GrammarError
from cadence.structured_outputs.params import StructuredOutputsParams


class ChatHandler:
    """Serves one model's chat completions endpoint."""

    def __init__(
        self,
        client: AsyncEngineClient,
        prompts: PromptBuilder,
        model_name: str,
        limits: RequestLimits,
        grammars: GrammarChecker,
        options: ChatOptions,
    ) -> None:
        self.client = client
        self.prompts = prompts
        self.model_name = model_name
        self.limits = limits
        self.grammars = grammars
        self.options = options
        self.tool_parser: type[ToolParser] | None = None
        if options.tool_call_parser is not None:
            self.tool_parser = get_tool_parser(options.tool_call_parser)
        self.reasoning_parser: type[ReasoningParser] | None = None
        if options.reasoning_parser is not None:
            self.reasoning_parser = get_reasoning_parser(options.reasoning_parser)

    async def create(self, body: ChatCompletionRequest, raw_request: Request) -> Response:
        requested_param = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
        most = self.limits.tokens_per_sequence(body.n, 1, body.requested_max_tokens, requested_param)
        if body.prompt_logprobs is not None and body.stream:
            raise bad_request("prompt_logprobs are not available when stream is true", "prompt_logprobs")
        plan = plan_tools(body, self.options.enable_auto_tool_choice and self.tool_parser is not None)
        prompt = await self.prompts.from_messages(
            body.messages, body.add_generation_prompt, body.tools, body.chat_template_kwargs
        )
        # Chat has no default length of its own: the answer may use whatever context is
        # left, up to what the server allows a request.
        max_tokens = self.prompts.max_tokens(
            prompt, body.requested_max_tokens, most, prompt_param="messages", requested_param=requested_param
        )
        reading = self._reading(plan, prompt)
        constraint = answer_constraint(body, reading)
        if constraint is not None:  # the costliest check comes last
            await self.grammars.check(constraint)
        top_logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = self.prompts.sampling_params(
            body,
            max_tokens,
            top_logprobs,
            body.prompt_logprobs,
            None if constraint is None else constraint.params,
            reading.skip_special_tokens(body.skip_special_tokens),
        )
        group = RequestGroup(self.client, body.priority)
        group.submit(new_id("chatcmpl", raw_request), [prompt], [params])
        if body.stream:
            stream = _ChatStream(self, body, group, reading)
            return EventStreamResponse(stream_events(group, stream.on_update, stream.on_finish), group)
        (output,) = await group.run_to_end(raw_request)
        scored_prompt = None
        if body.prompt_logprobs is not None:
            scored_prompt = prompt_logprobs(output.prompt_token_ids, output.prompt_logprobs, body.prompt_logprobs)
        choices = []
        for completion in output.outputs:
            reader = reading.reader()
            reader.feed(completion.text)
            reader.finish()
            choices.append(
                ChatChoice(
                    index=completion.index,
                    message=reader.message(),
                    logprobs=_logprobs(body, completion.token_ids, completion.logprobs),
                    finish_reason=finish_reason(completion.finish_reason, reader),
                    stop_reason=completion.stop_reason,
                )
            )
        return json_response(
            ChatCompletionResponse(
                id=group.request_id,
                created=group.created,
                model=self.model_name,
                choices=choices,
                usage=group.usage(),
                prompt_logprobs=scored_prompt,
            )
        )

    def _reading(self, plan: ToolPlan, prompt: Prompt) -> OutputReading:
        parser = self.reasoning_parser
        if parser is None:
            return OutputReading(plan, self.tool_parser)
        text = prompt.text or ""
        return OutputReading(
            plan, self.tool_parser, parser, parser.starts_in_reasoning(text), parser.opening_marker(text)
        )


def answer_constraint(body: ChatCompletionRequest, reading: OutputReading) -> Constraint | None:
    """The one constraint on the answer: a forced call's, else the request's own, else the
    auto parser's grammar; bound to the text after the reasoning, if any."""
    plan = reading.plan
    constraint = plan.constraint(body.parallel_tool_calls) or requested_constraint(body)
    if constraint is None and plan.mode == "auto" and reading.tool_parser is not None:
        grammar = reading.tool_parser(tool_specs(plan)).auto_grammar()
        if grammar is not None:
            constraint = Constraint(StructuredOutputsParams(grammar=grammar), "tools")
    parser = reading.reasoning_parser
    if constraint is None or parser is None:
        return constraint
    try:
        wrapped = after_reasoning(
            constraint.params, parser.end_marker, reading.opening_marker, reading.starts_in_reasoning
        )
    except GrammarError as error:
        # Wrapping reads the constraint's own text first: its fault, the field's 400.
        raise bad_request(f"{constraint.param}: {error}", constraint.param) from error
    return Constraint(wrapped, constraint.param)


def _logprobs(
    body: ChatCompletionRequest, token_ids: list[int], positions: list[PositionLogprobs] | None
) -> ChatChoiceLogprobs | None:
    if not body.logprobs:
        return None
    return ChatChoiceLogprobs(content=chat_logprobs(token_ids, positions or [], body.top_logprobs or 0), refusal=None)


class _ChatStream:
    """Builds the SSE frames of one streamed chat call, a reader per choice."""

    def __init__(
        self, handler: ChatHandler, body: ChatCompletionRequest, group: RequestGroup, reading: OutputReading
    ) -> None:
        self.handler = handler
        self.body = body
        self.group = group
        self.cursors = [ChoiceCursor() for _ in range(body.n)]
        self.readers: list[ChoiceReader] = [reading.reader() for _ in range(body.n)]
        self.writer = ChunkWriter(group, ChatCompletionStreamResponse, handler.model_name, body.stream_options)

    def on_update(self) -> list[str]:
        frames = []
        (stream,) = self.group.streams
        for cursor, reader, completion in zip(self.cursors, self.readers, stream.output.outputs):
            delta = take_delta(stream, completion.index, cursor, self.body.logprobs)
            if delta is None:
                continue
            piece = reader.feed(delta.text)
            if delta.finish_reason is not None:
                last = reader.finish()
                piece.reasoning += last.reasoning
                piece.content += last.content
                piece.calls += last.calls
            message = reader.delta(piece, delta.first)
            logprobs = _logprobs(self.body, delta.token_ids, delta.logprobs)
            if not message.model_fields_set and delta.finish_reason is None and logprobs is None:
                continue  # the parsers hold this text back until they know what it is
            choice = ChatStreamChoice(
                index=completion.index,
                delta=message,
                logprobs=logprobs,
                finish_reason=finish_reason(delta.finish_reason, reader),
                stop_reason=delta.stop_reason,
            )
            frames.append(self.writer.chunk([choice]))
        return frames

    def on_finish(self) -> list[str]:
        return self.writer.finish()

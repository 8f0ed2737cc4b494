"""Response bodies of the OpenAI-compatible API, as pydantic models.

The server builds every answer through these models and the Python client
(`cadence.client`) parses every answer into them, so the two cannot drift. The shapes are
OpenAI's, with vLLM's additions (`stop_reason`, `max_model_len`, `/tokenize`); the
end-to-end tests still validate the JSON with the openai SDK's own models.

Streamed chunks are dumped with `exclude_unset=True`: a key the server did not set is
left out, not sent as null. That is how a chunk carries `usage` only when the call asked
for it (and `"usage": null` when it asked for usage in the last chunk alone), and how a
chat delta carries `role` only in its first chunk. Whoever builds a chunk therefore sets
every other field explicitly, None included.

Only pydantic is imported here: the client loads this module without the server's
dependencies.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

# What a choice ended on: "stop" (EOS, a stop token or string, or a complete constrained
# output), "length" (max_tokens or the context), "tool_calls" (the answer called tools),
# "abort" (the engine gave up on it). None while a streamed choice runs.
FinishReason = str | None
# The stop string or stop token id a choice ended on; None for EOS and other reasons.
StopReason = int | str | None


class _Response(BaseModel):
    # Python's json writes NaN and infinity as NaN/Infinity; so do these models, so a
    # logprob of -inf reads as it did before they existed. Keys a newer server adds are
    # ignored by an older client (pydantic's default), not refused.
    model_config = ConfigDict(ser_json_inf_nan="constants")


class Usage(_Response):
    """Token counts of one call, over all its prompts and choices."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(_Response):
    """Legacy completions' logprobs: one entry per token in each list.

    A position without logprobs (the first prompt token, when echoed) has None.
    `top_logprobs` maps the chosen token and the top alternatives to their logprobs.
    """

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(_Response):
    """vLLM's prompt_logprobs entry for one token at one prompt position."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's prompt_logprobs: per prompt position, token id -> its entry (the position's own
# token and the top alternatives); the first position has None. JSON keys are strings.
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class CompletionChoice(_Response):
    """One choice of a completions answer; `index` counts across prompts (prompt * n + i).
    `prompt_logprobs` is its prompt's, when asked for (vLLM puts them on each choice)."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason = None
    stop_reason: StopReason = None
    prompt_logprobs: PromptLogprobs | None = None


class _Answer(_Response):
    """What every generation answer and chunk has; each kind names its `object` and
    `choices`. The last chunk of a stream that asked for usage has no choices."""

    id: str
    object: str
    created: int
    model: str
    choices: list[Any]
    usage: Usage | None = None


class CompletionResponse(_Answer):
    """POST /v1/completions, not streamed."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class CompletionStreamChoice(CompletionChoice):
    """A streamed piece of one completions choice: the text since the last chunk."""


class CompletionStreamResponse(_Answer):
    """One chunk of a streamed completions call."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionStreamChoice]


class TopLogprob(_Response):
    """One of the most likely tokens at a chat position; `bytes` is its UTF-8."""

    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprob(TopLogprob):
    """The chosen token at a chat position, with the top alternatives."""

    top_logprobs: list[TopLogprob]


class ChatChoiceLogprobs(_Response):
    """A chat choice's logprobs, a token per entry."""

    content: list[ChatLogprob] | None = None
    refusal: list[ChatLogprob] | None = None


class ToolCallFunction(_Response):
    """The function a tool call names, with its arguments as JSON text."""

    name: str
    arguments: str


class ToolCall(_Response):
    """One call the assistant made; `id` is unique within the answer ("call_...")."""

    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatResponseMessage(_Response):
    """The assistant's message of a chat choice: `content` is None when the answer is only
    tool calls; `reasoning_content` (vLLM's field) holds the thinking a reasoning parser
    took out of the text."""

    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = None
    reasoning_content: str | None = None


class ChatChoice(_Response):
    """One choice of a chat answer."""

    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: FinishReason = None
    stop_reason: StopReason = None


class ChatCompletionResponse(_Answer):
    """POST /v1/chat/completions, not streamed; `prompt_logprobs` as vLLM places them."""

    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    prompt_logprobs: PromptLogprobs | None = None


class ToolCallFunctionDelta(_Response):
    """A piece of a streamed call's function: the name once, then arguments in pieces."""

    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(_Response):
    """A piece of one streamed tool call. The call's first piece carries its `index`, `id`,
    `type` and `function.name` (with arguments ""); later ones only `index` and argument
    text (unset keys are not sent)."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: ToolCallFunctionDelta | None = None


class ChatDelta(_Response):
    """What a streamed chat choice gained; `role` comes only in the choice's first chunk,
    and only the keys set are sent."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatStreamChoice(_Response):
    """A streamed piece of one chat choice."""

    index: int
    delta: ChatDelta
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: FinishReason = None
    stop_reason: StopReason = None


class ChatCompletionStreamResponse(_Answer):
    """One chunk of a streamed chat call."""

    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatStreamChoice]


class ModelCard(_Response):
    """One served model in GET /v1/models; `root` is the checkpoint it was loaded from."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    root: str | None = None
    max_model_len: int | None = None


class ModelList(_Response):
    """GET /v1/models."""

    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(_Response):
    """POST /tokenize: the prompt's token ids and the model's context length."""

    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(_Response):
    """POST /detokenize: the text of the given token ids."""

    prompt: str


class ErrorDetail(_Response):
    """What went wrong: `type` is OpenAI's error type, `param` the field at fault. `code` is
    a string here (OpenAI's); vLLM sends the HTTP status, an integer, which parses too."""

    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(_Response):
    """Every error the server answers, streamed or not: `{"error": {...}}`."""

    error: ErrorDetail

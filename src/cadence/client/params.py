"""The keyword arguments of the client's calls, typed: OpenAI's sampling parameters,
Cadence's (vLLM's) extensions, and the call's own options.

The client methods take them as `**args: Unpack[CompletionArgs]`, so a type checker knows
every name and type; at run time an unknown name is refused with a TypeError rather than
sent and ignored. A field the server accepts that is not listed here goes in `extra_body`,
which is merged into the request body last, as in the openai SDK. The names and ranges are
the server's (openai_schema/requests.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

import httpx
from typing_extensions import NotRequired, TypedDict

# Seconds, or httpx's per-phase limits; None in a call means the client's own.
Timeout = float | httpx.Timeout | None


class GenerationParams(TypedDict, total=False):
    """What completions and chat share."""

    max_tokens: int
    temperature: float  # 0 is greedy
    top_p: float
    n: int  # choices per prompt
    stop: str | list[str]
    seed: int
    presence_penalty: float
    frequency_penalty: float
    user: str
    # Extensions (vLLM's names):
    top_k: int  # -1 or 0: off
    min_p: float
    repetition_penalty: float  # 1 is off
    ignore_eos: bool  # generate to max_tokens even past the end-of-sequence token
    min_tokens: int  # no stop (EOS, stop ids) before this many tokens
    priority: int  # lower runs first when the server must choose
    stop_token_ids: list[int]
    include_stop_str_in_output: bool
    skip_special_tokens: bool
    logit_bias: Mapping[str, float]  # token id (as a string) -> -100 .. 100
    prompt_logprobs: int  # alternatives per prompt position (not with streaming)
    # Constrained output: OpenAI's {"type": "json_object"} or {"type": "json_schema",
    # "json_schema": {"name": ..., "schema": {...}}}, or vLLM's structured_outputs object
    # with exactly one of json, regex, choice, grammar or json_object.
    response_format: Mapping[str, Any]
    structured_outputs: Mapping[str, Any]


class CompletionParams(GenerationParams, total=False):
    """POST /v1/completions. `logprobs` is how many alternatives to list per token."""

    echo: bool
    logprobs: int


class ChatParams(GenerationParams, total=False):
    """POST /v1/chat/completions."""

    max_completion_tokens: int
    logprobs: bool
    top_logprobs: int
    add_generation_prompt: bool
    # OpenAI's function tools: [{"type": "function", "function": {"name", "description",
    # "parameters"}}]; tool_choice "none", "auto", "required" or {"type": "function",
    # "function": {"name": ...}}. The answer's message carries `tool_calls`.
    tools: Sequence[Mapping[str, Any]]
    tool_choice: str | Mapping[str, Any]
    parallel_tool_calls: bool
    chat_template_kwargs: Mapping[str, Any]  # passed to the chat template, e.g. enable_thinking


class CallOptions(TypedDict, total=False):
    """What every generation call takes besides its parameters."""

    model: str  # default: the first model GET /v1/models lists
    timeout: Timeout  # this call's, instead of the client's
    extra_body: Mapping[str, Any]  # fields sent as they are, last


class CompletionArgs(CompletionParams, CallOptions, total=False):
    """The keyword arguments of `completions`."""


class ChatArgs(ChatParams, CallOptions, total=False):
    """The keyword arguments of `chat`."""


class StreamOptions(TypedDict, total=False):
    """A stream's usage: in a last chunk (`include_usage`), and on every chunk as well
    (`continuous_usage_stats`, vLLM's extension)."""

    include_usage: bool
    continuous_usage_stats: bool


class CompletionStreamArgs(CompletionArgs, total=False):
    """The keyword arguments of `completions_stream`."""

    stream_options: StreamOptions


class ChatStreamArgs(ChatArgs, total=False):
    """The keyword arguments of `chat_stream`."""

    stream_options: StreamOptions


class TokenizeArgs(TypedDict, total=False):
    """The keyword arguments of `tokenize`."""

    model: str
    add_special_tokens: bool  # a prompt's BOS and the like (default true)
    add_generation_prompt: bool  # messages: end with the assistant's turn (default true)
    timeout: Timeout


class TextPart(TypedDict):
    """A part of a message's content."""

    type: Literal["text"]
    text: str


class ToolCallFunction(TypedDict):
    name: str
    arguments: str  # JSON text


class ToolCall(TypedDict):
    """A call an assistant message made, as a response's message.tool_calls lists it."""

    id: str
    type: Literal["function"]
    function: ToolCallFunction


class ChatMessage(TypedDict):
    """One message of a chat: an assistant's may carry the tool calls it made, and a
    tool's answer names the call it answers."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None
    name: NotRequired[str]
    tool_calls: NotRequired[list[ToolCall]]
    tool_call_id: NotRequired[str]
    reasoning_content: NotRequired[str]


Prompt = str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]]


# Options of the call, not fields of the body as they stand.
_NOT_SAMPLING = frozenset(CallOptions.__optional_keys__)


def request_body(kind: type[Any], fields: Mapping[str, Any], args: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON body of a call whose keyword arguments are the TypedDict `kind`: the call's
    own `fields`, then the parameters in `args` (any name `kind` lacks is refused), then
    `extra_body`."""
    unknown = sorted(set(args) - kind.__required_keys__ - kind.__optional_keys__)
    if unknown:
        raise TypeError(f"unknown argument(s): {', '.join(unknown)}; pass other fields of the body in extra_body")
    params = {key: value for key, value in args.items() if key not in _NOT_SAMPLING}
    return {**fields, **params, **args.get("extra_body", {})}

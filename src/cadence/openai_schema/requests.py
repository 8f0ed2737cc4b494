"""Request bodies of the OpenAI-compatible API, validated by pydantic at the server edge.

Unknown fields are ignored, not rejected: clients send vendor extensions. Fields Cadence
cannot honour (suffix, best_of other than n, guided_whitespace_pattern) are rejected with
a clear 400 rather than silently dropped, because ignoring them would change what the
caller gets. The fields that constrain output (response_format, structured_outputs,
tools) are shaped in openai_schema/constraint_fields.py.
Responses are the models of openai_schema/responses.py, shaped exactly like OpenAI's (the
Python client parses into the same models); the tests validate them with the openai SDK's
own models too.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BeforeValidator, Discriminator, Field, Tag, model_validator

from cadence.openai_schema.constraint_fields import (
    MessageToolCall,
    ResponseFormat,
    StructuredOutputsField,
    ToolChoice,
    Tools,
)
from cadence.openai_schema.text_fields import Lenient, Text, no_lone_surrogates
from cadence.sampling_limits import FLOAT32_MAX, INT64_MAX, MAX_LOGPROBS

# Stop strings are checked on every new token of every choice; bound that work.
MAX_STOPS = 64
MAX_STOP_LENGTH = 512
# Biases are added to the logits at every step. OpenAI documents no bound (its API is
# reported to refuse more than 300 entries); this one keeps a request's work and size small.
MAX_LOGIT_BIAS = 1024
# Token ids are below 2**31: ten digits at most (leading zeros included).
MAX_TOKEN_ID_DIGITS = 10


# NaN and infinity are refused (JSON parsers accept NaN and Infinity); fields with no
# range of their own are also kept to what float32, the sampler's type, can hold.
FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]
NonNegativeFloat = Annotated[FiniteFloat, Field(ge=0.0, le=FLOAT32_MAX)]


def _stop_string(text: str) -> str:
    if len(text) > MAX_STOP_LENGTH:
        raise ValueError(f"a stop string may have at most {MAX_STOP_LENGTH} characters, not {len(text)}")
    return no_lone_surrogates(text)


StopString = Annotated[str, AfterValidator(_stop_string)]


def _logit_bias_ids(bias: object) -> object:
    # OpenAI's form: token ids as JSON object keys (strings of ASCII digits), read as ints
    # here so that nothing later parses client text. Whether each id is in the vocabulary
    # is checked by the server, which knows it.
    if not isinstance(bias, dict):
        return bias  # pydantic refuses it as not an object
    if len(bias) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias may have at most {MAX_LOGIT_BIAS} entries, not {len(bias)}")
    by_id: dict[object, object] = {}
    for key, value in bias.items():
        digits = key.strip() if isinstance(key, str) else ""
        if not (digits.isascii() and digits.isdigit() and len(digits) <= MAX_TOKEN_ID_DIGITS):
            raise ValueError(f"logit_bias keys are token ids written as strings of digits, not {str(key)[:32]!r}")
        by_id[int(digits)] = value
    return by_id


def _logit_bias_values(bias: dict[int, float]) -> dict[int, float]:
    for token, value in bias.items():
        if not -100.0 <= value <= 100.0:
            raise ValueError(f"logit_bias values lie in [-100, 100]; token {token} has {value}")
    return bias


def _no_whitespace_pattern(pattern: str) -> str:
    raise ValueError(
        "guided_whitespace_pattern is not supported: JSON output has no free whitespace "
        "(as with structured_outputs.disable_any_whitespace)"
    )


LogitBias = Annotated[dict[int, FiniteFloat], BeforeValidator(_logit_bias_ids), AfterValidator(_logit_bias_values)]


class StreamOptions(Lenient):
    include_usage: bool = False
    # vLLM's extension: every chunk carries the usage so far.
    continuous_usage_stats: bool = False


class SamplingFields(Lenient):
    """Fields shared by completions and chat, including vLLM's sampling extensions."""

    model: Text | None = None
    n: int = Field(1, ge=1)  # at most --max-n-sequences (server/request_limits.py)
    temperature: NonNegativeFloat | None = None
    top_p: FiniteFloat | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=INT64_MAX)
    min_p: FiniteFloat | None = Field(None, ge=0.0, le=1.0)
    presence_penalty: FiniteFloat | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: FiniteFloat | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: FiniteFloat | None = Field(None, gt=0.0, le=FLOAT32_MAX)
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOPS)] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0, le=INT64_MAX)]] | None = Field(None, max_length=MAX_STOPS)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: int = Field(0, ge=-INT64_MAX - 1, le=INT64_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    logit_bias: LogitBias | None = None
    # vLLM's extension: the logprobs of each prompt token (and this many alternatives).
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # What the output must match: OpenAI's form, vLLM's, and vLLM's older fields. At most
    # one may constrain a request (server/structured_requests.py).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | Text | None = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = None
    guided_grammar: Text | None = None
    # Names the grammar library; Cadence has one, so the name changes nothing.
    guided_decoding_backend: Text | None = None
    guided_whitespace_pattern: Annotated[Text, AfterValidator(_no_whitespace_pattern)] | None = None

    @model_validator(mode="after")
    def _check_common(self) -> SamplingFields:
        if isinstance(self.stop, list) and any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self


TokenIds = list[Annotated[int, Field(ge=0)]]


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""

    prompt: Text | list[Text] | TokenIds | list[TokenIds]
    max_tokens: int | None = Field(16, ge=1)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: Text | None = None
    best_of: int | None = None

    @model_validator(mode="after")
    def _check_completion(self) -> CompletionRequest:
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of is not supported (it may only equal n)")
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt must not be empty")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts, each text or token ids."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]  # type: ignore[arg-type]
        return list(prompt)  # type: ignore[arg-type]


class TextPart(Lenient):
    type: Literal["text"]
    text: Text


def _part_kind(part: Any) -> str:
    kind = part.get("type") if isinstance(part, dict) else getattr(part, "type", None)
    return "text part" if kind == "text" else "other part"


# A part that says it is text is validated as text (a bad one is refused with its path),
# never accepted as some other kind of part. The tags hold a space, which tells the error
# handler they are not field names.
ContentPart = Annotated[
    Annotated[TextPart, Tag("text part")] | Annotated[dict[str, Any], Tag("other part")], Discriminator(_part_kind)
]


class ChatMessage(Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[ContentPart] | None = None
    name: Text | None = None
    # An assistant turn that called tools, and a tool's answer to one of those calls.
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: Text | None = None
    # An assistant turn's reasoning, which templates such as Qwen3's render or drop.
    reasoning_content: Text | None = None

    def text(self) -> str:
        """The message's text; non-text parts (images, audio) are refused."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        pieces = []
        for part in self.content:
            if not isinstance(part, TextPart):
                kind = part.get("type", "unknown")
                raise ValueError(f"content parts of type {kind!r} are not supported; this model reads text")
            pieces.append(part.text)
        return "".join(pieces)


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    max_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    # Extra variables for the chat template, such as {"enable_thinking": false}.
    chat_template_kwargs: dict[str, Any] | None = None
    tools: Tools | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs to be true")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class TokenizeRequest(Lenient):
    """POST /tokenize: either a prompt or chat messages."""

    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    tools: Tools | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(Lenient):
    """POST /detokenize."""

    model: Text | None = None
    tokens: TokenIds

"""Request bodies of the OpenAI-compatible API, validated by pydantic at the server edge.

Unknown fields are ignored, not rejected: clients send vendor extensions. Fields Cadence
cannot honour (tools, logit_bias, structured output) are rejected with a clear 400 rather
than silently dropped, because ignoring them would change what the caller gets.
Responses are the models of openai_schema/responses.py, shaped exactly like OpenAI's (the
Python client parses into the same models); the tests validate them with the openai SDK's
own models too.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

from cadence.sampling_limits import FLOAT32_MAX, INT64_MAX, MAX_LOGPROBS

# Stop strings are checked on every new token of every choice; bound that work.
MAX_STOPS = 64
MAX_STOP_LENGTH = 512


def _no_lone_surrogates(text: str) -> str:
    # JSON's \ud800 escapes decode to halves of UTF-16 pairs that no UTF-8 text holds;
    # the tokenizer would refuse them with a TypeError deep inside. Encoding finds the
    # first one faster than a regular expression would.
    if text.isascii():
        return text
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(
            f"the text holds a lone UTF-16 surrogate (U+{ord(text[error.start]):04X}) at character {error.start}, "
            "which is not a Unicode character"
        ) from None
    return text


# Every string a client sends is checked: each one reaches a tokenizer or a JSON answer.
Text = Annotated[str, AfterValidator(_no_lone_surrogates)]
# NaN and infinity are refused (JSON parsers accept NaN and Infinity); fields with no
# range of their own are also kept to what float32, the sampler's type, can hold.
FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]
NonNegativeFloat = Annotated[FiniteFloat, Field(ge=0.0, le=FLOAT32_MAX)]


def _stop_string(text: str) -> str:
    if len(text) > MAX_STOP_LENGTH:
        raise ValueError(f"a stop string may have at most {MAX_STOP_LENGTH} characters, not {len(text)}")
    return _no_lone_surrogates(text)


StopString = Annotated[str, AfterValidator(_stop_string)]


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        # OpenAI's schema lets clients send null for any optional field; it means "unset".
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None}
        return data


class StreamOptions(_Lenient):
    include_usage: bool = False
    # vLLM's extension: every chunk carries the usage so far.
    continuous_usage_stats: bool = False


class SamplingFields(_Lenient):
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
    logit_bias: dict[str, float] | None = None

    @model_validator(mode="after")
    def _check_common(self) -> SamplingFields:
        if self.logit_bias:
            raise ValueError("logit_bias is not supported")
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


class TextPart(_Lenient):
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


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[ContentPart] | None = None
    name: Text | None = None

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
    tools: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        if self.tools:
            raise ValueError("tools are not supported")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise ValueError("response_format other than text is not supported")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs to be true")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class TokenizeRequest(_Lenient):
    """POST /tokenize: either a prompt or chat messages."""

    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(_Lenient):
    """POST /detokenize."""

    model: Text | None = None
    tokens: TokenIds

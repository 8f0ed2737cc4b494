"""From API request to engine request: tokenization, chat templates, limits, sampling.

Everything here raises `APIError` (400) for input the engine could not serve, so a bad
request is refused before it reaches the engine and nothing is queued for it.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from transformers import PreTrainedTokenizerBase

from cadence.engine.detokenizer import decode_text
from cadence.engine.sampling_params import SamplingParams
from cadence.openai_schema.constraint_fields import MessageToolCall, Tool
from cadence.openai_schema.requests import ChatMessage, SamplingFields
from cadence.server.errors import APIError, bad_request
from cadence.server.token_bound import token_bound
from cadence.server.tokenize_pool import TokenizePool
from cadence.structured_outputs.params import StructuredOutputsParams

T = TypeVar("T")


@dataclass
class Prompt:
    """A prompt as the engine sees it (token ids) and as the caller wrote it (text)."""

    token_ids: list[int]
    text: str | None


class PromptBuilder:
    """Turns text, token ids and chat messages into validated prompts for one model.

    Everything that grows with the input runs on the tokenizer pool's threads, off the
    event loop, and a prompt whose length alone proves it longer than the context is
    refused before any of that work.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase | None,
        max_model_len: int,
        vocab_size: int,
        chat_template: str | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        # --chat-template: renders chats instead of the tokenizer's own template.
        self.chat_template = chat_template
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self.pool = None if backend is None else TokenizePool(backend)
        self.bound = None if self.pool is None else token_bound(self.pool.json)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()

    def _require_tokenizer(self) -> PreTrainedTokenizerBase:
        if self.tokenizer is None:
            raise bad_request("this model has no tokenizer; send prompts as token ids", "prompt")
        return self.tokenizer

    async def _off_loop(self, function: Callable[..., T], *args: object) -> T:
        if self.pool is not None:
            return await self.pool.run(function, *args)
        # A tokenizer in Python: a thread at least lets the loop run between bytecodes.
        return await asyncio.to_thread(function, *args)

    async def encode(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        """The text's token ids; 400 when its length alone shows the context cannot hold it."""
        tokenizer = self._require_tokenizer()
        least = None if self.bound is None else self.bound.proves_at_least(text, self.max_model_len)
        if least is not None:
            raise APIError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens. However, your "
                f"prompt has {len(text)} characters, which make at least {least} tokens.",
                param=param,
                code="context_length_exceeded",
            )
        if self.pool is not None:
            return await self.pool.encode(text, add_special_tokens)
        return await self._off_loop(functools.partial(tokenizer.encode, text, add_special_tokens=add_special_tokens))

    async def from_completion_prompt(self, prompt: str | list[int], add_special_tokens: bool = True) -> Prompt:
        if isinstance(prompt, str):
            return Prompt(await self.encode(prompt, add_special_tokens, "prompt"), prompt)
        if len(prompt) >= self.max_model_len:
            raise self._no_room(len(prompt), "prompt")
        text = await self._off_loop(self._checked_text, prompt, "prompt")
        return Prompt(list(prompt), text)

    def _checked_text(self, token_ids: list[int], param: str) -> str | None:
        self.check_token_ids(token_ids, param)
        return None if self.tokenizer is None else decode_text(self.tokenizer, token_ids)

    async def from_messages(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool = True,
        tools: list[Tool] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> Prompt:
        """The chat rendered by the template (with the tools' function specs, and the
        client's extra template variables) and tokenized."""
        tokenizer = self._require_tokenizer()
        if self.chat_template is None and tokenizer.chat_template is None:
            raise bad_request("this model's tokenizer has no chat template; use /v1/completions", "messages")
        extra = self._template_kwargs(tokenizer, template_kwargs or {})
        try:
            conversation = [message_dict(m) for m in messages]
            text = await self._off_loop(
                functools.partial(
                    tokenizer.apply_chat_template,
                    conversation,
                    tools=[t.model_dump(exclude_none=True, by_alias=True) for t in tools] if tools else None,
                    chat_template=self.chat_template,
                    tokenize=False,
                    add_generation_prompt=add_generation_prompt,
                    **extra,
                )
            )
        except ValueError as error:
            raise bad_request(str(error), "messages") from error
        except Exception as error:  # jinja raises many kinds for bad input
            raise bad_request(f"the chat template could not render these messages: {error}", "messages") from error
        assert isinstance(text, str)
        # The template already holds any BOS it wants; encoding must not add another.
        return Prompt(await self.encode(text, False, "messages"), text)

    @staticmethod
    def _template_kwargs(tokenizer: PreTrainedTokenizerBase, kwargs: dict[str, Any]) -> dict[str, Any]:
        # The template's own variables only: a name apply_chat_template itself takes
        # (tokenize, return_dict, ...) would change what it returns, not what it renders.
        taken = set(inspect.signature(tokenizer.apply_chat_template).parameters)
        reserved = sorted(taken & set(kwargs))
        if reserved:
            raise bad_request(f"chat_template_kwargs may not set {', '.join(reserved)}", "chat_template_kwargs")
        return kwargs

    def check_token_ids(self, token_ids: list[int], param: str) -> None:
        bad = next((t for t in token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})", param)

    def token_text(self, token_id: int) -> str:
        """One token's text, for logprobs ("" when there is no tokenizer)."""
        return "" if self.tokenizer is None else decode_text(self.tokenizer, [token_id])

    async def decode(self, token_ids: list[int]) -> str:
        self._require_tokenizer()
        text = await self._off_loop(self._checked_text, token_ids, "tokens")
        assert text is not None
        return text

    def _no_room(self, prompt_len: int, param: str) -> APIError:
        return APIError(
            400,
            f"This model's maximum context length is {self.max_model_len} tokens. However, "
            f"your prompt has {prompt_len} tokens, which leaves no room to generate.",
            param=param,
            code="context_length_exceeded",
        )

    def max_tokens(
        self,
        prompt: Prompt,
        requested: int | None,
        default: int | None,
        prompt_param: str = "prompt",
        requested_param: str = "max_tokens",
    ) -> int:
        """How many tokens a request may generate; 400 when the context cannot hold them."""
        prompt_len = len(prompt.token_ids)
        if prompt_len == 0:
            raise bad_request("the prompt is empty", "prompt")
        room = self.max_model_len - prompt_len
        if room < 1:
            raise self._no_room(prompt_len, prompt_param)
        if requested is not None:
            if requested > room:
                raise APIError(
                    400,
                    f"This model's maximum context length is {self.max_model_len} tokens. However, "
                    f"you requested {prompt_len + requested} tokens ({prompt_len} in the prompt, "
                    f"{requested} for the completion). Reduce the prompt or the completion length.",
                    param=requested_param,
                    code="context_length_exceeded",
                )
            return requested
        return room if default is None else min(default, room)

    def sampling_params(
        self,
        request: SamplingFields,
        max_tokens: int,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        structured_outputs: StructuredOutputsParams | None = None,
        skip_special_tokens: bool | None = None,
    ) -> SamplingParams:
        """The engine's SamplingParams for an API request; OpenAI's defaults where unset.

        `skip_special_tokens`, when given, replaces the request's own."""
        self.check_token_ids(request.stop_token_ids or [], "stop_token_ids")
        logit_bias = dict(request.logit_bias) if request.logit_bias else None  # token ids since validation
        if logit_bias:
            self.check_token_ids(sorted(logit_bias), "logit_bias")
        try:
            return SamplingParams(
                n=request.n,
                max_tokens=max_tokens,
                min_tokens=request.min_tokens,
                temperature=1.0 if request.temperature is None else request.temperature,
                top_p=1.0 if request.top_p is None else request.top_p,
                top_k=0 if request.top_k is None else request.top_k,
                min_p=request.min_p or 0.0,
                presence_penalty=request.presence_penalty or 0.0,
                frequency_penalty=request.frequency_penalty or 0.0,
                repetition_penalty=1.0 if request.repetition_penalty is None else request.repetition_penalty,
                seed=request.seed,
                stop=request.stop,
                stop_token_ids=list(request.stop_token_ids or []),
                ignore_eos=request.ignore_eos,
                include_stop_str_in_output=request.include_stop_str_in_output,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                skip_special_tokens=request.skip_special_tokens if skip_special_tokens is None else skip_special_tokens,
                logit_bias=logit_bias,
                structured_outputs=structured_outputs,
            )
        except ValueError as error:
            raise bad_request(str(error)) from error


def message_dict(message: ChatMessage) -> dict[str, Any]:
    """A message as chat templates read it (transformers' and vLLM's conventions)."""
    entry: dict[str, Any] = {"role": message.role, "content": message.text()}
    if message.content is None and message.tool_calls:
        # A turn that only called tools: templates test `content` for none, not "".
        entry["content"] = None
    if message.name is not None:
        entry["name"] = message.name
    if message.tool_calls:
        entry["tool_calls"] = [_tool_call_dict(call) for call in message.tool_calls]
    if message.tool_call_id is not None:
        entry["tool_call_id"] = message.tool_call_id
    if message.reasoning_content is not None:
        entry["reasoning_content"] = message.reasoning_content
    return entry


def _tool_call_dict(call: MessageToolCall) -> dict[str, Any]:
    # Templates write a call's arguments with `tojson` (Qwen2.5, Llama 3, Hermes) or test
    # `is string` first (Qwen3): an object suits both, so JSON text is read into one, as
    # vLLM does. Text that is not a JSON object is passed on as it came.
    arguments: Any = call.function.arguments
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except (json.JSONDecodeError, RecursionError):
            parsed = None
        if isinstance(parsed, dict):
            arguments = parsed
    entry: dict[str, Any] = {"type": "function", "function": {"name": call.function.name, "arguments": arguments}}
    if call.id is not None:
        entry["id"] = call.id
    return entry

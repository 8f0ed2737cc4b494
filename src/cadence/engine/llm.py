"""The offline API: `LLM(model=...).generate(prompts, SamplingParams(...))`, as in vLLM."""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from cadence.engine.engine_args import engine_args_for
from cadence.engine.engine_core import EngineCore
from cadence.engine.output_processor import OutputProcessor
from cadence.engine.outputs import RequestOutput
from cadence.engine.protocol import EngineCoreRequest
from cadence.engine.sampling_params import SamplingParams
from cadence.structured_outputs.grammar import check_grammar, grammar_text
from cadence.tokenization.loading import load_tokenizer

# Text, token ids, or vLLM's dict forms {"prompt": text} / {"prompt_token_ids": ids}.
PromptType = str | list[int] | dict[str, Any]


class LLM:
    """Batch generation in-process: every prompt is added, then the engine steps until done.

    `model` is what `cadence serve [MODEL]` takes: an HF folder, a .gguf file (converted
    once and cached, then served in its own quantized blocks unless `quantization` says
    otherwise) or None for the default SmolLM2-135M-Instruct. Keyword arguments are
    EngineArgs fields (dtype, quantization, max_num_seqs, max_num_batched_tokens,
    block_size, enable_prefix_caching, num_gpu_blocks, kv_cache_memory, max_model_len, ...),
    with the server's defaults; an unknown one raises TypeError. The tokenizer comes from
    the loaded folder unless `tokenizer` names another.

    On CPU the engine raises glibc's malloc thresholds for the whole process, so freed
    memory stays in it (``engine/host_memory.py``), unless the environment already sets
    the allocator (``LD_PRELOAD``, ``GLIBC_TUNABLES`` or ``MALLOC_*_``).
    """

    def __init__(
        self,
        model: str | os.PathLike[str] | None = None,
        tokenizer: str | os.PathLike[str] | None = None,
        **engine_options: object,
    ) -> None:
        args = engine_args_for(model, **engine_options)
        self.engine = EngineCore(args)
        self.tokenizer = load_tokenizer(os.fspath(tokenizer) if tokenizer is not None else args.model)
        self._ids = itertools.count()

    def get_tokenizer(self) -> PreTrainedTokenizerBase | None:
        return self.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order.

        Raises ValueError, before anything runs, for a prompt the engine cannot take or a
        structured output whose schema or grammar does not compile; and, after it ran, for
        a request the engine ended because its grammar failed there (a compile that ran
        out of time), aborting the rest.
        """
        prompt_list = self._normalize_prompts(prompts)
        params_list = self._per_prompt(sampling_params or SamplingParams(), len(prompt_list))
        priorities = list(priority) if priority is not None else [0] * len(prompt_list)
        if len(priorities) != len(prompt_list):
            raise ValueError("priority must have one entry per prompt")

        requests = []
        for prompt, params, prio in zip(prompt_list, params_list, priorities):
            token_ids = self._tokenize(prompt)
            if params.structured_outputs is not None:
                check_grammar(grammar_text(params.structured_outputs), self.engine.structured.tokenizer())
            request = EngineCoreRequest(f"offline-{next(self._ids)}", token_ids, params, prio)
            self.engine.validate(request)
            text = prompt.get("prompt") if isinstance(prompt, dict) else prompt
            requests.append((request, text if isinstance(text, str) else None))

        processor = OutputProcessor(self.tokenizer)
        order = {request.request_id: i for i, (request, _) in enumerate(requests)}
        results: list[RequestOutput | None] = [None] * len(requests)
        try:
            for request, text in requests:
                processor.add_request(request.request_id, text, request.prompt_token_ids, request.sampling_params)
                self.engine.add_request(request)
            while self.engine.has_unfinished_requests():
                if not self.engine.has_work():
                    self.engine.structured.wait()  # only grammars still compiling
                finished, to_abort = processor.process(self.engine.step())
                failed = self.engine.take_failed_requests()
                if failed:
                    request_id, reason = next(iter(failed.items()))
                    raise ValueError(f"request {request_id}: {reason}")
                for request_id, index in to_abort:
                    self.engine.abort_requests([self.engine.sequence_id(request_id, index)])
                for output in finished:
                    results[order[output.request_id]] = output
        except BaseException:
            # Leave the engine usable: nothing of this call may stay scheduled.
            self.engine.abort_requests(order)
            raise
        return [r for r in results if r is not None]

    def chat(
        self,
        messages: Sequence[dict[str, Any]] | Sequence[Sequence[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: Sequence[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Generate for one conversation, or for each of a list of them, as vLLM's `LLM.chat`.

        Each conversation goes through the chat template (the tokenizer's, or
        `chat_template`) with `tools` and `chat_template_kwargs`, exactly as the server
        renders it; the answers are the model's raw text (tool calls and reasoning are read
        out of it by the server's parsers, not here).
        """
        tokenizer = self.tokenizer
        if tokenizer is None:
            raise ValueError("this model has no tokenizer, so it has no chat template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts: list[PromptType] = []
        for conversation in conversations:
            text = tokenizer.apply_chat_template(
                list(conversation),  # type: ignore[arg-type]
                tools=list(tools) if tools else None,
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
                **(chat_template_kwargs or {}),
            )
            assert isinstance(text, str)
            # The template holds any BOS it wants; encoding must not add another.
            prompts.append({"prompt_token_ids": tokenizer.encode(text, add_special_tokens=False), "prompt": text})
        return self.generate(prompts, sampling_params)

    @staticmethod
    def _normalize_prompts(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
        if isinstance(prompts, (str, dict)):
            return [prompts]
        items = list(prompts)
        token_ids = [p for p in items if isinstance(p, int)]
        if items and len(token_ids) == len(items):
            return [token_ids]  # one prompt given as token ids
        prompt_list = [p for p in items if not isinstance(p, int)]
        if len(prompt_list) != len(items):
            raise ValueError("a list of prompts cannot mix token ids with other prompts")
        return prompt_list

    @staticmethod
    def _per_prompt(params: SamplingParams | Sequence[SamplingParams], count: int) -> list[SamplingParams]:
        if isinstance(params, SamplingParams):
            return [params] * count
        params = list(params)
        if len(params) != count:
            raise ValueError(f"got {len(params)} sampling params for {count} prompts")
        return params

    def _tokenize(self, prompt: PromptType) -> list[int]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = prompt["prompt_token_ids"]
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a dict prompt needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer; pass prompts as token ids")
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, dict) or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise ValueError("a token-id prompt must be a list of ints")
        return list(prompt)

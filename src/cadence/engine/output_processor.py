"""Front-end bookkeeping: gathers EngineCoreOutputs into RequestOutputs.

It detokenizes, applies stop strings (telling the caller which sequences to abort in the
engine), and turns raw logprob rows into vLLM's {token_id: Logprob} dicts.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from cadence.engine.detokenizer import IncrementalDetokenizer, decode_text
from cadence.engine.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from cadence.engine.protocol import EngineCoreOutput, TokenLogprobs
from cadence.engine.sampling_params import SamplingParams


def to_position_logprobs(row: TokenLogprobs, tokenizer: PreTrainedTokenizerBase | None) -> PositionLogprobs:
    """One position's (ids, logprobs, rank) row as {token_id: Logprob}, chosen token first."""
    ids, values, chosen_rank = row
    result: PositionLogprobs = {}
    for column, (token_id, value) in enumerate(zip(ids, values)):
        if token_id in result:
            continue  # the chosen token also appears among the top alternatives
        text = decode_text(tokenizer, [token_id]) if tokenizer is not None else None
        result[token_id] = Logprob(value, chosen_rank if column == 0 else column, text)
    return result


@dataclass
class RequestState:
    """Everything the front end knows about one request in flight."""

    output: RequestOutput
    params: SamplingParams
    detokenizers: list[IncrementalDetokenizer] | None


class OutputProcessor:
    """Turns per-step engine outputs into growing RequestOutputs."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}

    def add_request(
        self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        outputs = [
            CompletionOutput(
                index=i,
                text="",
                token_ids=[],
                cumulative_logprob=None if params.logprobs is None else 0.0,
                logprobs=None if params.logprobs is None else [],
            )
            for i in range(params.n)
        ]
        detokenizers = None
        if self.tokenizer is not None:
            detokenizers = [
                IncrementalDetokenizer(
                    self.tokenizer,
                    skip_special_tokens=params.skip_special_tokens,
                    stop=params.stop_strings,
                    include_stop_str_in_output=params.include_stop_str_in_output,
                    min_tokens=params.min_tokens,
                )
                for _ in range(params.n)
            ]
        elif params.stop_strings:
            raise ValueError("stop strings need a tokenizer, and this model has none")
        prompt_logprobs: list[PositionLogprobs | None] | None = None if params.prompt_logprobs is None else [None]
        request_output = RequestOutput(request_id, prompt, prompt_token_ids, outputs, prompt_logprobs)
        self.states[request_id] = RequestState(request_output, params, detokenizers)

    def process(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[tuple[str, int]]]:
        """Apply one step's outputs.

        Returns the requests that finished with this step, and the (request id, index)
        of sequences that a stop string ended, which the engine must abort.
        """
        finished: list[RequestOutput] = []
        to_abort: list[tuple[str, int]] = []
        for out in outputs:
            state = self.states.get(out.request_id)
            if state is None:
                continue
            request_output = state.output
            if out.new_prompt_logprobs:
                assert request_output.prompt_logprobs is not None, "prompt logprobs come only when asked for"
                request_output.prompt_logprobs.extend(
                    to_position_logprobs(row, self.tokenizer) for row in out.new_prompt_logprobs
                )
            request_output.num_cached_tokens = max(request_output.num_cached_tokens, out.num_cached_tokens)
            completion = request_output.outputs[out.index]
            if completion.finished:
                continue
            completion.token_ids.extend(out.new_token_ids)
            if out.new_logprobs:
                assert completion.logprobs is not None and completion.cumulative_logprob is not None
                for row in out.new_logprobs:
                    completion.logprobs.append(to_position_logprobs(row, self.tokenizer))
                    completion.cumulative_logprob += row[1][0]
            finish_reason = out.finish_reason
            stop_reason: int | str | None = out.stop_reason  # a stop string replaces the stop token id
            if state.detokenizers is not None:
                text_ids = out.new_token_ids
                # A stop token stays in token_ids, not in text; a grammar's last token is text.
                ended_by_token = finish_reason == "stop" and not out.completed_grammar
                if ended_by_token and not state.params.include_stop_str_in_output:
                    text_ids = text_ids[:-1]
                _, match = state.detokenizers[out.index].add_tokens(text_ids)
                completion.text = state.detokenizers[out.index].text
                if match is not None and finish_reason is None:
                    finish_reason, stop_reason = "stop", match.stop
                    to_abort.append((out.request_id, out.index))
                elif match is not None:
                    finish_reason, stop_reason = "stop", match.stop
            if finish_reason is not None:
                completion.finish_reason, completion.stop_reason = finish_reason, stop_reason
            if all(c.finished for c in request_output.outputs):
                request_output.finished = True
                finished.append(request_output)
                del self.states[out.request_id]
        return finished, to_abort

    def held_back(self, request_id: str, index: int) -> int:
        """Trailing characters of a sequence's text that streaming must not send yet."""
        state = self.states.get(request_id)
        if state is None or state.detokenizers is None:
            return 0
        return state.detokenizers[index].held_back()

    def abort(self, request_id: str) -> None:
        self.states.pop(request_id, None)

"""GrammarMatcher: accepting, terminating, failing, and rolling back to an earlier mask,
as speculative decoding will use it."""

from __future__ import annotations

import json
from pathlib import Path

import llguidance
import pytest
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from cadence.engine.structured_output.bitmask import allowed_tokens, bitmask_width
from cadence.engine.structured_output.matcher import GrammarMatcher, fill_bitmasks
from cadence.structured_outputs.grammar import grammar_text, ll_tokenizer, parser_limits
from cadence.structured_outputs.params import StructuredOutputsParams
from tests.support.tiny_tokenizer import save_tiny_tokenizer

VOCAB = 512
EOS = 2


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> tuple[PreTrainedTokenizerBase, llguidance.LLTokenizer]:
    path: Path = tmp_path_factory.mktemp("tokenizer")
    save_tiny_tokenizer(path)
    hf = AutoTokenizer.from_pretrained(path)
    return hf, ll_tokenizer(hf.backend_tokenizer.to_str(), VOCAB, [EOS])


def matcher_for(tokenizer: llguidance.LLTokenizer, params: StructuredOutputsParams) -> GrammarMatcher:
    return GrammarMatcher(llguidance.LLMatcher(tokenizer, grammar_text(params), limits=parser_limits(), log_level=0))


EXECUTOR = llguidance.LLExecutor(num_threads=1)


def allowed(matcher: GrammarMatcher) -> list[int]:
    """The tokens the matcher allows next, from the mask as the engine fills it."""
    bitmask = torch.empty((1, bitmask_width(VOCAB)), dtype=torch.int32)
    fill_bitmasks(EXECUTOR, [matcher], bitmask)
    return allowed_tokens(bitmask, VOCAB)[0].nonzero().flatten().tolist()


def test_accepts_a_valid_output_and_terminates_on_its_last_token(tokenizers: tuple) -> None:
    hf, tokenizer = tokenizers
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    matcher = matcher_for(tokenizer, StructuredOutputsParams(json=schema))
    tokens = hf.encode(json.dumps({"a": 12}))
    assert matcher.accept(tokens[:-1]) and not matcher.is_terminated
    assert matcher.accept(tokens[-1:]) and matcher.is_terminated
    assert allowed(matcher) == [EOS]
    assert matcher.num_accepted == len(tokens)


def test_a_refused_token_is_an_error_for_good(tokenizers: tuple) -> None:
    hf, tokenizer = tokenizers
    matcher = matcher_for(tokenizer, StructuredOutputsParams(choice=("yes", "no")))
    assert matcher.num_valid(hf.encode("yes") + hf.encode("!")) == len(hf.encode("yes"))
    assert not matcher.accept(hf.encode("!"))
    assert matcher.is_error and matcher.error and not matcher.is_terminated
    assert not matcher.accept(hf.encode("yes"))


def test_rollback_restores_each_earlier_mask(tokenizers: tuple) -> None:
    hf, tokenizer = tokenizers
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}}}
    matcher = matcher_for(tokenizer, StructuredOutputsParams(json=schema))
    tokens = hf.encode(json.dumps({"name": "fox", "n": 3})) + [EOS, EOS]  # EOS after the end counts too
    masks = [allowed(matcher)]
    for token in tokens:
        assert matcher.accept([token])
        masks.append(allowed(matcher))
    assert len(set(map(tuple, masks))) > 3  # the masks differ along the way
    # Back one token at a time, then forward again and back several at once.
    for back in range(1, len(tokens) + 1):
        matcher.rollback(1)
        assert matcher.num_accepted == len(tokens) - back
        assert allowed(matcher) == masks[len(tokens) - back]
    assert matcher.accept(tokens)
    matcher.rollback(5)
    assert allowed(matcher) == masks[len(tokens) - 5] and not matcher.is_terminated
    assert matcher.accept(tokens[-5:]) and matcher.is_terminated


def test_rollback_past_what_was_accepted_is_refused(tokenizers: tuple) -> None:
    hf, tokenizer = tokenizers
    matcher = matcher_for(tokenizer, StructuredOutputsParams(regex="[a-z]+"))
    matcher.accept(hf.encode("fox"))
    with pytest.raises(ValueError, match="cannot roll back"):
        matcher.rollback(matcher.num_accepted + 1)

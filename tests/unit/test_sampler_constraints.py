"""The sampler's logit_bias and grammar stages, and their order with min_tokens and the
raw logprobs. logit_bias as OpenAI describes it: -100 bans, +100 leaves only the +100
tokens, values in between are added."""

from __future__ import annotations

import torch

from cadence.engine.sampler import Sampler, SamplingMetadata
from cadence.engine.sampling_params import SamplingParams

CPU = torch.device("cpu")
VOCAB = 40


def bitmask(allowed: list[set[int]]) -> torch.Tensor:
    """Packed int32 rows, bit t % 32 of word t // 32 set for each allowed token t."""
    words = torch.zeros((len(allowed), (VOCAB + 31) // 32), dtype=torch.int64)
    for row, tokens in enumerate(allowed):
        for t in tokens:
            words[row, t // 32] |= 1 << (t % 32)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def build(
    params: list[SamplingParams],
    grammar: dict[int, set[int]] | None = None,
    outputs: list[list[int]] | None = None,
    stops: list[set[int]] | None = None,
) -> SamplingMetadata:
    n = len(params)
    rows = sorted(grammar or {})
    masks = (torch.tensor(rows, dtype=torch.int64), bitmask([(grammar or {})[r] for r in rows])) if rows else None
    return SamplingMetadata.build(
        params,
        [[] for _ in range(n)],
        outputs if outputs is not None else [[] for _ in range(n)],
        [None] * n,
        stops if stops is not None else [set() for _ in range(n)],
        CPU,
        grammar=masks,
    )


def logits(batch: int) -> torch.Tensor:
    return torch.randn(batch, VOCAB, generator=torch.Generator().manual_seed(batch))


def test_each_row_samples_only_what_its_grammar_allows() -> None:
    raw = logits(3)
    allowed = {0: {5, 9}, 2: {17}}
    greedy, sampled = SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)
    for params in ([greedy] * 3, [sampled] * 3):
        for _ in range(20):
            tokens = Sampler()(raw, build(params, allowed)).sampled_token_ids.tolist()
            assert tokens[0] in allowed[0] and tokens[2] == 17
    # Greedy picks the best allowed token; the unconstrained row its own argmax.
    tokens = Sampler()(raw, build([greedy] * 3, allowed)).sampled_token_ids.tolist()
    assert tokens[0] == max(allowed[0], key=lambda t: raw[0, t].item())
    assert tokens[1] == int(raw[1].argmax())


def test_logit_bias_moves_greedy_rows_and_never_lets_a_token_past_the_grammar() -> None:
    raw = logits(2)
    low = int(raw[0].argmin())
    params = [SamplingParams(temperature=0.0, logit_bias={low: 99.0}), SamplingParams(temperature=0.0)]
    assert Sampler()(raw, build(params)).sampled_token_ids.tolist() == [low, int(raw[1].argmax())]
    # Biased or not, a token outside the grammar stays out.
    tokens = Sampler()(raw, build(params, {0: {3, 4}})).sampled_token_ids.tolist()
    assert tokens[0] == max((3, 4), key=lambda t: raw[0, t].item())


def test_minus_100_bans_a_token_however_likely() -> None:
    raw = logits(1)
    raw[0, 7] = 1e4  # far past what subtracting 100 would bring down
    for temperature in (0.0, 1.0):
        params = [SamplingParams(temperature=temperature, seed=1, logit_bias={7: -100.0, 8: -5.0})]
        for _ in range(20):
            assert Sampler()(raw, build(params)).sampled_token_ids.tolist() != [7]


def test_plus_100_leaves_only_the_plus_100_tokens() -> None:
    raw = logits(1)
    raw[0, 5] = raw[0, 6] = -1e4  # far below what adding 100 would lift past the rest
    params = [SamplingParams(temperature=2.0, logit_bias={5: 100.0, 6: 100.0, 9: 50.0})]
    seen = {Sampler()(raw, build(params)).sampled_token_ids.item() for _ in range(60)}
    assert seen == {5, 6}
    # Under a grammar: the +100 tokens it allows, or the grammar's own choice if none.
    assert {Sampler()(raw, build(params, {0: {6, 11}})).sampled_token_ids.item() for _ in range(20)} == {6}
    grammar_only = {Sampler()(raw, build(params, {0: {11, 12}})).sampled_token_ids.item() for _ in range(40)}
    assert grammar_only <= {11, 12} and grammar_only


def test_a_ban_that_empties_a_grammar_row_yields_to_the_grammar() -> None:
    raw = logits(1)
    params = [SamplingParams(temperature=0.0, logit_bias={3: -100.0})]
    assert Sampler()(raw, build(params, {0: {3}})).sampled_token_ids.tolist() == [3]


def test_min_tokens_yields_where_the_grammar_allows_only_stop_ids() -> None:
    raw = logits(2)
    params = [SamplingParams(temperature=0.0, min_tokens=5)] * 2
    # Row 0's grammar allows only stop id 7; row 1's allows 7 and 8, so min_tokens holds 7 back.
    metadata = build(params, {0: {7}, 1: {7, 8}}, outputs=[[], []], stops=[{7}, {7}])
    assert Sampler()(raw, metadata).sampled_token_ids.tolist() == [7, 8]


def test_logprobs_are_the_raw_model_logprobs() -> None:
    raw = logits(1)
    params = [SamplingParams(temperature=0.0, logprobs=2, logit_bias={1: 50.0})]
    out = Sampler()(raw, build(params, {0: {1, 2}}))
    expected = torch.log_softmax(raw, dim=-1)
    assert out.logprobs is not None and out.logprob_token_ids is not None
    assert int(out.sampled_token_ids[0]) == 1
    assert torch.allclose(out.logprobs[0, 0], expected[0, 1])
    assert out.logprob_token_ids[0, 1:].tolist() == expected[0].topk(2).indices.tolist()

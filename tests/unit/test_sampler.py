"""Tests for cadence.engine.sampler: each stage against hand-computed values, plus sampling statistics."""

from __future__ import annotations

import pytest
import torch

import cadence.engine.sampler as sampler_mod
from cadence.engine.sampler import (
    Sampler,
    SamplingMetadata,
    apply_min_p,
    apply_min_tokens,
    apply_penalties,
    apply_top_k_top_p,
    compute_logprobs,
    row_argmax,
)
from cadence.engine.sampling_params import SamplingParams

CPU = torch.device("cpu")
NEG_INF = float("-inf")


def build(
    params: list[SamplingParams],
    prompts: list[list[int]] | None = None,
    outputs: list[list[int]] | None = None,
    generators: list[torch.Generator | None] | None = None,
    stops: list[set[int]] | None = None,
) -> SamplingMetadata:
    n = len(params)
    return SamplingMetadata.build(
        params,
        prompts if prompts is not None else [[] for _ in range(n)],
        outputs if outputs is not None else [[] for _ in range(n)],
        generators if generators is not None else [None] * n,
        stops if stops is not None else [set() for _ in range(n)],
        CPU,
    )


def log_of(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float32).log()


def kept(row: torch.Tensor) -> set[int]:
    return set(torch.isfinite(row).nonzero().flatten().tolist())


# ---------------------------------------------------------------- greedy


def test_greedy_is_argmax() -> None:
    torch.manual_seed(0)
    logits = torch.randn(16, 300)
    out = Sampler()(logits, build([SamplingParams(temperature=0.0)] * 16))
    assert out.sampled_token_ids.dtype == torch.int64
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    assert out.logprobs is None and out.logprob_token_ids is None and out.sampled_ranks is None


def test_greedy_rows_in_mixed_batch_consume_no_randomness() -> None:
    torch.manual_seed(1)
    logits = torch.randn(4, 200)
    gens = [torch.Generator().manual_seed(s) for s in range(4)]
    states = [g.get_state().clone() for g in gens]
    params = [
        SamplingParams(temperature=0.0, seed=1),
        SamplingParams(temperature=1.0, seed=2),
        SamplingParams(temperature=0.0, top_k=3, top_p=0.5, seed=3),
        SamplingParams(temperature=0.5),
    ]
    gens_in: list[torch.Generator | None] = [gens[0], gens[1], gens[2], None]
    original = logits.clone()
    out = Sampler()(logits, build(params, generators=gens_in))
    assert torch.equal(logits, original), "caller's logits must not be modified"
    assert out.sampled_token_ids[0] == logits[0].argmax()
    assert out.sampled_token_ids[2] == logits[2].argmax()
    assert torch.equal(gens[0].get_state(), states[0])
    assert torch.equal(gens[2].get_state(), states[2])
    assert not torch.equal(gens[1].get_state(), states[1])


# ---------------------------------------------------------------- sampling statistics


def test_temperature_sampling_matches_softmax() -> None:
    torch.manual_seed(1234)
    base = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0])
    n = 20000
    temperature = 0.7
    out = Sampler()(base.repeat(n, 1), build([SamplingParams(temperature=temperature)] * n))
    counts = torch.bincount(out.sampled_token_ids, minlength=5).double()
    expected = torch.softmax(base.double() / temperature, -1) * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    # df = 4: the 99.99% quantile is about 23.5, so a correct sampler essentially never fails this.
    assert chi2 < 23.5, (counts, expected)
    # And the distribution must actually depend on temperature (e.g. not plain softmax(base)).
    wrong = torch.softmax(base.double(), -1) * n
    assert float(((counts - wrong) ** 2 / wrong).sum()) > 100


def test_seeded_row_sampling_matches_softmax() -> None:
    base = torch.tensor([0.5, 1.5, -1.0, 0.0])
    g = torch.Generator().manual_seed(7)
    params = [SamplingParams(temperature=1.0, seed=7)]
    sampler = Sampler()
    n = 3000
    samples = [int(sampler(base[None], build(params, generators=[g])).sampled_token_ids[0]) for _ in range(n)]
    counts = torch.bincount(torch.tensor(samples), minlength=4).double()
    expected = torch.softmax(base.double(), -1) * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 21.1, (counts, expected)  # df = 3, 99.99% quantile


def test_top_k_never_samples_outside_top_k() -> None:
    torch.manual_seed(3)
    base = torch.randn(50)
    n = 4000
    out = Sampler()(base.repeat(n, 1), build([SamplingParams(temperature=1.5, top_k=5)] * n))
    top5 = set(base.topk(5).indices.tolist())
    seen = set(out.sampled_token_ids.tolist())
    assert seen <= top5
    assert len(seen) == 5  # a flat-ish temperature should reach all five


@pytest.mark.parametrize("with_top_p", [False, True])
def test_top_k_mask_per_row(with_top_p: bool) -> None:
    # Exercises both the topk path and the sort path; row 1 has top_k off.
    torch.manual_seed(4)
    logits = torch.randn(3, 40)
    top_p = 0.9999999 if with_top_p else 1.0
    params = [
        SamplingParams(top_k=3, top_p=top_p),
        SamplingParams(top_k=0, top_p=top_p),
        SamplingParams(top_k=100, top_p=top_p),
    ]
    masked = apply_top_k_top_p(logits.clone(), build(params))
    assert kept(masked[0]) == set(logits[0].topk(3).indices.tolist())
    assert len(kept(masked[1])) >= 38  # top_p just below 1 may drop the tiniest tail only
    assert len(kept(masked[2])) >= 38
    assert torch.equal(masked[0][torch.isfinite(masked[0])], logits[0][torch.isfinite(masked[0])])


def test_top_p_keeps_minimal_nucleus() -> None:
    row = log_of([0.05, 0.5, 0.15, 0.3])
    params = [SamplingParams(top_p=0.75), SamplingParams(top_p=0.85), SamplingParams(top_p=0.4)]
    masked = apply_top_k_top_p(row.repeat(3, 1), build(params))
    assert kept(masked[0]) == {1, 3}  # 0.5 < 0.75 <= 0.8
    assert kept(masked[1]) == {1, 2, 3}  # 0.8 < 0.85 <= 0.95
    assert kept(masked[2]) == {1}  # the top token alone already covers 0.4


def test_top_p_applies_after_top_k_renormalization() -> None:
    # Over the full distribution top_p = 0.75 keeps {0, 1, 2} (0.4 + 0.3 < 0.75); after top_k = 3
    # the renormalized masses are 0.444, 0.333, 0.222, so the nucleus is {0, 1}.
    row = log_of([0.4, 0.3, 0.2, 0.1])
    params = [SamplingParams(top_k=3, top_p=0.75), SamplingParams(top_p=0.75)]
    masked = apply_top_k_top_p(row.repeat(2, 1), build(params))
    assert kept(masked[0]) == {0, 1}
    assert kept(masked[1]) == {0, 1, 2}


def test_top_p_sampling_stays_in_nucleus() -> None:
    torch.manual_seed(5)
    row = log_of([0.05, 0.5, 0.15, 0.3])
    n = 3000
    out = Sampler()(row.repeat(n, 1), build([SamplingParams(top_p=0.75)] * n))
    counts = torch.bincount(out.sampled_token_ids, minlength=4)
    assert counts[0] == 0 and counts[2] == 0
    # Renormalized nucleus: 0.5/0.8 and 0.3/0.8.
    assert abs(counts[1].item() / n - 0.625) < 0.04


def reference_top_k_top_p(row: torch.Tensor, k: int, p: float) -> set[int]:
    """Straightforward per-row definition: top_k by threshold, then the minimal nucleus."""
    row = row.double().clone()
    if k > 0:
        row[row < row.sort(descending=True).values[min(k, row.numel()) - 1]] = NEG_INF
    if p < 1.0:
        values = row.sort(descending=True).values
        probs = values.softmax(-1)
        mass_before = probs.cumsum(-1) - probs
        n_keep = int((mass_before < p).sum())
        row[row < values[n_keep - 1]] = NEG_INF
    return kept(row)


@pytest.mark.parametrize("window", [4, 64, 1024])
def test_top_k_top_p_match_reference(window: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # Small windows force the full-sort fallback for wide nuclei; results must not change.
    monkeypatch.setattr(sampler_mod, "_TOP_P_WINDOW", window)
    gen = torch.Generator().manual_seed(10)
    rows = 24
    logits = torch.randn(rows, 300, generator=gen) * torch.linspace(0.3, 6.0, rows).unsqueeze(1)
    ks = [0, 1, 5, 40, 0, 3, 2, 0] * 3  # all <= 40, so small windows stay small
    ps = [1.0, 0.9, 0.5, 0.95, 0.3, 0.99, 0.7, 0.999] * 3
    params = [SamplingParams(top_k=k, top_p=p) for k, p in zip(ks, ps)]
    masked = apply_top_k_top_p(logits.clone(), build(params))
    for i in range(rows):
        assert kept(masked[i]) == reference_top_k_top_p(logits[i], ks[i], ps[i]), i
        finite = torch.isfinite(masked[i])
        assert torch.equal(masked[i][finite], logits[i][finite])


def test_min_p() -> None:
    row = log_of([0.5, 0.3, 0.15, 0.05])
    params = [SamplingParams(min_p=m) for m in (0.2, 0.5, 0.0, 1.0)]
    masked = apply_min_p(row.repeat(4, 1), build(params))
    assert kept(masked[0]) == {0, 1, 2}  # threshold 0.1
    assert kept(masked[1]) == {0, 1}  # threshold 0.25
    assert kept(masked[2]) == {0, 1, 2, 3}
    assert kept(masked[3]) == {0}


def test_min_p_is_measured_after_temperature() -> None:
    torch.manual_seed(6)
    # probs 0.6 / 0.4: min_p = 0.5 keeps both at T=1, but T=0.25 gives ratio (2/3)^4 < 0.5.
    row = log_of([0.6, 0.4])
    n = 2000
    out = Sampler()(row.repeat(n, 1), build([SamplingParams(min_p=0.5, temperature=0.25)] * n))
    assert set(out.sampled_token_ids.tolist()) == {0}
    out = Sampler()(row.repeat(n, 1), build([SamplingParams(min_p=0.5, temperature=1.0)] * n))
    assert set(out.sampled_token_ids.tolist()) == {0, 1}


# ---------------------------------------------------------------- penalties

ROW = [2.0, -1.0, 0.5, 3.0, -2.0, 1.0]
PROMPT = [0, 1]
OUTPUT = [3, 3, 4]


def penalized(params: SamplingParams) -> torch.Tensor:
    # Row 1 is neutral and must come back unchanged.
    logits = torch.tensor([ROW, ROW])
    md = build([params, SamplingParams()], prompts=[PROMPT, PROMPT], outputs=[OUTPUT, OUTPUT])
    out = apply_penalties(logits, md)
    assert torch.equal(out[1], torch.tensor(ROW))
    return out[0]


def test_repetition_penalty() -> None:
    # Seen: 0, 1 (prompt), 3, 4 (output). Positives / 2, negatives * 2.
    got = penalized(SamplingParams(repetition_penalty=2.0))
    torch.testing.assert_close(got, torch.tensor([1.0, -2.0, 0.5, 1.5, -4.0, 1.0]))


def test_frequency_penalty() -> None:
    # Counts in output: 3 -> 2, 4 -> 1. Prompt tokens are not penalized.
    got = penalized(SamplingParams(frequency_penalty=0.5))
    torch.testing.assert_close(got, torch.tensor([2.0, -1.0, 0.5, 2.0, -2.5, 1.0]))


def test_presence_penalty() -> None:
    got = penalized(SamplingParams(presence_penalty=0.25))
    torch.testing.assert_close(got, torch.tensor([2.0, -1.0, 0.5, 2.75, -2.25, 1.0]))


def test_all_penalties_together() -> None:
    # Repetition first, then frequency (0.5 * count), then presence (0.25).
    got = penalized(SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25))
    torch.testing.assert_close(got, torch.tensor([1.0, -2.0, 0.5, 0.25, -4.75, 1.0]))


def dense_penalties(
    logits: torch.Tensor, params: list[SamplingParams], prompts: list[list[int]], outputs: list[list[int]]
) -> torch.Tensor:
    out = logits.clone()
    for i, sp in enumerate(params):
        ids = torch.tensor(outputs[i], dtype=torch.int64)
        counts = torch.bincount(ids, minlength=logits.shape[1]).float()
        seen = counts > 0
        if prompts[i]:
            seen[torch.tensor(prompts[i])] = True
        r = sp.repetition_penalty
        out[i] = torch.where(seen, torch.where(out[i] > 0, out[i] / r, out[i] * r), out[i])
        out[i] = out[i] - sp.frequency_penalty * counts
        out[i] = out[i] - sp.presence_penalty * (counts > 0).float()
    return out


def test_penalties_match_dense_reference() -> None:
    # Ragged rows, repeats, token 0 (the padding id) as a real token, rows with no tokens.
    gen = torch.Generator().manual_seed(11)
    vocab = 40
    logits = torch.randn(6, vocab, generator=gen) * 3
    prompts = [[0, 5, 5, 7], [], [1, 2, 3, 4, 5, 6, 7, 8, 9], [0], [], [3, 3]]
    outputs = [[5, 0, 0, 9, 9, 9], [0], [], [12, 12, 39, 0, 1, 2, 3, 4, 5, 6, 7], [], [3]]
    params = [
        SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=-0.7),
        SamplingParams(frequency_penalty=1.5),
        SamplingParams(repetition_penalty=0.8),
        SamplingParams(repetition_penalty=1.7, presence_penalty=2.0),
        SamplingParams(repetition_penalty=2.0, frequency_penalty=1.0),
        SamplingParams(),
    ]
    got = apply_penalties(logits.clone(), build(params, prompts=prompts, outputs=outputs))
    torch.testing.assert_close(got, dense_penalties(logits, params, prompts, outputs))
    assert torch.equal(got[4], logits[4]) and torch.equal(got[5], logits[5])


def test_penalties_change_greedy_choice() -> None:
    logits = torch.tensor([[2.0, 1.9, 0.0]])
    params = [SamplingParams(temperature=0.0, frequency_penalty=1.0)]
    out = Sampler()(logits, build(params, outputs=[[0]]))
    assert out.sampled_token_ids.tolist() == [1]


def test_no_penalty_no_min_tokens_leaves_logits_alone() -> None:
    logits = torch.randn(2, 10)
    md = build([SamplingParams(), SamplingParams()], outputs=[[1, 2], [3]], stops=[{1}, {2}])
    assert md.output_counts is None and md.seen_token_ids is None and md.min_tokens_rows is None
    assert torch.equal(apply_penalties(logits.clone(), md), logits)
    assert torch.equal(apply_min_tokens(logits.clone(), md), logits)


# ---------------------------------------------------------------- min_tokens


def test_min_tokens_suppresses_stop_ids() -> None:
    logits = torch.zeros(3, 8)
    logits[:, 2] = 50.0  # EOS
    logits[:, 5] = 40.0  # extra stop id
    params = [SamplingParams(temperature=t, min_tokens=3) for t in (0.0, 0.0, 1.0)]
    stops = [{2, 5}, {2, 5}, {2, 5}]
    md = build(params, outputs=[[0, 1], [0, 1, 3], [7]], stops=stops)
    masked = apply_min_tokens(logits.clone(), md)
    assert masked[0, 2] == NEG_INF and masked[0, 5] == NEG_INF
    assert torch.equal(masked[1], logits[1])  # already produced 3 tokens
    assert masked[2, 2] == NEG_INF and masked[2, 5] == NEG_INF
    torch.manual_seed(0)
    out = Sampler()(logits, md)
    assert out.sampled_token_ids[0] not in (2, 5)
    assert out.sampled_token_ids[1] == 2
    assert out.sampled_token_ids[2] not in (2, 5)


# ---------------------------------------------------------------- reproducibility


def _seeded_run(position: int, others: list[SamplingParams], seed: int, steps: int = 30) -> list[int]:
    torch.manual_seed(1000 + position)  # other rows' default-RNG draws differ between runs
    vocab = 64
    target = torch.linspace(-2.0, 2.0, vocab).sin() * 3
    target_params = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, min_p=0.01, seed=seed)
    params = list(others)
    params.insert(position, target_params)
    gens: list[torch.Generator | None] = [
        torch.Generator().manual_seed(99 + i) if p.seed is not None else None for i, p in enumerate(params)
    ]
    gens[position] = torch.Generator().manual_seed(seed)
    tokens = []
    for _ in range(steps):
        logits = torch.randn(len(params), vocab) * 4
        logits[position] = target
        out = Sampler()(logits, build(params, generators=gens))
        tokens.append(int(out.sampled_token_ids[position]))
    return tokens


def test_seeded_row_independent_of_batch() -> None:
    a = _seeded_run(0, [SamplingParams(), SamplingParams(temperature=0.0)], seed=42)
    b = _seeded_run(
        3,
        [
            SamplingParams(top_k=2),
            SamplingParams(temperature=0.0),
            SamplingParams(seed=5, top_p=0.5),
            SamplingParams(temperature=2.0),
            SamplingParams(min_p=0.3),
        ],
        seed=42,
    )
    alone = _seeded_run(0, [], seed=42)
    assert a == b == alone
    assert len(set(a)) > 3  # really sampling, not a constant
    assert _seeded_run(0, [], seed=43) != a


def test_seeded_top_p_row_independent_of_window_width(monkeypatch: pytest.MonkeyPatch) -> None:
    # Another row's top_k widens the candidate window; the seeded row's tokens must not move.
    monkeypatch.setattr(sampler_mod, "_TOP_P_WINDOW", 4)
    narrow = _seeded_run(1, [SamplingParams(top_k=5)], seed=3)
    wide = _seeded_run(0, [SamplingParams(top_k=50), SamplingParams(top_p=0.2)], seed=3)
    assert narrow == wide


def test_seeded_row_uses_its_generator_as_documented() -> None:
    # The sample must be argmax(probs / q) with q = torch.empty(V).exponential_(generator=g).
    logits = torch.randn(1, 100)
    out = Sampler()(logits, build([SamplingParams(seed=11)], generators=[torch.Generator().manual_seed(11)]))
    q = torch.empty(100).exponential_(generator=torch.Generator().manual_seed(11))
    assert int(out.sampled_token_ids[0]) == int((logits[0].softmax(-1) / q).argmax())


# ---------------------------------------------------------------- logprobs


def test_compute_logprobs_and_ranks() -> None:
    torch.manual_seed(8)
    logits = torch.randn(5, 30)
    tokens = torch.tensor([0, 7, 29, 3, 3])
    ids, lps, ranks = compute_logprobs(logits, tokens, 4)
    ref = torch.log_softmax(logits, -1)
    assert ids.shape == (5, 5) and lps.shape == (5, 5)
    assert torch.equal(ids[:, 0], tokens)
    torch.testing.assert_close(lps, ref.gather(1, ids))
    order = ref.argsort(dim=-1, descending=True)
    assert torch.equal(ids[:, 1:], order[:, :4])
    expected_ranks = (order == tokens[:, None]).nonzero()[:, 1] + 1
    assert torch.equal(ranks, expected_ranks)
    ids0, lps0, _ = compute_logprobs(logits, tokens, 0)
    assert ids0.shape == (5, 1) and lps0.shape == (5, 1)


def test_sampler_logprobs_come_from_raw_logits() -> None:
    torch.manual_seed(9)
    logits = torch.randn(3, 50)
    params = [
        SamplingParams(temperature=0.0, logprobs=2, repetition_penalty=1.5),
        SamplingParams(temperature=0.3, top_k=5, logprobs=5),
        SamplingParams(temperature=1.0),  # asks for none; its columns are junk but present
    ]
    out = Sampler()(logits, build(params, prompts=[[1, 2], [], []]))
    assert out.logprob_token_ids is not None and out.logprobs is not None and out.sampled_ranks is not None
    assert out.logprob_token_ids.shape == (3, 6)
    assert torch.equal(out.logprob_token_ids[:, 0], out.sampled_token_ids)
    ref = torch.log_softmax(logits, -1)
    torch.testing.assert_close(out.logprobs, ref.gather(1, out.logprob_token_ids))
    assert torch.equal(out.logprob_token_ids[1, 1:], ref[1].topk(5).indices)
    for i in range(3):
        tok = int(out.sampled_token_ids[i])
        assert int(out.sampled_ranks[i]) == int((ref[i] > ref[i, tok]).sum()) + 1


def test_logprobs_zero_and_none() -> None:
    logits = torch.randn(2, 20)
    params = [SamplingParams(temperature=0.0, logprobs=0), SamplingParams(temperature=0.0)]
    out = Sampler()(logits, build(params))
    assert out.logprob_token_ids is not None and out.logprobs is not None
    assert out.logprob_token_ids.shape == (2, 1)
    expected = torch.log_softmax(logits, -1).gather(1, logits.argmax(-1, keepdim=True))[:, 0]
    torch.testing.assert_close(out.logprobs[:, 0], expected)
    assert out.sampled_ranks is not None and out.sampled_ranks.tolist() == [1, 1]


def test_exponential_race_is_exact_for_peaked_distribution() -> None:
    # A nearly one-hot distribution must return its mode; masked tokens (prob 0) never win.
    logits = torch.full((200, 10), NEG_INF)
    logits[:, 4] = 0.0
    logits[:, 6] = -30.0
    out = Sampler()(logits, build([SamplingParams()] * 200))
    assert set(out.sampled_token_ids.tolist()) == {4}


def test_row_argmax_is_argmax_with_ties_and_nan() -> None:
    x = torch.randn(6, 1000)
    x[1, [10, 500, 999]] = x[1].max() + 1  # a three-way tie: the first index wins
    x[2] = 0.0
    x[3, [7, 800]] = float("nan")
    x[4] = -float("inf")
    x = torch.cat([x, x.half().float()])  # fp16-rounded rows tie more often
    assert torch.equal(row_argmax(x), x.argmax(dim=-1))
    assert row_argmax(x)[1] == 10 and row_argmax(x)[3] == 7

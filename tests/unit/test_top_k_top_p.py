"""Tests for cadence.engine.top_k_top_p (top_k / top_p thresholds without a full sort) and the
sampler's two-step block sampling: both against plain references written here."""

from __future__ import annotations

import pytest
import torch

from cadence.engine import top_k_top_p
from cadence.engine.sampler import Sampler, SamplingMetadata, _sample_by_block
from cadence.engine.sampling_params import SamplingParams
from cadence.engine.top_k_top_p import BLOCK, top_k_top_p_thresholds

NEG_INF = float("-inf")
WINDOW = 16384


def reference_threshold(row: torch.Tensor, k: int, p: float) -> float:
    """Full sort + cumsum: top_k by the k-th value, then the minimal nucleus of the top_k mass.

    Masses are exp(v - max) in float32, as the sampler computes them, summed in float64; p is
    the float32 the sampler carries.
    """
    values = row.sort(descending=True).values
    kth = values[min(k, values.numel()) - 1].item() if k > 0 else NEG_INF
    if p >= 1.0:
        return kth
    values = values.masked_fill(values < kth, NEG_INF)
    mass = (values - values[0]).exp().double()
    before = mass.cumsum(0) - mass
    p32 = torch.tensor(p, dtype=torch.float32).double()
    n_keep = max(int((before < p32 * mass.sum()).sum()), 1)
    return max(values[n_keep - 1].item(), kth)


def distributions(vocab: int, rows: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(vocab)
    spike = torch.zeros(rows, vocab)
    spike[:, 7] = 3.0  # one token above a tied rest: the cutoff lands in a huge tie group
    cluster = -3.0 - torch.rand(rows, vocab, generator=g) * 1e-4  # distinct values in one bin
    cluster[:, 0] = 0.0
    sparse = torch.randn(rows, vocab, generator=g)
    sparse[torch.rand(rows, vocab, generator=g) < 0.9] = NEG_INF  # as min_p leaves a row
    return {
        "random": torch.randn(rows, vocab, generator=g) * 2,
        "peaked": torch.randn(rows, vocab, generator=g) * 20,
        "heavy tail": -torch.empty(rows, vocab).exponential_(generator=g).log() * 3,
        "flat": torch.rand(rows, vocab, generator=g) * 0.01,
        "tied": (torch.randn(rows, vocab, generator=g) * 2).round(),
        "uniform": torch.zeros(rows, vocab),
        "spike over ties": spike,
        "dense cluster": cluster,
        "mostly -inf": sparse,
    }


CASES = [(0, 0.95), (0, 0.5), (0, 0.999), (0, 0.05), (1, 1.0), (50, 1.0), (50, 0.9), (5, 0.5), (300, 0.95)]


@pytest.mark.parametrize("vocab", [4096, 1000])  # 1000: not whole blocks
def test_thresholds_match_full_sort_reference(vocab: int) -> None:
    for name, logits in distributions(vocab, 6).items():
        for k, p in CASES:
            got = top_k_top_p_thresholds(logits, torch.full((6,), k), torch.full((6,), p), WINDOW)
            for i in range(logits.shape[0]):
                kept = int((logits[i] >= got[i]).sum())
                expected = int((logits[i] >= reference_threshold(logits[i], k, p)).sum())
                assert kept == expected, (name, k, p, i)


def _count_histogram_rows(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list that grows by one entry per row the top_p histogram is run on."""
    rows: list[int] = []
    histogram = top_k_top_p._top_p_thresholds

    def counted(logits: torch.Tensor, *args: object) -> torch.Tensor:
        rows.extend(range(logits.shape[0]))
        return histogram(logits, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(top_k_top_p, "_top_p_thresholds", counted)
    return rows


def test_sparse_rows_of_a_wide_vocabulary_take_the_candidate_search(monkeypatch: pytest.MonkeyPatch) -> None:
    # As min_p leaves rows: most tokens -inf, and some rows with fewer finite blocks than
    # candidate tokens; a vocabulary that is not whole blocks.
    histogram_rows = _count_histogram_rows(monkeypatch)
    gathered: list[int] = []
    gather = top_k_top_p._gather_blocks

    def counted_gather(rows: torch.Tensor, *args: object) -> torch.Tensor:
        gathered.append(rows.shape[0])
        return gather(rows, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(top_k_top_p, "_gather_blocks", counted_gather)
    g = torch.Generator().manual_seed(12)
    rows, vocab = 8, 49152 + 37
    logits = torch.randn(rows, vocab, generator=g) * 4
    keep = torch.rand(rows, vocab, generator=g) < torch.linspace(0.0002, 0.01, rows)[:, None]
    keep[:, 5] = True
    logits = logits.masked_fill(~keep, NEG_INF)
    p = torch.full((rows,), 0.9)
    got = top_k_top_p_thresholds(logits, torch.zeros(rows, dtype=torch.int64), p, WINDOW)
    for i in range(rows):
        assert int((logits[i] >= got[i]).sum()) == int((logits[i] >= reference_threshold(logits[i], 0, 0.9)).sum()), i
    assert histogram_rows == []
    # top_k over more tokens than the rows' finite blocks hold (one token in one block, alone).
    logits[0] = NEG_INF
    logits[0, 5] = 1.0
    for batch, k in [(rows, 300), (1, 100)]:
        got = top_k_top_p_thresholds(logits[:batch], torch.full((batch,), k), p[:batch], WINDOW)
        for i in range(batch):
            expected = reference_threshold(logits[i], k, 0.9)
            assert int((logits[i] >= got[i]).sum()) == int((logits[i] >= expected).sum()), (batch, i)
    assert gathered  # blocks of -inf alone did not send the batch to a whole-row search


@pytest.mark.parametrize("vocab", [500, 151936])
def test_shifted_mass_of_a_row_does_not_depend_on_the_batch(vocab: int) -> None:
    # Elementwise kernels run a loop's last elements through scalar code: where those fall
    # in a [B, V] tensor depends on B, and must not change a row's bits.
    g = torch.Generator().manual_seed(13)
    logits = torch.randn(8, vocab, generator=g) * 5
    top = logits.amax(dim=-1, keepdim=True)
    together = top_k_top_p.shifted_mass(logits, top, torch.empty_like(logits))
    for batch in range(1, 8):
        part = top_k_top_p.shifted_mass(logits[:batch].clone(), top[:batch], torch.empty(batch, vocab))
        assert torch.equal(part, together[:batch]), batch


@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.95, 0.99])
@pytest.mark.parametrize("candidates", [top_k_top_p._CANDIDATE_TOKENS, 1])  # 1: nearly every row by histogram
def test_language_model_rows_match_reference(top_p: float, candidates: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # A Gumbel bulk with a few dozen strong tokens per row, from peaked to flat: some rows'
    # nucleus lies within the candidate tokens (found in the blocks gathered around them),
    # the others' beyond it (found by the histogram).
    monkeypatch.setattr(top_k_top_p, "_CANDIDATE_TOKENS", candidates)
    histogram_rows = _count_histogram_rows(monkeypatch)
    g = torch.Generator().manual_seed(11)
    rows, vocab = 16, 49152
    logits = -torch.empty(rows, vocab).exponential_(generator=g).log()
    strong = torch.randint(0, vocab, (rows, 40), generator=g)
    logits.scatter_add_(1, strong, torch.rand(rows, 40, generator=g) * torch.linspace(3.0, 16.0, rows)[:, None])
    got = top_k_top_p_thresholds(logits, torch.zeros(rows, dtype=torch.int64), torch.full((rows,), top_p), WINDOW)
    sizes = []
    for i in range(rows):
        kept = int((logits[i] >= got[i]).sum())
        assert kept == int((logits[i] >= reference_threshold(logits[i], 0, top_p)).sum()), i
        sizes.append(kept)
    if top_p == 0.5:
        assert min(sizes) <= top_k_top_p._CANDIDATE_TOKENS < max(sizes), sizes  # both ways were taken
    assert len(histogram_rows) == sum(size > candidates for size in sizes)  # the others were resolved before it


@pytest.mark.parametrize("name", ["random", "spike over ties", "dense cluster", "tied"])
def test_small_window_gives_the_same_thresholds(name: str) -> None:
    # A window of one block sends every row whose crossing bin spans two blocks down the wide
    # path: a tie group is its own cutoff, anything else is sorted whole.
    logits = distributions(4096, 4)[name]
    k, p = torch.zeros(4, dtype=torch.int64), torch.full((4,), 0.9)
    narrow = top_k_top_p_thresholds(logits, k, p, BLOCK)
    assert torch.equal(narrow, top_k_top_p_thresholds(logits, k, p, WINDOW))
    for i in range(4):
        assert int((logits[i] >= narrow[i]).sum()) == int((logits[i] >= reference_threshold(logits[i], 0, 0.9)).sum())


def test_real_vocabulary_size_mixed_rows() -> None:
    g = torch.Generator().manual_seed(3)
    vocab = 49152
    logits = torch.cat([torch.randn(2, vocab, generator=g) * s for s in (0.3, 3.0, 8.0)])
    k = torch.tensor([0, 20, 0, 0, 1, 0])
    p = torch.tensor([0.95, 0.9, 0.8, 1.0, 1.0, 0.99])
    got = top_k_top_p_thresholds(logits, k, p, WINDOW)
    for i in range(6):
        expected = reference_threshold(logits[i], int(k[i]), float(p[i]))
        assert int((logits[i] >= got[i]).sum()) == int((logits[i] >= expected).sum()), i


def test_row_threshold_does_not_depend_on_the_batch() -> None:
    # One row alone and among 63 others: torch splits a single row's reductions across threads
    # differently from a batch's, so only per-row arithmetic keeps this bit for bit.
    g = torch.Generator().manual_seed(4)
    vocab = 49152
    batch = torch.randn(64, vocab, generator=g) * torch.linspace(0.2, 10.0, 64).unsqueeze(1)
    batch[5] = 0.0
    batch[9, :100] = 4.0
    for k_value, p_value in [(0, 0.95), (40, 0.9), (7, 1.0)]:
        k, p = torch.full((64,), k_value), torch.full((64,), p_value)
        together = top_k_top_p_thresholds(batch, k, p, WINDOW)
        for i in (0, 5, 9, 31, 63):
            alone = top_k_top_p_thresholds(batch[i : i + 1].clone(), k[:1], p[:1], WINDOW)
            assert torch.equal(alone, together[i : i + 1]), (k_value, p_value, i)
        # Rows with other settings beside it (top_k widens the searched blocks) change nothing.
        mixed_k = k.clone()
        mixed_k[1::2] = 300
        mixed = top_k_top_p_thresholds(batch, mixed_k, p, WINDOW)
        assert torch.equal(mixed[0::2], together[0::2])


def test_block_sampling_matches_probabilities() -> None:
    # Masses across several blocks, with zeros (masked tokens) inside and between them.
    torch.manual_seed(5)
    vocab = 4 * BLOCK
    probs = torch.zeros(vocab)
    chosen = torch.tensor([3, 64, 65, 130, 200, 255])
    probs[chosen] = torch.tensor([0.05, 0.3, 0.1, 0.25, 0.2, 0.1])
    n = 20000
    tokens = _sample_by_block(probs.repeat(n, 1))
    counts = torch.bincount(tokens, minlength=vocab).double()
    assert counts.sum() == counts[chosen].sum()  # a token of probability 0 is never drawn
    expected = probs[chosen].double() / probs.sum() * n
    chi2 = float(((counts[chosen] - expected) ** 2 / expected).sum())
    assert chi2 < 27.9, (counts[chosen], expected)  # df = 5, 99.999% quantile


def test_sampler_stays_in_nucleus_on_a_wide_vocabulary() -> None:
    torch.manual_seed(6)
    vocab = 49152
    row = torch.randn(vocab) * 3
    params = [SamplingParams(temperature=0.8, top_p=0.7)] * 32
    md = SamplingMetadata.build(params, [[]] * 32, [[]] * 32, [None] * 32, [set()] * 32, torch.device("cpu"))
    out = Sampler()(row.repeat(32, 1), md)
    threshold = reference_threshold(row / 0.8, 0, 0.7)
    assert bool(((row / 0.8)[out.sampled_token_ids] >= threshold).all())

"""Per-row logit thresholds for top_k then top_p, without sorting a vocabulary-wide row on CPU.

The rule (vLLM's order): keep each row's top_k tokens, then the minimal nucleus whose mass,
renormalized over what top_k kept, reaches top_p; a token tied with the last kept one is kept
too, and the row's largest token always is. Both steps are a threshold on the logits, so each
row gets one value and the caller keeps `logits >= threshold`.

On CPU a full sort costs milliseconds per row, so nothing here sorts a whole row:
- top_k rows: the k-th largest token is at least the k-th largest block maximum, so the k
  blocks with the largest maxima hold every token of the top_k set; only those are searched.
- top_p rows: a language model's nucleus is mostly a few dozen tokens. The row's
  `_CANDIDATE_TOKENS` largest tokens lie in the blocks with that many largest maxima, so
  only those blocks are searched; where the candidates' mass reaches p of the row's, the
  cutoff is among them. Other rows take one histogram of the row's mass over value bins,
  which finds the bin where the nucleus ends; only that bin's few tokens are sorted. The
  bins come from the float bits of a stretched exp(logit - max), so they are monotone in
  the logit and need no division.
Rows the histogram cannot split (a bin holding thousands of distinct values) fall back to a
full sort, as every row does on other devices, where sorting is cheap.

Masses are exp(logit - max), computed as exp2 of the difference times log2(e), which torch
runs several times faster than exp on CPU; the sampler computes them once per step
(`shifted_mass`) and draws from the same tensor.

Batch invariance: a row's threshold depends on that row alone, bit for bit. Everything is
elementwise, a max/min, a sum over one block's tokens, a per-row sequential scan (cumsum),
a sort within the row, or a histogram whose bins belong to one row and are filled in the
row's own order. No float sum runs over the whole row as one reduction, since torch splits
those across threads differently for one row than for many.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

BLOCK = 64  # tokens per block whose maximum stands in for the block
# Stretching the kept range to this many nats spreads it over ~87 octaves of the float
# exponent, i.e. ~2800 histogram bins, whatever the row's own spread.
_STRETCH = 60.0
_SHIFT = 18  # keep 8 exponent and 5 mantissa bits: 32 bins per octave
_BINS = (0x3F800000 >> _SHIFT) + 1  # float bits of 1.0, the largest stretched weight
_LOG2_E = 1.4426950408889634
_EXP2_FLOOR = -126.0  # exp2 of anything lower is a float32 denormal
# How many of a row's largest tokens are searched for the nucleus before its histogram is.
_CANDIDATE_TOKENS = 64
_COPIES = 4  # interleaved copies of each bin, so most rows' tails do not all add into one


@dataclass
class Scratch:
    """Buffers reused from call to call: on CPU a fresh vocabulary-wide tensor costs a page
    fault per 4 KiB every time, as much as the arithmetic done in it."""

    buffers: dict[str, torch.Tensor] = field(default_factory=dict)

    def take(self, name: str, like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A tensor shaped like `like` (and typed like it unless `dtype`), contents undefined."""
        dtype = dtype or like.dtype
        size = like.numel()
        buf = self.buffers.get(name)
        if buf is None or buf.numel() < size or buf.dtype != dtype or buf.device != like.device:
            buf = self.buffers[name] = torch.empty(size, dtype=dtype, device=like.device)
        return buf[:size].view(like.shape)


def shifted_mass(logits: torch.Tensor, top: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``exp(logits - top)`` into ``out`` ([B, V]; top: [B, 1]), as exp2 of the difference in
    base 2, with the exponent floored where the result would be a denormal (a slow path on
    CPU): a token that far below the top gets 1e-38 of its mass instead of less, and -inf
    logits get that too, so callers that must drop them mask them."""
    torch.add(top * -_LOG2_E, logits, alpha=_LOG2_E, out=out)
    return _exp2_rows(out.clamp_(min=_EXP2_FLOOR, max=0.0))


def _exp2_rows(exponents: torch.Tensor) -> torch.Tensor:
    """``exp2_`` in place, one row at a time. torch's CPU exp2 runs a loop's last few
    elements through scalar code whose results can differ in the last bit from the vector
    code's; on a whole [B, V] tensor where those elements fall depends on B, on a row only
    on V and the thread count, so each row's bits stay its own."""
    for row in exponents:
        row.exp2_()
    return exponents


def top_k_top_p_thresholds(
    logits: torch.Tensor,
    k: torch.Tensor,
    p: torch.Tensor,
    window: int,
    scratch: Scratch | None = None,
    mass: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-row threshold: keep `logits >= threshold`. k: [B] int64 (0 = off), p: [B] (1.0 = off).

    logits: [B, V] float32; rows with neither step get -inf. window: how many tokens the blocks
    around a top_p row's crossing bin may hold before that row is sorted whole instead.
    scratch: buffers to reuse across calls (none: fresh ones). mass: the rows'
    ``shifted_mass`` from their maxima, if the caller has it (else it is computed).
    """
    scratch = scratch if scratch is not None else Scratch()
    batch, vocab = logits.shape
    k = k.clamp(max=vocab)
    threshold = torch.full((batch,), float("-inf"), dtype=logits.dtype, device=logits.device)
    k_rows = (k > 0).nonzero().squeeze(1)
    p_rows = ((k == 0) & (p < 1.0)).nonzero().squeeze(1)
    if logits.device.type != "cpu":
        rows = torch.cat([k_rows, p_rows])
        if rows.numel():
            threshold[rows] = _sorted_thresholds(logits[rows], k[rows], p[rows])
        return threshold
    if k_rows.numel() or p_rows.numel():
        padded = _pad_to_blocks(logits)
        if k_rows.numel():
            threshold[k_rows] = _top_k_thresholds(padded[k_rows], k[k_rows], p[k_rows])
        if p_rows.numel():
            every = p_rows.numel() == batch  # the usual batch: no copy of the rows
            rows = padded if every else padded[p_rows]
            if mass is None:
                mass = shifted_mass(logits, logits.amax(dim=-1, keepdim=True), scratch.take("shifted", logits))
            row_mass = _pad_to_blocks(mass, 0.0)
            cut = _top_p_candidates(rows, row_mass if every else row_mass[p_rows], p[p_rows], window, scratch)
            if every:
                threshold = cut
            else:
                threshold[p_rows] = cut
    return threshold


def _pad_to_blocks(logits: torch.Tensor, fill: float = float("-inf")) -> torch.Tensor:
    """The rows widened to whole blocks with ``fill``: -inf for logits (no mass, never in a
    top_k set of finite tokens), 0 for masses."""
    extra = -logits.shape[1] % BLOCK
    if not extra:
        return logits
    return torch.nn.functional.pad(logits, (0, extra), value=fill)


def _prefix_thresholds(
    vals: torch.Tensor, k: torch.Tensor, p: torch.Tensor, z: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Thresholds from `vals`, each row's largest logits in descending order (a prefix of the
    sorted row). z: each row's mass after top_k, scaled by exp(-max) ([R] float64); None means
    the mass of `vals` itself. Returns (threshold, kth) where kth is the top_k threshold alone.
    """
    neg_inf = float("-inf")
    k_on = k > 0
    kth = vals.gather(1, (k - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
    kth = torch.where(k_on, kth, torch.full_like(kth, neg_inf))
    vals = vals.masked_fill(vals < kth.unsqueeze(1), neg_inf)
    # Masses in float64: a flat row adds tens of thousands of comparable terms.
    mass = (vals - vals[:, :1]).exp().double()
    c = mass.cumsum(dim=-1)
    total = c[:, -1] if z is None else z
    mass_before = torch.cat([torch.zeros_like(c[:, :1]), c[:, :-1]], dim=1)
    # Keep a token while the mass strictly above it is < p: the minimal set reaching p.
    # At least the top token survives, even when p * z underflows to 0.
    short = (mass_before < (p.double() * total).unsqueeze(1)).sum(dim=-1)
    cutoff = vals.gather(1, (short - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
    threshold = torch.where(p < 1.0, torch.maximum(cutoff, kth), kth)
    return threshold, kth


def _sorted_thresholds(rows: torch.Tensor, k: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The plain algorithm: sort each whole row."""
    return _prefix_thresholds(rows.sort(dim=-1, descending=True).values, k, p, None)[0]


def _block_view(rows: torch.Tensor) -> torch.Tensor:
    return rows.view(rows.shape[0], -1, BLOCK)


def _gather_blocks(rows: torch.Tensor, chosen: torch.Tensor, fill: float, min_width: int = BLOCK) -> torch.Tensor:
    """[R, W]: each row's chosen blocks ([R, NBLK] bool) side by side in block order, then `fill`,
    W at least ``min_width``."""
    pairs = chosen.nonzero()
    counts = chosen.sum(dim=-1)
    width = max(int(counts.max()) * BLOCK if pairs.numel() else 0, -(-min_width // BLOCK) * BLOCK)
    out = torch.full((rows.shape[0], width // BLOCK, BLOCK), fill, dtype=rows.dtype, device=rows.device)
    slot = torch.arange(pairs.shape[0], device=rows.device) - (counts.cumsum(0) - counts)[pairs[:, 0]]
    out[pairs[:, 0], slot] = _block_view(rows)[pairs[:, 0], pairs[:, 1]]
    return out.view(rows.shape[0], width)


def _candidate_blocks(rows: torch.Tensor, counts: torch.Tensor, most: int) -> torch.Tensor | None:
    """[R, NBLK] bool: the blocks holding each row's ``counts`` largest tokens (``most`` is
    the largest count), and every token tied with them; None where for some row they would
    be over a quarter of the row (a small vocabulary, or blocks tied at the floor in a flat
    row), which is then searched whole.

    The n-th largest token is at least the n-th largest block maximum (n blocks reach it), so
    the n largest tokens lie in blocks whose maximum is at least that. Blocks of -inf alone
    hold none of them that counts, also where a row has fewer than n others (as min_p leaves
    it): choosing them would send the whole batch to the whole-row search.
    """
    block_max = _block_view(rows).amax(dim=-1)
    floor = block_max.topk(most, dim=-1).values.gather(1, (counts - 1).unsqueeze(1))
    chosen = (block_max >= floor) & (block_max > float("-inf"))
    if int(chosen.sum(dim=-1).max()) > block_max.shape[1] // 4:
        return None
    return chosen


def _top_k_thresholds(rows: torch.Tensor, k: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Rows with top_k (and maybe top_p): search only the blocks that can hold the top_k set."""
    n_blocks = rows.shape[1] // BLOCK
    k_max = int(k.max())
    if k_max > n_blocks // 4:  # the candidate blocks would be most of the row
        return _sorted_thresholds(rows, k, p)
    chosen = _candidate_blocks(rows, k, k_max)
    candidates = rows if chosen is None else _gather_blocks(rows, chosen, float("-inf"), k_max)
    vals = candidates.topk(k_max, dim=-1).values
    kth = vals.gather(1, (k - 1).unsqueeze(1))
    # The top_k mass counts every token tied with the k-th, also those past k_max.
    top = vals[:, :1]
    z = torch.where(candidates >= kth, (candidates - top).exp(), 0.0).double().cumsum(dim=-1)[:, -1]
    return _prefix_thresholds(vals, k, p, z)[0]


def _stretched_bins(rows: torch.Tensor, top: torch.Tensor, low: torch.Tensor, scratch: Scratch) -> torch.Tensor:
    """Stretched weights exp((rows - top) * a) with a = _STRETCH / (top - low), in [0, 1],
    whose float bits >> _SHIFT are the histogram bin (exp2 in base 2, as ``shifted_mass``).

    Exponents are floored where the result would be a denormal (a slow path on CPU): only
    tokens far below `low` reach the floor, and they share the lowest bin.
    """
    spread = top - low
    # A row of one value has no spread (and needs no bins): 1 keeps its weights finite.
    stretch = torch.where(spread > 0, _STRETCH * _LOG2_E / spread, 1.0)
    bins = torch.addcmul(top * -stretch, rows, stretch, out=scratch.take("bins", rows))
    # A fused multiply-add can leave the top token a hair above 0, and its weight above 1.
    return _exp2_rows(bins.clamp_(min=_EXP2_FLOOR, max=0.0))


def _histogram(bins: torch.Tensor, mass: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """([R, _BINS] float64 mass per bin, [R, V] int32 bin of each token plus its row's offset).
    Each row has its own bins, and each bin's copies are filled in the row's own order.

    Overwrites `bins` (its memory holds the returned indices).
    """
    n_rows, width = bins.shape
    index = torch.bitwise_right_shift(bins.view(torch.int32), _SHIFT, out=bins.view(torch.int32))
    copy = torch.arange(width, dtype=torch.int32, device=bins.device) % _COPIES * _BINS
    row = torch.arange(n_rows, dtype=torch.int32, device=bins.device).unsqueeze(1) * (_COPIES * _BINS)
    index.add_(row).add_(copy)
    hist = torch.bincount(index.view(-1), weights=mass.view(-1), minlength=n_rows * _COPIES * _BINS)
    index.sub_(copy)
    hist = hist.view(n_rows, _COPIES, _BINS).double()
    total = hist[:, 0]
    for c in range(1, _COPIES):
        total = total + hist[:, c]
    return total, index


def _top_p_candidates(
    rows: torch.Tensor, mass: torch.Tensor, p: torch.Tensor, window: int, scratch: Scratch
) -> torch.Tensor:
    """Rows with top_p alone: the cutoff from each row's `_CANDIDATE_TOKENS` largest tokens
    where their mass reaches p of the row's (``mass``: its ``shifted_mass``), else from the
    histogram (`_top_p_thresholds`)."""
    n_rows, width = rows.shape
    count = min(_CANDIDATE_TOKENS, width // BLOCK)
    chosen = _candidate_blocks(rows, torch.full((n_rows,), count, device=rows.device), count)
    if chosen is None:
        candidates, candidate_mass = rows, mass
    else:
        candidates = _gather_blocks(rows, chosen, float("-inf"))
        candidate_mass = _gather_blocks(mass, chosen, 0.0)
    vals, order = candidates.topk(count, dim=-1)
    # Each token's mass read from the very tensor the row's total is summed from.
    cumulative = candidate_mass.gather(1, order).double().cumsum(dim=-1)
    total = _block_view(mass).sum(dim=-1).double().cumsum(dim=-1)[:, -1]
    target = p.double() * total
    # The nucleus ends at the first token whose cumulative mass reaches the target.
    last = (cumulative < target.unsqueeze(1)).sum(dim=-1)
    threshold = vals.gather(1, last.clamp(max=count - 1).unsqueeze(1)).squeeze(1)
    wider = (last == count).nonzero().squeeze(1)
    if wider.numel():
        threshold[wider] = _top_p_thresholds(rows[wider], mass[wider], p[wider], window, scratch)
    return threshold


def _top_p_thresholds(
    rows: torch.Tensor, mass: torch.Tensor, p: torch.Tensor, window: int, scratch: Scratch
) -> torch.Tensor:
    """Rows with top_p alone: a mass histogram finds the nucleus's last bin, whose tokens are sorted."""
    n_rows, width = rows.shape
    top = rows.amax(dim=-1, keepdim=True)
    # A token with mass below (1 - p) / V of the top one is never kept: all such tokens together
    # weigh less than 1 - p of the row. A nat of margin keeps rounding away from that bound.
    bound = top + torch.log((1.0 - p.double()) / width).to(rows.dtype).unsqueeze(1) - 1.0
    low = torch.maximum(rows.amin(dim=-1, keepdim=True), bound)
    bins = _stretched_bins(rows, top, low, scratch)
    hist, row_bin = _histogram(bins, mass)
    at_or_above = hist.flip(-1).cumsum(-1).flip(-1)
    target = p.double() * at_or_above[:, 0]
    # The last bin whose mass at or above still reaches the target holds the cutoff.
    crossing = (at_or_above >= target.unsqueeze(1)).sum(dim=-1) - 1
    above = torch.cat([at_or_above, torch.zeros_like(at_or_above[:, :1])], 1).gather(1, (crossing + 1).unsqueeze(1))
    row_offset = torch.arange(n_rows, device=rows.device) * (_COPIES * _BINS)
    in_bin = row_bin == (crossing + row_offset).to(torch.int32).unsqueeze(1)
    # A block's 64 flags read as 8 int64 words: the block touches the bin if any word is nonzero.
    touching = in_bin.view(torch.int64).view(n_rows, -1, BLOCK // 8).amax(dim=-1) != 0
    threshold = top.squeeze(1).clone()  # rows all of one value keep everything
    spread = (top > low).squeeze(1)
    wide = spread & (touching.sum(dim=-1) * BLOCK > window)
    narrow = spread & ~wide
    if bool(narrow.any()):
        cutoff = _bin_cutoffs(rows, mass, in_bin, touching & narrow.unsqueeze(1), above, target)
        threshold = torch.where(narrow, cutoff, threshold)
    wide_rows = wide.nonzero().squeeze(1)
    if wide_rows.numel():
        threshold[wide_rows] = _wide_bin_cutoffs(rows[wide_rows], in_bin[wide_rows], p[wide_rows])
    return threshold


def _wide_bin_cutoffs(rows: torch.Tensor, in_bin: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Rows whose crossing bin spans too many blocks to gather. A bin of one repeated value (a
    flat row, or one whose few other values a penalty moved) is its own cutoff; any other such
    row, a dense cluster of distinct values, is sorted whole."""
    high = torch.where(in_bin, rows, float("-inf")).amax(dim=-1)
    low = torch.where(in_bin, rows, float("inf")).amin(dim=-1)
    threshold = high.clone()
    mixed = (high != low).nonzero().squeeze(1)
    if mixed.numel():
        threshold[mixed] = _sorted_thresholds(rows[mixed], torch.zeros_like(mixed), p[mixed])
    return threshold


def _bin_cutoffs(
    rows: torch.Tensor,
    mass: torch.Tensor,
    in_bin: torch.Tensor,
    touching: torch.Tensor,
    above: torch.Tensor,
    target: torch.Tensor,
) -> torch.Tensor:
    """The exact cutoff inside each row's crossing bin: its tokens (`in_bin`, found in the
    `touching` blocks) sorted, their masses added to the mass above the bin until the target.
    Rows without touching blocks get junk."""
    member = _gather_blocks(in_bin.view(torch.uint8), touching, 0).bool()
    vals = _gather_blocks(rows, touching, float("-inf")).masked_fill_(~member, float("-inf"))
    weights = _gather_blocks(mass, touching, 0.0).masked_fill_(~member, 0.0)
    count = member.sum(dim=-1)
    order = vals.topk(max(int(count.max()), 1), dim=-1)
    sorted_mass = weights.gather(1, order.indices).double()
    reached = above + sorted_mass.cumsum(dim=-1) >= target.unsqueeze(1)
    # The first member at which the target is reached; the bin's last member if rounding
    # left the bin's own total a hair short of the histogram's.
    first = (~reached).sum(dim=-1).clamp(max=count - 1).clamp(min=0)
    return order.values.gather(1, first.unsqueeze(1)).squeeze(1)

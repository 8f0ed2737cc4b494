"""Turns one step's logits into next tokens (and their logprobs), vectorized over the batch.

Processing order: grammar mask -> logit_bias -> min_tokens suppression -> penalties ->
greedy argmax -> temperature -> min_p -> top_k / top_p -> sampling (see _sample_rows).
The grammar mask of a constrained row (structured outputs) leaves only the tokens its
grammar allows; logit_bias (OpenAI's, engine/logit_bias.py) then moves greedy rows too,
and bans or singles out tokens only among those. Both yield to the grammar: where a ban,
or suppressing min_tokens' stop ids, would leave a row no token at all, the row keeps
them. Logprobs come from the raw logits, before any stage. Every stage is skipped when
no row of the batch needs it, because this runs once per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

import torch

from cadence.engine.logit_bias import LogitBias
from cadence.engine.sampling_params import SamplingParams
from cadence.engine.structured_output.bitmask import apply_token_bitmask
from cadence.engine.top_k_top_p import BLOCK, Scratch, shifted_mass, top_k_top_p_thresholds


def _pad(rows: list[list[int]], pad: list[int], device: torch.device) -> torch.Tensor:
    """Right-pads token lists into a [B, L] int64 tensor, row i padded with pad[i]."""
    width = max((len(r) for r in rows), default=0)
    out = torch.tensor(pad, dtype=torch.int64).unsqueeze(1).repeat(1, width)
    for i, r in enumerate(rows):
        if r:
            out[i, : len(r)] = torch.tensor(r, dtype=torch.int64)
    return out.to(device)


def _distinct_counts(rows: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, each distinct token once with its count: ([B, L] ids, [B, L] float32 counts).

    Repeats and padding get count 0 (and id 0), so a scatter_add of f * count touches each token
    exactly once with its full count, without a dense [B, V] count tensor.
    """
    sentinel = torch.iinfo(torch.int64).max  # sorts after every real id
    ids = _pad(rows, [sentinel] * len(rows), device).sort(dim=1).values
    first = torch.searchsorted(ids, ids)
    count = torch.searchsorted(ids, ids, right=True) - first
    is_first = (first == torch.arange(ids.shape[1], device=device)) & (ids != sentinel)
    return torch.where(is_first, ids, 0), torch.where(is_first, count, 0).to(torch.float32)


def _tensor(values: list[float] | list[int], device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device)


@dataclass
class SamplingMetadata:
    """Per-step batch tensors for the sampler, built once per step by `build`.

    A field left as None means no row of the batch needs that stage, so it is skipped.
    Greedy rows carry neutral values in temperature/top_k/top_p/min_p so they never make a
    stage run, and their generators are dropped so they consume no random numbers.
    """

    all_greedy: bool
    greedy_rows: torch.Tensor | None = None  # [G] int64; None unless greedy and random rows mix
    temperature: torch.Tensor | None = None  # [B] float32, greedy rows 1.0
    top_k: torch.Tensor | None = None  # [B] int64, 0 = off
    top_p: torch.Tensor | None = None  # [B] float32, 1.0 = off
    min_p: torch.Tensor | None = None  # [B] float32, 0.0 = off
    repetition_penalty: torch.Tensor | None = None  # [B] float32
    frequency_penalty: torch.Tensor | None = None  # [B] float32
    presence_penalty: torch.Tensor | None = None  # [B] float32
    # Ids seen in prompt or output, padded with a repeat of the row's own first id (rows with
    # none get id 0 and penalty 1.0), so the gather/scatter never touches an unseen token.
    seen_token_ids: torch.Tensor | None = None  # [B, S] int64
    output_distinct_ids: torch.Tensor | None = None  # [B, O] int64, see _distinct_counts
    output_counts: torch.Tensor | None = None  # [B, O] float32
    min_tokens_rows: torch.Tensor | None = None  # [M] int64 row index of each suppressed id
    min_tokens_cols: torch.Tensor | None = None  # [M] int64 token id to suppress
    seeded_rows: list[int] = field(default_factory=list)  # random rows with their own generator
    seeded_generators: list[torch.Generator] = field(default_factory=list)
    unseeded_rows: torch.Tensor | None = None  # [R] int64 random rows using the default RNG
    max_num_logprobs: int | None = None  # max params.logprobs over rows; None = nobody asked
    logit_bias: list[tuple[int, LogitBias]] | None = None  # (row, its bias) for each biased row
    grammar_rows: torch.Tensor | None = None  # [K] int64 rows with a grammar
    grammar_bitmask: torch.Tensor | None = None  # [K, ceil(V / 32)] int32, bit set = allowed

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        generators: list[torch.Generator | None],
        stop_token_ids: Sequence[AbstractSet[int]],
        device: torch.device,
        grammar: tuple[torch.Tensor, torch.Tensor] | None = None,
        logit_biases: Sequence[LogitBias | None] | None = None,
    ) -> SamplingMetadata:
        """`grammar`: the rows that have a grammar and their bitmask rows, on `device`.
        `logit_biases`: each row's prepared logit_bias (the runner keeps them per request);
        None builds them from `params`."""
        greedy = [p.greedy for p in params]
        random_rows = [i for i in range(len(params)) if not greedy[i]]
        md = cls(all_greedy=not random_rows)
        md._set_sampling_stages(params, greedy, random_rows, device)
        md._set_penalties(params, prompt_token_ids, output_token_ids, device)
        md._set_min_tokens(params, output_token_ids, stop_token_ids, device)
        md._set_generators(random_rows, generators, device)
        if logit_biases is None:
            logit_biases = [None if not p.logit_bias else LogitBias.build(p.logit_bias, device) for p in params]
        biased = [(i, bias) for i, bias in enumerate(logit_biases) if bias is not None]
        md.logit_bias = biased or None
        if grammar is not None and grammar[0].numel():
            md.grammar_rows, md.grammar_bitmask = grammar
        asked = [p.logprobs for p in params if p.logprobs is not None]
        md.max_num_logprobs = max(asked) if asked else None
        return md

    def _set_sampling_stages(
        self, params: list[SamplingParams], greedy: list[bool], random_rows: list[int], device: torch.device
    ) -> None:
        batch = len(params)
        # Only a batch that also samples needs them: an all-greedy batch takes the argmax
        # of every row, and on a GPU each host tensor made here is a copy to wait for.
        if random_rows and len(random_rows) < batch:
            self.greedy_rows = _tensor([i for i in range(batch) if greedy[i]], device, torch.int64)

        # Only random rows decide whether a sampling stage runs; greedy rows get neutral values.
        rand = [params[i] for i in random_rows]
        if any(p.temperature != 1.0 for p in rand):
            self.temperature = _tensor([1.0 if g else p.temperature for p, g in zip(params, greedy)], device)
        if any(p.top_k > 0 for p in rand):
            self.top_k = _tensor([0 if g else p.top_k for p, g in zip(params, greedy)], device, torch.int64)
        if any(p.top_p < 1.0 for p in rand):
            self.top_p = _tensor([1.0 if g else p.top_p for p, g in zip(params, greedy)], device)
        if any(p.min_p > 0.0 for p in rand):
            self.min_p = _tensor([0.0 if g else p.min_p for p, g in zip(params, greedy)], device)

    def _set_penalties(
        self,
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        device: torch.device,
    ) -> None:
        # Penalties change greedy rows too, so every row counts here.
        if any(p.repetition_penalty != 1.0 for p in params):
            seen = [
                prompt_token_ids[i] + output_token_ids[i] if p.repetition_penalty != 1.0 else []
                for i, p in enumerate(params)
            ]
            penalties = [p.repetition_penalty if s else 1.0 for p, s in zip(params, seen)]
            self.repetition_penalty = _tensor(penalties, device)
            self.seen_token_ids = _pad(seen, [s[0] if s else 0 for s in seen], device)
        if any(p.frequency_penalty != 0.0 for p in params):
            self.frequency_penalty = _tensor([p.frequency_penalty for p in params], device)
        if any(p.presence_penalty != 0.0 for p in params):
            self.presence_penalty = _tensor([p.presence_penalty for p in params], device)
        if self.frequency_penalty is not None or self.presence_penalty is not None:
            self.output_distinct_ids, self.output_counts = _distinct_counts(
                [
                    output_token_ids[i] if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 else []
                    for i, p in enumerate(params)
                ],
                device,
            )

    def _set_min_tokens(
        self,
        params: list[SamplingParams],
        output_token_ids: list[list[int]],
        stop_token_ids: Sequence[AbstractSet[int]],
        device: torch.device,
    ) -> None:
        rows: list[int] = []
        cols: list[int] = []
        for i, p in enumerate(params):
            if len(output_token_ids[i]) < p.min_tokens:
                rows.extend([i] * len(stop_token_ids[i]))
                cols.extend(sorted(stop_token_ids[i]))
        if rows:
            self.min_tokens_rows = _tensor(rows, device, torch.int64)
            self.min_tokens_cols = _tensor(cols, device, torch.int64)

    def _set_generators(
        self, random_rows: list[int], generators: list[torch.Generator | None], device: torch.device
    ) -> None:
        unseeded: list[int] = []
        for i in random_rows:
            g = generators[i]
            if g is None:
                unseeded.append(i)
            else:
                self.seeded_rows.append(i)
                self.seeded_generators.append(g)
        if unseeded:
            self.unseeded_rows = _tensor(unseeded, device, torch.int64)


@dataclass
class SamplerOutput:
    """One step's result. Logprob columns past a row's own `params.logprobs` are junk: slice per row."""

    sampled_token_ids: torch.Tensor  # [B] int64
    logprob_token_ids: torch.Tensor | None = None  # [B, 1 + max_k] int64, column 0 = sampled token
    logprobs: torch.Tensor | None = None  # [B, 1 + max_k] float32
    sampled_ranks: torch.Tensor | None = None  # [B] int64, 1 = most likely


def compute_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """log_softmax of raw logits; returns (ids [N,1+num_top], logprobs [N,1+num_top], ranks [N]) with
    column 0 = token_ids. Used for sampled logprobs and for prompt logprobs.

    Rank counts tokens whose logprob is >= the token's own (vLLM's rule), so ties rank it lower.
    """
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    token_ids = token_ids.to(torch.int64).view(-1, 1)
    token_lp = logprobs.gather(1, token_ids)
    ranks = (logprobs >= token_lp).sum(dim=-1)
    if num_top > 0:
        top_lp, top_ids = logprobs.topk(num_top, dim=-1)
        return torch.cat([token_ids, top_ids], 1), torch.cat([token_lp, top_lp], 1), ranks
    return token_ids, token_lp, ranks


def apply_logit_bias(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """In place: each biased row's logit_bias (after its grammar mask)."""
    for row, bias in md.logit_bias or ():
        bias.apply(logits[row])
    return logits


def apply_grammar(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """In place: -inf for every token a constrained row's grammar does not allow."""
    if md.grammar_rows is None or md.grammar_bitmask is None:
        return logits
    apply_token_bitmask(logits, md.grammar_bitmask, md.grammar_rows)
    return logits


def apply_min_tokens(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """In place: stop ids get -inf in rows that have not yet produced min_tokens tokens,
    except in a constrained row whose grammar allows nothing else (the grammar wins)."""
    rows, cols = md.min_tokens_rows, md.min_tokens_cols
    if rows is None or cols is None:
        return logits
    # A stop id past the logits width cannot be sampled anyway; indexing it would fail.
    keep = cols < logits.shape[-1]
    rows, cols = rows[keep], cols[keep]
    grammar_rows = md.grammar_rows
    before = logits[rows, cols] if grammar_rows is not None else None
    logits[rows, cols] = float("-inf")
    if grammar_rows is not None and before is not None:
        emptied = grammar_rows[logits[grammar_rows].amax(dim=-1) == float("-inf")]
        restore = torch.isin(rows, emptied)
        logits[rows[restore], cols[restore]] = before[restore]
    return logits


def apply_penalties(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """In place: repetition (prompt or output tokens), then frequency, then presence penalty.

    Sparse: only the [B, S] seen / [B, O] output positions are read and written.
    """
    if md.repetition_penalty is not None:
        assert md.seen_token_ids is not None
        r = md.repetition_penalty.to(logits.dtype).unsqueeze(1)
        vals = logits.gather(1, md.seen_token_ids)
        # Divide positives and multiply negatives so the penalty always lowers the logit.
        # Repeated ids write identical values, so the scatter is deterministic.
        logits.scatter_(1, md.seen_token_ids, torch.where(vals > 0, vals / r, vals * r))
    if md.output_counts is not None:
        assert md.output_distinct_ids is not None
        counts = md.output_counts.to(logits.dtype)
        # Repeats and padding carry count 0 and add an exact zero.
        if md.frequency_penalty is not None:
            f = md.frequency_penalty.to(logits.dtype).unsqueeze(1)
            logits.scatter_add_(1, md.output_distinct_ids, -(f * counts))
        if md.presence_penalty is not None:
            p = md.presence_penalty.to(logits.dtype).unsqueeze(1)
            logits.scatter_add_(1, md.output_distinct_ids, -(p * (counts > 0).to(logits.dtype)))
    return logits


def apply_temperature(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """In place: divide by each row's temperature (greedy rows carry 1.0)."""
    if md.temperature is not None:
        logits.div_(md.temperature.to(logits.dtype).unsqueeze(1))
    return logits


def apply_min_p(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """In place: drop tokens whose prob < min_p * max prob.

    Compared in logit space (logit < max_logit + log(min_p)) to avoid a softmax; min_p = 0
    gives log(0) = -inf, which leaves the row untouched.
    """
    if md.min_p is None:
        return logits
    threshold = logits.amax(dim=-1, keepdim=True) + torch.log(md.min_p.to(logits.dtype)).unsqueeze(1)
    return logits.masked_fill_(logits < threshold, float("-inf"))


# How many tokens the blocks around a top_p row's crossing bin may hold before the row is
# sorted whole (engine/top_k_top_p.py): only a dense cluster of distinct values gets there.
_TOP_P_WINDOW = 16384


def top_k_top_p_threshold(
    logits: torch.Tensor, md: SamplingMetadata, scratch: Scratch | None = None, mass: torch.Tensor | None = None
) -> torch.Tensor | None:
    """Per-row logit threshold [B] for top_k then top_p (-inf for rows with neither), or None
    when no row uses them. A row's threshold depends on that row alone (engine/top_k_top_p.py).
    mass: the logits' ``shifted_mass``, if the caller has it."""
    if md.top_k is None and md.top_p is None:
        return None
    batch = logits.shape[0]
    k = md.top_k if md.top_k is not None else torch.zeros(batch, dtype=torch.int64, device=logits.device)
    p = md.top_p if md.top_p is not None else torch.ones(batch, dtype=torch.float32, device=logits.device)
    return top_k_top_p_thresholds(logits, k, p.to(logits.dtype), _TOP_P_WINDOW, scratch, mass)


def apply_top_k_top_p(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """In place: keep each row's top_k tokens, then the minimal nucleus of mass >= top_p.

    top_p is measured on the distribution renormalized after top_k (vLLM's order). Both are
    applied as a per-row logit threshold, so tokens tied with the last kept one are kept too.
    """
    threshold = top_k_top_p_threshold(logits, md)
    if threshold is None:
        return logits
    return logits.masked_fill_(logits < threshold.unsqueeze(1), float("-inf"))


def _mass(logits: torch.Tensor, scratch: Scratch) -> torch.Tensor:
    """exp(logit - row max) ([B, V], a scratch buffer): the softmax without its per-row
    normalizer, which neither truncation nor sampling needs (``top_k_top_p.shifted_mass``)."""
    return shifted_mass(logits, logits.amax(dim=-1, keepdim=True), scratch.take("probs", logits))


def _probabilities(
    logits: torch.Tensor, mass: torch.Tensor, threshold: torch.Tensor | None, scratch: Scratch
) -> torch.Tensor:
    """In place in ``mass`` (the logits' ``_mass``): with a threshold, exactly 0 below it and
    for -inf logits (whose mass is floored, not 0)."""
    if threshold is None:
        return mass
    # The mask as 1.0 / 0.0 floats and a multiply: a bool mask and masked_fill_ branch per
    # token, which is several times slower on CPU when kept and dropped tokens interleave.
    floor = threshold.clamp(min=torch.finfo(logits.dtype).min).unsqueeze(1)  # -inf logits too
    return mass.mul_(torch.ge(logits, floor, out=scratch.take("keep", logits)))


def _sample_rows(probs: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """One token per random row from probs [B, V] (exp(logit - max), masked tokens 0).

    Seeded rows race over the whole row, argmax(probs / q) with q = exponential_(generator=g)
    drawn into their own row, so their samples never depend on batch composition or position
    (and stay those of earlier versions). Other random rows share the default RNG and sample in
    two exact steps that draw a few numbers per row instead of one per token: a block of BLOCK
    tokens with probability proportional to its mass (inverse CDF over the block masses, in
    float64), then the token within that block by an exponential race. Greedy rows get junk:
    the caller overrides them.
    """
    sampled = torch.zeros(probs.shape[0], dtype=torch.int64, device=probs.device)
    if md.unseeded_rows is not None:
        rows = md.unseeded_rows
        every = rows.numel() == probs.shape[0]
        sampled[rows] = _sample_by_block(probs if every else probs[rows])
    tiny = torch.finfo(torch.float32).tiny
    for row, gen in zip(md.seeded_rows, md.seeded_generators):
        # The clamp guards a drawn 0 (p / 0 would always win).
        q = torch.empty(probs.shape[1], dtype=torch.float32, device=probs.device)
        q.exponential_(generator=gen).clamp_min_(tiny)
        sampled[row] = row_argmax(probs[row] / q)
    return sampled


def _sample_by_block(probs: torch.Tensor) -> torch.Tensor:
    """An exact sample per row of probs [R, V] from the default RNG: block, then token."""
    n_rows, vocab = probs.shape
    extra = -vocab % BLOCK
    blocks = torch.nn.functional.pad(probs, (0, extra)) if extra else probs
    blocks = blocks.view(n_rows, -1, BLOCK)
    cdf = blocks.sum(dim=-1).double().cumsum(dim=-1)
    total = cdf[:, -1:].contiguous()
    u = torch.rand((n_rows, 1), dtype=torch.float64, device=probs.device) * total
    # The first block whose cumulative mass passes u; rounding can put u at the total, so never
    # past the last block that has mass.
    last_with_mass = torch.searchsorted(cdf, total, right=False)
    chosen = torch.minimum(torch.searchsorted(cdf, u, right=True), last_with_mass).squeeze(1)
    candidates = blocks[torch.arange(n_rows, device=probs.device), chosen]
    q = torch.empty_like(candidates).exponential_().clamp_min_(torch.finfo(torch.float32).tiny)
    return chosen * BLOCK + row_argmax(candidates / q)


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """Each row's first largest index, as ``argmax(dim=-1)`` gives it (ties and NaN alike).

    ``max(dim=-1).indices`` because on CPU it is faster than ``argmax`` over a vocabulary-wide
    row (`git show 90ba143:bench/HISTORY.md` has the measurement).
    """
    return x.max(dim=-1).indices


class Sampler:
    """Picks each row's next token from one step's logits and, if asked, its logprobs.

    Call with logits [B, V] of the rows needing a token and the step's SamplingMetadata.
    The caller's logits tensor is never modified.
    """

    def __init__(self) -> None:
        self.scratch = Scratch()

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        md = metadata
        raw = logits
        edits = (md.logit_bias, md.grammar_rows, md.min_tokens_rows, md.repetition_penalty, md.output_counts)
        if md.all_greedy and all(e is None for e in edits):
            sampled = row_argmax(raw)
        else:
            # One float32 copy that every stage then edits in place; raw stays for logprobs.
            work = self.scratch.take("work", raw, torch.float32).copy_(raw)
            apply_grammar(work, md)
            apply_logit_bias(work, md)
            apply_min_tokens(work, md)
            apply_penalties(work, md)
            if md.all_greedy:
                sampled = row_argmax(work)
            else:
                # Greedy rows pick now, before temperature and truncation touch them.
                greedy_rows = md.greedy_rows
                greedy_tokens = row_argmax(work[greedy_rows]) if greedy_rows is not None else None
                apply_temperature(work, md)
                apply_min_p(work, md)
                mass = _mass(work, self.scratch)
                threshold = top_k_top_p_threshold(work, md, self.scratch, mass)
                masks = (md.min_p, md.min_tokens_rows, md.grammar_rows, md.logit_bias)
                if threshold is None and any(m is not None for m in masks):
                    threshold = torch.full_like(work[:, 0], float("-inf"))  # -inf logits to 0
                sampled = _sample_rows(_probabilities(work, mass, threshold, self.scratch), md)
                if greedy_rows is not None and greedy_tokens is not None:
                    sampled[greedy_rows] = greedy_tokens
        sampled = sampled.to(torch.int64)
        if md.max_num_logprobs is None:
            return SamplerOutput(sampled_token_ids=sampled)
        ids, lps, ranks = compute_logprobs(raw, sampled, md.max_num_logprobs)
        return SamplerOutput(sampled, ids, lps, ranks)

"""bench/gpu_kernels.py's attention section: paged decode over fp16/int8/fp8 KV caches, split-KV against one split."""

from __future__ import annotations

import math

import torch

from common.gpu_timing import rotation_sets
from common.kernel_bench import Bench
from common.kernel_report import rel_err

# ---------------------------------------------------------------- paged attention


def make_kv_cache(b: Bench, kind: str, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A random cache [2, blocks, block_size, kv_heads, head_dim] (+ float32 row scales)."""
    if kind == "fp16":
        return b.randn(*shape), None
    scales = torch.rand(shape[:4], device=b.dev).mul_(0.5).add_(0.75)  # dequantized values O(1)
    if kind == "int8":
        return torch.randint(-127, 128, shape, device=b.dev, dtype=torch.int8), scales.div_(127)
    return b.randn(*shape).to(torch.float8_e4m3fn), scales


def attention_reference(
    pa: object,
    q: torch.Tensor,
    cache: torch.Tensor,
    scales: torch.Tensor | None,
    table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    n_check: int,
) -> torch.Tensor:
    """Reference output of the first n_check sequences over a compacted copy of their blocks.

    The whole pool can be several GB (the fp32 reference would double it), and attention
    of one sequence never reads another's blocks, so a gathered cache gives the same answer.
    1-byte caches gather as uint8: fp8 indexing kernels are missing on some backends.
    """
    ids = table[:n_check].reshape(-1).long()
    raw = cache.view(torch.uint8) if cache.element_size() == 1 else cache
    small = raw[:, ids].view(cache.dtype)
    small_table = torch.arange(ids.numel(), device=ids.device, dtype=torch.int32).view(n_check, -1)
    starts = torch.arange(n_check + 1, device=ids.device, dtype=torch.int32)
    return pa.reference(
        q[:n_check],
        small,
        small_table,
        seq_lens[:n_check],
        starts,
        scale,  # type: ignore[attr-defined]
        kv_scales=None if scales is None else scales[:, ids],
    )


def bench_attention(b: Bench) -> None:
    b.rep.baselines["attention"] = "fp16"
    kinds = ["fp16", "int8"]
    if not b.on_gpu or torch.cuda.get_device_capability() >= (8, 9):
        kinds.append("fp8")  # e4m3 needs sm_89+ on a GPU; the interpreter converts it in software
    for batch in b.sizes.batches:
        for ctx in b.sizes.contexts:
            attention_case(b, batch, ctx, kinds)
            if b.on_gpu:
                torch.cuda.empty_cache()  # the pools run to GBs and change size every case
    if b.on_gpu:
        for kind in kinds:
            recs = [r for r in b.rep.records if r.section == "attention" and r.variant == kind and r.derived]
            met = sum(r.derived["pct_bw"] >= 80 for r in recs)
            worst = min(recs, key=lambda r: r.derived["pct_bw"], default=None)
            if worst is not None:
                b.rep.targets.append(
                    f"paged decode {kind} >= 80% of copy BW: met in {met}/{len(recs)} "
                    f"(lowest {worst.derived['pct_bw']:.0f}% at {worst.case})"
                )


def attention_case(b: Bench, batch: int, ctx: int, kinds: list[str]) -> None:
    """Decode of `batch` sequences of `ctx` tokens each, every KV format."""
    from cadence.kernels.triton import paged_attention as pa

    hq, hkv, d, bs = b.sizes.heads
    splits = pa.choose_num_splits(batch, hkv, ctx, b.sizes.num_sms)  # what the wrapper will pick
    case = f"b{batch} ctx{ctx} s{splits}"
    if b.rep.out_of_time():
        b.skip("attention", case, "time budget spent")
        return
    blocks = -(-ctx // bs)
    sets = rotation_sets(batch * ctx * hkv * (d + 4) * 2, b.l2)  # sized by int8, the smallest
    num_blocks = sets * batch * blocks
    # Scattered blocks, disjoint across sets, as a long-running pool hands them out.
    tables = torch.randperm(num_blocks, device=b.dev).to(torch.int32).view(sets, batch, blocks)
    seq_lens = torch.full((batch,), ctx, device=b.dev, dtype=torch.int32)
    starts = torch.arange(batch + 1, device=b.dev, dtype=torch.int32)
    qs = [b.randn(batch, hq, d) for _ in range(sets)]
    outs = [torch.empty_like(q) for q in qs]
    # Compare with one split; where none is picked (smoke sizes), force 2 so the merge kernel runs.
    alt = 1 if splits > 1 else (2 if b.sizes.force_split else None)
    for kind in kinds:
        attention_kind(b, pa, case, kind, [None] + ([alt] if alt else []), qs, outs, tables, seq_lens, starts, ctx)


def attention_kind(
    b: Bench,
    pa: object,
    case: str,
    kind: str,
    split_choices: list[int | None],
    qs: list[torch.Tensor],
    outs: list[torch.Tensor],
    tables: torch.Tensor,
    seq_lens: torch.Tensor,
    starts: torch.Tensor,
    ctx: int,
) -> None:
    """One KV format: its pool (up to GBs) lives only for this call."""
    hq, hkv, d, bs = b.sizes.heads
    batch, sets, n_check = qs[0].shape[0], len(qs), min(qs[0].shape[0], 4)
    cache, kv_scales = make_kv_cache(b, kind, (2, tables.numel(), bs, hkv, d))
    kv_bytes = batch * ctx * hkv * 2 * (d * cache.element_size() + (4 if kv_scales is not None else 0))
    total_bytes, flops = kv_bytes + 2 * batch * hq * d * 2, 4 * batch * hq * ctx * d
    ref = attention_reference(pa, qs[0], cache, kv_scales, tables[0], seq_lens, d**-0.5, n_check)

    def attend(i: int, num_splits: int | None) -> torch.Tensor:
        return pa.paged_attention(
            qs[i],
            cache,
            tables[i],
            seq_lens,
            starts,
            1,
            d**-0.5,  # type: ignore[attr-defined]
            num_splits=num_splits,
            max_seq_len=ctx,
            num_sms=b.sizes.num_sms,
            out=outs[i],
            kv_scales=kv_scales,
        )

    def check(num_splits: int | None) -> float:
        outs[0].fill_(math.nan)  # the whole batch is poisoned; the first n_check rows are compared
        attend(0, num_splits)
        return math.inf if bool(outs[0].isnan().any()) else rel_err(outs[0][:n_check], ref)

    for ns in split_choices:
        calls = [lambda i=i, ns=ns: attend(i, ns) for i in range(sets)]
        label = kind if ns is None else f"{kind} splits={ns}"
        b.run("attention", case, label, calls, lambda ns=ns: check(ns), total_bytes, flops)

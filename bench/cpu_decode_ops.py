"""Two CPU decode-step ops, each timed against the form it replaced, alternating in one process.

    python bench/cpu_decode_ops.py
    python bench/cpu_decode_ops.py --heads 32 --kv-heads 8 --head-dim 128 --vocab 128256

**Attention.** A decode token's query heads that share a KV head can go into SDPA as that KV head's
query rows (``[batch, kv_heads, heads per kv head, D]``) instead of through enable_gqa:
every row attends to the same keys under the same mask, so the result is the same up to
rounding. This times both on K/V gathered from a paged cache the way
``engine/attention/torch_sdpa.py`` gathers it (16-token blocks scattered over the cache,
viewed ``[batch, kv_heads, length, D]``), with and without a padding mask, alternating in
one process. Medians in ms per call and the folded form's speedup; the default shapes
are SmolLM2-135M's attention (9 query heads, 3 KV heads, head_dim 64).

**Greedy pick.** ``argmax(dim=-1)`` against ``max(dim=-1).indices``
(``engine/sampler.row_argmax``) over fp32 logits of SmolLM2's vocabulary by default.
"""
from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F
from cpu_linear import time_call

BLOCK = 16


def case(batch: int, length: int, heads: int, kv_heads: int, dim: int, seconds: float) -> list[str]:
    cache_blocks = max(4096, 2 * batch * length // BLOCK)
    cache = torch.randn(cache_blocks * BLOCK, kv_heads, dim)
    blocks = torch.randperm(cache_blocks)[: batch * length // BLOCK]
    slots = (blocks[:, None] * BLOCK + torch.arange(BLOCK)).reshape(-1)
    keys = cache.index_select(0, slots).view(batch, length, kv_heads, dim).transpose(1, 2)
    values = cache.index_select(0, slots).view(batch, length, kv_heads, dim).transpose(1, 2)
    query = torch.randn(batch, heads, dim)
    lengths = torch.randint(length // 2, length + 1, (batch,))
    lengths[0] = length
    padding = (torch.arange(length)[None, :] < lengths[:, None])[:, None, None, :]
    scale = dim**-0.5

    def gqa(mask: torch.Tensor | None) -> torch.Tensor:
        out = F.scaled_dot_product_attention(query.unsqueeze(2), keys, values, attn_mask=mask, scale=scale,
                                             enable_gqa=True)
        return out.squeeze(2)

    def folded(mask: torch.Tensor | None) -> torch.Tensor:
        out = F.scaled_dot_product_attention(query.view(batch, kv_heads, -1, dim), keys, values, attn_mask=mask,
                                             scale=scale)
        return out.view(batch, heads, dim)

    rows = []
    for label, mask in (("none", None), ("padding", padding)):
        diff = (gqa(mask) - folded(mask)).abs().max().item()
        base, new = [], []
        for _ in range(3):  # alternate, so the machine's drift falls on both
            base.append(time_call(lambda: gqa(mask), seconds) / 1e3)
            new.append(time_call(lambda: folded(mask), seconds) / 1e3)
        b, n = statistics.median(base), statistics.median(new)
        rows.append(f"| {batch} | {length} | {label} | {b:.3f} | {n:.3f} | {b / n:.2f}x | {diff:.1e} |")
    return rows


def greedy_rows(batch: int, vocab: int, seconds: float) -> str:
    logits = torch.randn(batch, vocab)
    assert torch.equal(logits.argmax(dim=-1), logits.max(dim=-1).indices)
    base, new = [], []
    for _ in range(3):
        base.append(time_call(lambda: logits.argmax(dim=-1), seconds) / 1e3)
        new.append(time_call(lambda: logits.max(dim=-1).indices, seconds) / 1e3)
    b, n = statistics.median(base), statistics.median(new)
    return f"| {batch} | {b:.3f} | {n:.3f} | {b / n:.2f}x |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--shapes", nargs="+", default=["1x256", "1x2048", "4x2048", "32x256", "32x1024", "64x128"],
                        help="batch x context length")
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--greedy-batches", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--seconds", type=float, default=0.2, help="timing per form and round (cpu_linear.time_call)")
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, heads {args.heads}/{args.kv_heads}, "
          f"head_dim {args.head_dim}, fp32")
    print("| batch | context | mask | enable_gqa ms | folded ms | speedup | max abs diff |")
    print("|---:|---:|---|---:|---:|---:|---:|")
    for shape in args.shapes:
        batch, length = (int(v) for v in shape.split("x"))
        for row in case(batch, length, args.heads, args.kv_heads, args.head_dim, args.seconds):
            print(row, flush=True)
    print(f"\n| rows x {args.vocab} | argmax ms | max(dim).indices ms | speedup |")
    print("|---:|---:|---:|---:|")
    for batch in args.greedy_batches:
        print(greedy_rows(batch, args.vocab, args.seconds), flush=True)


if __name__ == "__main__":
    main()

"""bench/gpu_kernels.py's moe section: fused MoE (dense / int8 / int4 experts) against a plain-torch per-expert loop."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from common.gpu_timing import graph_calls, rotation_sets
from common.kernel_bench import F16, Bench, poisoned_check
from common.kernel_report import Record, nbytes, rel_err

# ---------------------------------------------------------------- fused MoE


def torch_moe_loop(
    x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """The plain-torch baseline: one gathered F.linear pair per routed-to expert, in x's dtype."""
    out = torch.zeros(x.shape, device=x.device, dtype=torch.float32)
    for e in torch.unique(topk_ids).tolist():  # host sync, as any eager per-expert loop has
        tok, slot = (topk_ids == e).nonzero(as_tuple=True)
        gate, up = F.linear(x[tok], w1[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[e]) * topk_weights[tok, slot, None]
        out.index_add_(0, tok, y.float())
    return out.to(x.dtype)


def bench_moe(b: Bench) -> None:
    b.rep.baselines["moe"] = "torch loop"
    for name, dims in b.sizes.moe_shapes.items():
        if b.rep.out_of_time():
            b.skip("moe", name, "time budget spent")
            continue
        moe_shape(b, name, *dims)
        if b.on_gpu:
            torch.cuda.empty_cache()


def moe_shape(b: Bench, name: str, experts: int, top_k: int, hidden: int, inter: int) -> None:
    """Every M for one MoE shape; the expert weights (GBs for Mixtral) live only for this call."""
    from cadence.kernels.triton import fused_moe as fm

    group = min(b.sizes.group, inter)
    sets = rotation_sets(experts * 3 * hidden * inter / 2, b.l2, cap=4)  # int4 experts, the smallest
    dense = [
        (b.randn(experts, 2 * inter, hidden, scale=hidden**-0.5), b.randn(experts, hidden, inter, scale=inter**-0.5))
        for _ in range(sets)
    ]
    formats = {
        "dense fp16": dense,
        "int8": [(fm.Int8Experts.quantize(w1), fm.Int8Experts.quantize(w2)) for w1, w2 in dense],
        f"int4 g{group}": [
            (fm.Int4Experts.quantize(w1, group), fm.Int4Experts.quantize(w2, group)) for w1, w2 in dense
        ],
    }
    for m in b.sizes.moe_m:
        case = f"{name} M={m}"
        if b.rep.out_of_time():
            b.skip("moe", case, "time budget spent")
            continue
        xs = [b.randn(m, hidden) for _ in range(sets)]
        routes = [fm.route(b.randn(m, experts, dtype=torch.float32), top_k, renormalize=True) for _ in range(sets)]
        touched = sum(torch.unique(ids).numel() for _, ids in routes) / sets  # experts whose weights are read
        flops, io_bytes = 6 * m * top_k * hidden * inter, 2 * m * hidden * 2
        loop = [lambda i=i: torch_moe_loop(xs[i], *dense[i], *routes[i]) for i in range(sets)]
        dense_ref = fm.reference(xs[0], *dense[0], *routes[0])
        b.run(
            "moe",
            case,
            "torch loop",
            loop,
            lambda: rel_err(loop[0](), dense_ref),
            touched / experts * nbytes(dense[0]) + io_bytes,
            flops,
        )
        outs = [torch.empty(m, hidden, device=b.dev, dtype=F16) for _ in range(sets)]
        for fmt, ws in formats.items():
            per_call = touched / experts * nbytes(ws[0]) + io_bytes
            calls = [lambda i=i, ws=ws: fm.fused_moe(xs[i], *ws[i], *routes[i], out=outs[i]) for i in range(sets)]
            ref = dense_ref if ws is dense else fm.reference(xs[0], *ws[0], *routes[0])
            b.run("moe", case, fmt, calls, poisoned_check(calls[0], outs[0], ref), per_call, flops)
            if b.on_gpu:  # replays drop the launch gaps of ~20 small launches (moe_align is torch ops)
                moe_graph(b, case, fmt, calls, outs[0], ref, per_call, flops)


def moe_graph(
    b: Bench,
    case: str,
    fmt: str,
    calls: list[Callable[[], object]],
    out0: torch.Tensor,
    ref: torch.Tensor,
    per_call: float,
    flops: float,
) -> None:
    """The same calls captured as CUDA graphs (one per input set), checked again after capture."""
    try:
        replays = graph_calls(calls)
    except Exception as exc:  # noqa: BLE001 -- a capture failure is a finding, not a crash
        b.rep.add(
            Record(
                "moe",
                case,
                f"{fmt} graph",
                None,
                per_call,
                flops,
                err=math.nan,
                ok=False,
                note=f"capture failed: {exc}"[:90],
            )
        )
        return
    b.run("moe", case, f"{fmt} graph", replays, poisoned_check(replays[0], out0, ref), per_call, flops)

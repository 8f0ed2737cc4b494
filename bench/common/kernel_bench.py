"""What every section of bench/gpu_kernels.py shares: the sizes, and check-then-time into the report."""

from __future__ import annotations

import math
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch

from common.gpu_timing import time_us
from common.kernel_report import TOLERANCE, Record, Report, rel_err

F16, BF16 = torch.float16, torch.bfloat16


@dataclass
class Sizes:
    quant_shapes: dict[str, tuple[int, int]]  # name -> (K, N)
    quant_m: list[int]
    group: int
    heads: tuple[int, int, int, int]  # q heads, KV heads, head_dim, block_size
    contexts: list[int]
    batches: list[int]
    moe_shapes: dict[str, tuple[int, int, int, int]]  # name -> (experts, top_k, hidden, intermediate)
    moe_m: list[int]
    num_sms: int
    force_split: bool = False  # smoke: split tiny contexts anyway, so the merge kernel is checked


class Bench:
    """What every section shares: the report, the device, and check-then-time."""

    def __init__(self, report: Report, device: str, sizes: Sizes, l2_bytes: int) -> None:
        self.rep, self.dev, self.sizes, self.l2 = report, device, sizes, l2_bytes
        self.on_gpu = device == "cuda"

    def randn(self, *shape: int, dtype: torch.dtype = F16, scale: float = 1.0) -> torch.Tensor:
        """Fresh normal values, drawn in `dtype` (an fp32 draw of an 8.6 GB KV pool would double it)."""
        t = torch.randn(*shape, device=self.dev, dtype=dtype)
        return t.mul_(scale) if scale != 1.0 else t

    def run(
        self,
        section: str,
        case: str,
        variant: str,
        calls: list[Callable[[], object]],
        check: Callable[[], float] | None,
        moved_bytes: float,
        flops: float,
        *,
        tol: float = TOLERANCE[F16],
        rate: str = "fp16",
        note: str = "",
    ) -> Record:
        """Check (when given) then time one variant; a crash becomes a failed record, not an abort."""
        err = None
        try:
            if check is not None:
                err = check()
            us = time_us(calls, self.on_gpu)
        except Exception as exc:  # noqa: BLE001 -- report every kernel, even after one breaks
            traceback.print_exc(limit=3)
            return self.rep.add(
                Record(
                    section,
                    case,
                    variant,
                    None,
                    moved_bytes,
                    flops,
                    rate,
                    math.nan,
                    False,
                    f"{type(exc).__name__}: {str(exc)[:80]}",
                )
            )
        return self.rep.add(Record(section, case, variant, us, moved_bytes, flops, rate, err, True, note), tol)

    def skip(self, section: str, case: str, why: str) -> None:
        self.rep.add(Record(section, case, "-", None, 0, 0, note=why))


def poisoned_check(call: Callable[[], object], out: torch.Tensor, ref: torch.Tensor) -> Callable[[], float]:
    """Fill out with NaN, run, compare: an element the kernel never writes fails."""

    def check() -> float:
        out.fill_(math.nan)
        call()
        return rel_err(out, ref)

    return check

"""The rest of bench/gpu_kernels.py's machinery: importing cadence, checking, the report.

Kept apart so gpu_kernels.py holds only what is benchmarked. Nothing here imports triton at
module level: gpu_kernels.py must set TRITON_INTERPRET (CPU smoke runs) before triton loads.
"""

from __future__ import annotations

import json
import math
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from common.gpu_timing import Ceilings

ROOT = Path(__file__).resolve().parents[2]
# ||out - ref|| / ||ref|| bounds: the references round where the kernels do, so the
# difference is accumulation order plus output rounding (fp16/bf16 operands land
# between 1e-3 and 1e-2); the margin covers K up to 14336 and 32k-token contexts.
TOLERANCE = {torch.float16: 5e-3, torch.bfloat16: 2e-2, torch.float32: 1e-4}


def import_cadence_from_repo() -> None:
    """Make `import cadence` mean this checkout, installed or not.

    The device machine gets a bare copy of the tree (no `pip install -e .`), and on this
    machine an installed cadence could point at another worktree: this checkout's src/
    goes first on sys.path. Call it before anything imports cadence.
    """
    source = str(ROOT / "src")
    loaded = sys.modules.get("cadence")
    if loaded is not None:
        if Path(loaded.__file__ or "").resolve().parent != ROOT / "src" / "cadence":
            raise RuntimeError(f"cadence was imported from {loaded.__file__} before this checkout's {source}")
        return
    sys.path.insert(0, source)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; inf when out holds a NaN (an unwritten element)."""
    out64, ref64 = out.double(), ref.double()
    if bool(torch.isnan(out64).any()):
        return math.inf
    return float((out64 - ref64).norm() / ref64.norm().clamp(min=1e-30))


def nbytes(obj: object) -> int:
    """Bytes of a tensor, or of all tensors in a tuple/list/dataclass (a packed weight)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (tuple, list)):
        return sum(nbytes(o) for o in obj)
    if hasattr(obj, "__dataclass_fields__"):
        return sum(nbytes(v) for v in vars(obj).values() if isinstance(v, (torch.Tensor, tuple, list)))
    return 0


def device_info(device: str) -> dict[str, str]:
    import triton

    info = {"torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version()}
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(
            device=props.name,
            capability=".".join(map(str, torch.cuda.get_device_capability(0))),
            sms=str(props.multi_processor_count),
            l2_mib=f"{getattr(props, 'L2_cache_size', 0) / 2**20:.0f}",
            memory_gib=f"{props.total_memory / 2**30:.0f}",
            cuda=str(torch.version.cuda),
        )
    else:
        info.update(device=f"CPU ({platform.processor() or platform.machine()}), Triton interpreter")
    return info


@dataclass
class Record:
    """One timed (or skipped) variant of one case. `rate` names the matmul ceiling it is held to."""

    section: str
    case: str
    variant: str
    us: float | None
    bytes: float
    flops: float
    rate: str = "fp16"
    err: float | None = None  # None: not checked (a baseline with no reference of its own)
    ok: bool = True
    note: str = ""
    derived: dict[str, float] = field(default_factory=dict)


class Report:
    """Collects records; derives % of the ceilings; prints and writes the tables."""

    def __init__(self, info: dict[str, str], on_gpu: bool, budget_s: float) -> None:
        self.info, self.on_gpu, self.budget_s = info, on_gpu, budget_s
        self.ceilings: Ceilings | None = None
        self.records: list[Record] = []
        self.baselines: dict[str, str] = {}  # section -> variant the speedups divide by
        self.targets: list[str] = []
        self.start = time.perf_counter()

    def out_of_time(self) -> bool:
        """Past the budget: later cases are skipped so the tables still print inside the call."""
        return time.perf_counter() - self.start > self.budget_s

    def add(self, rec: Record, tol: float | None = None) -> Record:
        if tol is not None and rec.err is not None:
            rec.ok = rec.err <= tol  # inf (NaN output) and nan both fail
        c = self.ceilings
        if rec.us and c is not None and self.on_gpu:  # CPU ceilings say nothing about a GPU kernel
            bw_us = rec.bytes / (c.copy_gbps * 1e3)
            flop_us = rec.flops / (c.tflops.get(rec.rate, c.tflops["fp16"]) * 1e6)  # no fp8 rate: fp16's
            rec.derived = dict(
                gbps=rec.bytes / rec.us / 1e3,
                pct_bw=100 * bw_us / rec.us,
                tflops=rec.flops / rec.us / 1e6,
                pct_flop=100 * flop_us / rec.us,
                roofline=100 * max(bw_us, flop_us) / rec.us,
            )
        self.records.append(rec)
        err = "-" if rec.err is None else f"{rec.err:.1e}"
        pct = (
            f" {rec.derived['pct_bw']:.0f}%bw {rec.derived['pct_flop']:.0f}%flop" if self.on_gpu and rec.derived else ""
        )
        us = "skip" if rec.us is None else f"{rec.us:.1f}us"
        flag = "" if rec.ok else "  <-- FAILED"
        print(f"  [{rec.section}] {rec.case} | {rec.variant}: {us}{pct} err {err} {rec.note}{flag}", flush=True)
        return rec

    def failures(self) -> list[Record]:
        return [r for r in self.records if not r.ok]

    def find(self, section: str, case: str, variant: str) -> Record | None:
        for r in self.records:
            if (r.section, r.case, r.variant) == (section, case, variant):
                return r
        return None

    def _cell(self, r: Record, base: Record | None) -> str:
        if r.us is None:
            return "skip" if r.ok else "ERR"
        cell = f"{r.us:.1f}"
        if base is not None and base is not r and base.us:
            cell += f" {base.us / r.us:.2f}x"
        if self.on_gpu and r.derived:
            cell += f" {r.derived['roofline']:.0f}%"
        return cell + ("" if r.ok else " FAIL")

    def compact(self, section: str) -> list[str]:
        """One row per case, one column per variant: `µs [speedup] [roofline %]`."""
        recs = [r for r in self.records if r.section == section]
        if not recs:
            return []
        cases = list(dict.fromkeys(r.case for r in recs))
        variants = list(dict.fromkeys(r.variant for r in recs))
        lines = [f"| {section} | " + " | ".join(variants) + " |", "|---|" + "---:|" * len(variants)]
        for case in cases:
            base = self.find(section, case, self.baselines.get(section, ""))
            cells = [self._cell(r, base) if (r := self.find(section, case, v)) else "" for v in variants]
            lines.append(f"| {case} | " + " | ".join(cells) + " |")
        return lines

    def full(self, section: str) -> list[str]:
        lines = [
            "| case | variant | µs | speedup | GB/s | %BW | TFLOP/s | %FLOP | roofline % | rel err | ok | note |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
        ]
        for r in (r for r in self.records if r.section == section):
            d = r.derived
            nums = [f"{d[k]:.1f}" for k in ("gbps", "pct_bw", "tflops", "pct_flop", "roofline")] if d else ["-"] * 5
            us = "skip" if r.us is None else f"{r.us:.2f}"
            base = self.find(section, r.case, self.baselines.get(section, ""))
            speedup = f"{base.us / r.us:.2f}x" if base and base.us and r.us else "-"
            err = "-" if r.err is None else f"{r.err:.1e}"
            lines.append(
                f"| {r.case} | {r.variant} | {us} | {speedup} | "
                + " | ".join(nums)
                + f" | {err} | {'yes' if r.ok else 'NO'} | {r.note} |"
            )
        return lines

    def header(self) -> list[str]:
        lines = ["# Cadence Triton kernels", "", ", ".join(f"{k}: {v}" for k, v in self.info.items())]
        if self.ceilings:
            c = self.ceilings
            rates = ", ".join(f"{k} matmul {v:.0f} TFLOP/s" for k, v in c.tflops.items())
            lines.append(
                f"Ceilings (measured): copy {c.copy_gbps:.0f} GB/s (read+write; a repeat differed by "
                f"{c.repeat_spread_pct:.1f}%), {rates}"
            )
        if not self.on_gpu:
            lines.append("CPU smoke run: times are Triton-interpreter times; % of ceilings omitted (meaningless).")
        lines.append(
            "Cells: median µs, speedup over the section's baseline, roofline % = max(bytes/BW, "
            "FLOPs/rate) / time. FAIL = correctness check failed."
        )
        return lines

    def markdown(self, full: bool) -> str:
        """full: the file (header first, then every figure). Otherwise the printed summary,
        header after the tables so the device tool's 12,000-character tail keeps it."""
        sections = list(dict.fromkeys(r.section for r in self.records))
        tables: list[str] = []
        for s in sections:
            tables += ["", f"## {s} (baseline: {self.baselines.get(s, '-')})", ""] + self.compact(s)
        tail = ["", "## Targets", ""] + [f"- {t}" for t in self.targets] if self.targets else []
        bad = self.failures()
        tail += [
            "",
            f"Correctness: {'ALL PASSED' if not bad else f'{len(bad)} FAILED'} "
            f"({sum(r.err is not None for r in self.records)} checks)",
        ]
        tail += [f"- FAILED {r.section} {r.case} {r.variant}: err {r.err} {r.note}" for r in bad[:20]]
        tail.append(f"Wall time {time.perf_counter() - self.start:.0f} s.")
        if not full:
            return "\n".join(tables + [""] + self.header() + tail)
        out = self.header() + tables + tail
        for s in sections:
            out += ["", f"## {s}: all figures", ""] + self.full(s)
        return "\n".join(out)

    def write(self, out_dir: str | None) -> None:
        """JSON and markdown under out_dir; called after every section so a cut-off run keeps its figures."""
        if not out_dir:
            return
        path = Path(out_dir)
        path.mkdir(parents=True, exist_ok=True)
        doc = dict(
            info=self.info,
            ceilings=asdict(self.ceilings) if self.ceilings else None,
            baselines=self.baselines,
            targets=self.targets,
            records=[asdict(r) for r in self.records],
        )
        (path / "kernels.json").write_text(json.dumps(doc, indent=1, default=str))
        (path / "kernels.md").write_text(self.markdown(full=True) + "\n")

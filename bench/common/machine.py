"""The machine a run was measured on, and how much of its CPU other processes took meanwhile.

On a shared machine a timed run can be slowed by someone else's work; the report states
the cores other processes used during each run so such numbers can be recognised.
"""

from __future__ import annotations

import os
import platform
import subprocess
import time

import torch

_HZ = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def machine_info() -> dict[str, str]:
    """CPU model and ISA, core count, library versions and torch's thread count, for the report header."""
    import transformers

    model_name = platform.processor() or "?"
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        for line in lscpu.splitlines():
            if line.startswith("Model name:"):
                model_name = line.split(":", 1)[1].strip()
    except OSError:
        pass
    return dict(
        cpu=model_name,
        isa=", ".join(cpu_flags()) or "none of the checked extensions",
        cores=str(os.cpu_count()),
        torch=torch.__version__,
        transformers=transformers.__version__,
        threads=str(torch.get_num_threads()),
        python=platform.python_version(),
    )


def cpu_flags() -> list[str]:
    """The ISA extensions that decide which CPU kernels run fast (AVX-512, AMX)."""
    wanted = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_int8", "amx_tile")
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return []
    return [flag for flag in wanted if flag in flags]


def machine_line(info: dict[str, str]) -> str:
    """One report line naming the machine, as bench/RESULTS.md records it."""
    return (
        f"machine: {info['cpu']} ({info['isa']}), {info['cores']} cores, torch {info['torch']}, "
        f"{info['threads']} threads"
    )


def load_average_line(before: tuple[float, float, float], after: tuple[float, float, float]) -> str:
    """os.getloadavg() at the start and end of the whole run, as one report line."""
    return (
        f"Load average (1/5/15 min) at start {before[0]:.2f}/{before[1]:.2f}/{before[2]:.2f}, "
        f"at end {after[0]:.2f}/{after[1]:.2f}/{after[2]:.2f} "
        "(this process alone keeps it near the thread count; more means something else shared the cores)"
    )


def _busy_seconds() -> float:
    """CPU-seconds all processes have been busy since boot (from /proc/stat), or nan."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return float("nan")
    # user nice system idle iowait irq softirq steal ...: all but idle and iowait are busy.
    return (sum(fields[:8]) - fields[3] - fields[4]) / _HZ


def _own_seconds() -> float:
    t = os.times()
    return t.user + t.system


class Contention:
    """`with Contention() as c: ...` then c.other_cores: mean cores busy outside this process."""

    other_cores: float

    def __enter__(self) -> Contention:
        self._t, self._busy, self._own = time.perf_counter(), _busy_seconds(), _own_seconds()
        return self

    def __exit__(self, *exc: object) -> None:
        wall = time.perf_counter() - self._t
        other = (_busy_seconds() - self._busy) - (_own_seconds() - self._own)
        self.other_cores = max(0.0, other / wall) if wall > 0 else 0.0

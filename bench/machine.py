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
import transformers

_HZ = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def machine_info() -> dict[str, str]:
    """CPU model, core count, library versions and torch's thread count, for the report header."""
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
        cores=str(os.cpu_count()),
        torch=torch.__version__,
        transformers=transformers.__version__,
        threads=str(torch.get_num_threads()),
        python=platform.python_version(),
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

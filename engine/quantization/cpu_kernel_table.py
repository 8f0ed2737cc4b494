"""The CPU planner's measured times on disk: one JSON table, keyed by what the times depend on.

``machine_key`` names the CPU (model name, a hash of its ISA flags and of any variable
capping a library's instruction set), the torch build and the ISA it runs, the thread
count and ``KERNELS_VERSION``; ``KernelTable`` reads a table, hands back a layer group's
well-formed times, and writes it back whole (through a temporary file, so a reader never
sees half a table).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os

import torch

from cadence.engine.gguf_loader import DEFAULT_CACHE_ROOT
from cadence.engine.quantization.cpu_kernels import BUCKETS, KERNELS

logger = logging.getLogger(__name__)

# Part of the table's key: raise it when the kernels change what they cost, so older times
# are measured again rather than trusted.
KERNELS_VERSION = 8


def default_table_path() -> str:
    return os.path.join(os.path.expanduser(DEFAULT_CACHE_ROOT), "cpu_kernels.json")


# Environment variables that cap the instruction set a library's kernels use.
ISA_CAPS = (
    "ATEN_CPU_CAPABILITY",
    "MKL_ENABLE_INSTRUCTIONS",
    "ONEDNN_MAX_CPU_ISA",
    "DNNL_MAX_CPU_ISA",
    "FBGEMM_ENABLE_INSTRUCTIONS",
    "NUMBA_CPU_NAME",
    "NUMBA_CPU_FEATURES",
)


def machine_key() -> str:
    """CPU model, a hash of its ISA flags, torch version and thread count: what the times depend on."""
    model, flags = "unknown CPU", ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and model == "unknown CPU":
                    model = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = value.strip()
    except OSError:
        pass
    # What the libraries were told to use, where it narrows what the flags allow: a user
    # (or a benchmark standing in for an older CPU) may cap torch, oneDNN, fbgemm or numba.
    caps = [f"{name}={os.environ[name]}" for name in ISA_CAPS if os.environ.get(name)]
    digest = hashlib.sha1(" ".join([flags, *caps]).encode()).hexdigest()[:12]
    threads = torch.get_num_threads()
    torch_build = f"torch {torch.__version__} {torch.backends.cpu.get_cpu_capability()}"
    return f"{model} | flags {digest} | {torch_build} | {threads} threads | kernels v{KERNELS_VERSION}"


class KernelTable:
    """Measured µs per (machine, layer group, kernel, bucket), kept in a JSON file."""

    def __init__(self, path: str) -> None:
        self.path, self.machine = path, machine_key()
        self.entries: dict[str, dict[str, dict[str, list[float]]]] = {}
        if os.path.isfile(path):
            try:
                with open(path, encoding="utf-8") as f:
                    loaded = json.load(f)
                if not isinstance(loaded, dict) or not all(isinstance(v, dict) for v in loaded.values()):
                    raise ValueError("not a table of machines")
                self.entries = loaded
            except (OSError, ValueError) as exc:
                logger.warning("ignoring unreadable CPU kernel table %s (%s); measuring again", path, exc)

    def times(self, group_key: str, kernels: tuple[str, ...]) -> dict[str, list[float]]:
        """The group's measured times for ``kernels``, where well formed. The table keeps
        every well-formed entry: a mode offering fewer kernels (``precise``) must not drop
        the times another mode reads."""
        machine = self.entries.setdefault(self.machine, {})
        stored = machine.get(group_key)
        valid = {
            kernel: values
            for kernel, values in (stored.items() if isinstance(stored, dict) else ())
            if kernel in KERNELS
            and isinstance(values, list)
            and len(values) == len(BUCKETS)
            and all(isinstance(t, (int, float)) and t > 0 for t in values)
        }
        machine[group_key] = valid
        return {kernel: values for kernel, values in valid.items() if kernel in kernels}

    def record(self, group_key: str, kernel: str, values: list[float]) -> None:
        """Keep a kernel's times, measured now, for ``save``."""
        self.entries.setdefault(self.machine, {}).setdefault(group_key, {})[kernel] = values

    def save(self) -> None:
        try:
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            tmp = f"{self.path}.{os.getpid()}.tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(self.entries, f, indent=1)
            os.replace(tmp, self.path)
        except OSError as exc:
            logger.warning("could not save the CPU kernel table to %s: %s", self.path, exc)

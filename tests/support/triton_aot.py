"""Compile Cadence's Triton kernels for real NVIDIA targets on a machine with no GPU.

The interpreter (TRITON_INTERPRET=1) checks what a kernel computes, but not that Triton's
compiler accepts it: layouts, ``tl.dot`` shape and dtype rules, and bf16 or fp8 paths the
interpreter gets wrong are only seen when the kernel is lowered for a GPU. Triton's
NVIDIA backend (with its bundled ptxas) runs without a device, so this does it here.

Two steps, in two processes, because one process cannot hold both kinds of kernel:

1. ``record_launches`` (interpreter on): drive the real wrappers (``w8a16_matmul``,
   ``paged_attention``, ...) with CPU tensors at production shapes. Every kernel launch
   is captured (argument types, constexprs, launch options) instead of run, so the
   configurations compiled are exactly the ones the wrappers choose.
2. ``python tests/support/triton_aot.py LAUNCHES.json --arch 80 90`` (interpreter off): compile
   each recorded launch to a cubin for each target and report ptxas's resource usage
   (registers, spills, shared memory) as JSON on stdout.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

_TRITON_TYPES = {
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float32: "fp32",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.int32: "i32",
    torch.int64: "i64",
    torch.float8_e4m3fn: "fp8e4nv",
}


@dataclass
class Launch:
    """One kernel launch as a wrapper made it: enough to compile it again elsewhere."""

    label: str
    module: str
    kernel: str
    arg_types: dict[str, str]  # non-constexpr parameter -> Triton type ("*fp16", "i32", ...)
    constexprs: dict[str, Any]
    options: dict[str, Any] = field(default_factory=dict)  # num_warps, num_stages

    @property
    def min_arch(self) -> int:
        """Triton's e4m3 type exists only from compute capability 8.9 (fp8 hardware)."""
        return 89 if any("fp8e4nv" in t for t in self.arg_types.values()) else 0


def _arg_type(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + _TRITON_TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"cannot describe kernel argument {value!r}")


def record_launches(cases: dict[str, Callable[[], object]]) -> list[Launch]:
    """Run each case with kernel launches captured instead of executed (interpreter mode)."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("record_launches needs TRITON_INTERPRET=1, so that CPU tensors reach the kernels")
    launches: list[Launch] = []

    def capture(self: InterpretedFunction, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
        bound = dict(zip(self.arg_names, args)) | {k: v for k, v in kwargs.items() if k in self.arg_names}
        options = {k: v for k, v in kwargs.items() if k not in self.arg_names}
        hints = self.fn.__annotations__
        constexpr_names = {n for n in self.arg_names if "constexpr" in str(hints.get(n, ""))}
        launches.append(
            Launch(
                label="",
                module=self.fn.__module__,
                kernel=self.fn.__name__,  # labelled by the loop below
                arg_types={n: _arg_type(v) for n, v in bound.items() if n not in constexpr_names},
                constexprs={
                    n: (v.value if isinstance(v, tl.constexpr) else v) for n, v in bound.items() if n in constexpr_names
                },
                options=options,
            )
        )

    original = InterpretedFunction.run
    InterpretedFunction.run = capture
    try:
        for label, case in cases.items():
            first = len(launches)
            case()
            for launch in launches[first:]:
                launch.label = label
    finally:
        InterpretedFunction.run = original
    return launches


# ---------------------------------------------------------------- compiling (no interpreter)


def compile_launch(launch: Launch, arch: int) -> dict[str, Any]:
    """Compile one launch for ``sm_<arch>``; ptxas's resource report, or the error."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(launch.module), launch.kernel)
    signature: dict[str, str] = {}
    constexprs: dict[str, Any] = {}
    for param in fn.params:
        if param.is_constexpr:
            signature[param.name] = "constexpr"
            constexprs[param.name] = launch.constexprs.get(param.name, param.default)
        else:
            signature[param.name] = launch.arg_types[param.name]
    result: dict[str, Any] = {"label": launch.label, "kernel": launch.kernel, "arch": arch}
    if arch < launch.min_arch:
        result["skipped"] = f"needs sm_{launch.min_arch}"
        return result
    try:
        compiled = triton.compile(
            ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", arch, 32), options=dict(launch.options)
        )
    except Exception as exc:  # noqa: BLE001 - a kernel that does not compile is the finding to report
        result["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        return result
    result["num_warps"] = compiled.metadata.num_warps
    result["shared_bytes"] = compiled.metadata.shared
    gpu = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "kernel.ptx")
        with open(ptx, "w", encoding="utf-8") as f:
            f.write(compiled.asm["ptx"])
        report = subprocess.run(
            [get_ptxas(arch).path, "-v", f"--gpu-name={gpu}", ptx, "-o", os.path.join(tmp, "k.o")],
            capture_output=True,
            text=True,
            check=True,
        ).stderr
    for key, pattern in (
        ("registers", r"Used (\d+) registers"),
        ("spill_stores", r"(\d+) bytes spill stores"),
        ("spill_loads", r"(\d+) bytes spill loads"),
        ("stack_bytes", r"(\d+) bytes stack frame"),
    ):
        match = re.search(pattern, report)
        result[key] = int(match.group(1)) if match else 0
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("launches", help="JSON list written by record_launches (via Launch fields)")
    ap.add_argument("--arch", type=int, nargs="+", default=[80, 90], help="compute capabilities, e.g. 80 90")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("compile with TRITON_INTERPRET unset: interpreted kernels cannot be lowered")
    with open(args.launches, encoding="utf-8") as f:
        launches = [Launch(**entry) for entry in json.load(f)]
    results = [compile_launch(launch, arch) for launch in launches for arch in args.arch]
    json.dump(results, sys.stdout)
    return 0


def dump_launches(launches: list[Launch], path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump([asdict(launch) for launch in launches], f)


if __name__ == "__main__":
    raise SystemExit(main())

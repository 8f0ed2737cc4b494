"""What arithmetic a model runs: the user's ``--dtype``, the checkpoint's dtype and the device.

``resolve_precision`` turns the three into a ``Precision``: the dtype activations (and the
KV cache, norms, attention and sampling) are computed in, and whether a CPU model's dense
linears run ``bf16dot`` (``kernels/cpu/bf16_dot.py``: weights rounded to bf16 once, bf16
products summed in fp32, each row in one fixed order at any batch size).

``auto``:

* On CUDA, the checkpoint's dtype.
* On a CPU where ``bf16dot`` runs (AVX512-BF16): **bf16**, whatever the checkpoint stores
  (float32, bfloat16 or float16), as vLLM's CPU backend chooses. The linears run bf16 dot
  products; activations stay float32 between them, which the CPU paged decode kernel
  reads, and which spares the model every other rounding.
* On a CPU without bf16 arithmetic: **float32**. vLLM would take bf16 there too, through
  matmuls that convert to fp32 and back (bench/RESULTS.md measures what that costs).

An explicit ``float32`` keeps dense weights and activations in float32; ``bfloat16`` is the
``bf16dot`` precision where it runs, else bf16 activations and oneDNN's bf16 matmuls;
``float16`` is fp16 activations. Quantized layers run the kernel the CPU planner gives them
under any of these (``engine/quantization/cpu_planner.py``), and ``--kv-cache-dtype`` stores
the KV cache as it says. What was chosen, and why, goes to the startup log
(``Precision.describe``); a disaggregated pair must agree on it (``KVLayout.precision``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cadence.engine.model_config import ModelConfig

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


@dataclass(frozen=True)
class Precision:
    """How a model computes: ``activations`` is the engine's dtype (KV cache included);
    ``bf16_dot_linears`` says that its dense CPU linears run ``bf16dot`` on bf16 weights."""

    activations: torch.dtype
    bf16_dot_linears: bool = False
    asked: str = "auto"
    stored: torch.dtype = torch.float32

    @property
    def name(self) -> str:
        """Short: ``bf16dot``, or the activation dtype's name."""
        return "bf16dot" if self.bf16_dot_linears else _name(self.activations)

    def describe(self) -> str:
        """One line for the startup log: what runs, and why."""
        stored = _name(self.stored)
        if self.bf16_dot_linears:
            what = (
                "bf16: dense weights rounded to bf16, bf16 dot products summed in fp32 (bf16dot), "
                "float32 activations (quantized layers: the CPU kernel the planner gives them)"
            )
        else:
            what = _name(self.activations)
        why = f"--dtype {self.asked}, the checkpoint stores {stored}"
        if self.asked == "auto" and self.bf16_dot_linears and self.stored != torch.bfloat16:
            why += "; this CPU has AVX512-BF16, so auto takes bf16 as vLLM does (--dtype float32: fp32 linears)"
        elif self.asked == "auto" and self.activations == torch.float32 and self.stored != torch.float32:
            why += "; this CPU lacks AVX512-BF16, so auto takes float32"
        return f"precision {what} ({why})"


def resolve_precision(name: str | torch.dtype, config: ModelConfig, device: torch.device | str) -> Precision:
    """The ``Precision`` for ``--dtype name`` on ``device`` (ValueError for an unknown name)."""
    asked = str(name).removeprefix("torch.") if isinstance(name, torch.dtype) else name.lower().removeprefix("torch.")
    if asked != "auto" and asked not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; use auto, float32, float16 or bfloat16")
    stored = DTYPES.get((config.torch_dtype or "float32").lower().removeprefix("torch."), torch.float32)
    wanted = stored if asked == "auto" else DTYPES[asked]
    if torch.device(device).type != "cpu":
        return Precision(wanted, False, asked, stored)
    if wanted == torch.float32 and asked != "auto":
        return Precision(torch.float32, False, asked, stored)
    if wanted == torch.float16 and asked != "auto":
        return Precision(torch.float16, False, asked, stored)
    if _bf16_dot_runs():
        return Precision(torch.float32, True, asked, stored)
    if asked == "auto":
        from cadence.kernels.cpu.half_linear import native_bf16

        half = stored in (torch.float16, torch.bfloat16) and native_bf16()
        return Precision(torch.bfloat16 if half else torch.float32, False, asked, stored)
    return Precision(torch.bfloat16, False, asked, stored)


def _bf16_dot_runs() -> bool:
    from cadence.kernels.cpu.bf16_dot import hardware_ready

    return hardware_ready()


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")

"""FP8 (e4m3) W8A8 in plain torch: the quantizers both the CPU path and the kernels share.

Dynamic FP8, as vLLM's ``--quantization fp8`` does it for a bf16/fp16 checkpoint:

    weight      float8_e4m3fn [N, K], float32 scale [N]  (per output channel, once at load)
    activations float8_e4m3fn [M, K], float32 scale [M]  (per token, at every call)
    out[m, n] = sum_k xq[m, k] * wq[n, k] * x_scale[m] * w_scale[n]

Each row is scaled so its largest magnitude lands on e4m3's largest finite value, 448.
Both scales are constant along K, so a GEMM applies them once to its fp32 accumulator.

Decoding: every e4m3 value, subnormals included, divided by 256 is an fp16 value, and
its bits are the code's bits moved into place (the exponent biases are 7 and 15). That
is exact, works where fp8 hardware (and fast fp8 casts) do not, and is how both the
Triton fallback and the CPU path read fp8.

No triton here: a CPU install quantizes with this module and never imports the kernels.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
# Decoded fp16 values are the fp8 values divided by this.
FP16_DECODE_DIVISOR = 256.0
# A row whose largest magnitude is below this counts as zero. The floor keeps the scale
# positive, so an all-zero row (padding, a dead channel) divides into zeros, not NaNs.
MIN_ROW_ABSMAX = 1e-12


def quantize_fp8_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """t [..., K] -> (float8_e4m3fn [..., K], float32 scale [...]) with one scale per row."""
    t32 = t.float()
    scale = t32.abs().amax(dim=-1).clamp(min=MIN_ROW_ABSMAX) / FP8_MAX
    # The clamp matters: x / scale can land a rounding step above 448, and torch's fp8
    # cast of an out-of-range value is not saturating on every backend (it may give NaN).
    q = (t32 / scale[..., None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def quantize_fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations x [M, K] -> (xq float8_e4m3fn [M, K], x_scale float32 [M])."""
    return quantize_fp8_rows(x)


def quantize_fp8_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An nn.Linear weight [N, K] -> (wq float8_e4m3fn [N, K], w_scale float32 [N])."""
    if w.dim() != 2:
        raise ValueError(f"expected a [N, K] weight, got shape {tuple(w.shape)}")
    return quantize_fp8_rows(w)


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q [..., K] times its row's scale [...], in ``dtype``."""
    return (q.float() * scale.float()[..., None]).to(dtype)


def fp8_as_fp16_divided(q: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn codes -> fp16 values exactly FP16_DECODE_DIVISOR times smaller.

    A few integer passes; much faster on CPU than ``q.to(torch.float16)`` (``python
    bench/cpu_linear.py --fp8`` measures both). The NaN codes (0x7F, 0xFF) decode to
    +-480, but the quantizers here never produce them.
    """
    # Sign-extended, a code b >= 0x80 is b - 256; times 128 that is 0xC000 | (b & 0x7F) << 7
    # in 16 bits (no overflow: |h| <= 16384), and clearing bit 14 leaves the fp16 pattern
    # sign << 15 | (b & 0x7F) << 7. Codes below 0x80 already have it.
    h = q.view(torch.int8).to(torch.int16)
    h.mul_(128)
    h.bitwise_and_(~0x4000)
    return h.view(torch.float16)

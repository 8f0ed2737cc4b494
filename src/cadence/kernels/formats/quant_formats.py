"""The packed weight layouts Cadence's quantized GEMMs read, and converters into them.

int8 (W8A16), per output channel, symmetric:
    qweight int8 [N, K]  -- the nn.Linear layout, so no transpose at load time
    scale   [N]          -- fp16/fp32;  w[n, k] = qweight[n, k] * scale[n]

int4 (W4A16), group-wise along K, ``Int4Weight``:
    qweight int32 [K // 8, N]  -- eight 4-bit codes per int32, packed along K;
                                  code for row k sits at bits 4 * (k % 8) of qweight[k // 8]
    scales  [K // group, N]    -- fp16/fp32
    zeros   uint8 [K // group, N], float32 [K // group, N], or None
    w[k, n] = (code[k, n] - z[k // group, n]) * scales[k // group, n],  z = 8 when zeros is None

Zero points are integers (uint8) for GPTQ, AWQ and our own quantizer. GGUF's Q4_1 stores
``w = code * d + min`` per block of 32, which is the same formula with a real-valued zero
``z = -min / d``; those are kept as float32 so that ``(code - z) * d`` reproduces the
file's values to fp32 rounding.

Why this int4 layout: a Triton tile of ``BLOCK_K x BLOCK_N`` weights loads
``qweight[offs_k // 8, offs_n]`` -- rows are contiguous along N, so loads coalesce, and
unpacking is one shift by ``4 * (offs_k % 8)`` and a mask, with no interleave table. It
is also exactly GPTQ's qweight layout, so GPTQ checkpoints convert without repacking;
AWQ (packed along N, interleaved) is repacked once at load time. Zeros stay unpacked
uint8 because they are 1/group of the weight and unpacking them in-kernel buys nothing.
Codes are always unsigned 0..15; symmetric quantization is "zero point 8", so one kernel
path serves both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# AWQ packs 8 output columns into an int32 with column AWQ_ORDER[i] at nibble i.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
SYMMETRIC_ZERO = 8


@dataclass
class Int4Weight:
    """A group-wise int4 weight in Cadence's layout (see module docstring)."""

    qweight: torch.Tensor  # int32 [K // 8, N]
    scales: torch.Tensor  # [K // group_size, N]
    zeros: torch.Tensor | None  # uint8 or float32 [K // group_size, N], None = symmetric (zero 8)
    group_size: int

    @property
    def in_features(self) -> int:
        return self.qweight.shape[0] * 8

    @property
    def out_features(self) -> int:
        return self.qweight.shape[1]

    def to(self, device: torch.device | str) -> Int4Weight:
        zeros = None if self.zeros is None else self.zeros.to(device)
        return Int4Weight(self.qweight.to(device), self.scales.to(device), zeros, self.group_size)


# ---------------------------------------------------------------- nibble packing helpers


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words in [0, 2**32) -> int32 with the same bits (explicit, not a cast's wrap)."""
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.to(torch.int32)


def pack_nibbles(codes: torch.Tensor, dim: int, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """Pack 4-bit codes (0..15, any int dtype) 8-per-int32 along ``dim``.

    Element ``order[i]`` of each group of eight lands at bits ``4 * i``.
    """
    codes = codes.to(torch.int64).movedim(dim, -1)
    if codes.shape[-1] % 8:
        raise ValueError(f"packed dim must be a multiple of 8, got {codes.shape[-1]}")
    if codes.numel() and (codes.min() < 0 or codes.max() > 15):
        raise ValueError("int4 codes must lie in 0..15")
    codes = codes.reshape(*codes.shape[:-1], -1, 8)[..., list(order)]
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=codes.device)
    words = (codes << shifts).sum(-1)  # disjoint bits, so sum == bitwise or
    return _to_int32(words).movedim(-1, dim).contiguous()


def unpack_nibbles(words: torch.Tensor, dim: int, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """Inverse of :func:`pack_nibbles`: int32 words -> uint8 codes, 8x longer along ``dim``."""
    w = words.to(torch.int64).movedim(dim, -1)
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=w.device)
    nib = (w.unsqueeze(-1) >> shifts) & 0xF  # [..., n, 8], nibble i at index i
    inverse = [order.index(j) for j in range(8)]  # element j lives in nibble inverse[j]
    codes = nib[..., inverse].reshape(*w.shape[:-1], -1)
    return codes.to(torch.uint8).movedim(-1, dim).contiguous()


# ---------------------------------------------------------------- int8


def quantize_int8(w: torch.Tensor, scale_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8 of a ``[N, K]`` weight -> (qweight int8 [N, K], scale [N])."""
    wf = w.float()
    # amax / 127 keeps the largest magnitude exactly representable; the clamp guards
    # all-zero rows (scale 0 would make q = nan).
    scale = (wf.abs().amax(dim=1) / 127.0).clamp(min=1e-8)
    q = torch.round(wf / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale.to(scale_dtype or w.dtype)


def dequantize_int8(qweight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """int8 [N, K] and scale [N] -> dense [N, K] in ``dtype`` (default scale's dtype)."""
    return (qweight.float() * scale.float()[:, None]).to(dtype or scale.dtype)


# ---------------------------------------------------------------- int4


def quantize_int4(
    w: torch.Tensor, group_size: int = 128, symmetric: bool = True, scale_dtype: torch.dtype | None = None
) -> Int4Weight:
    """Group-wise int4 of a ``[N, K]`` (nn.Linear) weight; groups run along K."""
    n, k = w.shape
    if group_size <= 0 or k % group_size or group_size % 8:
        raise ValueError(f"K={k} must be a multiple of group_size={group_size}, itself a multiple of 8")
    g = w.float().t().reshape(k // group_size, group_size, n)  # [groups, group, N]
    if symmetric:
        # Codes -8..7 around zero 8; amax/7 so +amax is representable (-8 is the spare).
        scales = (g.abs().amax(dim=1) / 7.0).clamp(min=1e-8)
        zeros = torch.full_like(scales, SYMMETRIC_ZERO)
    else:
        lo = g.amin(dim=1).clamp(max=0.0)  # include 0 so it is exactly representable
        hi = g.amax(dim=1).clamp(min=0.0)
        scales = ((hi - lo) / 15.0).clamp(min=1e-8)
        zeros = torch.round(-lo / scales).clamp(0, 15)
    scales = scales.to(scale_dtype or w.dtype)
    # Quantize against the scale as stored, so dequantization reproduces our rounding.
    codes = torch.round(g / scales.float()[:, None, :]) + zeros[:, None, :]
    codes = codes.clamp(0, 15).reshape(k, n)
    return Int4Weight(
        qweight=pack_nibbles(codes, dim=0),
        scales=scales.contiguous(),
        zeros=None if symmetric else zeros.to(torch.uint8).contiguous(),
        group_size=group_size,
    )


def unpack_int4(weight: Int4Weight) -> torch.Tensor:
    """Codes as uint8 ``[K, N]``."""
    return unpack_nibbles(weight.qweight, dim=0)


def dequantize_int4(weight: Int4Weight, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Dense ``[N, K]`` (nn.Linear layout) in ``dtype`` (default the scales' dtype)."""
    codes = unpack_int4(weight).float()  # [K, N]
    g = weight.group_size
    zeros = SYMMETRIC_ZERO if weight.zeros is None else weight.zeros.float().repeat_interleave(g, dim=0)
    scales = weight.scales.float().repeat_interleave(g, dim=0)
    # (code - zero) has <= 5 significant bits, so the fp32 product is exact and the final
    # cast rounds once -- the kernels compute the same value in registers.
    return ((codes - zeros) * scales).t().to(dtype or weight.scales.dtype).contiguous()


# ---------------------------------------------------------------- GPTQ


def _zeros_or_symmetric(zeros: torch.Tensor) -> torch.Tensor | None:
    """All-8 zero points are symmetric quantization: drop them so the kernel skips the load."""
    return None if bool((zeros == SYMMETRIC_ZERO).all()) else zeros.to(torch.uint8).contiguous()


def _check_g_idx(g_idx: torch.Tensor | None, k: int, group_size: int) -> None:
    if g_idx is None:
        return
    expected = torch.arange(k, device=g_idx.device) // group_size
    if g_idx.shape != (k,) or not torch.equal(g_idx.to(torch.int64), expected):
        raise ValueError(
            "GPTQ act-order (desc_act) checkpoints are not supported: g_idx must equal "
            "arange(K) // group_size; re-quantize with desc_act=False"
        )


def from_gptq(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None = None,
    *,
    group_size: int,
    zero_minus_one: bool = True,
) -> Int4Weight:
    """GPTQ 4-bit tensors -> :class:`Int4Weight`.

    qweight int32 [K/8, N] (packed along K, same as ours), qzeros int32 [K/g, N/8]
    (packed along N), scales [K/g, N]. Most GPTQ checkpoints (AutoGPTQ "v1" format)
    store zero - 1; ``zero_minus_one=False`` reads the "v2" format that stores zero.
    """
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    if group_size == -1:  # GPTQ's spelling of "one group for the whole K"
        group_size = k
    _check_g_idx(g_idx, k, group_size)
    if qzeros.shape != (k // group_size, n // 8) or scales.shape != (k // group_size, n):
        raise ValueError(
            f"GPTQ shapes disagree: qweight {tuple(qweight.shape)}, qzeros "
            f"{tuple(qzeros.shape)}, scales {tuple(scales.shape)}, group {group_size}"
        )
    zeros = unpack_nibbles(qzeros, dim=1).to(torch.int16)
    if zero_minus_one:
        # v1 stores z - 1 in 4 bits, so a zero of 0 was written as 15. Wrapping it back
        # to 0 is what the quantizer meant and what AutoGPTQ's torch path reads; its CUDA
        # kernels and vLLM's read 16 instead, which is why `cadence quantize` never
        # writes a zero of 0 (gptq._group_grid).
        zeros = (zeros + 1) & 0xF
    return Int4Weight(qweight.to(torch.int32).contiguous(), scales.contiguous(), _zeros_or_symmetric(zeros), group_size)


def to_gptq(weight: Int4Weight, zero_minus_one: bool = True) -> dict[str, torch.Tensor]:
    """Pack an :class:`Int4Weight` as a GPTQ checkpoint would store it (for tests/export)."""
    zeros = _dense_zeros(weight).to(torch.int64)
    if zero_minus_one:
        zeros = (zeros - 1) & 0xF
    return {
        "qweight": weight.qweight.clone(),
        "qzeros": pack_nibbles(zeros, dim=1),
        "scales": weight.scales.clone(),
        "g_idx": torch.arange(weight.in_features, dtype=torch.int32) // weight.group_size,
    }


def _dense_zeros(weight: Int4Weight) -> torch.Tensor:
    if weight.zeros is not None and weight.zeros.is_floating_point():
        raise ValueError("GPTQ/AWQ store integer zero points; this weight has real-valued ones (GGUF Q4_1)")
    if weight.zeros is not None:
        return weight.zeros
    return torch.full(weight.scales.shape, SYMMETRIC_ZERO, dtype=torch.uint8, device=weight.scales.device)


# ---------------------------------------------------------------- AWQ


def from_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, *, group_size: int) -> Int4Weight:
    """AWQ (GEMM) 4-bit tensors -> :class:`Int4Weight`.

    qweight int32 [K, N/8] and qzeros int32 [K/g, N/8] pack along N with AWQ's
    interleaved nibble order; scales [K/g, N]. AWQ stores zero points as-is.
    """
    k, n = qweight.shape[0], qweight.shape[1] * 8
    if k % group_size or qzeros.shape != (k // group_size, n // 8) or scales.shape != (k // group_size, n):
        raise ValueError(
            f"AWQ shapes disagree: qweight {tuple(qweight.shape)}, qzeros "
            f"{tuple(qzeros.shape)}, scales {tuple(scales.shape)}, group {group_size}"
        )
    codes = unpack_nibbles(qweight, dim=1, order=AWQ_ORDER)  # [K, N]
    zeros = unpack_nibbles(qzeros, dim=1, order=AWQ_ORDER)
    return Int4Weight(pack_nibbles(codes, dim=0), scales.contiguous(), _zeros_or_symmetric(zeros), group_size)


def to_awq(weight: Int4Weight) -> dict[str, torch.Tensor]:
    """Pack an :class:`Int4Weight` as an AWQ (GEMM) checkpoint would store it."""
    return {
        "qweight": pack_nibbles(unpack_int4(weight), dim=1, order=AWQ_ORDER),
        "qzeros": pack_nibbles(_dense_zeros(weight), dim=1, order=AWQ_ORDER),
        "scales": weight.scales.clone(),
    }

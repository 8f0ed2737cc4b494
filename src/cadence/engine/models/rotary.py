"""Rotary position embeddings with a precomputed cos/sin table indexed by position.

Uses Hugging Face's non-interleaved ("rotate_half") layout: dimension i is paired with
dimension i + head_dim/2. Supported scaling types: default, linear, llama3, yarn and
dynamic (see `_inv_freq` for what dynamic means here).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from cadence.kernels import layer_ops_reference as reference
from cadence.kernels.cpu import rotary as cpu_rotary


def _base_inv_freq(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between."""
    factor = float(s["factor"])
    low, high = float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_mid, blended, scaled)


def _yarn_inv_freq(theta: float, dim: int, s: dict[str, Any], max_pos: int) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies, extrapolate high ones, ramp between; also
    returns the attention factor that scales cos/sin."""
    factor = s.get("factor")
    orig = float(s["original_max_position_embeddings"])
    if factor is None:
        factor = max_pos / orig
    factor = float(factor)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = s.get("attention_factor")
    if attn is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        attn = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast = s.get("beta_fast") or 32
    beta_slow = s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    lo, hi = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001  # avoid dividing by zero in the ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * ramp + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attn)


def _inv_freq(theta: float, dim: int, scaling: dict[str, Any] | None, max_pos: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [dim/2] and the cos/sin multiplier for a RoPE config."""
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type in ("default", "dynamic"):
        # Dynamic NTK only changes frequencies for sequences longer than
        # max_position_embeddings, and our table never goes past that length, so within
        # range it is exactly the default RoPE.
        return _base_inv_freq(theta, dim), 1.0
    assert scaling is not None
    if rope_type == "linear":
        return _base_inv_freq(theta, dim) / float(scaling["factor"]), 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(_base_inv_freq(theta, dim), scaling), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(theta, dim, scaling, max_pos)
    raise ValueError(f"unsupported rope type {rope_type!r}")


class RotaryEmbedding:
    """Applies RoPE to q and k given each token's absolute position.

    The float32 cos/sin tables ([max_positions, head_dim/2]) are plain attributes, not
    module buffers, so casting the model to half precision cannot degrade them and
    building the model on the meta device cannot leave them empty; they are rebuilt
    lazily for whatever device the positions live on.
    """

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict[str, Any] | None = None,
    ) -> None:
        if head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {head_dim}")
        self.head_dim = head_dim
        self.max_positions = max_positions
        # Computed on the CPU at construction so unsupported types fail early; the explicit
        # device context wins over an enclosing `with torch.device("meta")` model build.
        with torch.device("cpu"):
            self.inv_freq, self.attention_scaling = _inv_freq(theta, head_dim, scaling, max_positions)
        self.cos: torch.Tensor | None = None
        self.sin: torch.Tensor | None = None

    def build(self, device: torch.device | str) -> None:
        """(Re)compute the cos/sin tables on `device`."""
        device = torch.device(device)
        if device.type == "meta":
            return
        inv = self.inv_freq.to(device)
        pos = torch.arange(self.max_positions, device=device, dtype=torch.int64).float()
        # Same float32 product as transformers computes per call, so values match exactly.
        freqs = pos[:, None] * inv[None, :]
        self.cos = freqs.cos() * self.attention_scaling
        self.sin = freqs.sin() * self.attention_scaling

    def at(self, positions: torch.Tensor) -> PositionedRotary:
        """RoPE for one forward pass's tokens at `positions [T]`, to apply in every layer."""
        if self.cos is None or self.cos.device != positions.device:
            self.build(positions.device)
        assert self.cos is not None and self.sin is not None
        return PositionedRotary(positions, self.cos, self.sin)


class PositionedRotary:
    """Rotates each layer's q [T, H, D] and k [T, KV, D] by one forward pass's positions.

    On a CPU the per-token cos/sin factors are gathered and cast once per pass, not once
    per layer: at batch 1 that took about as long as the rotation itself; fp32 q and k
    are then rotated in one numba call (``kernels/cpu/rotary.py``, the torch code's
    bits). A GPU's Triton kernel reads the tables by position itself (and rotates in place).
    """

    def __init__(self, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        self.positions = positions
        self.cos = cos
        self.sin = sin
        # Keyed by dtype because the factors are rounded to q's; one entry in practice.
        self._rows: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}
        self._factors: torch.Tensor | None = None  # fp32 rows' factors as cpu_rotary reads them

    def __call__(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if q.is_cuda:  # triton is only imported where its kernels run
            from cadence.kernels.triton.rotary import apply_rotary

            return apply_rotary(self.positions, q, k, self.cos, self.sin)
        rows = self._rows.get(q.dtype)
        if rows is None:
            rows = self._rows[q.dtype] = reference.rotary_rows(self.positions, self.cos, self.sin, q.dtype)
        if q.dtype == torch.float32 and q.shape[0] >= cpu_rotary.MIN_ROWS:  # one numba call, the same bits
            if self._factors is None:
                self._factors = cpu_rotary.rotary_factors(*rows)
            rotated = cpu_rotary.rotate(q, k, self._factors)
            if rotated is not None:
                return rotated
        return reference.rotate(q, *rows), reference.rotate(k, *rows)

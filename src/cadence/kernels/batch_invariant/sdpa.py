"""CPU attention whose output rows do not depend on the batch or on where a prompt was cut.

torch's CPU flash kernel walks keys in blocks (of the key length, or of 512 from 512 keys
on) and queries in blocks whose size follows the query length, and each block's sums go
through BLAS, whose order follows the block's shape. So a token's attention could change
with the other decodes of its group (their padding sets the key length), with where its
prompt was chunked, and between a one-token chunk (a decode) and a longer one. Three
rules keep every row's arithmetic the same; none touches the kernel:

- keys: a call's key length is padded (masked) to a multiple of 16 up to a short-key
  limit, and to a multiple of 512 beyond, so that every key block a row reaches holds
  the same keys at the same offsets, with masked zeros after them, whatever the other
  rows need. Where a short block of keys sums like the first keys of a 512-key block
  depends on the BLAS and the CPU (on some, blocks of 208 to 368 keys do not), so the
  limit is measured too;
- queries: a prefill's queries are padded to a multiple of ``query_multiple`` rows, and a
  decode's query heads of one KV head to ``decode_rows`` rows, so no query block is one
  of the small ones BLAS sums differently;
- masks: always an additive float mask, built once per step, never ``is_causal``, whose
  key blocks would end where the query block does.

How many query rows suffice, and up to how many keys a block may be short, is BLAS's
business, so ``invariant_shape`` measures both once per attention shape, running these
very functions on random data (whole prompt, chunked prompt, decodes of every padded
length alone and among longer ones) and taking the first candidate under which every
row agrees.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)


class AttentionShape(Protocol):
    """What the measurement reads of a model's attention (the engine's ``AttentionSpec``)."""

    @property
    def num_heads(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def scale(self) -> float: ...
    @property
    def sliding_window(self) -> int | None: ...


# Beyond the measured short-key limit, a call's keys are padded to whole blocks of the
# flash kernel's block size.
_KEY_BLOCK = 512
_KEY_MULTIPLE = 16
# A long prefill chunk attends in query segments of this many tokens, each to the keys up
# to its own end, so causal attention skips most of the upper triangle.
PREFILL_SEGMENT = 512


def additive_mask(
    query_pos: torch.Tensor, kv_len: int, limits: torch.Tensor, window: int | None, dtype: torch.dtype
) -> torch.Tensor:
    """``[len(query_pos), kv_len]``: 0 where a query at that position sees the key, -inf
    elsewhere; ``limits`` is each query's number of keys (its position + 1)."""
    key_pos = torch.arange(kv_len, device=query_pos.device)[None, :]
    visible = key_pos < limits[:, None]
    if window is not None:
        visible &= key_pos > query_pos[:, None] - window
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, float("-inf"))


@dataclass(frozen=True)
class InvariantShape:
    """Query and key padding under which every row's attention is batch-invariant."""

    decode_rows: int  # a decode's query rows per KV head (its query heads, zero-padded)
    query_multiple: int  # a prefill segment's query rows are padded to a multiple of this
    short_keys: int  # the most keys a call may run at without padding them to a whole block

    def kv_len(self, length: int) -> int:
        """The key length a call that must see ``length`` keys runs at: a multiple of 16 up
        to ``short_keys``, whole key blocks beyond (see the module doc)."""
        multiple = _KEY_MULTIPLE if length <= self.short_keys else _KEY_BLOCK
        return -(-length // multiple) * multiple


def decode_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float, rows: int
) -> torch.Tensor:
    """Decodes ``query [n, kv_heads, group, D]`` against ``keys/values [n, kv_heads, L, D]``
    under ``mask [n, 1, 1, L]``; the group's query heads go in as one KV head's query rows
    (so each K/V block is read once per KV head), zero-padded to ``rows``."""
    group = query.shape[2]
    if rows > group:
        query = F.pad(query, (0, 0, 0, rows - group))
    out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask.to(query.dtype), scale=scale)
    return out[:, :, :group]


def prefill_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """Queries ``[n, heads, D]`` against ``keys/values [L, kv_heads, D]`` under ``mask
    [padded n, L]`` (padding rows see key 0, so none is all -inf); ``[n, heads, D]``."""
    n = query.shape[0]
    padded = F.pad(query, (0, 0, 0, 0, 0, mask.shape[0] - n))
    # A batch dimension of 1 matters: 3-D inputs miss the CPU flash kernel.
    out = F.scaled_dot_product_attention(
        padded.transpose(0, 1)[None],
        keys.transpose(0, 1)[None],
        values.transpose(0, 1)[None],
        attn_mask=mask.to(query.dtype)[None, None],
        scale=scale,
        enable_gqa=True,
    )
    return out[0, :, :n].transpose(0, 1)


def prefill_mask(
    start: int, end: int, shape: InvariantShape, window: int | None, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """The mask of query positions ``[start, end)`` of a sequence, padded as ``prefill_attention`` wants."""
    num_rows = -(-(end - start) // shape.query_multiple) * shape.query_multiple
    positions = torch.arange(start, start + num_rows, device=device)
    limits = torch.where(positions < end, positions + 1, 1)
    return additive_mask(positions, shape.kv_len(end), limits, window, dtype)


def decode_mask(
    lengths: list[int], shape: InvariantShape, window: int | None, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """``[rows, 1, 1, L]`` for decodes whose sequences hold ``lengths`` tokens (the new one included)."""
    limits = torch.tensor(lengths, device=device)
    return additive_mask(limits - 1, shape.kv_len(max(lengths)), limits, window, dtype)[:, None, None, :]


_CANDIDATE_ROWS = (4, 8, 16, 32)
_CANDIDATE_MULTIPLES = (16, 32, 64)
# Short-key limits, longest first; 0 pads every call's keys to whole blocks.
_CANDIDATE_SHORT_KEYS = (256, 192, 128, 64, 32, 0)
_shapes: dict[tuple[int, int, int, int | None, torch.dtype, int], InvariantShape] = {}


def invariant_shape(spec: AttentionShape, dtype: torch.dtype) -> InvariantShape:
    """The cached padding for this attention shape, measured on first use on the machine
    the process runs on (it follows the CPU's SDPA kernel and BLAS)."""
    key = (spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.sliding_window, dtype, torch.get_num_threads())
    shape = _shapes.get(key)
    if shape is None:
        group = spec.num_heads // spec.num_kv_heads
        candidates = [
            InvariantShape(rows, multiple, short_keys)
            for short_keys in _CANDIDATE_SHORT_KEYS
            for multiple in _CANDIDATE_MULTIPLES
            for rows in sorted({group, *(r for r in _CANDIDATE_ROWS if r > group)})
        ]
        shape = next((c for c in candidates if rows_agree(spec, dtype, c)), None)
        if shape is None:
            shape = candidates[-1]
            logger.warning("no padding makes CPU attention batch-invariant for %s; using %s", spec, shape)
        _shapes[key] = shape
    return shape


def rows_agree(spec: AttentionShape, dtype: torch.dtype, shape: InvariantShape, length: int = 700) -> bool:
    """Whether, under ``shape``, each position's output is the same from a whole prompt, a
    prompt cut into chunks (one-token chunks are decodes), and a decode alone or grouped
    with longer and shorter rows, at every padded key length up to a whole key block and
    beyond it. ``length`` spans more than one key block."""
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
    query = torch.randn(length, heads, dim, generator=gen).to(dtype)
    longest = 2 * length  # a decode grouped with a longer row
    keys, values = (torch.randn(shape.kv_len(longest), kv_heads, dim, generator=gen).to(dtype) for _ in range(2))
    device = query.device

    def prefill(start: int, end: int) -> torch.Tensor:
        kv = shape.kv_len(end)
        mask = prefill_mask(start, end, shape, spec.sliding_window, dtype, device)
        return prefill_attention(query[start:end], keys[:kv], values[:kv], mask, spec.scale)

    def decode(position: int, lengths: list[int]) -> torch.Tensor:
        # Row 0 is the position's token; the others read the same keys at other lengths.
        mask = decode_mask([position + 1, *lengths], shape, spec.sliding_window, dtype, device)
        kv = mask.shape[-1]
        rows = 1 + len(lengths)
        q = torch.randn(rows, kv_heads, heads // kv_heads, dim, generator=gen).to(dtype)
        q[0] = query[position].view(kv_heads, -1, dim)
        k, v = (t[:kv].transpose(0, 1).expand(rows, -1, -1, -1) for t in (keys, values))
        return decode_attention(q, k, v, mask, spec.scale, shape.decode_rows)[0].reshape(heads, dim)

    whole = torch.cat([prefill(s, min(s + PREFILL_SEGMENT, length)) for s in range(0, length, PREFILL_SEGMENT)])
    # Every padded key length up to a whole block (the last position of each), and some beyond.
    ends_of_lengths = range(_KEY_MULTIPLE - 1, _KEY_BLOCK, _KEY_MULTIPLE)
    for position in (*ends_of_lengths, 0, 17, 256, 300, 530, length - 1):
        for others in ([], [position + 20], [longest - 50, 3], [max(position - 200, 1)]):
            if not torch.equal(decode(position, others), whole[position]):
                return False
    cuts = [0, 1, 2, 19, 200, 300, 530, length - 1, length]
    for start, end in zip(cuts, cuts[1:]):
        chunk = decode(start, []).unsqueeze(0) if end - start == 1 else prefill(start, end)
        if not torch.equal(chunk, whole[start:end]):
            return False
    return True

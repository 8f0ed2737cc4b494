"""Decode steps replayed from CUDA graphs: one launch instead of hundreds.

A decode step of a small model is a few hundred short kernels (norms, rotary, four
projections and attention per layer), and launching them from Python costs far more than
running them: on an H100 a 1B model spent 25 ms of CPU per step on under 1 ms of GPU work.
So, as vLLM and SGLang do, the model's forward for a pure-decode batch is captured once
per padded batch size at start-up and replayed each step.

A graph replays fixed addresses and a fixed grid, so:

* every input lives in one static int64 buffer, filled on the host and copied to the
  device in one transfer per step; rows past the real batch are padding (token 0 at
  position 0, KV slot -1, which the cache write skips, and a context of one token);
* the attention kernel's split-KV count is part of the grid, so each batch size gets a
  few graphs, one per split count on a power-of-two ladder up to what its longest
  possible context would choose; a step replays the largest one not above what the
  kernel would choose for its real longest context (splits past a sequence's length
  do no work, so any count is correct, only the speed differs).

Prefill, chunked and mixed steps, and batches above the largest size, run eagerly.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
from torch import nn

from cadence.engine.attention.backend import AttentionContext, KVCache
from cadence.engine.attention.triton_backend import TritonAttentionBackend, TritonMetadata
from cadence.engine.block_tables import TableRows
from cadence.kernels.launch import num_sms
from cadence.kernels.paged_attention import choose_num_splits

if TYPE_CHECKING:
    from cadence.scheduler.scheduler import ScheduledRequest

logger = logging.getLogger(__name__)

# Padded batch sizes with a graph (vLLM's ladder is similar): small steps apart where
# padding would cost most, then coarser.
CAPTURE_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
_NO_SLOT = -1  # the cache write skips a negative slot


@dataclass
class _Captured:
    """One replayable forward: its CUDA graph and the output tensor replays rewrite."""

    graph: torch.cuda.CUDAGraph
    hidden: torch.Tensor  # [batch, hidden_size], rewritten by every replay


class DecodeGraphs:
    """Captured decode forwards for the batch sizes up to `max_batch`.

    With `use_graphs=False` nothing is captured and `run` calls the forward on the same
    static, padded inputs: what a replay computes, without CUDA. Tests use it on CPU.
    """

    def __init__(
        self,
        model: nn.Module,
        backend: TritonAttentionBackend,
        kv_caches: list[KVCache],
        *,
        max_batch: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
        use_graphs: bool = True,
    ) -> None:
        self.model = model
        self.backend = backend
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.use_graphs = use_graphs
        self.batch_sizes = [b for b in CAPTURE_BATCH_SIZES if b <= max_batch] or [1]
        self.max_batch = self.batch_sizes[-1]
        self.max_blocks = -(-max_model_len // block_size)
        self.max_model_len = max_model_len
        self.num_sms = num_sms(device)
        self.num_kv_heads = backend.spec.num_kv_heads
        b = self.max_batch
        pinned = device.type == "cuda"
        # Per-sequence inputs, [4 * batch] int64 for a batch: ids, positions, KV slots and
        # sequence lengths, each `batch` long. A step fills and copies only its batch's
        # prefix: two host-to-device copies per step, with the block tables.
        self._host_scalars = torch.zeros(4 * b, dtype=torch.int64, pin_memory=pinned)
        self._scalars = torch.zeros(4 * b, dtype=torch.int64, device=device)
        self._host_tables = torch.zeros(b, self.max_blocks, dtype=torch.int32, pin_memory=pinned)
        self.block_tables = torch.zeros(b, self.max_blocks, dtype=torch.int32, device=device)
        # numpy views of the pinned buffers: element writes from Python cost far less there.
        self._host_scalars_np = self._host_scalars.numpy()
        self._host_tables_np = self._host_tables.numpy()
        self._table_rows = TableRows(self._host_tables_np)
        # Marks the last upload: the host buffers may be rewritten only once it is done (a
        # step that samples nothing never waits on the device otherwise).
        self._uploaded = torch.cuda.Event() if device.type == "cuda" else None
        # One token per sequence: sequence i's query is row i.
        self.query_start_loc = torch.arange(b + 1, dtype=torch.int32, device=device)
        # Fixed per batch size, so computed once rather than on every step.
        self._ladders = {batch: self.split_ladder(batch) for batch in self.batch_sizes}
        self._captured: dict[tuple[int, int], _Captured] = {}
        self._pool = None

    # ----- start-up --------------------------------------------------------------------
    def split_ladder(self, batch: int) -> list[int]:
        """Split counts captured for `batch`: powers of two up to the longest context's choice."""
        top = choose_num_splits(batch, self.num_kv_heads, self.max_model_len, self.num_sms)
        ladder = [1]
        while ladder[-1] * 2 <= top:
            ladder.append(ladder[-1] * 2)
        return ladder

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every (batch size, split count); largest first, so smaller graphs fit in
        the memory pool the larger ones already reserved. Without graphs, nothing to do."""
        if not self.use_graphs:
            return
        start = time.perf_counter()
        for batch in reversed(self.batch_sizes):
            self._fill_padding(batch)  # the capture runs write no KV: every slot is -1
            for splits in self._ladders[batch]:
                self._captured[(batch, splits)] = self._capture_one(batch, splits)
        torch.cuda.synchronize(self.device)
        logger.info(
            "captured %d decode CUDA graphs (batch sizes up to %d) in %.1f s",
            len(self._captured), self.max_batch, time.perf_counter() - start,
        )

    def _capture_one(self, batch: int, splits: int) -> _Captured:
        forward = self._forward_fn(batch, splits)
        # One eager run compiles every Triton kernel this shape needs, outside the capture.
        forward()
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            hidden = forward()
        if self._pool is None:
            self._pool = graph.pool()
        return _Captured(graph, hidden)

    def _forward_fn(self, batch: int, splits: int) -> Callable[[], torch.Tensor]:
        ids, positions, slots, seq_lens = _split_scalars(self._scalars, batch)
        metadata = TritonMetadata(
            slot_mapping=slots,
            block_tables=self.block_tables[:batch],
            seq_lens=seq_lens,
            query_start_loc=self.query_start_loc[: batch + 1],
            max_query_len=1,
            max_seq_len=self.max_model_len,
            num_splits=splits,
        )
        ctx = AttentionContext(self.backend, self.kv_caches, metadata)
        return lambda: self.model(ids, positions, ctx)

    # ----- each step -------------------------------------------------------------------
    def can_run(self, items: list[ScheduledRequest]) -> bool:
        """Whether this step is one the graphs cover: one new token per sequence, few enough."""
        return 0 < len(items) <= self.max_batch and all(item.num_new_tokens == 1 for item in items)

    def run(self, items: list[ScheduledRequest]) -> torch.Tensor:
        """The model's final hidden states for the step, [len(items), hidden_size]."""
        n = len(items)
        batch = next(b for b in self.batch_sizes if b >= n)
        if self._uploaded is not None:
            self._uploaded.synchronize()
        ids, positions, slots, seq_lens = _split_scalars(self._host_scalars_np, batch)
        longest = 0
        for i, item in enumerate(items):
            request = item.request
            position = request.num_computed_tokens
            block_ids = request.block_ids
            ids[i] = request.token_ids[position]
            positions[i] = position
            slots[i] = block_ids[position // self.block_size] * self.block_size + position % self.block_size
            seq_lens[i] = position + 1
            self._table_rows.write(i, block_ids, position // self.block_size)
            longest = max(longest, position + 1)
        self._pad_rows(n, batch)
        self._upload(batch)
        wanted = choose_num_splits(batch, self.num_kv_heads, longest, self.num_sms)
        splits = max(s for s in self._ladders[batch] if s <= wanted)
        captured = self._captured.get((batch, splits))
        if captured is None:  # use_graphs=False: the same padded inputs, run eagerly
            return self._forward_fn(batch, splits)()[:n]
        captured.graph.replay()
        return captured.hidden[:n]

    def _fill_padding(self, batch: int) -> None:
        self._pad_rows(0, batch)
        self._upload(batch)

    def _pad_rows(self, start: int, batch: int) -> None:
        """Rows start..batch-1 become padding: token 0 at position 0, no KV slot (the cache
        write skips it), and one token of context (a stale cache row; the output is dropped)."""
        ids, positions, slots, seq_lens = _split_scalars(self._host_scalars_np, batch)
        ids[start:] = 0
        positions[start:] = 0
        slots[start:] = _NO_SLOT
        seq_lens[start:] = 1
        self._host_tables_np[start:batch, 0] = 0
        self._table_rows.forget(start, batch)

    def _upload(self, batch: int) -> None:
        """The batch's inputs to the device: its prefix of the scalars and its table rows,
        copied asynchronously from pinned memory; `_uploaded` marks when they are done."""
        non_blocking = self.device.type == "cuda"
        self._scalars[: 4 * batch].copy_(self._host_scalars[: 4 * batch], non_blocking=non_blocking)
        self.block_tables[:batch].copy_(self._host_tables[:batch], non_blocking=non_blocking)
        if self._uploaded is not None:
            self._uploaded.record()


def _split_scalars(flat, batch: int) -> tuple:
    """(ids, positions, slots, seq lens) of a batch: consecutive `batch`-long runs of `flat`
    (a tensor or a numpy array)."""
    return tuple(flat[i * batch : (i + 1) * batch] for i in range(4))

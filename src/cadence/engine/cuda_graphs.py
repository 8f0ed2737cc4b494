"""Decode steps replayed from CUDA graphs: one launch instead of hundreds.

A decode step of a small model is a few hundred short kernels (norms, rotary, four
projections and attention per layer), and launching them from Python costs far more than
running them (bench/RESULTS.md). So, as vLLM and SGLang do, the model's forward for a
pure-decode batch is captured once per padded batch size at start-up and replayed each
step.

A graph replays fixed addresses and a fixed grid, so:

* every input lives in static buffers: ids, positions, KV slots and sequence lengths in
  one int64 buffer, block tables in an int32 one with a row per batch slot, both filled
  on the host (the tables from the input batch's rows) and copied to the device each
  step; rows past the real batch are padding (token 0 at position 0, KV slot -1, which
  the cache write skips, and a context of one token);
* the attention backend builds the graph's metadata over those buffers, and may ask for
  several graphs per batch size (`AttentionBackend.graph_variants`: the Triton backend's
  split-KV counts), choosing one per step (`pick_graph_variant`).

Prefill, chunked and mixed steps, and batches above the largest size, run eagerly.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from cadence.engine.attention.backend import AttentionBackend, DecodeGraphInputs, KVCache
from cadence.engine.forward_context import ForwardContext
from cadence.engine.input_batch import StepInputs
from cadence.engine.models.causal_lm import CausalLM

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
        model: CausalLM,
        backend: AttentionBackend,
        kv_caches: list[KVCache],
        *,
        max_batch: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
        use_graphs: bool = True,
    ) -> None:
        if not backend.supports_cuda_graphs:
            raise ValueError(f"{type(backend).__name__} cannot run decode steps from CUDA graphs")
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
        self.host_scalars = self._host_scalars.numpy()
        self.host_tables = self._host_tables.numpy()
        # Marks the last upload: the host buffers may be rewritten only once it is done (a
        # step that samples nothing never waits on the device otherwise).
        self._uploaded = torch.cuda.Event() if device.type == "cuda" else None
        # One token per sequence: sequence i's query is row i.
        self.query_start_loc = torch.arange(b + 1, dtype=torch.int32, device=device)
        # Fixed per batch size, so asked once rather than on every step.
        self.variants = {batch: backend.graph_variants(batch, max_model_len, device) for batch in self.batch_sizes}
        self._captured: dict[tuple[int, int], _Captured] = {}
        # The first captured graph's memory pool, which every later capture shares.
        self._pool: torch.cuda._POOL_HANDLE | None = None

    # ----- start-up --------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every (batch size, variant); largest first, so smaller graphs fit in
        the memory pool the larger ones already reserved. Without graphs, nothing to do."""
        if not self.use_graphs:
            return
        start = time.perf_counter()
        for batch in reversed(self.batch_sizes):
            self._pad_rows(0, batch)  # the capture runs write no KV: every slot is -1
            self._upload(batch)
            for variant in self.variants[batch]:
                self._captured[(batch, variant)] = self._capture_one(batch, variant)
        torch.cuda.synchronize(self.device)
        logger.info(
            "captured %d decode CUDA graphs (batch sizes up to %d) in %.1f s",
            len(self._captured),
            self.max_batch,
            time.perf_counter() - start,
        )

    def _capture_one(self, batch: int, variant: int) -> _Captured:
        forward = self._forward_fn(batch, variant)
        # One eager run compiles every Triton kernel this shape needs, outside the capture.
        forward()
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            hidden = forward()
        if self._pool is None:
            self._pool = graph.pool()
        return _Captured(graph, hidden)

    def _forward_fn(self, batch: int, variant: int) -> Callable[[], torch.Tensor]:
        ids, positions, slots, seq_lens = _split_scalars(self._scalars, batch)
        inputs = DecodeGraphInputs(
            slot_mapping=slots,
            block_tables=self.block_tables[:batch],
            seq_lens=seq_lens,
            query_start_loc=self.query_start_loc[: batch + 1],
            max_seq_len=self.max_model_len,
        )
        ctx = ForwardContext(self.backend, self.kv_caches, self.backend.graph_metadata(inputs, variant))
        return lambda: self.model(ids, positions, ctx)

    # ----- each step -------------------------------------------------------------------
    def can_run(self, step: StepInputs) -> bool:
        """Whether this step is one the graphs cover: one new token per sequence, few enough."""
        return 0 < step.num_seqs <= self.max_batch and step.num_decodes == step.num_seqs

    def run(self, step: StepInputs, block_table: np.ndarray) -> torch.Tensor:
        """The model's final hidden states for the step, [num_seqs, hidden_size];
        `block_table` holds the input batch's rows."""
        batch = self.stage(step, block_table)
        self._upload(batch)
        longest = max(step.context_lens) + 1
        variant = self.backend.pick_graph_variant(batch, longest, self.variants[batch], self.device)
        captured = self._captured.get((batch, variant))
        if captured is None:  # use_graphs=False: the same padded inputs, run eagerly
            return self._forward_fn(batch, variant)()[: step.num_seqs]
        captured.graph.replay()
        return captured.hidden[: step.num_seqs]

    def stage(self, step: StepInputs, block_table: np.ndarray) -> int:
        """Fill the host buffers for a step and return its padded batch size. Each row's
        table is copied only as wide as the step's widest: the sequence lengths bound every
        read, so what lies past them may be stale."""
        n = step.num_seqs
        batch = next(b for b in self.batch_sizes if b >= n)
        if self._uploaded is not None:
            self._uploaded.synchronize()
        ids, positions, slots, seq_lens = _split_scalars(self.host_scalars, batch)
        ids[:n] = step.input_ids
        positions[:n] = step.positions
        slots[:n] = step.slot_mapping
        seq_lens[:n] = step.positions + 1
        self.host_tables[:n, : step.num_blocks] = block_table[step.rows, : step.num_blocks]
        self._pad_rows(n, batch)
        return batch

    def _pad_rows(self, start: int, batch: int) -> None:
        """Rows start..batch-1 become padding: token 0 at position 0, no KV slot (the cache
        write skips it), and one token of context (a stale cache row; the output is dropped)."""
        ids, positions, slots, seq_lens = _split_scalars(self.host_scalars, batch)
        ids[start:] = 0
        positions[start:] = 0
        slots[start:] = _NO_SLOT
        seq_lens[start:] = 1
        self.host_tables[start:batch, 0] = 0

    def _upload(self, batch: int) -> None:
        """The batch's inputs to the device: its prefix of the scalars and its table rows,
        copied asynchronously from pinned memory; `_uploaded` marks when they are done."""
        non_blocking = self.device.type == "cuda"
        self._scalars[: 4 * batch].copy_(self._host_scalars[: 4 * batch], non_blocking=non_blocking)
        self.block_tables[:batch].copy_(self._host_tables[:batch], non_blocking=non_blocking)
        if self._uploaded is not None:
            self._uploaded.record()


def _split_scalars(flat: Any, batch: int) -> tuple:
    """(ids, positions, slots, seq lens) of a batch: consecutive `batch`-long runs of `flat`
    (a tensor or a numpy array)."""
    return tuple(flat[i * batch : (i + 1) * batch] for i in range(4))

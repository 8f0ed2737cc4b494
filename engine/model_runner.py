"""Turns a SchedulerOutput into one flat forward pass, then samples.

The runner owns the KV cache tensors, the attention backend and the per-request random
generators. It reads token ids and block tables straight from the scheduler's requests:
both live in the engine-core process, so nothing needs copying between them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from cadence.engine.attention.backend import (
    AttentionBackend,
    AttentionContext,
    KVCache,
    QuantizedKVCache,
    StepBatch,
    split_kv_cache,
)
from cadence.engine.attention.selector import create_attention_backend
from cadence.engine.block_tables import EagerBlockTables
from cadence.kernels.kv_quant import KV_CACHE_DTYPES
from cadence.kernels.launch import has_fp8_hardware
from cadence.engine.protocol import TokenLogprobs
from cadence.engine.sampler import Sampler, SamplingMetadata, compute_logprobs
from cadence.engine.sampling_params import SamplingParams
from cadence.scheduler.scheduler import ScheduledRequest, SchedulerOutput

if TYPE_CHECKING:  # the module imports triton, which a CPU install lacks
    from cadence.engine.cuda_graphs import DecodeGraphs


@dataclass
class ModelRunnerOutput:
    """Sampled tokens (and logprobs when asked) by request id."""

    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)


def _rows_to_logprobs(ids: torch.Tensor, values: torch.Tensor, ranks: torch.Tensor, num_top: int) -> list[TokenLogprobs]:
    ids_list, values_list, ranks_list = ids.tolist(), values.tolist(), ranks.tolist()
    return [
        (ids_list[r][: 1 + num_top], values_list[r][: 1 + num_top], ranks_list[r]) for r in range(len(ids_list))
    ]


def allocate_kv_cache(
    shape: tuple[int, ...], dtype: torch.dtype, kv_cache_dtype: str, device: torch.device
) -> KVCache:
    """One layer's cache: in the model's dtype ("auto"), or int8 / fp8 with row scales."""
    if kv_cache_dtype == "auto":
        return torch.zeros(shape, dtype=dtype, device=device)
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown kv_cache_dtype {kv_cache_dtype!r}; use auto, int8 or fp8")
    return QuantizedKVCache(
        torch.zeros(shape, dtype=KV_CACHE_DTYPES[kv_cache_dtype], device=device),
        torch.zeros(shape[:4], dtype=torch.float32, device=device),
    )


class ModelRunner:
    """Runs the model on the paged KV cache for whatever the scheduler chose."""

    def __init__(
        self,
        model: nn.Module,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        attention_backend: str = "auto",
        kv_cache_dtype: str = "auto",
        *,
        enforce_eager: bool = False,
        max_num_seqs: int = 256,
        max_model_len: int = 2048,
    ) -> None:
        self.model = model
        self.device = device
        self.block_size = block_size
        spec = model.attention_spec()
        self.backend: AttentionBackend = create_attention_backend(attention_backend, spec, block_size, device)
        cache_shape = (2, num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
        self.kv_caches: list[KVCache] = [
            allocate_kv_cache(cache_shape, dtype, kv_cache_dtype, device) for _ in range(model.config.num_hidden_layers)
        ]
        self.decode_graphs: DecodeGraphs | None = None
        if not enforce_eager and self._graphs_supported(kv_cache_dtype):
            from cadence.engine.cuda_graphs import DecodeGraphs

            self.decode_graphs = DecodeGraphs(
                model, self.backend, self.kv_caches, max_batch=max_num_seqs, max_model_len=max_model_len,
                block_size=block_size, device=device,
            )
            self.decode_graphs.capture()
        self._block_tables = EagerBlockTables()
        self.sampler = Sampler()
        self.generators: dict[str, torch.Generator] = {}
        # Prompt positions whose logprobs were already reported: a preempted request
        # recomputes its prompt, and must not report those positions twice.
        self.prompt_logprobs_reported: dict[str, int] = {}

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        for request_id in output.finished_request_ids:
            self.generators.pop(request_id, None)
            self.prompt_logprobs_reported.pop(request_id, None)
        if output.block_copies:
            self._copy_blocks(output.block_copies)
        if output.is_empty:
            return ModelRunnerOutput()

        # Decodes (one new token) first, shortest context first: the backend batches
        # decodes of similar length into one attention call.
        items = sorted(output.scheduled, key=lambda s: (s.num_new_tokens != 1, s.request.num_computed_tokens))
        if self.decode_graphs is not None and self.decode_graphs.can_run(items):
            query_starts, hidden = list(range(len(items))), self.decode_graphs.run(items)
        else:
            query_starts, hidden = self._run_eager(items)

        result = ModelRunnerOutput()
        self._prompt_logprobs(items, query_starts, hidden, result)
        sampling = [(i, item) for i, item in enumerate(items) if item.samples]
        if sampling:
            rows = [query_starts[i] + item.num_new_tokens - 1 for i, item in sampling]
            logits = self.model.compute_logits(hidden[self._row_selector(rows)])
            self._sample([item for _, item in sampling], logits, result)
        return result

    def _row_selector(self, rows: list[int]) -> slice | torch.Tensor:
        """``rows`` of the hidden states as a slice when they run consecutively, as in
        every decode step: an index tensor would be a host-to-device copy the host waits
        on behind the step's kernels, where a slice lets it queue the LM head at once."""
        if rows == list(range(rows[0], rows[0] + len(rows))):
            return slice(rows[0], rows[0] + len(rows))
        return torch.tensor(rows, device=self.device)

    def _graphs_supported(self, kv_cache_dtype: str) -> bool:
        """CUDA graphs need the Triton backend on a GPU, and no host sync in the step: an
        fp8 cache below compute capability 8.9 is written by torch code that syncs."""
        if self.device.type != "cuda" or not self.backend.supports_cuda_graphs:
            return False
        return kv_cache_dtype != "fp8" or has_fp8_hardware(self.device)

    def _run_eager(self, items: list[ScheduledRequest]) -> tuple[list[int], torch.Tensor]:
        """Any step, launched op by op: returns each sequence's first row and the hidden states."""
        input_ids: list[int] = []
        positions: list[int] = []
        query_starts: list[int] = []
        for item in items:
            request, start = item.request, item.request.num_computed_tokens
            query_starts.append(len(input_ids))
            input_ids.extend(request.token_ids[start : start + item.num_new_tokens])
            positions.extend(range(start, start + item.num_new_tokens))
        input_ids_t = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        positions_t = torch.tensor(positions, dtype=torch.long, device=self.device)
        batch = self._step_batch(items, query_starts, positions_t)
        ctx = AttentionContext(self.backend, self.kv_caches, self.backend.build_metadata(batch))
        return query_starts, self.model(input_ids_t, positions_t, ctx)

    def _step_batch(
        self, items: list[ScheduledRequest], query_starts: list[int], positions: torch.Tensor
    ) -> StepBatch:
        query_lens = [item.num_new_tokens for item in items]
        rows = [
            (item.request.request_id, item.request.block_ids, item.request.num_computed_tokens // self.block_size)
            for item in items
        ]
        tables = torch.from_numpy(self._block_tables.build(rows)).to(self.device)
        seq_index = torch.repeat_interleave(
            torch.arange(len(items), device=self.device), torch.tensor(query_lens, device=self.device)
        )
        block_index = torch.div(positions, self.block_size, rounding_mode="floor")
        slot_mapping = tables[seq_index, block_index] * self.block_size + positions % self.block_size
        return StepBatch(
            query_starts=query_starts,
            query_lens=query_lens,
            context_lens=[item.request.num_computed_tokens for item in items],
            block_tables=tables,
            num_decodes=sum(1 for n in query_lens if n == 1),
            slot_mapping=slot_mapping,
        )

    def _sample(self, items: list[ScheduledRequest], logits: torch.Tensor, result: ModelRunnerOutput) -> None:
        requests = [item.request for item in items]
        params: list[SamplingParams] = [r.sampling_params for r in requests]
        metadata = SamplingMetadata.build(
            params,
            prompt_token_ids=[r.prompt_token_ids for r in requests],
            # Slicing out every history each step would cost O(length); only penalties
            # and min_tokens read it.
            output_token_ids=[
                r.output_token_ids if p.needs_penalties or p.min_tokens else [] for r, p in zip(requests, params)
            ],
            generators=[self._generator(r.request_id, p) for r, p in zip(requests, params)],
            stop_token_ids=[r.stop.stop_token_ids for r in requests],
            device=self.device,
        )
        sampled = self.sampler(logits, metadata)
        token_ids = sampled.sampled_token_ids.tolist()
        for request, token_id in zip(requests, token_ids):
            result.sampled_token_ids[request.request_id] = token_id
        if sampled.logprobs is not None:
            rows = _rows_to_logprobs(
                sampled.logprob_token_ids, sampled.logprobs, sampled.sampled_ranks, metadata.max_num_logprobs or 0
            )
            for request, p, row in zip(requests, params, rows):
                if p.logprobs is not None:
                    result.logprobs[request.request_id] = (row[0][: 1 + p.logprobs], row[1][: 1 + p.logprobs], row[2])

    def _generator(self, request_id: str, params: SamplingParams) -> torch.Generator | None:
        if params.seed is None or params.greedy:
            return None
        generator = self.generators.get(request_id)
        if generator is None:
            generator = torch.Generator(device=self.device)
            # Any int is a valid seed; torch takes the low 64 bits (siblings use seed + index).
            generator.manual_seed(params.seed % (1 << 64))
            self.generators[request_id] = generator
        return generator

    def _prompt_logprobs(
        self,
        items: list[ScheduledRequest],
        query_starts: list[int],
        hidden: torch.Tensor,
        result: ModelRunnerOutput,
    ) -> None:
        """Logprobs of each prompt token given the tokens before it, chunk by chunk."""
        for item, query_start in zip(items, query_starts):
            request = item.request
            num_top = request.sampling_params.prompt_logprobs
            if num_top is None:
                continue
            chunk_start = request.num_computed_tokens
            start = max(chunk_start, self.prompt_logprobs_reported.get(request.request_id, 0))
            # Position p's logits score token p + 1; only prompt tokens are scored.
            end = min(chunk_start + item.num_new_tokens, request.num_prompt_tokens - 1)
            if end <= start:
                continue
            self.prompt_logprobs_reported[request.request_id] = end
            rows = slice(query_start + start - chunk_start, query_start + end - chunk_start)
            logits = self.model.compute_logits(hidden[rows])
            targets = torch.tensor(request.prompt_token_ids[start + 1 : end + 1], device=self.device)
            ids, values, ranks = compute_logprobs(logits, targets, num_top)
            result.prompt_logprobs[request.request_id] = _rows_to_logprobs(ids, values, ranks, num_top)

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        for cache in self.kv_caches:
            for tensor in split_kv_cache(cache):
                if tensor is not None:
                    tensor[:, dst] = tensor[:, src]

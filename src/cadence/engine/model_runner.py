"""Turns a SchedulerOutput into one flat forward pass, then samples.

The runner owns the KV cache tensors, the attention backend, the per-request random
generators and its own copy of the requests it runs (`engine/input_batch.py`), kept up
to date from each step's changes. It never reads the scheduler's `Request` objects, so
everything it needs arrives in the `SchedulerOutput`, which may come from another process.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
import torch

from cadence.engine.attention.backend import (
    AttentionBackend,
    KVCache,
    QuantizedKVCache,
    StepBatch,
    split_kv_cache,
)
from cadence.engine.attention.selector import create_attention_backend
from cadence.engine.batch_invariant import make_batch_invariant
from cadence.engine.cuda_graphs import DecodeGraphs
from cadence.engine.forward_context import ForwardContext
from cadence.engine.host_memory import zeroed_pages
from cadence.engine.input_batch import InputBatch, RequestState, StepInputs
from cadence.engine.kv_connector.worker_side import WorkerSideConnector
from cadence.engine.logit_bias import LogitBias
from cadence.engine.models.causal_lm import CausalLM
from cadence.engine.models.moe import routes_on_host
from cadence.engine.protocol import TokenLogprobs
from cadence.engine.sampler import Sampler, SamplingMetadata, compute_logprobs
from cadence.engine.sampling_params import SamplingParams
from cadence.engine.structured_output.manager import GrammarMasks
from cadence.kernels.formats.kv_quant import KV_CACHE_DTYPES
from cadence.kernels.triton.launch import has_fp8_hardware
from cadence.scheduler.output import SchedulerOutput
from cadence.scheduler.remote_kv import KVLoadResult


@dataclass
class ModelRunnerOutput:
    """Sampled tokens (and logprobs when asked) by request id."""

    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    kv_load_results: list[KVLoadResult] = field(default_factory=list)


def _rows_to_logprobs(
    ids: torch.Tensor, values: torch.Tensor, ranks: torch.Tensor, num_top: int
) -> list[TokenLogprobs]:
    ids_list, values_list, ranks_list = ids.tolist(), values.tolist(), ranks.tolist()
    return [(ids_list[r][: 1 + num_top], values_list[r][: 1 + num_top], ranks_list[r]) for r in range(len(ids_list))]


TensorFactory = Callable[[tuple[int, ...], torch.dtype, torch.device], torch.Tensor]


def allocate_kv_cache(
    shape: tuple[int, ...],
    dtype: torch.dtype,
    kv_cache_dtype: str,
    device: torch.device,
    zeros: TensorFactory = lambda shape, dtype, device: torch.zeros(shape, dtype=dtype, device=device),
) -> KVCache:
    """One layer's cache: in the model's dtype ("auto"), or int8 / fp8 with row scales.
    `zeros` makes the storage (a KV transport may need it in memory of its own)."""
    if kv_cache_dtype == "auto":
        return zeros(shape, dtype, device)
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown kv_cache_dtype {kv_cache_dtype!r}; use auto, int8 or fp8")
    return QuantizedKVCache(
        zeros(shape, KV_CACHE_DTYPES[kv_cache_dtype], device), zeros(shape[:4], torch.float32, device)
    )


def _cache_memory(kv_connector: WorkerSideConnector | None) -> TensorFactory:
    """Where the cache's zeroed tensors come from: the KV transport's memory when there is
    one (it may need memory of its own); on CPU, pages the OS zeroes when first written
    (``host_memory.zeroed_pages``), since ``torch.zeros`` would write the whole cache now."""
    if kv_connector is not None:
        return kv_connector.zeros
    return lambda shape, dtype, device: (
        zeroed_pages(shape, dtype) if device.type == "cpu" else torch.zeros(shape, dtype=dtype, device=device)
    )


class ModelRunner:
    """Runs the model on the paged KV cache for whatever the scheduler chose."""

    def __init__(
        self,
        model: CausalLM,
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
        batch_invariant: bool = False,
        kv_connector: WorkerSideConnector | None = None,
    ) -> None:
        self.model = model
        self.kv_connector = kv_connector
        self.device = device
        self.block_size = block_size
        spec = model.attention_spec()
        self.backend: AttentionBackend = create_attention_backend(
            attention_backend, spec, block_size, device, dtype, batch_invariant=batch_invariant
        )
        # Where Triton kernels run (CUDA, or the interpreter's Triton backend in tests) they
        # take their batch-invariant configurations; CPU's torch paths are invariant as they are.
        if batch_invariant and (device.type == "cuda" or attention_backend == "triton"):
            make_batch_invariant(model)
        cache_shape = (2, num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
        self.kv_caches: list[KVCache] = [
            allocate_kv_cache(cache_shape, dtype, kv_cache_dtype, device, _cache_memory(kv_connector))
            for _ in range(model.config.num_hidden_layers)
        ]
        if kv_connector is not None:
            kv_connector.register_kv_caches(self.kv_caches)
        self.backend.use_paged_decode(device, dtype if kv_cache_dtype == "auto" else None)
        self.input_batch = InputBatch(max_num_seqs, max_model_len, block_size)
        self.decode_graphs: DecodeGraphs | None = None
        if not enforce_eager and self._graphs_supported(kv_cache_dtype):
            self.decode_graphs = DecodeGraphs(
                model,
                self.backend,
                self.kv_caches,
                max_batch=max_num_seqs,
                max_model_len=max_model_len,
                block_size=block_size,
                device=device,
            )
            self.decode_graphs.capture()
        self.sampler = Sampler()
        # Whether attention runs prompt tokens' rows apart, and so needs each step's prompt
        # lengths (and the prefix cache to keep generated tokens' blocks apart).
        self.splits_prompt_rows = self.backend.splits_generated_rows
        # Both outlive a preemption (the rows do not), and go when the request finishes: a
        # seeded request's samples continue its own stream, and a recomputed prompt must
        # not report its logprobs twice.
        self.generators: dict[str, torch.Generator] = {}
        self.prompt_logprobs_reported: dict[str, int] = {}
        self.logit_biases: dict[str, LogitBias] = {}  # built once, not each step

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput, grammar_masks: Future[GrammarMasks] | None = None) -> ModelRunnerOutput:
        """Run the step and sample. `grammar_masks`, being filled while the forward pass
        runs, holds the token masks of the constrained sequences that sample."""
        for request_id in output.finished_request_ids:
            self.generators.pop(request_id, None)
            self.prompt_logprobs_reported.pop(request_id, None)
            self.logit_biases.pop(request_id, None)
        self.input_batch.apply(output)
        if output.block_copies:
            self._copy_blocks(output.block_copies)
        result = ModelRunnerOutput()
        if self.kv_connector is not None:
            result.kv_load_results = self.kv_connector.transfer(output)
        elif output.kv_loads:
            raise RuntimeError("this engine has no KV transport to load blocks with")
        if output.is_empty:
            return result

        step = self.input_batch.prepare(output.num_scheduled_tokens)
        if self.decode_graphs is not None and self.decode_graphs.can_run(step):
            hidden = self.decode_graphs.run(step, self.input_batch.block_table)
        else:
            hidden = self._run_eager(step)

        self._prompt_logprobs(step, hidden, result)
        sampling = [i for i in range(step.num_seqs) if step.samples(i)]
        if sampling:
            rows = [step.query_starts[i] + step.query_lens[i] - 1 for i in sampling]
            logits = self.model.compute_logits(hidden[self._row_selector(rows)])
            self._sample([step.requests[i] for i in sampling], logits, result, grammar_masks)
        return result

    @torch.inference_mode()
    def warm_up(self) -> None:
        """One token through the model and its head, so that what the CPU's batch-invariant
        paths measure on first use (each weight shape's GEMM tiles, the attention padding)
        is measured at start rather than in the first request's time to first token. The
        token's K/V lands in slot 0, which is only read under a -inf mask or after a
        request's own token has replaced it."""
        device = self.device

        def context(prompt_len: int) -> ForwardContext:
            batch = StepBatch(
                query_starts=[0],
                query_lens=[1],
                context_lens=[0],
                block_tables=torch.zeros((1, 1), dtype=torch.int32, device=device),
                num_decodes=1,
                slot_mapping=torch.zeros(1, dtype=torch.int64, device=device),
                prompt_lens=[prompt_len],
            )
            return ForwardContext.for_step(self.backend, self.kv_caches, batch)

        zero = torch.zeros(1, dtype=torch.int64, device=device)
        self.model.compute_logits(self.model(zero, zero, context(0)))  # as a generated token
        if self.splits_prompt_rows:  # and once as a prompt token, for the prompt rows' attention
            self.model(zero, zero, context(1))

    def _row_selector(self, rows: list[int]) -> slice | torch.Tensor:
        """``rows`` of the hidden states as a slice when they run consecutively, as in
        every decode step: an index tensor would be a host-to-device copy the host waits
        on behind the step's kernels, where a slice lets it queue the LM head at once."""
        if rows == list(range(rows[0], rows[0] + len(rows))):
            return slice(rows[0], rows[0] + len(rows))
        return torch.tensor(rows, device=self.device)

    def _graphs_supported(self, kv_cache_dtype: str) -> bool:
        """CUDA graphs need a backend with graph hooks on a GPU, and no host sync in the
        step: an fp8 cache below compute capability 8.9 is written by torch code that syncs,
        and MoE layers with offloaded or quantized experts read their routing on the host
        (only dense resident experts go through the fused kernel)."""
        if self.device.type != "cuda" or not self.backend.supports_cuda_graphs:
            return False
        if routes_on_host(self.model):
            return False
        return kv_cache_dtype != "fp8" or has_fp8_hardware(self.device)

    def _run_eager(self, step: StepInputs) -> torch.Tensor:
        """Any step, launched op by op: the hidden states of every flat row."""
        device = self.device
        positions = torch.from_numpy(step.positions).to(device)
        prompt_lens = [state.num_prompt_tokens for state in step.requests] if self.splits_prompt_rows else None
        batch = StepBatch(
            query_starts=step.query_starts,
            query_lens=step.query_lens,
            context_lens=step.context_lens,
            block_tables=torch.from_numpy(self.input_batch.step_block_table(step)).to(device),
            num_decodes=step.num_decodes,
            slot_mapping=torch.from_numpy(step.slot_mapping).to(device),
            prompt_lens=prompt_lens,
        )
        ctx = ForwardContext.for_step(self.backend, self.kv_caches, batch)
        return self.model(torch.from_numpy(step.input_ids).to(device), positions, ctx)

    def _sample(
        self,
        states: list[RequestState],
        logits: torch.Tensor,
        result: ModelRunnerOutput,
        grammar_masks: Future[GrammarMasks] | None,
    ) -> None:
        batch = self.input_batch
        params: list[SamplingParams] = [s.sampling_params for s in states]
        pairs = list(zip(states, params))
        metadata = SamplingMetadata.build(
            params,
            # Copying out every history each step would cost O(length): only the
            # repetition penalty reads the prompt, and penalties and min_tokens the outputs.
            prompt_token_ids=[
                batch.prompt_token_ids(s).tolist() if p.repetition_penalty != 1.0 else [] for s, p in pairs
            ],
            output_token_ids=[batch.output_token_ids(s) if p.needs_penalties or p.min_tokens else [] for s, p in pairs],
            generators=[self._generator(s.request_id, p) for s, p in pairs],
            stop_token_ids=[s.stop_token_ids for s in states],
            device=self.device,
            grammar=None if grammar_masks is None else self._grammar_rows(states, grammar_masks.result()),
            logit_biases=[self._logit_bias(s.request_id, p) for s, p in pairs],
        )
        sampled = self.sampler(logits, metadata)
        token_ids = sampled.sampled_token_ids.tolist()
        for state, token_id in zip(states, token_ids):
            result.sampled_token_ids[state.request_id] = token_id
        if sampled.logprobs is not None:
            # The sampler fills the three logprob fields together.
            assert sampled.logprob_token_ids is not None and sampled.sampled_ranks is not None
            rows = _rows_to_logprobs(
                sampled.logprob_token_ids, sampled.logprobs, sampled.sampled_ranks, metadata.max_num_logprobs or 0
            )
            for state, p, row in zip(states, params, rows):
                if p.logprobs is not None:
                    result.logprobs[state.request_id] = (row[0][: 1 + p.logprobs], row[1][: 1 + p.logprobs], row[2])

    def _grammar_rows(self, states: list[RequestState], masks: GrammarMasks) -> tuple[torch.Tensor, torch.Tensor]:
        """The sampling rows that have a grammar, and their masks, on the device."""
        rows = [i for i, state in enumerate(states) if state.request_id in masks.rows]
        order = [masks.rows[states[i].request_id] for i in rows]
        bitmask = masks.bitmask if order == list(range(len(masks.rows))) else masks.bitmask[order]
        return torch.tensor(rows, dtype=torch.int64, device=self.device), bitmask.to(self.device)

    def _logit_bias(self, request_id: str, params: SamplingParams) -> LogitBias | None:
        if not params.logit_bias:
            return None
        bias = self.logit_biases.get(request_id)
        if bias is None:
            bias = self.logit_biases[request_id] = LogitBias.build(params.logit_bias, self.device)
        return bias

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

    def _prompt_logprobs(self, step: StepInputs, hidden: torch.Tensor, result: ModelRunnerOutput) -> None:
        """Logprobs of each prompt token given the tokens before it, chunk by chunk."""
        for i, state in enumerate(step.requests):
            num_top = state.sampling_params.prompt_logprobs
            if num_top is None:
                continue
            chunk_start = step.context_lens[i]
            start = max(chunk_start, self.prompt_logprobs_reported.get(state.request_id, 0))
            # Position p's logits score token p + 1; only prompt tokens are scored.
            end = min(chunk_start + step.query_lens[i], state.num_prompt_tokens - 1)
            if end <= start:
                continue
            self.prompt_logprobs_reported[state.request_id] = end
            query_start = step.query_starts[i]
            rows = slice(query_start + start - chunk_start, query_start + end - chunk_start)
            logits = self.model.compute_logits(hidden[rows])
            prompt = self.input_batch.prompt_token_ids(state)
            targets = torch.from_numpy(prompt[start + 1 : end + 1].astype(np.int64)).to(self.device)
            ids, values, ranks = compute_logprobs(logits, targets, num_top)
            result.prompt_logprobs[state.request_id] = _rows_to_logprobs(ids, values, ranks, num_top)

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        for cache in self.kv_caches:
            for tensor in split_kv_cache(cache):
                if tensor is not None:
                    tensor[:, dst] = tensor[:, src]

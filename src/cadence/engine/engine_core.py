"""The engine loop: schedule, execute, update. Usable in-process or behind a transport."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterable
from dataclasses import replace

import torch

from cadence.engine.attention.backend import AttentionSpec
from cadence.engine.core_setup import default_token_budget, generation_eos_ids, kv_connectors, kv_layout_of
from cadence.engine.engine_args import EngineArgs
from cadence.engine.experts.offloaded import offloaded_stats
from cadence.engine.host_memory import keep_freed_heap
from cadence.engine.kv_cache_size import kv_cache_bytes_per_block, resolve_num_blocks
from cadence.engine.kv_connector.scheduler_side import KVEvents
from cadence.engine.kv_connector.worker_side import WorkerSideConnector
from cadence.engine.kv_transfer.layout import KVLayout
from cadence.engine.kv_transfer.source import KVSource
from cadence.engine.loader import load_model
from cadence.engine.model_config import ModelConfig
from cadence.engine.model_runner import ModelRunner, ModelRunnerOutput
from cadence.engine.precision import resolve_precision
from cadence.engine.protocol import EngineCoreOutput, EngineCoreRequest, EngineReady, EngineStats
from cadence.engine.request_checks import check_token_ids
from cadence.engine.step_stats import StepRecorder, StepTimings, mark_first_scheduled
from cadence.engine.structured_output.manager import StructuredOutputManager
from cadence.engine.weights_memory import host_weights_bytes
from cadence.scheduler.output import SchedulerOutput
from cadence.scheduler.remote_kv import KVLoadOutcome, KVPrefilled, KVReservation, RemoteKV
from cadence.scheduler.request import Request, StopConditions
from cadence.scheduler.scheduler import CacheConfig, Scheduler, SchedulerConfig

# Which role an engine needs for a request whose prompt KV crosses engines.
_ROLE_FOR = {RemoteKV.LOAD.value: "decode", RemoteKV.SEND.value: "prefill"}

logger = logging.getLogger(__name__)


class EngineCore:
    """Owns the scheduler and the model runner, and turns steps into per-sequence outputs.

    A request with n > 1 becomes n scheduler requests; the later ones fork the first
    one's prompt KV instead of computing it again.
    """

    def __init__(self, args: EngineArgs) -> None:
        self.args = args
        self.device = args.resolve_device()
        if self.device.type == "cpu":
            keep_freed_heap()
        torch.manual_seed(args.seed)
        config = ModelConfig.from_pretrained(args.model)
        self.eos_token_ids = generation_eos_ids(args.model, config)
        self.vocab_size = config.vocab_size
        # Made first: it starts building llguidance's tokenizer while the model loads.
        self.structured = StructuredOutputManager(
            args.model, self.vocab_size, self.eos_token_ids, args.structured_outputs_compile_timeout
        )
        self.precision = resolve_precision(args.dtype, config, self.device)
        logger.info("%s", self.precision.describe())
        self.dtype = self.precision.activations
        self.model, self.model_config = load_model(
            args.model,
            self.dtype,
            self.device,
            quantization=args.quantization,
            quantize_lm_head=args.quantize_lm_head,
            cpu_kernels=args.cpu_kernels,
            expert_offload=args.expert_offload_options(),
            bf16_dot_linears=self.precision.bf16_dot_linears,
        )
        self.max_model_len = min(args.max_model_len or config.max_position_embeddings, config.max_position_embeddings)
        spec = self.model.attention_spec()
        self.num_kv_blocks = self._num_kv_blocks(config, spec)
        worker_connector, self.kv_connector = kv_connectors(args)
        self.runner = self._build_runner(worker_connector)
        self.scheduler = self._build_scheduler()
        # What a reader checks before loading our blocks, and where a prefill engine's are.
        self.kv_layout: KVLayout | None = None
        self.kv_source: KVSource | None = None
        if worker_connector is not None:
            self.kv_layout = kv_layout_of(args, config, spec, self.dtype, self.precision.name)
            if args.kv_role == "prefill":
                self.kv_source = worker_connector.export(self.kv_layout)
        self._forgotten: dict[str, str] = {}  # scheduler id -> client id, until events are taken
        if self.device.type == "cpu":
            self.runner.warm_up()
        self._failed: dict[str, str] = {}  # client request id -> why its grammar failed, until taken
        self.timings = StepTimings()
        self.step_recorder = StepRecorder(self.scheduler.kv_cache, offloaded_stats(self.model))
        self._arrivals = itertools.count()
        # Scheduler request id -> (client request id, index among its n sequences).
        self._sequences: dict[str, tuple[str, int]] = {}
        self._children: dict[str, list[str]] = {}
        self._num_preemptions = 0

    def _num_kv_blocks(self, config: ModelConfig, spec: AttentionSpec) -> int:
        """The KV cache's blocks: as set, or what the memory left beside the weights holds."""
        args = self.args
        bytes_per_block = (
            kv_cache_bytes_per_block(args, spec.num_kv_heads, spec.head_dim, self.dtype) * config.num_hidden_layers
        )
        return resolve_num_blocks(
            args, self.device, bytes_per_block, self.max_model_len, args.max_num_seqs, host_weights_bytes(self.model)
        )

    def _build_runner(self, worker_connector: WorkerSideConnector | None) -> ModelRunner:
        args = self.args
        return ModelRunner(
            self.model,
            self.num_kv_blocks,
            args.block_size,
            self.dtype,
            self.device,
            args.attention_backend,
            args.kv_cache_dtype,
            enforce_eager=args.enforce_eager,
            max_num_seqs=args.max_num_seqs,
            max_model_len=self.max_model_len,
            batch_invariant=args.batch_invariant,
            kv_connector=worker_connector,
        )

    def _build_scheduler(self) -> Scheduler:
        args = self.args
        return Scheduler(
            SchedulerConfig(
                max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens
                or max(default_token_budget(self.device), args.max_num_seqs),
                max_model_len=self.max_model_len,
                long_prefill_token_threshold=args.long_prefill_token_threshold,
            ),
            # The runner knows whether a token's K/V depends on where its prompt ended.
            CacheConfig(
                self.num_kv_blocks, args.block_size, args.enable_prefix_caching, self.runner.splits_prompt_rows
            ),
            self.kv_connector,
        )

    def ready_message(self) -> EngineReady:
        """What a front end or router must know of this engine before sending it work."""
        return EngineReady(
            max_model_len=self.max_model_len,
            vocab_size=self.vocab_size,
            max_num_seqs=self.args.max_num_seqs,
            device=str(self.device),
            dtype=str(self.dtype).removeprefix("torch."),
            num_kv_blocks=self.num_kv_blocks,
            kv_role=self.args.kv_role,
            kv_layout=self.kv_layout,
            kv_source=self.kv_source,
            kv_wait_timeout=self.args.kv_wait_timeout,
            kv_hold_timeout=self.args.kv_hold_timeout,
            max_num_batched_tokens=self.scheduler.config.max_num_batched_tokens,
            long_prefill_token_threshold=self.scheduler.config.long_prefill_token_threshold,
            block_size=self.args.block_size,
            kv_cache_dtype=self.args.kv_cache_dtype,
            enable_prefix_caching=self.args.enable_prefix_caching,
        )

    def close(self) -> None:
        """Stop exporting KV and release what the transport holds (memory, sockets, agents)."""
        if self.runner.kv_connector is not None:
            self.runner.kv_connector.close()
        self.structured.close()

    # ----- requests ------------------------------------------------------------------
    def validate(self, request: EngineCoreRequest) -> None:
        """Raise ValueError for a request the engine cannot serve, before touching state."""
        check_token_ids(request, self.max_model_len, self.vocab_size)
        if request.remote_kv is not None:
            self._validate_remote_kv(request)
        taken = [i for i in self._sequence_ids(request) if i in self._sequences]
        if request.request_id in self._children or taken:
            raise ValueError(f"request id {request.request_id!r} is already in use")

    def _validate_remote_kv(self, request: EngineCoreRequest) -> None:
        role = _ROLE_FOR.get(request.remote_kv or "")
        if role is None:
            raise ValueError(f"remote_kv must be one of {', '.join(_ROLE_FOR)}, got {request.remote_kv!r}")
        if self.args.kv_role != role:
            raise ValueError(f"a {request.remote_kv!r} request needs a {role} engine; this one is {self.args.kv_role}")
        if request.sampling_params.prompt_logprobs is not None:
            raise ValueError("prompt logprobs need the whole prompt computed on the engine that serves it")
        if request.remote_kv == RemoteKV.SEND.value and (
            request.sampling_params.n != 1 or len(request.prompt_token_ids) < 2
        ):
            raise ValueError("a prompt computed for another engine needs n=1 and at least two tokens")

    @staticmethod
    def _sequence_ids(request: EngineCoreRequest) -> list[str]:
        """The scheduler ids of a request's n sequences."""
        if request.sampling_params.n == 1:
            return [request.request_id]
        return [f"{request.request_id}#{i}" for i in range(request.sampling_params.n)]

    def add_request(self, request: EngineCoreRequest) -> None:
        self.validate(request)
        params = request.sampling_params
        room = self.max_model_len - len(request.prompt_token_ids)
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)
        stop = StopConditions(
            max_tokens=max(1, min(params.max_tokens or room, room)),
            min_tokens=params.min_tokens,
            stop_token_ids=frozenset(stop_ids),
        )
        ids = self._sequence_ids(request)
        self._children[request.request_id] = ids
        sequences = []
        for index, sub_id in enumerate(ids):
            self._sequences[sub_id] = (request.request_id, index)
            child_params = params
            if index:
                # Seeded siblings must not draw the same samples, and only the first
                # sequence scores the prompt they share.
                seed = None if params.seed is None else params.seed + index
                child_params = replace(params, seed=seed, prompt_logprobs=None)
            sequences.append(
                Request(
                    request_id=sub_id,
                    prompt_token_ids=list(request.prompt_token_ids),
                    stop=stop,
                    arrival_seq=next(self._arrivals),
                    priority=request.priority,
                    sampling_params=child_params,
                    fork_parent_id=ids[0] if index else None,
                    client_request_id=request.request_id,
                    skip_prefix_cache=child_params.prompt_logprobs is not None,
                    # Only the first sequence loads; the others fork its prompt as usual.
                    remote_kv=RemoteKV(request.remote_kv) if request.remote_kv and not index else None,
                )
            )
        # A prompt computed for another engine samples nothing here: it needs no grammar.
        constrained = params.structured_outputs is not None and request.remote_kv != RemoteKV.SEND.value
        if constrained and not self.structured.hold(request.request_id, sequences):
            return  # scheduled once its grammar is compiled (`_admit_compiled`)
        for sequence in sequences:
            self.scheduler.add_request(sequence)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Abort whole requests by their id, or single sequences by (id, index) name."""
        sub_ids: list[str] = []
        for request_id in request_ids:
            for held in self.structured.drop(request_id):  # still waiting for its grammar
                self._forget(held.request_id)
            sub_ids.extend(self._children.get(request_id, [request_id]))
        for request in self.scheduler.abort_requests(sub_ids):
            self._forget(request.request_id)

    def has_sequence(self, request_id: str, index: int) -> bool:
        """Whether sequence `index` of a request is still scheduled."""
        ids = self._children.get(request_id)
        return ids is not None and index < len(ids) and ids[index] in self._sequences

    def sequence_id(self, request_id: str, index: int) -> str:
        """The name under which sequence `index` of a request is scheduled."""
        return self._children[request_id][index]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self.structured.num_held > 0

    def has_work(self) -> bool:
        """Whether `step` would do anything (parked and held prompt KV, and requests whose
        grammar is still compiling, only wait)."""
        return self.scheduler.has_work() or self.structured.has_ready()

    def take_failed_requests(self) -> dict[str, str]:
        """Client requests ended since the last call because their grammar did not
        compile (or not in time), or refused a token: request id -> why. Their sequences
        are aborted; a front end ends their streams with the error."""
        failed, self._failed = self._failed, {}
        return failed

    def _admit_compiled(self) -> None:
        """Schedule the sequences whose grammar is ready; fail those whose grammar is not coming."""
        ready, failed = self.structured.take_ready()
        for sequence in ready:
            self.scheduler.add_request(sequence)
        for request_id, (reason, sequences) in failed.items():
            for sequence in sequences:  # never scheduled: only the engine's records of them
                self._forget(sequence.request_id)
            self._failed[request_id] = reason

    def _fail(self, request_id: str, reason: str) -> None:
        self._failed[request_id] = reason
        self.abort_requests([request_id])

    # ----- prompt KV across engines (engine/kv_connector/), by client request id ---------
    @property
    def num_expired_kv(self) -> int:
        """Waits for KV and holds of KV that ran out of time."""
        return 0 if self.kv_connector is None else self.kv_connector.num_expired_kv

    def start_kv_load(self, request_id: str, source: KVSource, block_ids: list[int]) -> None:
        """Load a parked request's prompt KV from a prefill engine's `block_ids`. KV laid
        out differently is never read: the request computes its prompt here instead.
        A request no longer parked (aborted, or its wait ended) ignores it."""
        sub_id = self._first_sequence(request_id)
        connector = self.kv_connector
        if sub_id is None or connector is None or sub_id not in connector.awaiting_kv:
            return
        assert self.kv_layout is not None  # a parked request implies the decode role
        mismatch = self.kv_layout.mismatch(source.layout)
        if mismatch is not None:
            connector.cancel_kv_wait(sub_id, mismatch)
        else:
            connector.start_kv_load(sub_id, source, block_ids)

    def cancel_kv_wait(self, request_ids: Iterable[str], reason: str, chunk_tokens: int = 0) -> None:
        """Stop waiting for these requests' KV (their prefill engine is gone, or the router
        placed them here): each computes what did not arrive here, `chunk_tokens` at most
        a step when that is set."""
        if self.kv_connector is None:
            return
        for request_id in request_ids:
            sub_id = self._first_sequence(request_id)
            if sub_id is not None:
                self.kv_connector.cancel_kv_wait(sub_id, reason, chunk_tokens)

    def extend_kv_wait(self, request_ids: Iterable[str]) -> None:
        """Wait `kv_wait_timeout` more from now for these parked requests' KV."""
        if self.kv_connector is None:
            return
        sub_ids = [self._first_sequence(request_id) for request_id in request_ids]
        self.kv_connector.extend_kv_wait(sub_id for sub_id in sub_ids if sub_id is not None)

    def release_sent_kv(self, request_ids: Iterable[str]) -> None:
        """The readers of these prompts' KV are done (or gone): free the blocks."""
        if self.kv_connector is None:
            return
        for request in self.kv_connector.release_sent_kv(list(request_ids)):
            self._forget(request.request_id)

    def take_kv_events(self) -> KVEvents:
        """What happened to prompt KV since the last call, by client request id."""
        if self.kv_connector is None:
            return KVEvents([], [], [])
        events = self.kv_connector.take_kv_events()
        named: list[KVReservation | KVPrefilled | KVLoadOutcome] = [*events.reserved, *events.prefilled, *events.loaded]
        for event in named:
            sequence = self._sequences.get(event.request_id)
            event.request_id = sequence[0] if sequence is not None else self._forgotten[event.request_id]
        self._forgotten.clear()
        return events

    def expire_kv_deadlines(self) -> bool:
        """End waits for KV that never came, and release KV no reader said it was done
        with. Whether anything expired."""
        if self.kv_connector is None:
            return False
        expired_before = self.kv_connector.num_expired_kv
        for request in self.kv_connector.expire_kv_deadlines():
            self._forget(request.request_id)
        return self.kv_connector.num_expired_kv > expired_before

    def next_kv_deadline(self) -> float | None:
        """When the earliest wait for, or hold of, prompt KV ends (time.monotonic)."""
        return None if self.kv_connector is None else self.kv_connector.next_kv_deadline()

    def _first_sequence(self, request_id: str) -> str | None:
        ids = self._children.get(request_id)
        return ids[0] if ids else None

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting) + self.structured.num_held,
            kv_cache_usage=self.scheduler.kv_cache.usage,
            num_preemptions=self._num_preemptions,
            num_steps=self.timings.num_steps,
            num_waiting_for_kv=0 if self.kv_connector is None else len(self.kv_connector.awaiting_kv),
            num_holding_kv=0 if self.kv_connector is None else len(self.kv_connector.held_kv),
            num_computed_tokens=self.timings.num_computed_tokens,
            num_sampled_tokens=self.timings.num_sampled_tokens,
            busy_seconds=self.timings.schedule + self.timings.execute + self.timings.update,
            num_expired_kv=self.num_expired_kv,
            num_chunk_steps=self.timings.num_chunk_steps,
            chunk_step_seconds=self.timings.chunk_step_seconds,
            num_chunk_tokens=self.timings.num_chunk_tokens,
        )

    # ----- the loop ------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        """Run one scheduling step and report what each sequence gained."""
        if self.kv_connector is not None and self.kv_connector.deadlines:
            self.expire_kv_deadlines()
        start = time.perf_counter()
        self._admit_compiled()
        scheduler_output = self.scheduler.schedule()
        mark_first_scheduled(scheduler_output, self.scheduler.requests)
        scheduled_at = time.perf_counter()
        # The constrained sequences' masks are filled while the forward pass runs.
        masks = self.structured.start_masks(self._sampling(scheduler_output)) if self.structured.matchers else None
        runner_output = self.runner.execute(scheduler_output, masks)
        if masks is not None:
            masks.result()  # the matchers are the engine's again
        executed_at = time.perf_counter()
        outputs = self._update(scheduler_output, runner_output)
        if runner_output.kv_load_results:
            assert self.kv_connector is not None  # only a connector's worker half reports loads
            self.kv_connector.finish_kv_loads(runner_output.kv_load_results)
        done = time.perf_counter()
        self._num_preemptions += len(scheduler_output.preempted_request_ids)
        t = self.timings
        t.schedule += scheduled_at - start
        t.execute += executed_at - scheduled_at
        t.update += done - executed_at
        t.num_steps += 1
        if not scheduler_output.is_empty:
            self.step_recorder.record(done - start, scheduler_output)
        t.num_computed_tokens += scheduler_output.num_batched_tokens
        t.num_sampled_tokens += len(runner_output.sampled_token_ids)
        beyond_one_each = scheduler_output.num_batched_tokens - len(scheduler_output.num_scheduled_tokens)
        if beyond_one_each > 0:
            t.num_chunk_steps += 1
            t.chunk_step_seconds += done - start
            t.num_chunk_tokens += beyond_one_each
        return outputs

    def _sampling(self, scheduler_output: SchedulerOutput) -> list[Request]:
        """The scheduled sequences that sample a token this step (their chunk ends their tokens)."""
        requests = self.scheduler.requests
        return [
            request
            for request_id, num_new in scheduler_output.num_scheduled_tokens.items()
            if (request := requests[request_id]).num_computed_tokens + num_new == request.num_tokens
        ]

    def _update(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        sampled = runner_output.sampled_token_ids
        stopped: set[str] = set()
        complete: set[str] = set()  # ended by their grammar, on a text token
        refused: dict[str, str] = {}
        if self.structured.matchers:
            stopped, complete, refused = self.structured.advance(sampled, self.scheduler.requests)
        finished = {f.request.request_id: f for f in self.scheduler.update(scheduler_output, sampled, stopped)}
        outputs = []
        for sub_id in scheduler_output.num_scheduled_tokens:
            token_id = runner_output.sampled_token_ids.get(sub_id)
            prompt_logprobs = runner_output.prompt_logprobs.get(sub_id)
            if (token_id is None and prompt_logprobs is None) or sub_id not in self._sequences:
                continue  # nothing new, or aborted while the step ran
            request_id, index = self._sequences[sub_id]
            logprobs = runner_output.logprobs.get(sub_id)
            end = finished.get(sub_id)
            request = self.scheduler.requests[sub_id] if end is None else end.request
            first = token_id is not None and request.num_output_tokens == 1  # carries its engine times
            stop_reason = None
            # Like vLLM, EOS ends a request with no stop reason; a user's stop id is named.
            if end is not None and request.stop_token_id in request.sampling_params.stop_token_ids:
                stop_reason = request.stop_token_id
            outputs.append(
                EngineCoreOutput(
                    request_id=request_id,
                    index=index,
                    new_token_ids=[] if token_id is None else [token_id],
                    new_logprobs=None if logprobs is None else [logprobs],
                    new_prompt_logprobs=prompt_logprobs,
                    finish_reason=None if end is None else end.status.finish_reason,
                    stop_reason=stop_reason,
                    num_cached_tokens=request.num_cached_tokens,
                    queued_at=request.queued_at if first else 0.0,
                    scheduled_at=request.scheduled_at if first else 0.0,
                    completed_grammar=sub_id in complete,
                )
            )
            if end is not None:
                self._forget(sub_id)
        for sub_id, reason in refused.items():
            if sub_id in self._sequences:
                self._fail(self._sequences[sub_id][0], f"the output left its grammar: {reason}")
        return outputs

    def _forget(self, sub_id: str) -> None:
        self.structured.forget(sub_id)
        request_id, _ = self._sequences.pop(sub_id)
        if self.kv_connector is not None:  # its KV events, not taken yet, still name it
            self._forgotten[sub_id] = request_id
        siblings = self._children[request_id]
        if not any(s in self._sequences for s in siblings):
            del self._children[request_id]

"""The model runner's own copy of the requests it runs, kept up to date from step deltas.

Each request the runner holds gets a row of two preallocated host arrays: its token ids
(`[max_num_seqs, max_model_len]` int32) and its block table (`[max_num_seqs, max_blocks]`
int32, zero past its blocks). A `SchedulerOutput` only appends to rows and swaps single
block ids in them, so keeping the rows current costs what changed, never the blocks held.
Each step's flat batch is then gathered out of the rows with numpy indexing, in the
runner's order: decodes first, shortest context first (the attention backends batch
decodes of similar length together); its block table is one numpy copy of the step's rows
as wide as the widest. Eager steps and the decode graphs both read it. The arrays are
allocated but untouched (so uncommitted) past what requests use.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cadence.engine.sampling_params import SamplingParams
from cadence.scheduler.output import CachedRequestData, NewRequestData, SchedulerOutput


@dataclass(slots=True)
class RequestState:
    """What the runner knows of one request; its tokens and blocks live in row `row`."""

    request_id: str
    row: int
    num_prompt_tokens: int
    num_tokens: int
    num_blocks: int
    num_computed_tokens: int  # where the latest scheduled step's tokens start
    sampling_params: SamplingParams
    stop_token_ids: frozenset[int]


@dataclass
class StepInputs:
    """One step's flat batch on the host, sequences in the runner's order.

    Sequence i adds `query_lens[i]` tokens from position `context_lens[i]`; they sit at
    `query_starts[i]` in the flat arrays. The first `num_decodes` sequences add one token.
    """

    requests: list[RequestState]
    rows: np.ndarray  # [S] int64: each sequence's row in the input batch
    query_starts: list[int]
    query_lens: list[int]
    context_lens: list[int]
    num_decodes: int
    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64: block id * block_size + offset
    num_blocks: int  # the most blocks any sequence of the step holds

    @property
    def num_seqs(self) -> int:
        return len(self.requests)

    def samples(self, i: int) -> bool:
        """Whether sequence i's chunk reaches the end of its known tokens (a token is sampled)."""
        return self.context_lens[i] + self.query_lens[i] == self.requests[i].num_tokens


class InputBatch:
    """The requests the runner holds, one row each, and each step's batch gathered from them."""

    def __init__(self, max_num_seqs: int, max_model_len: int, block_size: int) -> None:
        self.block_size = block_size
        self.max_blocks = -(-max_model_len // block_size)
        self.token_ids = np.zeros((max_num_seqs, max_model_len), dtype=np.int32)
        self.block_table = np.zeros((max_num_seqs, self.max_blocks), dtype=np.int32)
        self.requests: dict[str, RequestState] = {}
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))  # popped from the end: row 0 first

    def apply(self, output: SchedulerOutput) -> None:
        """Bring the rows up to date with a step's changes: drops, then arrivals, then deltas."""
        for request_id in output.finished_request_ids:
            self.remove(request_id)
        for request_id in output.preempted_request_ids:
            self.remove(request_id)
        for new in output.new_requests:
            self.add(new)
        for cached in output.cached_requests:
            self.update(cached)

    def add(self, new: NewRequestData) -> None:
        if new.request_id in self.requests:
            raise ValueError(f"request {new.request_id!r} is already in the input batch")
        if not self._free_rows:
            raise RuntimeError(f"more than {self.token_ids.shape[0]} requests at once (max_num_seqs)")
        row = self._free_rows.pop()
        num_tokens, num_blocks = len(new.token_ids), len(new.block_ids)
        self.token_ids[row, :num_tokens] = new.token_ids
        self.block_table[row, :num_blocks] = new.block_ids
        self.requests[new.request_id] = RequestState(
            new.request_id,
            row,
            new.num_prompt_tokens,
            num_tokens,
            num_blocks,
            new.num_computed_tokens,
            new.sampling_params,
            frozenset(new.stop_token_ids),
        )

    def update(self, cached: CachedRequestData) -> None:
        state = self.requests[cached.request_id]
        row = state.row
        new_tokens = cached.new_token_ids
        if len(new_tokens) == 1:  # every decode: a scalar store costs far less than a slice
            self.token_ids[row, state.num_tokens] = new_tokens[0]
        elif new_tokens:
            self.token_ids[row, state.num_tokens : state.num_tokens + len(new_tokens)] = new_tokens
        state.num_tokens += len(new_tokens)
        if cached.new_block_ids:
            count = len(cached.new_block_ids)
            self.block_table[row, state.num_blocks : state.num_blocks + count] = cached.new_block_ids
            state.num_blocks += count
        for index, block_id in cached.replaced_blocks:
            self.block_table[row, index] = block_id
        state.num_computed_tokens = cached.num_computed_tokens

    def remove(self, request_id: str) -> None:
        """Forget a request (unknown ids are ignored: it may have ended before it ran)."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return
        # Entries past a row's blocks stay 0, so a padded read of the table finds block 0.
        self.block_table[state.row, : state.num_blocks] = 0
        self._free_rows.append(state.row)

    def prepare(self, num_scheduled_tokens: dict[str, int]) -> StepInputs:
        """The step's flat batch: decodes first, shortest context first."""
        scheduled = [(self.requests[request_id], n) for request_id, n in num_scheduled_tokens.items()]
        scheduled.sort(key=lambda pair: (pair[1] != 1, pair[0].num_computed_tokens))
        states = [state for state, _ in scheduled]
        query_lens = [n for _, n in scheduled]
        context_lens = [state.num_computed_tokens for state in states]
        rows = np.array([state.row for state in states], dtype=np.int64)
        num_decodes = query_lens.count(1)
        if num_decodes == len(states):
            query_starts = list(range(len(states)))
            token_rows = rows
            positions = np.array(context_lens, dtype=np.int64)
        else:
            lens = np.array(query_lens, dtype=np.int64)
            ends = np.cumsum(lens)
            query_starts = (ends - lens).tolist()
            seq_of_token = np.repeat(np.arange(len(states)), lens)
            token_rows = rows[seq_of_token]
            offsets = np.array(context_lens, dtype=np.int64) - (ends - lens)
            positions = np.arange(int(ends[-1]), dtype=np.int64) + offsets[seq_of_token]
        block_index, offset = np.divmod(positions, self.block_size)
        slot_mapping = self.block_table[token_rows, block_index].astype(np.int64) * self.block_size + offset
        return StepInputs(
            requests=states,
            rows=rows,
            query_starts=query_starts,
            query_lens=query_lens,
            context_lens=context_lens,
            num_decodes=num_decodes,
            input_ids=self.token_ids[token_rows, positions].astype(np.int64),
            positions=positions,
            slot_mapping=slot_mapping,
            num_blocks=max(state.num_blocks for state in states),
        )

    def step_block_table(self, step: StepInputs) -> np.ndarray:
        """The step's block table, int32 `[num_seqs, step.num_blocks]`, zero-padded."""
        return self.block_table[step.rows, : step.num_blocks]

    def prompt_token_ids(self, state: RequestState) -> np.ndarray:
        return self.token_ids[state.row, : state.num_prompt_tokens]

    def output_token_ids(self, state: RequestState) -> list[int]:
        return self.token_ids[state.row, state.num_prompt_tokens : state.num_tokens].tolist()

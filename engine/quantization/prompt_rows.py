"""Which of a step's token rows hold prompt tokens, for layers that run those on a kernel of their own.

On CPU the kernel that reads the fewest weight bytes (int4 ``packed``) wins a decode step,
and a GEMM on a half-precision copy (``bf16``) wins a prefill chunk by far. A layer must
not pick between them by the step's batch size, or a row's bits would follow its batch.
It may pick by what the row is: a prompt token's row always runs the prompt kernel, a
generated token's row the other, whatever else the step holds. A token is a prompt token
by its position alone (below the request's prompt length), so a recomputed request, a
chunked prompt and a prompt alone all give each row the kernel it had before.

The model runner states the step's rows (``step_rows``) around the forward pass; a layer
whose plan splits reads them (``current``) and runs each run of rows on its kernel.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass


@dataclass(frozen=True)
class RowRuns:
    """The step's ``num_rows`` token rows as runs ``(start, stop, is_prompt)``, in order."""

    num_rows: int
    runs: tuple[tuple[int, int, bool], ...]


def row_runs(context_lens: Sequence[int], query_lens: Sequence[int], prompt_lens: Sequence[int]) -> RowRuns:
    """The runs of a step whose sequence ``i`` adds ``query_lens[i]`` rows from position
    ``context_lens[i]`` and has ``prompt_lens[i]`` prompt tokens; sequences lie one after
    another in the rows, and neighbouring runs of one kind merge."""
    runs: list[tuple[int, int, bool]] = []
    row = 0
    for start, count, prompt in zip(context_lens, query_lens, prompt_lens):
        prompt_rows = min(max(prompt - start, 0), count)
        for length, is_prompt in ((prompt_rows, True), (count - prompt_rows, False)):
            if not length:
                continue
            if runs and runs[-1][2] == is_prompt:
                runs[-1] = (runs[-1][0], row + length, is_prompt)
            else:
                runs.append((row, row + length, is_prompt))
            row += length
    return RowRuns(row, tuple(runs))


# Per thread (and task): two engines of one process may step in two threads.
_current: ContextVar[RowRuns | None] = ContextVar("step_rows", default=None)


def current() -> RowRuns | None:
    """The rows of the forward pass under way, if the runner stated them."""
    return _current.get()


@contextmanager
def step_rows(rows: RowRuns) -> Iterator[None]:
    """State ``rows`` for the forward pass run inside."""
    token = _current.set(rows)
    try:
        yield
    finally:
        _current.reset(token)

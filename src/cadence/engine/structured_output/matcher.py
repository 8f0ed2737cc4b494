"""One sequence's grammar state: which tokens may come next, advanced token by token.

The interface is what decoding and speculative decoding need, over llguidance's LLMatcher:

* `accept(tokens)` consumes tokens; a token the grammar refuses puts the matcher in its
  error state for good (`is_error`, `error`), so a caller that is not sure (a draft)
  asks `num_valid(tokens)` first;
* `rollback(n)` undoes the last n accepted tokens, any n up to `num_accepted`, so a
  verifier can take back rejected draft tokens; the mask afterwards is the one before
  they were accepted;
* `is_terminated` once the grammar is complete and allows nothing but EOS;
* `fill_bitmasks(executor, matchers, bitmask)` writes each one's next-token mask into its
  row of an int32 bitmask, the matchers in parallel (how the engine fills a step's masks).

EOS accepted after termination changes nothing in llguidance, but counts here as an
accepted token like any other, so `rollback` counts what `accept` counted.
"""

from __future__ import annotations

from collections.abc import Sequence

import llguidance
import torch


class GrammarMatcher:
    """A sequence's grammar state (one llguidance matcher, never shared between sequences)."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._matcher = matcher
        self._num_accepted = 0
        # Tokens accepted after termination (EOS), which llguidance does not record.
        self._num_after_termination = 0

    @property
    def num_accepted(self) -> int:
        """Tokens accepted so far (and not rolled back)."""
        return self._num_accepted

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete: only EOS may follow."""
        return self._matcher.is_stopped() and not self._matcher.is_error()

    @property
    def is_error(self) -> bool:
        return self._matcher.is_error()

    @property
    def error(self) -> str:
        """Why the matcher failed ('' when it has not)."""
        return self._matcher.get_error() if self._matcher.is_error() else ""

    def num_valid(self, token_ids: Sequence[int]) -> int:
        """How many of `token_ids`, in order, the grammar would accept now (none consumed)."""
        return self._matcher.validate_tokens(list(token_ids))

    def accept(self, token_ids: Sequence[int]) -> bool:
        """Consume `token_ids` in order. False when the grammar refused one (or had failed
        before): the matcher is then in its error state, and stays there."""
        for token_id in token_ids:
            terminated = self.is_terminated
            if not self._matcher.consume_token(token_id):
                return False
            self._num_accepted += 1
            if terminated:
                self._num_after_termination += 1
        return True

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (0 <= num_tokens <= num_accepted)."""
        if not 0 <= num_tokens <= self._num_accepted:
            raise ValueError(f"cannot roll back {num_tokens} tokens of {self._num_accepted} accepted")
        after = min(num_tokens, self._num_after_termination)
        self._num_after_termination -= after
        if num_tokens > after and not self._matcher.rollback(num_tokens - after):
            raise RuntimeError(f"the grammar could not roll back: {self._matcher.get_error()}")
        self._num_accepted -= num_tokens


def fill_bitmasks(executor: llguidance.LLExecutor, matchers: Sequence[GrammarMatcher], bitmask: torch.Tensor) -> None:
    """Write matcher i's next-token mask into row i of `bitmask`: a contiguous CPU int32
    tensor [len(matchers), ceil(vocab / 32)] (bit t % 32 of word t // 32 allows token t),
    the matchers in parallel on `executor`'s threads."""
    if bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or not bitmask.is_contiguous():
        raise ValueError("a bitmask is a contiguous CPU int32 tensor")
    if bitmask.dim() != 2 or bitmask.shape[0] != len(matchers):
        raise ValueError(f"a bitmask for {len(matchers)} matchers has {len(matchers)} rows, not {bitmask.shape[0]}")
    row_bytes = bitmask.shape[1] * bitmask.element_size()
    # Each matcher is one sequence's own, never shared, so the rows fill independently.
    rows = [(matcher._matcher, i) for i, matcher in enumerate(matchers)]
    executor.unsafe_compute_mask_ptr(rows, bitmask.data_ptr(), row_bytes, len(matchers))

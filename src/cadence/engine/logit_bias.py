"""OpenAI's logit_bias on one row of logits, prepared once per request.

-100 bans a token; +100 makes the +100 tokens the only ones the row may sample; values in
between are added to their tokens' logits. The tensors are built when a request first
samples and kept for its life (the runner caches them by request id), so a step costs a
few tensor operations per biased row, however many tokens it biases. A row's grammar
mask comes first and wins: where the bias would leave no token the grammar allows, the
row keeps the grammar's choice alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BAN = -100.0
EXCLUSIVE = 100.0


@dataclass(frozen=True)
class LogitBias:
    """One request's logit_bias as tensors on the sampling device."""

    added_ids: torch.Tensor | None  # [A] int64 tokens whose bias is added
    added_values: torch.Tensor | None  # [A] float32
    banned_ids: torch.Tensor | None  # [N] int64
    exclusive_ids: torch.Tensor | None  # [X] int64: when set, the only tokens left

    @classmethod
    def build(cls, bias: dict[int, float], device: torch.device) -> LogitBias:
        def ids(tokens: list[int]) -> torch.Tensor | None:
            return torch.tensor(tokens, dtype=torch.int64, device=device) if tokens else None

        added = {t: v for t, v in bias.items() if BAN < v < EXCLUSIVE}
        return cls(
            added_ids=ids(list(added)),
            added_values=torch.tensor(list(added.values()), dtype=torch.float32, device=device) if added else None,
            banned_ids=ids([t for t, v in bias.items() if v <= BAN]),
            exclusive_ids=ids([t for t, v in bias.items() if v >= EXCLUSIVE]),
        )

    def apply(self, row: torch.Tensor) -> None:
        """In place on one float32 row of logits [V]."""
        narrows = self.banned_ids is not None or self.exclusive_ids is not None
        before = row.clone() if narrows else None
        if self.added_ids is not None and self.added_values is not None:
            row.index_add_(0, self.added_ids, self.added_values)
        if self.banned_ids is not None:
            row.index_fill_(0, self.banned_ids, float("-inf"))
        if self.exclusive_ids is not None:
            kept = row[self.exclusive_ids]
            row.fill_(float("-inf")).index_copy_(0, self.exclusive_ids, kept)
        if before is not None:
            # Nothing left (the grammar allows none of the tokens left): the unbiased row.
            # Chosen on the device, so no step waits for it.
            row.copy_(torch.where(row.amax() == float("-inf"), before, row))

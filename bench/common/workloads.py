"""The benchmark's scenarios: seeded random token-id prompts and per-prompt output lengths."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    max_tokens: list[int]
    description: str

    @property
    def useful_tokens(self) -> int:
        """Output tokens the prompts ask for: the only ones either engine gets credit for."""
        return sum(self.max_tokens)


def make_workload(name: str, num_prompts: int, vocab_size: int, quick: bool, seed: int = 1234) -> Workload:
    """`equal`: same prompt and output length for all; `mixed`: both drawn at random."""
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        # Avoid id 0 (pad/eos in these configs), so a prompt never looks padded.
        return [rng.randrange(1, vocab_size) for _ in range(n)]

    if name == "equal":
        plen, out = (32, 16) if quick else (128, 64)
        return Workload(
            name,
            [ids(plen) for _ in range(num_prompts)],
            [out] * num_prompts,
            f"{num_prompts} prompts x {plen} random token ids, {out} output tokens each",
        )
    if name == "mixed":
        (plo, phi), (olo, ohi) = ((8, 64), (4, 32)) if quick else ((16, 512), (16, 256))
        lens = [rng.randint(plo, phi) for _ in range(num_prompts)]
        outs = [rng.randint(olo, ohi) for _ in range(num_prompts)]
        return Workload(
            name,
            [ids(n) for n in lens],
            outs,
            f"{num_prompts} prompts, lengths uniform in {plo}-{phi}, max_tokens uniform in {olo}-{ohi} "
            f"(seed {seed}; prompt tokens {sum(lens)}, requested output tokens {sum(outs)})",
        )
    raise ValueError(name)

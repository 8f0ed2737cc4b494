"""How much one API call may ask of the engine: `--max-n-sequences` and
`--max-request-output-tokens`.

Fair scheduling (scheduler/fair_share.py) keeps one request's n sequences from starving
the others; these caps bound how much work one call can queue at all. They are server
options, like `--max-waiting`: they protect a shared server from its clients, while an
`LLM(...)` caller owns its engine.
"""

from __future__ import annotations

from dataclasses import dataclass

from cadence.server.errors import bad_request

# vLLM caps n at VLLM_MAX_N_SEQUENCES (16384, an environment variable). 128 is OpenAI's
# own limit for chat, and the one Cadence has always had.
DEFAULT_MAX_N_SEQUENCES = 128
# vLLM has no cap on n x max_tokens. 65,536 still lets one sequence fill a 64k context, 16
# sequences have 4,096 tokens each and 128 sequences 512 each.
DEFAULT_MAX_REQUEST_OUTPUT_TOKENS = 65536


@dataclass(frozen=True)
class RequestLimits:
    """The most sequences (n) and generated tokens (n x max_tokens, over all its prompts)
    one call may ask for."""

    max_n_sequences: int = DEFAULT_MAX_N_SEQUENCES
    max_request_output_tokens: int = DEFAULT_MAX_REQUEST_OUTPUT_TOKENS

    def __post_init__(self) -> None:
        if self.max_n_sequences < 1 or self.max_request_output_tokens < 1:
            raise ValueError(f"request limits must be at least 1: {self}")

    def tokens_per_sequence(self, n: int, num_prompts: int, requested: int | None, param: str) -> int:
        """The most tokens each of a call's n x `num_prompts` sequences may generate. A
        `requested` max_tokens (named `param` in the call) above it is refused with a
        400; a call that names none gets at most this many."""
        if n > self.max_n_sequences:
            raise bad_request(f"n must be at most {self.max_n_sequences} on this server, got {n}", "n")
        num_sequences = n * num_prompts
        most = self.max_request_output_tokens // num_sequences
        if most < 1:
            raise bad_request(
                f"this request has {num_sequences} sequences; this server generates at most "
                f"{self.max_request_output_tokens} tokens for one request",
                "n",
            )
        if requested is not None and requested > most:
            prompts = f" x {num_prompts} prompts" if num_prompts > 1 else ""
            raise bad_request(
                f"this request may generate {requested * num_sequences} tokens (n={n} x {param}={requested}"
                f"{prompts}), more than the {self.max_request_output_tokens} this server allows one "
                f"request; lower {param} or n",
                param,
            )
        return most

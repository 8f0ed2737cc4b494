"""The token ids of a request that the engine refuses before it touches any state."""

from __future__ import annotations

from cadence.engine.protocol import EngineCoreRequest


def check_token_ids(request: EngineCoreRequest, max_model_len: int, vocab_size: int) -> None:
    """ValueError for an empty or too long prompt, or a token id outside the vocabulary
    in the prompt, the stop token ids or logit_bias."""
    tokens = request.prompt_token_ids
    if not tokens:
        raise ValueError("the prompt is empty")
    if len(tokens) > max_model_len:
        raise ValueError(f"the prompt has {len(tokens)} tokens, more than max_model_len={max_model_len}")
    bad = next((t for t in tokens if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab_size})")
    params = request.sampling_params
    # Ids past the vocabulary can never be sampled, and the sampler's masks and biases
    # would index with them.
    bad_stop = next((t for t in params.stop_token_ids if not 0 <= t < vocab_size), None)
    if bad_stop is not None:
        raise ValueError(f"stop token id {bad_stop} is outside the vocabulary [0, {vocab_size})")
    bad_bias = next((t for t in params.logit_bias or {} if not 0 <= t < vocab_size), None)
    if bad_bias is not None:
        raise ValueError(f"logit_bias token id {bad_bias} is outside the vocabulary [0, {vocab_size})")

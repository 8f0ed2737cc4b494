"""Logprobs in the two shapes OpenAI uses (legacy completions and chat), and prompt
logprobs in vLLM's."""

from __future__ import annotations

from collections.abc import Callable

from cadence.engine.outputs import Logprob, PositionLogprobs
from cadence.openai_schema.responses import ChatLogprob, CompletionLogprobs, PromptLogprob, PromptLogprobs, TopLogprob


def _token_text(entry: Logprob) -> str:
    return entry.decoded_token or ""


def completion_logprobs(
    token_ids: list[int],
    positions: list[PositionLogprobs | None],
    text_offset: int,
    token_text: Callable[[int], str],
) -> tuple[CompletionLogprobs, int]:
    """`{tokens, token_logprobs, top_logprobs, text_offset}` and the offset after them.

    A position without logprobs (the first prompt token, when echoed) gets None, as in
    OpenAI's answers, and `token_text` names its token. `top_logprobs` holds the chosen
    token and the top alternatives.
    """
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for token_id, position in zip(token_ids, positions):
        offsets.append(text_offset)
        if position is None:
            text = token_text(token_id)
            tokens.append(text)
            token_logprobs.append(None)
            top_logprobs.append(None)
            text_offset += len(text)
            continue
        chosen = position[token_id]
        text = _token_text(chosen)
        tokens.append(text)
        token_logprobs.append(chosen.logprob)
        top_logprobs.append({_token_text(e): e.logprob for e in position.values()})
        text_offset += len(text)
    body = CompletionLogprobs(
        tokens=tokens, token_logprobs=token_logprobs, top_logprobs=top_logprobs, text_offset=offsets
    )
    return body, text_offset


def _top_entry(entry: Logprob) -> TopLogprob:
    text = _token_text(entry)
    return TopLogprob(token=text, logprob=entry.logprob, bytes=list(text.encode("utf-8")))


def chat_logprobs(token_ids: list[int], positions: list[PositionLogprobs], top_n: int) -> list[ChatLogprob]:
    """The `content` list of a chat choice's logprobs: each token with its top `top_n`."""
    content = []
    for token_id, position in zip(token_ids, positions):
        ranked = sorted(
            ((e.rank, e) for e in position.values() if e.rank is not None and e.rank <= top_n), key=lambda pair: pair[0]
        )
        chosen = _token_text(position[token_id])
        content.append(
            ChatLogprob(
                token=chosen,
                logprob=position[token_id].logprob,
                bytes=list(chosen.encode("utf-8")),
                top_logprobs=[_top_entry(e) for _, e in ranked[:top_n]],
            )
        )
    return content


def prompt_logprobs(
    prompt_token_ids: list[int], positions: list[PositionLogprobs | None] | None, top: int
) -> PromptLogprobs:
    """vLLM's prompt_logprobs: each prompt position's own token and its `top` most likely
    alternatives (the engine may have computed more, for echo's logprobs)."""
    entries: PromptLogprobs = []
    for token_id, position in zip(prompt_token_ids, positions or []):
        if position is None:
            entries.append(None)
            continue
        entries.append(
            {
                candidate: PromptLogprob(logprob=entry.logprob, rank=entry.rank, decoded_token=entry.decoded_token)
                for candidate, entry in position.items()
                if candidate == token_id or (entry.rank is not None and entry.rank <= top)
            }
        )
    return entries

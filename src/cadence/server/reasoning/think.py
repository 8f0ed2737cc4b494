"""Reasoning written as `<think>...</think>` before the answer (Qwen3, DeepSeek-R1 and their kin).

The output is reasoning from `<think>` (or from its start, where the prompt left a think
block open) up to `</think>`, and content after. `<think>` counts only at the very start
of the output. A think block that never closes is reasoning cut short (max_tokens), as
in vLLM's parsers, so a streamed answer never has to take back reasoning it already sent.
Marker text that arrives split across feeds is held until it is known, never split
between reasoning and content.
"""

from __future__ import annotations

from cadence.server.reasoning.base import ReasoningDelta, ReasoningParser
from cadence.server.text_markers import held_tail

START = "<think>"
END = "</think>"


class ThinkReasoningParser(ReasoningParser):
    end_marker = END
    start_marker = START

    @classmethod
    def opening_marker(cls, prompt_text: str) -> str | None:
        # A template that closed an (empty) block itself has turned thinking off.
        return None if prompt_ends_with(prompt_text, END) else START

    def __init__(self, starts_in_reasoning: bool) -> None:
        super().__init__(starts_in_reasoning)
        self._at_start = True  # nothing decided yet: a `<think>` here opens (or repeats) the block
        self._pending = ""

    def feed(self, text: str) -> ReasoningDelta:
        return self._advance(text, final=False)

    def finish(self) -> ReasoningDelta:
        return self._advance("", final=True)

    def _advance(self, text: str, final: bool) -> ReasoningDelta:
        buffer, self._pending = self._pending + text, ""
        delta = ReasoningDelta()
        if self._at_start:
            if START.startswith(buffer) and not final:
                self._pending = buffer
                return delta
            self._at_start = False
            if buffer.startswith(START):
                self.in_reasoning = True
                buffer = buffer[len(START) :]
        if not self.in_reasoning:
            delta.content = buffer
            return delta
        end = buffer.find(END)
        if end >= 0:
            self.in_reasoning = False
            delta.reasoning = buffer[:end]
            delta.content = buffer[end + len(END) :]
            return delta
        held = 0 if final else held_tail(buffer, 0, [END])
        delta.reasoning = buffer[: len(buffer) - held]
        self._pending = buffer[len(buffer) - held :]
        return delta


def prompt_ends_with(prompt_text: str, marker: str) -> bool:
    return prompt_text.rstrip().endswith(marker)


class Qwen3ReasoningParser(ThinkReasoningParser):
    """Qwen3: the model opens `<think>` itself, or (Qwen3 thinking-2507, Qwen3.5) the template does.

    With `enable_thinking: false` the template closes an empty block in the prompt and the
    output is all content."""

    name = "qwen3"

    @classmethod
    def starts_in_reasoning(cls, prompt_text: str) -> bool:
        return prompt_ends_with(prompt_text, START)


class DeepSeekR1ReasoningParser(ThinkReasoningParser):
    """DeepSeek-R1: the output is reasoning from its start, whether the template wrote `<think>`
    (R1-0528, the distills) or the model does; only a template that closed the block itself
    (thinking turned off) starts the output in content."""

    name = "deepseek_r1"

    @classmethod
    def starts_in_reasoning(cls, prompt_text: str) -> bool:
        return not prompt_ends_with(prompt_text, END)

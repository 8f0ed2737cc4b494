"""What every reasoning parser takes and gives: generated text in, reasoning and content out.

Parsing the whole output is `feed(text)` then `finish()`, so streamed and non-streamed
answers come from the same code and always agree.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar


@dataclass
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


class ReasoningParser(ABC):
    name: ClassVar[str]
    end_marker: ClassVar[str]  # the text that ends the reasoning, e.g. "</think>"
    # The text with which the model itself may open reasoning at the start of its output
    # (None: only the prompt can open it). Constraints then leave such a block free.
    start_marker: ClassVar[str | None] = None

    @classmethod
    def opening_marker(cls, prompt_text: str) -> str | None:
        """The marker with which output after this prompt may open reasoning, if it may."""
        return cls.start_marker

    def __init__(self, starts_in_reasoning: bool) -> None:
        self.in_reasoning = starts_in_reasoning

    @classmethod
    @abstractmethod
    def starts_in_reasoning(cls, prompt_text: str) -> bool:
        """Whether output rendered after this prompt begins inside the reasoning."""

    @abstractmethod
    def feed(self, text: str) -> ReasoningDelta:
        """Split the text generated since the last feed."""

    @abstractmethod
    def finish(self) -> ReasoningDelta:
        """Generation ended: release what is held."""

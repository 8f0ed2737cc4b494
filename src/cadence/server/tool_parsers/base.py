"""What every tool-call parser takes and gives: the request's tools in, content and call deltas out.

A parser is fed the text generated since its last feed and answers with the content that
is certainly not part of a call and the pieces of calls found so far. The whole output
parsed at once is `feed(text)` then `finish()`: the streaming and the non-streaming
answers come from the same code, so they always agree.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass(frozen=True)
class ToolSpec:
    """One entry of the request's `tools`, already validated."""

    name: str
    parameters: dict[str, Any]  # JSON schema ({} or {"type": "object"} when the tool gives none)


@dataclass
class CallDelta:
    index: int  # 0-based, in order of appearance
    name: str | None  # set exactly once: on the call's first delta
    arguments: str  # the next fragment of the arguments' JSON text ("" allowed)


@dataclass
class ParsedDelta:
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)


class DeltaBuilder:
    """Collects one feed's content and call fragments, merging a call's consecutive fragments."""

    def __init__(self) -> None:
        self._content: list[str] = []
        self._calls: list[CallDelta] = []

    def content(self, text: str) -> None:
        if text:
            self._content.append(text)

    def call(self, index: int, name: str | None, arguments: str) -> None:
        last = self._calls[-1] if self._calls else None
        if last is not None and last.index == index and name is None:
            last.arguments += arguments
        elif name is not None or arguments:
            self._calls.append(CallDelta(index=index, name=name, arguments=arguments))

    def build(self) -> ParsedDelta:
        return ParsedDelta(content="".join(self._content), calls=self._calls)


class ToolParser(ABC):
    """Splits generated text into content and tool calls, one feed at a time.

    A call's name is sent only once it is complete and names one of the request's tools;
    its arguments follow in fragments that join into the arguments' JSON text. Text that
    could still turn out to be a call is held back and released as content as soon as it
    cannot, or at `finish()`.
    """

    name: ClassVar[str]
    # The format's markers are special tokens: the text must be decoded with special tokens
    # kept, or the markers vanish and calls read as content (vLLM turns
    # skip_special_tokens off for such parsers too). The stop token itself never reaches the
    # text (engine/output_processor.py).
    needs_special_tokens: ClassVar[bool] = False

    def __init__(self, tools: Sequence[ToolSpec]) -> None:
        self.tools = {tool.name: tool for tool in tools}
        self.calls_started = 0
        # Calls whose arguments never completed: the output was cut (max_tokens) or went
        # wrong after the call's name had been sent. Their arguments are a valid JSON prefix.
        self.unfinished_calls: list[int] = []

    def feed(self, text: str) -> ParsedDelta:
        """Parse the text generated since the last feed."""
        out = DeltaBuilder()
        self._advance(text, out, final=False)
        return out.build()

    def finish(self) -> ParsedDelta:
        """Generation ended: release everything still held."""
        out = DeltaBuilder()
        self._advance("", out, final=True)
        return out.build()

    @abstractmethod
    def _advance(self, text: str, out: DeltaBuilder, final: bool) -> None:
        """Consume `text` (after what was held), writing what is decided into `out`."""

    @abstractmethod
    def auto_grammar(self) -> str | None:
        """An llguidance Lark grammar leaving free text free and holding calls to the tools' schemas.

        None where the format cannot be expressed as one."""

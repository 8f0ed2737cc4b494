"""From a chat choice's generated text to what the client sees: reasoning, content and
tool calls, as one message or as stream deltas.

Each choice gets its own reader (n > 1 keeps a parser per choice). The text goes first
through the reasoning parser, if the server has one; what it leaves as the answer goes
through the tool-call reader the request's tool choice picked (server/tool_calls.py):
the auto parser, or the reader of a forced call (server/forced_calls.py). Streamed or
not, the same reader sees the same text, so the two agree.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Protocol

from cadence.openai_schema.responses import (
    ChatDelta,
    ChatResponseMessage,
    ToolCall,
    ToolCallDelta,
    ToolCallFunction,
    ToolCallFunctionDelta,
)
from cadence.server.forced_calls import NamedCallReader, RequiredCallsReader
from cadence.server.reasoning.base import ReasoningParser
from cadence.server.tool_calls import ToolPlan
from cadence.server.tool_parsers.base import CallDelta, ParsedDelta, ToolParser, ToolSpec


class CallReader(Protocol):
    """What finds tool calls in the answer text, a piece at a time."""

    def feed(self, text: str) -> ParsedDelta: ...

    def finish(self) -> ParsedDelta: ...

    @property
    def unfinished_calls(self) -> list[int]:
        """Calls whose arguments never completed (known once finish() ran)."""
        ...


@dataclass
class OutputPiece:
    """What a choice's text gained: thinking, answer text and call deltas."""

    reasoning: str = ""
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)


def tool_specs(plan: ToolPlan) -> list[ToolSpec]:
    return [ToolSpec(t.function.name, t.function.parameters or {}) for t in plan.tools]


@dataclass(frozen=True)
class OutputReading:
    """How one request's choices are read: built once per request, a reader per choice."""

    plan: ToolPlan
    tool_parser: type[ToolParser] | None = None  # the server's auto parser, for mode auto
    reasoning_parser: type[ReasoningParser] | None = None
    starts_in_reasoning: bool = False
    opening_marker: str | None = None  # how the model may open reasoning itself, if it may

    def skip_special_tokens(self, requested: bool) -> bool:
        """Whether the text is decoded without special tokens: as requested, unless the auto
        parser reads markers that are special tokens."""
        parser = self.tool_parser
        return requested and not (self.plan.mode == "auto" and parser is not None and parser.needs_special_tokens)

    def reader(self) -> ChoiceReader:
        calls: CallReader | None = None
        if self.plan.mode == "named":
            assert self.plan.named is not None
            calls = NamedCallReader(self.plan.named)
        elif self.plan.mode == "required":
            calls = RequiredCallsReader()
        elif self.plan.mode == "auto" and self.tool_parser is not None:
            calls = self.tool_parser(tool_specs(self.plan))
        reasoning = None
        if self.reasoning_parser is not None:
            reasoning = self.reasoning_parser(self.starts_in_reasoning)
        max_calls = None if self.plan.mode != "auto" or self.plan.parallel_calls else 1
        return ChoiceReader(reasoning, calls, max_calls)


class ChoiceReader:
    """Reads one choice's text as it grows; remembers what it found, for the message."""

    def __init__(
        self, reasoning: ReasoningParser | None, calls: CallReader | None, max_calls: int | None = None
    ) -> None:
        self.reasoning_parser = reasoning
        self.call_reader = calls
        self.max_calls = max_calls  # calls past this many are dropped
        self.reasoning = ""
        self.content = ""
        self.call_ids: list[str] = []
        self.call_names: list[str] = []
        self.call_arguments: list[str] = []

    def feed(self, text: str) -> OutputPiece:
        reasoning, answer = "", text
        if self.reasoning_parser is not None:
            split = self.reasoning_parser.feed(text)
            reasoning, answer = split.reasoning, split.content
        return self._record(reasoning, answer, None if self.call_reader is None else self.call_reader.feed(answer))

    def finish(self) -> OutputPiece:
        """What the parsers held back, once the choice has ended."""
        reasoning, answer = "", ""
        if self.reasoning_parser is not None:
            split = self.reasoning_parser.finish()
            reasoning, answer = split.reasoning, split.content
        if self.call_reader is None:
            return self._record(reasoning, answer, None)
        parsed = self.call_reader.feed(answer) if answer else ParsedDelta("", [])
        final = self.call_reader.finish()
        return self._record(reasoning, "", ParsedDelta(parsed.content + final.content, parsed.calls + final.calls))

    def _record(self, reasoning: str, answer: str, parsed: ParsedDelta | None) -> OutputPiece:
        piece = OutputPiece(reasoning, answer)
        if parsed is not None:
            piece = OutputPiece(reasoning, parsed.content, [c for c in parsed.calls if self._kept(c.index)])
        self.reasoning += piece.reasoning
        self.content += piece.content
        for call in piece.calls:
            while len(self.call_ids) <= call.index:
                self.call_ids.append(f"call_{uuid.uuid4().hex[:24]}")
                self.call_names.append("")
                self.call_arguments.append("")
            if call.name is not None:
                self.call_names[call.index] = call.name
            self.call_arguments[call.index] += call.arguments
        return piece

    @property
    def made_calls(self) -> bool:
        return bool(self.call_ids)

    @property
    def calls_complete(self) -> bool:
        """Every call found has whole arguments (known once finish() ran)."""
        return self.call_reader is None or not any(self._kept(i) for i in self.call_reader.unfinished_calls)

    def _kept(self, call_index: int) -> bool:
        return self.max_calls is None or call_index < self.max_calls

    def message(self) -> ChatResponseMessage:
        """The whole choice as OpenAI's message: content null when it is only calls."""
        calls = [
            ToolCall(id=call_id, function=ToolCallFunction(name=name, arguments=arguments))
            for call_id, name, arguments in zip(self.call_ids, self.call_names, self.call_arguments)
        ]
        content: str | None = self.content
        if calls and not self.content.strip():
            content = None
        return ChatResponseMessage(
            content=content,
            tool_calls=calls or None,
            reasoning_content=self.reasoning or None,
        )

    def delta(self, piece: OutputPiece, first: bool) -> ChatDelta:
        """A piece as a stream delta: only the keys it has are set (so sent). A call has
        one entry per delta: its first carries the index, id, type and name with the
        arguments so far, the later ones only arguments."""
        fields: dict[str, object] = {}
        if first:
            fields["role"] = "assistant"
        if piece.content or (first and not piece.reasoning and not piece.calls):
            fields["content"] = piece.content
        if piece.reasoning:
            fields["reasoning_content"] = piece.reasoning
        names: dict[int, str] = {}
        arguments: dict[int, str] = {}
        for call in piece.calls:
            if call.name is not None:
                names[call.index] = call.name
            arguments[call.index] = arguments.get(call.index, "") + call.arguments
        calls = []
        for index, text in arguments.items():
            if index in names:
                calls.append(
                    ToolCallDelta(
                        index=index,
                        id=self.call_ids[index],
                        type="function",
                        function=ToolCallFunctionDelta(name=names[index], arguments=text),
                    )
                )
            elif text:
                calls.append(ToolCallDelta(index=index, function=ToolCallFunctionDelta(arguments=text)))
        if calls:
            fields["tool_calls"] = calls
        return ChatDelta(**fields)  # type: ignore[arg-type]


def finish_reason(reason: str | None, reader: ChoiceReader) -> str | None:
    """OpenAI's finish reason: "tool_calls" when a choice that ended normally made calls.

    Clients run the calls of a "tool_calls" choice, so a call cut short (a stop string or
    the stop token inside its arguments) keeps the engine's "stop": the message is as the
    model left it, its last call's arguments a JSON prefix."""
    if reason == "stop" and reader.made_calls and reader.calls_complete:
        return "tool_calls"
    return reason

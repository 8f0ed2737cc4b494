"""What `tools` and `tool_choice` mean for one chat request: which calls the output may
hold, how it is constrained, and how its text is read back into calls.

- `none` (the default without tools): the output is text; tools are still rendered into
  the prompt, as vLLM does by default.
- `auto` (the default with tools; needs --enable-auto-tool-choice and
  --tool-call-parser, as in vLLM): the model writes calls in its own format and the
  parser finds them; when the parser offers a grammar, the output is constrained by it,
  so a call it starts is always well-formed. With parallel_tool_calls false, calls after
  the first are dropped.
- `required`: the output is a JSON array of {"name": ..., "parameters": ...} objects,
  one of the tools each (at most one when parallel_tool_calls is false).
- a named function: the output is that function's arguments, valid against its schema.
Named and required calls are enforced by the grammar whether or not a tool says strict.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from cadence.openai_schema.constraint_fields import NamedToolChoice, Tool
from cadence.openai_schema.requests import ChatCompletionRequest
from cadence.server.errors import bad_request
from cadence.server.structured_requests import Constraint
from cadence.server.tool_parsers.call_grammar import object_schema
from cadence.structured_outputs.params import StructuredOutputsParams

ToolMode = Literal["none", "auto", "required", "named"]
# A function that declares no parameters takes an object of any shape (OpenAI's reading).
ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class ToolPlan:
    """How one request's tools shape its output."""

    mode: ToolMode
    tools: tuple[Tool, ...] = ()
    named: str | None = None  # the function a named choice calls
    # parallel_tool_calls: false keeps only an auto answer's first call (as vLLM does);
    # a required answer's schema already holds one at most.
    parallel_calls: bool = True

    def constraint(self, parallel_tool_calls: bool) -> Constraint | None:
        """The grammar that `required` and named choices impose; None otherwise."""
        if self.mode == "named":
            tool = next(t for t in self.tools if t.function.name == self.named)
            return Constraint(StructuredOutputsParams(json=_parameters(tool)), "tools")
        if self.mode == "required":
            return Constraint(StructuredOutputsParams(json=calls_schema(self.tools, parallel_tool_calls)), "tools")
        return None


def _parameters(tool: Tool) -> dict[str, Any]:
    # Arguments are an object: a schema that leaves the type open is read as one, as in auto mode.
    return object_schema(tool.function.parameters or ANY_OBJECT)


def calls_schema(tools: tuple[Tool, ...], parallel_tool_calls: bool) -> dict[str, Any]:
    """The JSON Schema of `required` output: a list of calls, each naming one of the tools
    and carrying arguments valid against that tool's parameters."""
    one_call = [
        {
            "type": "object",
            "properties": {"name": {"const": t.function.name}, "parameters": _parameters(t)},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": one_call}, "minItems": 1}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    return schema


def plan_tools(body: ChatCompletionRequest, auto_tool_choice: bool) -> ToolPlan:
    """The request's tool plan; 400 for a choice the tools or the server cannot honour."""
    tools = tuple(body.tools or ())
    choice = body.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return ToolPlan("none", tools)
    if not tools:
        raise bad_request("tool_choice other than none needs tools", "tool_choice")
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if all(t.function.name != name for t in tools):
            known = ", ".join(repr(t.function.name) for t in tools)
            raise bad_request(
                f"tool_choice names the function {name!r}, which is not in tools ({known})", "tool_choice"
            )
        plan = ToolPlan("named", tools, name)
    elif choice == "required":
        plan = ToolPlan("required", tools)
    else:
        if not auto_tool_choice:
            raise bad_request(
                'tool_choice "auto" needs the server started with --enable-auto-tool-choice and --tool-call-parser; '
                'send tool_choice "required", a named function, or "none"',
                "tool_choice",
            )
        return ToolPlan("auto", tools, parallel_calls=body.parallel_tool_calls)
    _refuse_second_constraint(body)
    return plan


def _refuse_second_constraint(body: ChatCompletionRequest) -> None:
    # A forced call's output is the call; a format for the same output cannot also hold
    # (OpenAI refuses the pair too).
    if body.response_format is not None and body.response_format.type != "text":
        raise bad_request("response_format cannot be combined with a tool_choice that forces a call", "response_format")
    for field in ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar"):
        if getattr(body, field) is not None:
            raise bad_request(f"{field} cannot be combined with a tool_choice that forces a call", field)

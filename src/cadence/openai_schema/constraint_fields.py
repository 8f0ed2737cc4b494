"""Request fields that constrain what the model writes: response formats, vLLM's
structured outputs (and its older guided_* fields), tools and tool choice.

These are shapes only; what they mean for generation (a grammar, a parser) is decided in
the server (server/structured_requests.py, server/tool_calls.py). Only pydantic is
imported here, as everywhere in this package.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, model_validator

from cadence.openai_schema.text_fields import Lenient, Text


class JsonSchemaFormat(Lenient):
    """`response_format.json_schema`: OpenAI names the schema `schema`."""

    name: Text = "response"
    description: Text | None = None
    # `schema` would shadow BaseModel.schema(); the wire name is kept by the alias.
    json_schema: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(Lenient):
    """OpenAI's `response_format`: free text, any JSON object, or JSON of a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError('a response_format of type "json_schema" needs its json_schema object')
        return self


class StructuredOutputsField(Lenient):
    """vLLM's `structured_outputs` object: exactly one constraint (checked by the server,
    which names this field in its 400)."""

    # `json` would shadow BaseModel.json(); the wire name is kept by the alias.
    json_schema: dict[str, Any] | Text | None = Field(None, alias="json")
    regex: Text | None = None
    choice: list[Text] | None = None
    grammar: Text | None = None
    json_object: bool | None = None
    # Cadence's JSON never has free whitespace; vLLM's flag asks for exactly that.
    disable_any_whitespace: bool = False


def _named(name: str) -> str:
    if not name:
        raise ValueError("a function needs a non-empty name")
    return name


class FunctionDefinition(Lenient):
    """A tool's function: its name, what it does, and its arguments' JSON Schema."""

    name: Annotated[Text, AfterValidator(_named)]
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Lenient):
    """One entry of `tools`; functions are the only kind of tool."""

    type: Literal["function"] = "function"
    function: FunctionDefinition


def _unique_names(tools: list[Tool]) -> list[Tool]:
    seen: set[str] = set()
    for tool in tools:
        if tool.function.name in seen:
            raise ValueError(f"two tools are named {tool.function.name!r}; tool names must be unique")
        seen.add(tool.function.name)
    return tools


Tools = Annotated[list[Tool], AfterValidator(_unique_names)]


class FunctionName(Lenient):
    name: Text


class NamedToolChoice(Lenient):
    """`tool_choice: {"type": "function", "function": {"name": ...}}`: call this tool."""

    type: Literal["function"] = "function"
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ToolCallFunction(Lenient):
    """A call's function in an assistant message: arguments as JSON text (OpenAI) or an
    object (what some clients send, and what chat templates read)."""

    name: Text
    arguments: Text | dict[str, Any] = "{}"


class MessageToolCall(Lenient):
    """A tool call the assistant made in an earlier turn."""

    id: Text | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction

"""Large schemas, built by code, each with an instance it accepts.

The sizes real apps reach: an agent's required tool call over 40 tools (an `anyOf` of
`name`/`arguments` objects), a 200-field intake form, an API description with nested
endpoint lists, and a configuration eight objects deep. Built deterministically, so every
run compiles the same text.
"""

from __future__ import annotations

from typing import Any

from common.schema_set_api import STRING, Entry, obj

_TOOL_VERBS = ["get", "list", "create", "update", "delete", "search", "archive", "export"]
_TOOL_NOUNS = ["invoice", "customer", "ticket", "repository", "calendar_event"]


def _parameter(index: int) -> tuple[dict[str, Any], Any]:
    """One of a few parameter shapes, with a value it accepts, chosen by index."""
    shape = index % 6
    if shape == 0:
        return {"type": "string", "description": f"Identifier number {index}"}, f"id-{index:04d}"
    if shape == 1:
        return {"type": "integer", "minimum": 0, "maximum": 1000}, index
    if shape == 2:
        return {"enum": ["asc", "desc"]}, "desc"
    if shape == 3:
        return {"type": "boolean"}, index % 2 == 0
    if shape == 4:
        return {"type": "array", "items": STRING, "maxItems": 5}, ["a", "b"]
    return {"type": ["string", "null"], "format": "date"}, None


def _tool_union_40() -> Entry:
    calls = []
    examples = []
    for i in range(40):
        name = f"{_TOOL_VERBS[i % len(_TOOL_VERBS)]}_{_TOOL_NOUNS[i // len(_TOOL_VERBS)]}"
        params = [_parameter(i + k) for k in range(3 + i % 6)]
        arguments = obj({f"p{k}_{name.split('_')[0]}": schema for k, (schema, _) in enumerate(params)})
        calls.append(obj({"name": {"const": name}, "arguments": arguments}))
        examples.append({"name": name, "arguments": dict(zip(arguments["properties"], (v for _, v in params)))})
    schema = {"anyOf": calls}
    return "big_tool_call_union_40", schema, examples[27]


def _intake_form_200() -> Entry:
    properties: dict[str, Any] = {}
    example: dict[str, Any] = {}
    for i in range(200):
        schema, value = _parameter(i)
        if i % 6 == 0:
            schema = {"type": "string", "maxLength": 40}
            value = f"answer {i}"
        properties[f"field_{i:03d}"] = schema
        if i % 2 == 0:
            example[f"field_{i:03d}"] = value
    required = [name for i, name in enumerate(properties) if i % 2 == 0]
    return "big_intake_form_200", obj(properties, required=required), example


def _api_description() -> Entry:
    parameter = obj(
        {
            "name": STRING,
            "in": {"enum": ["path", "query", "header", "cookie"]},
            "required": {"type": "boolean"},
            "schema": obj({"type": {"enum": ["string", "integer", "number", "boolean", "array"]}}),
        }
    )
    response = obj({"status": {"type": "integer", "minimum": 100, "maximum": 599}, "description": STRING})
    endpoint = obj(
        {
            "method": {"enum": ["get", "post", "put", "patch", "delete"]},
            "path": {"type": "string", "pattern": "^(/[a-z0-9_{}-]+)+$"},
            "summary": {"type": "string", "maxLength": 120},
            "parameters": {"type": "array", "items": parameter},
            "responses": {"type": "array", "items": response, "minItems": 1},
            "deprecated": {"type": "boolean"},
        }
    )
    schema = obj(
        {
            "title": STRING,
            "version": {"type": "string", "pattern": r"^\d+\.\d+\.\d+$"},
            "servers": {"type": "array", "items": obj({"url": {"type": "string", "format": "uri"}})},
            "endpoints": {"type": "array", "items": endpoint, "minItems": 1},
        }
    )

    def endpoint_example(method: str, path: str, summary: str, params: list[tuple[str, str]]) -> dict[str, Any]:
        return {
            "method": method,
            "path": path,
            "summary": summary,
            "parameters": [
                {"name": n, "in": where, "required": where == "path", "schema": {"type": "string"}}
                for n, where in params
            ],
            "responses": [{"status": 200, "description": "OK"}, {"status": 404, "description": "Not found"}],
            "deprecated": False,
        }

    example = {
        "title": "Pet store",
        "version": "2.1.0",
        "servers": [{"url": "https://petstore.example.com/v2"}],
        "endpoints": [
            endpoint_example("get", "/pets", "List pets", [("limit", "query"), ("tag", "query")]),
            endpoint_example("get", "/pets/{pet_id}", "Get one pet", [("pet_id", "path")]),
            endpoint_example("delete", "/pets/{pet_id}", "Delete a pet", [("pet_id", "path"), ("x-api-key", "header")]),
        ],
    }
    return "big_api_description", schema, example


def _nested_config_8() -> Entry:
    """A configuration eight objects deep, each level with a few settings beside the next level."""
    schema: dict[str, Any] = obj({"enabled": {"type": "boolean"}, "value": {"type": "integer"}})
    example: dict[str, Any] = {"enabled": True, "value": 8}
    for level in reversed(range(8)):
        schema = obj(
            {
                "name": {"type": "string", "pattern": "^[a-z_]+$"},
                "timeout_ms": {"type": "integer", "minimum": 0},
                "mode": {"enum": ["fast", "safe", "off"]},
                "child": schema,
            }
        )
        example = {"name": f"level_{'abcdefgh'[level]}", "timeout_ms": 100 * level, "mode": "safe", "child": example}
    return "big_nested_config_8", schema, example


def large_schemas() -> list[Entry]:
    return [_tool_union_40(), _intake_form_200(), _api_description(), _nested_config_8()]

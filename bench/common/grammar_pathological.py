"""Hostile schemas for the grammar engines, each with an instance to walk if it compiles.

Schemas come from clients, so a server must survive these: deep nesting (recursion in the
compiler), a huge enum, a regex that backtracks catastrophically, one whose DFA has 2^20
states, a huge alternation, wide optional-property objects and huge repetition bounds.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

SEPARATORS = (", ", ": ")


@dataclass(frozen=True)
class HostileCase:
    name: str
    what: str
    schema_text: str  # as a client sends it: text, which Python's json may be unable to parse or write
    probe_text: str  # an instance the schema accepts, walked token by token when the schema compiles


def _case(name: str, what: str, schema: dict[str, Any], probe: Any) -> HostileCase:
    return HostileCase(name, what, json.dumps(schema), json.dumps(probe, separators=SEPARATORS))


def _nested(depth: int) -> HostileCase:
    # Written as text: past about 500 levels Python's json cannot write (or read) it.
    schema, probe = '{"type": "integer"}', "1"
    for _ in range(depth):
        schema = (
            f'{{"type": "object", "properties": {{"n": {schema}}}, "required": ["n"], "additionalProperties": false}}'
        )
        probe = f'{{"n": {probe}}}'
    return HostileCase(f"nested_objects_{depth}", f"objects nested {depth} deep", schema, probe)


def _enum(count: int) -> HostileCase:
    values = [f"item-{i:05d}-{'xyzw'[i % 4]}" for i in range(count)]
    schema = {"type": "object", "properties": {"v": {"enum": values}}, "required": ["v"]}
    return _case(f"enum_{count}", f"string enum of {count:,} values", schema, {"v": values[count * 2 // 3]})


def _pattern(name: str, what: str, pattern: str, probe: str) -> HostileCase:
    schema = {"type": "object", "properties": {"s": {"type": "string", "pattern": pattern}}, "required": ["s"]}
    return _case(name, what, schema, {"s": probe})


def _alternation(count: int) -> HostileCase:
    rng = random.Random(7)
    words = sorted(
        {"".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(4, 12))) for _ in range(count)}
    )
    pattern = "^(" + "|".join(words) + ")$"
    return _pattern(
        f"regex_alternation_{len(words)}", f"pattern alternating {len(words):,} words", pattern, words[len(words) // 2]
    )


def _optional_properties(count: int) -> HostileCase:
    properties = {f"opt_{i:03d}": {"type": "integer"} for i in range(count)}
    schema = {"type": "object", "properties": properties, "additionalProperties": False}
    probe = {name: 1 for i, name in enumerate(properties) if i % 7 == 3}
    return _case(f"optional_properties_{count}", f"{count} optional properties, none required", schema, probe)


def _array_bounds() -> HostileCase:
    schema = {"type": "array", "items": {"type": "integer"}, "minItems": 100, "maxItems": 100000}
    return _case("array_items_100_to_100000", "minItems 100, maxItems 100,000", schema, list(range(100)))


def _string_bounds() -> HostileCase:
    schema = {"type": "object", "properties": {"s": {"type": "string", "minLength": 10, "maxLength": 100000}}}
    return _case("string_length_10_to_100000", "minLength 10, maxLength 100,000", schema, {"s": "abcdefghij" * 20})


def hostile_cases() -> list[HostileCase]:
    dfa_probe = "ab" * 20 + "a" + "b" * 20
    return [
        _nested(128),
        _nested(1000),
        _enum(10_000),
        _pattern("regex_backtracking", "pattern ^(a+)+$ (catastrophic for backtracking engines)", "^(a+)+$", "a" * 200),
        _pattern("regex_dfa_2pow20", "pattern ^[ab]*a[ab]{20}$ (a DFA of 2^20 states)", "^[ab]*a[ab]{20}$", dfa_probe),
        _alternation(5000),
        _optional_properties(100),
        _array_bounds(),
        _string_bounds(),
    ]

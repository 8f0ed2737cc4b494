"""JSON schemas of real-world shapes, each with one instance it accepts, for the structured-output benches.

The set mixes tool parameters and API payloads, extraction forms, the schemas pydantic
generates (`$defs`/`$ref`, `anyOf` with null, enums, `Literal` as `const`, discriminated
unions, recursion, tuples) and a few large ones (a 40-tool call union, a 200-field form, an
API description). Every example is checked against its schema here, so a bench that walks
an example through a grammar matcher knows the walk should succeed.

    python bench/structured_schemas.py        # lists the set and checks every example

Used by bench/grammar_engines.py (compile and mask time per grammar library) and
bench/structured.py (constrained throughput of `cadence serve`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from common.schema_set_api import api_schemas
from common.schema_set_extraction import extraction_schemas
from common.schema_set_large import large_schemas
from common.schema_set_pydantic import pydantic_schemas

# How Cadence writes JSON under a schema when whitespace is not flexible: these separators,
# no other whitespace, properties in the schema's order.
ITEM_SEPARATOR = ", "
KEY_SEPARATOR = ": "


@dataclass(frozen=True)
class NamedSchema:
    name: str
    schema: dict[str, Any]
    example: Any  # an instance the schema accepts, its object keys in the schema's property order

    def example_text(self) -> str:
        """The example as a constrained model would write it: Cadence's separators, UTF-8 kept."""
        return json.dumps(self.example, separators=(ITEM_SEPARATOR, KEY_SEPARATOR), ensure_ascii=False)


def schemas() -> list[NamedSchema]:
    """The whole set (at least 50), in a fixed order; names are unique."""
    pairs = api_schemas() + extraction_schemas() + pydantic_schemas() + large_schemas()
    named = [NamedSchema(name, schema, example) for name, schema, example in pairs]
    names = [s.name for s in named]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"schema names appear twice: {duplicates}")
    return named


def example_errors(named: NamedSchema) -> list[str]:
    """Why the example does not satisfy its schema (empty when it does), by `jsonschema`.

    Formats (date-time, email, ...) are checked too where jsonschema can check them.
    """
    import jsonschema  # type: ignore[import-untyped]

    validator_class = jsonschema.validators.validator_for(named.schema)
    validator_class.check_schema(named.schema)
    validator = validator_class(named.schema, format_checker=validator_class.FORMAT_CHECKER)
    return [
        f"{'/'.join(map(str, e.absolute_path)) or '(root)'}: {e.message}" for e in validator.iter_errors(named.example)
    ]


def check_all(named_schemas: list[NamedSchema]) -> None:
    """ValueError naming every example its schema refuses."""
    failures = [f"{s.name}: {error}" for s in named_schemas for error in example_errors(s)]
    if failures:
        raise ValueError("examples that fail their schemas:\n  " + "\n  ".join(failures))


def main() -> int:
    named_schemas = schemas()
    check_all(named_schemas)
    for s in named_schemas:
        size = len(json.dumps(s.schema))
        print(f"{s.name:32} schema {size:6d} chars, example {len(s.example_text()):5d} chars")
    print(f"{len(named_schemas)} schemas; every example satisfies its schema")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

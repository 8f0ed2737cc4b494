"""Hand-written extraction and classification schemas, each with an instance it accepts.

The "read this text and fill the form" shapes: labels from an enum, scores in a range,
entity lists with offsets, invoices and resumes with nested arrays, a recursive comment
tree through `$ref`, tables of mixed cells. Example objects list their keys in the schema's
property order.
"""

from __future__ import annotations

from common.schema_set_api import DATE_TIME, EMAIL, STRING, Entry, obj

NULLABLE_STRING = {"type": ["string", "null"]}
SCORE = {"type": "number", "minimum": 0, "maximum": 1}


def _sentiment() -> Entry:
    schema = obj({"label": {"enum": ["positive", "negative", "neutral"]}, "score": SCORE})
    return "cls_sentiment", schema, {"label": "negative", "score": 0.87}


def _multi_label() -> Entry:
    topics = ["billing", "shipping", "returns", "account", "technical", "feedback", "other"]
    schema = obj(
        {"labels": {"type": "array", "items": {"enum": topics}, "minItems": 1, "maxItems": 3, "uniqueItems": True}}
    )
    return "cls_support_topics", schema, {"labels": ["shipping", "returns"]}


def _moderation() -> Entry:
    categories = ["harassment", "hate", "self_harm", "sexual", "violence", "illicit"]
    schema = obj(
        {
            "flagged": {"type": "boolean"},
            "categories": obj({c: {"type": "boolean"} for c in categories}),
            "scores": obj(dict.fromkeys(categories, SCORE)),
        }
    )
    example = {
        "flagged": False,
        "categories": dict.fromkeys(categories, False),
        "scores": {c: round(0.01 * (i + 1), 2) for i, c in enumerate(categories)},
    }
    return "cls_moderation", schema, example


def _person() -> Entry:
    schema = obj(
        {
            "name": {"type": "string", "minLength": 1},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "email": EMAIL,
            "phone": {"type": "string", "pattern": r"^\+?[0-9 ()-]{7,20}$"},
            "occupation": NULLABLE_STRING,
        },
        required=["name"],
    )
    example = {"name": "María José Carreño", "age": 34, "email": "mj.carreno@example.es", "phone": "+34 612 345 678"}
    return "ext_person", schema, example


def _address() -> Entry:
    schema = obj(
        {
            "street": STRING,
            "city": STRING,
            "postal_code": {"type": "string", "pattern": "^[0-9A-Z -]{3,10}$"},
            "country": {"type": "string", "pattern": "^[A-Z]{2}$"},
        }
    )
    example = {"street": "221B Baker Street", "city": "London", "postal_code": "NW1 6XE", "country": "GB"}
    return "ext_address", schema, example


def _invoice() -> Entry:
    line = obj(
        {
            "description": STRING,
            "quantity": {"type": "integer", "minimum": 1},
            "unit_price": {"type": "number", "minimum": 0},
        }
    )
    schema = obj(
        {
            "invoice_number": {"type": "string", "pattern": r"^INV-\d{6}$"},
            "issue_date": {"type": "string", "format": "date"},
            "currency": {"enum": ["USD", "EUR", "GBP", "JPY", "CHF"]},
            "vendor": obj({"name": STRING, "vat_id": NULLABLE_STRING}),
            "line_items": {"type": "array", "items": line, "minItems": 1},
            "total": {"type": "number"},
        }
    )
    example = {
        "invoice_number": "INV-004217",
        "issue_date": "2025-01-31",
        "currency": "EUR",
        "vendor": {"name": "Nordlicht GmbH", "vat_id": "DE123456789"},
        "line_items": [
            {"description": "Consulting, January", "quantity": 12, "unit_price": 95.0},
            {"description": "Travel", "quantity": 1, "unit_price": 310.4},
        ],
        "total": 1450.4,
    }
    return "ext_invoice", schema, example


def _recipe() -> Entry:
    ingredient = obj(
        {
            "item": STRING,
            "amount": {"type": "number"},
            "unit": {"enum": ["g", "kg", "ml", "l", "tsp", "tbsp", "cup", "piece"]},
        }
    )
    schema = obj(
        {
            "name": STRING,
            "servings": {"type": "integer", "minimum": 1, "maximum": 24},
            "ingredients": {"type": "array", "items": ingredient, "minItems": 1},
            "steps": {"type": "array", "items": STRING, "minItems": 1},
        }
    )
    example = {
        "name": "Shakshuka",
        "servings": 4,
        "ingredients": [
            {"item": "eggs", "amount": 6, "unit": "piece"},
            {"item": "crushed tomatoes", "amount": 800, "unit": "g"},
            {"item": "cumin", "amount": 1, "unit": "tsp"},
        ],
        "steps": ["Soften onion and pepper.", "Add tomatoes and spices; simmer 10 min.", "Crack eggs in; cover."],
    }
    return "ext_recipe", schema, example


def _resume() -> Entry:
    month = {"type": "string", "pattern": r"^\d{4}-(0[1-9]|1[0-2])$"}
    job = obj(
        {
            "company": STRING,
            "role": STRING,
            "start": month,
            "end": {"anyOf": [month, {"type": "null"}]},
            "highlights": {"type": "array", "items": STRING, "maxItems": 5},
        }
    )
    schema = obj(
        {
            "name": STRING,
            "contact": obj({"email": EMAIL, "phone": NULLABLE_STRING}),
            "experience": {"type": "array", "items": job},
            "skills": {"type": "array", "items": STRING, "uniqueItems": True},
        }
    )
    example = {
        "name": "Tomás Novak",
        "contact": {"email": "tomas@example.cz", "phone": None},
        "experience": [
            {
                "company": "Acme Robotics",
                "role": "Staff Engineer",
                "start": "2021-04",
                "end": None,
                "highlights": ["Cut p99 latency 40%", "Led the move to gRPC"],
            },
            {"company": "DataCo", "role": "Engineer", "start": "2017-09", "end": "2021-03", "highlights": []},
        ],
        "skills": ["Go", "Kubernetes", "PostgreSQL"],
    }
    return "ext_resume", schema, example


def _entities() -> Entry:
    entity = obj(
        {
            "text": STRING,
            "type": {"enum": ["PERSON", "ORG", "LOC", "DATE", "MONEY"]},
            "start": {"type": "integer", "minimum": 0},
            "end": {"type": "integer", "minimum": 0},
        }
    )
    schema = obj({"entities": {"type": "array", "items": entity}})
    example = {
        "entities": [
            {"text": "Satya Nadella", "type": "PERSON", "start": 0, "end": 13},
            {"text": "Microsoft", "type": "ORG", "start": 22, "end": 31},
            {"text": "$69 billion", "type": "MONEY", "start": 46, "end": 57},
        ]
    }
    return "ext_named_entities", schema, example


def _qa_citations() -> Entry:
    citation = obj({"doc_id": {"type": "integer"}, "quote": {"type": "string", "maxLength": 200}})
    schema = obj(
        {
            "answer": STRING,
            "citations": {"type": "array", "items": citation},
            "confidence": {"enum": ["low", "medium", "high"]},
        }
    )
    example = {
        "answer": "The warranty covers two years from purchase.",
        "citations": [{"doc_id": 3, "quote": "covered for 24 months from the date of purchase"}],
        "confidence": "high",
    }
    return "ext_qa_citations", schema, example


def _comment_tree() -> Entry:
    comment = obj(
        {"author": STRING, "text": STRING, "replies": {"type": "array", "items": {"$ref": "#/$defs/comment"}}}
    )
    schema = {"$defs": {"comment": comment}, "$ref": "#/$defs/comment"}
    example = {
        "author": "ada",
        "text": "Is this reproducible on main?",
        "replies": [
            {
                "author": "lin",
                "text": "Yes, since the last merge.",
                "replies": [{"author": "ada", "text": "Thanks!", "replies": []}],
            }
        ],
    }
    return "ext_comment_tree", schema, example


def _table() -> Entry:
    cell = {"anyOf": [{"type": "string"}, {"type": "number"}, {"type": "null"}]}
    schema = obj(
        {
            "columns": {"type": "array", "items": STRING, "minItems": 1},
            "rows": {"type": "array", "items": {"type": "array", "items": cell}},
        }
    )
    example = {
        "columns": ["country", "gdp_trillion_usd", "note"],
        "rows": [["United States", 27.36, None], ["China", 17.79, "estimate"], ["Germany", 4.46, None]],
    }
    return "ext_table", schema, example


def _vitals() -> Entry:
    schema = obj(
        {
            "patient_id": {"type": "string", "pattern": "^P[0-9]{7}$"},
            "recorded_at": DATE_TIME,
            "blood_pressure": obj(
                {
                    "systolic": {"type": "integer", "minimum": 50, "maximum": 250},
                    "diastolic": {"type": "integer", "minimum": 30, "maximum": 150},
                }
            ),
            "temperature_c": {"type": "number", "minimum": 30, "maximum": 45},
            "allergies": {"type": "array", "items": STRING},
            "notes": NULLABLE_STRING,
        }
    )
    example = {
        "patient_id": "P0012345",
        "recorded_at": "2025-04-02T08:15:00Z",
        "blood_pressure": {"systolic": 128, "diastolic": 82},
        "temperature_c": 37.2,
        "allergies": ["penicillin"],
        "notes": None,
    }
    return "ext_vitals", schema, example


def _game_score() -> Entry:
    team = obj({"name": STRING, "score": {"type": "integer", "minimum": 0}})
    schema = obj(
        {
            "home": team,
            "away": team,
            "status": {"enum": ["scheduled", "live", "final", "postponed"]},
            "periods": {
                "type": "array",
                "items": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 2},
            },
        }
    )
    example = {
        "home": {"name": "Boston Celtics", "score": 112},
        "away": {"name": "Denver Nuggets", "score": 104},
        "status": "final",
        "periods": [[28, 25], [30, 27], [26, 29], [28, 23]],
    }
    return "ext_game_score", schema, example


def _math_answer() -> Entry:
    schema = obj({"steps": {"type": "array", "items": STRING, "minItems": 1}, "final_answer": {"type": "number"}})
    example = {"steps": ["48 / 2 = 24 clips in May", "48 + 24 = 72"], "final_answer": 72}
    return "ext_math_answer", schema, example


def _survey() -> Entry:
    answer = {
        "anyOf": [
            {"type": "integer", "minimum": 1, "maximum": 5},
            {"type": "string"},
            {"type": "array", "items": STRING},
        ]
    }
    schema = obj(
        {
            "respondent_id": {"type": "string", "format": "uuid"},
            "answers": {"type": "array", "items": obj({"question_id": {"type": "integer"}, "answer": answer})},
        }
    )
    example = {
        "respondent_id": "3fa85f64-5717-4562-b3fc-2c963f66afa6",
        "answers": [
            {"question_id": 1, "answer": 4},
            {"question_id": 2, "answer": "Faster checkout, please."},
            {"question_id": 3, "answer": ["email", "sms"]},
        ],
    }
    return "ext_survey", schema, example


def _product() -> Entry:
    schema = obj(
        {
            "sku": {"type": "string", "pattern": "^[A-Z]{2,4}-[0-9]{3,6}$"},
            "name": {"type": "string", "maxLength": 80},
            "price": obj({"amount": {"type": "number", "exclusiveMinimum": 0}, "currency": {"enum": ["USD", "EUR"]}}),
            "tags": {"type": "array", "items": STRING, "maxItems": 8},
            "in_stock": {"type": "boolean"},
            "dimensions_cm": obj({"w": {"type": "number"}, "h": {"type": "number"}, "d": {"type": "number"}}),
            "rating": {"type": ["number", "null"], "minimum": 0, "maximum": 5},
        },
        required=["sku", "name", "price", "in_stock"],
    )
    example = {
        "sku": "KB-20931",
        "name": "Mechanical keyboard, 75% layout",
        "price": {"amount": 129.99, "currency": "USD"},
        "tags": ["keyboard", "hot-swap", "bluetooth"],
        "in_stock": True,
        "dimensions_cm": {"w": 32.5, "h": 3.9, "d": 13.6},
        "rating": 4.6,
    }
    return "ext_product", schema, example


def _priority_untyped_enum() -> Entry:
    # Enums without a type, mixing strings, numbers and null, as hand-written schemas often do.
    schema = obj({"priority": {"enum": ["low", "medium", "high", None]}, "severity": {"enum": [1, 2, 3, 4, "unknown"]}})
    return "cls_untyped_enums", schema, {"priority": None, "severity": 2}


def _meeting_summary() -> Entry:
    action = obj({"owner": STRING, "task": STRING, "due": {"type": ["string", "null"], "format": "date"}})
    schema = obj(
        {
            "summary": {"type": "string", "maxLength": 600},
            "decisions": {"type": "array", "items": STRING},
            "action_items": {"type": "array", "items": action},
        }
    )
    example = {
        "summary": "Agreed to ship the beta behind a flag; pricing stays unchanged until Q3.",
        "decisions": ["Beta ships behind a flag", "No pricing change before Q3"],
        "action_items": [{"owner": "Priya", "task": "Write the rollout plan", "due": "2025-05-09"}],
    }
    return "ext_meeting_summary", schema, example


def extraction_schemas() -> list[Entry]:
    return [
        _sentiment(),
        _multi_label(),
        _moderation(),
        _person(),
        _address(),
        _invoice(),
        _recipe(),
        _resume(),
        _entities(),
        _qa_citations(),
        _comment_tree(),
        _table(),
        _vitals(),
        _game_score(),
        _math_answer(),
        _survey(),
        _product(),
        _priority_untyped_enum(),
        _meeting_summary(),
    ]

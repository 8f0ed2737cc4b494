"""Hand-written schemas of tool parameters and API payloads, each with an instance it accepts.

Shapes as function-calling apps and API clients send them: a few required fields, enums,
nullable fields as `["string", "null"]`, bounded numbers, patterns, arrays of objects,
free-form maps (`additionalProperties`), `const` tags and `anyOf` unions of tool calls.
Example objects list their keys in the schema's property order.
"""

from __future__ import annotations

from typing import Any

Entry = tuple[str, dict[str, Any], Any]


def obj(properties: dict[str, Any], required: list[str] | None = None, **extra: Any) -> dict[str, Any]:
    """An object schema as strict tool schemas write it: listed properties only, all required by default."""
    schema = {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
    }
    return {**schema, "additionalProperties": False, **extra}


STRING = {"type": "string"}
EMAIL = {"type": "string", "format": "email"}
DATE_TIME = {"type": "string", "format": "date-time"}


def _weather() -> Entry:
    schema = obj(
        {
            "location": {"type": "string", "description": "City and country, e.g. Paris, France"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
        required=["location"],
    )
    return "tool_get_weather", schema, {"location": "Zürich, Switzerland", "unit": "celsius"}


def _web_search() -> Entry:
    filters = obj({"recency": {"enum": ["day", "week", "month", "any"]}, "site": {"type": ["string", "null"]}})
    schema = obj(
        {
            "query": {"type": "string", "minLength": 1, "maxLength": 400},
            "filters": filters,
            "max_results": {"type": "integer", "minimum": 1, "maximum": 50},
        }
    )
    example = {
        "query": "rust async runtime comparison",
        "filters": {"recency": "month", "site": None},
        "max_results": 10,
    }
    return "tool_web_search", schema, example


def _sql_query() -> Entry:
    param = {"anyOf": [{"type": "string"}, {"type": "number"}, {"type": "boolean"}, {"type": "null"}]}
    schema = obj(
        {
            "sql": {"type": "string", "description": "One read-only SELECT statement"},
            "params": {"type": "array", "items": param, "maxItems": 20},
            "timeout_ms": {"type": "integer", "minimum": 100, "maximum": 60000},
        },
        required=["sql", "params"],
    )
    example = {"sql": "SELECT id, total FROM orders WHERE customer = ? AND paid = ?", "params": ["c_42", True, None]}
    return "tool_sql_query", schema, example


def _send_email() -> Entry:
    schema = obj(
        {
            "to": {"type": "array", "items": EMAIL, "minItems": 1, "maxItems": 10},
            "cc": {"type": "array", "items": EMAIL},
            "subject": {"type": "string", "maxLength": 120},
            "body": STRING,
            "send_at": {"type": ["string", "null"], "format": "date-time"},
        },
        required=["to", "subject", "body"],
    )
    example = {
        "to": ["ana@example.com", "li.wei@example.org"],
        "cc": [],
        "subject": "Quarterly review moved to Thursday",
        "body": "Hi both,\nThe review is now on Thursday at 10:00.\nThanks!",
        "send_at": "2025-03-04T09:30:00Z",
    }
    return "tool_send_email", schema, example


def _book_flight() -> Entry:
    airport = {"type": "string", "pattern": "^[A-Z]{3}$"}
    schema = obj(
        {
            "origin": airport,
            "destination": airport,
            "date": {"type": "string", "format": "date"},
            "passengers": {"type": "integer", "minimum": 1, "maximum": 9},
            "cabin": {"type": "string", "enum": ["economy", "premium_economy", "business", "first"]},
            "flexible_dates": {"type": "boolean"},
        }
    )
    example = {
        "origin": "SFO",
        "destination": "NRT",
        "date": "2025-11-20",
        "passengers": 2,
        "cabin": "premium_economy",
        "flexible_dates": False,
    }
    return "tool_book_flight", schema, example


def _create_issue() -> Entry:
    schema = obj(
        {
            "title": {"type": "string", "minLength": 1, "maxLength": 256},
            "body": STRING,
            "labels": {"type": "array", "items": STRING, "uniqueItems": True},
            "assignees": {"type": "array", "items": STRING, "maxItems": 10},
            "milestone": {"type": ["integer", "null"]},
        },
        required=["title"],
    )
    example = {
        "title": "Streaming tool calls drop the last argument chunk",
        "body": "Steps to reproduce:\n1. stream a call\n2. join the deltas",
        "labels": ["bug", "tool-calling"],
        "assignees": ["octocat"],
        "milestone": 7,
    }
    return "api_github_issue", schema, example


def _payment_intent() -> Entry:
    schema = obj(
        {
            "id": {"type": "string", "pattern": "^pi_[A-Za-z0-9]{24}$"},
            "object": {"const": "payment_intent"},
            "amount": {"type": "integer", "minimum": 50},
            "currency": {"type": "string", "pattern": "^[a-z]{3}$"},
            "status": {
                "enum": [
                    "requires_payment_method",
                    "requires_confirmation",
                    "requires_action",
                    "processing",
                    "requires_capture",
                    "canceled",
                    "succeeded",
                ]
            },
            "metadata": {"type": "object", "additionalProperties": {"type": "string"}},
            "created": {"type": "integer"},
        }
    )
    example = {
        "id": "pi_3MtwBwLkdIwHu7ix28a3tqPa",
        "object": "payment_intent",
        "amount": 2000,
        "currency": "usd",
        "status": "requires_payment_method",
        "metadata": {"order_id": "6735", "channel": "web"},
        "created": 1680800504,
    }
    return "api_payment_intent", schema, example


def _json_patch() -> Entry:
    path = {"type": "string", "pattern": "^(/[^/]*)*$"}
    operation = {
        "anyOf": [
            obj({"op": {"const": "add"}, "path": path, "value": {}}),
            obj({"op": {"const": "remove"}, "path": path}),
            obj({"op": {"const": "replace"}, "path": path, "value": {}}),
            obj({"op": {"const": "move"}, "from": path, "path": path}),
        ]
    }
    schema = {"type": "array", "items": operation, "minItems": 1}
    example = [
        {"op": "replace", "path": "/spec/replicas", "value": 3},
        {"op": "add", "path": "/metadata/labels/tier", "value": "backend"},
        {"op": "remove", "path": "/spec/template/annotations"},
        {"op": "move", "from": "/a/b", "path": "/a/c"},
    ]
    return "api_json_patch", schema, example


def _geojson() -> Entry:
    point = obj(
        {
            "type": {"const": "Point"},
            "coordinates": {"type": "array", "items": {"type": "number"}, "minItems": 2, "maxItems": 3},
        }
    )
    schema = obj(
        {
            "type": {"const": "Feature"},
            "geometry": point,
            "properties": obj({"name": STRING, "population": {"type": "integer", "minimum": 0}}),
        }
    )
    example = {
        "type": "Feature",
        "geometry": {"type": "Point", "coordinates": [139.6917, 35.6895]},
        "properties": {"name": "東京", "population": 13960000},
    }
    return "api_geojson_feature", schema, example


def _deployment() -> Entry:
    dns_name = {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 63}
    container = obj(
        {
            "name": dns_name,
            "image": STRING,
            "ports": {
                "type": "array",
                "items": obj({"containerPort": {"type": "integer", "minimum": 1, "maximum": 65535}}),
            },
            "env": {"type": "array", "items": obj({"name": STRING, "value": STRING})},
        },
        required=["name", "image"],
    )
    spec = obj(
        {
            "replicas": {"type": "integer", "minimum": 0, "maximum": 100},
            "template": obj({"spec": obj({"containers": {"type": "array", "items": container, "minItems": 1}})}),
        }
    )
    schema = obj(
        {
            "apiVersion": {"const": "apps/v1"},
            "kind": {"const": "Deployment"},
            "metadata": obj({"name": dns_name, "labels": {"type": "object", "additionalProperties": STRING}}),
            "spec": spec,
        }
    )
    containers = [
        {
            "name": "web",
            "image": "nginx:1.27",
            "ports": [{"containerPort": 80}],
            "env": [{"name": "MODE", "value": "prod"}],
        }
    ]
    example = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "web-frontend", "labels": {"app": "web"}},
        "spec": {"replicas": 3, "template": {"spec": {"containers": containers}}},
    }
    return "api_k8s_deployment", schema, example


def _log_entry() -> Entry:
    schema = obj(
        {
            "timestamp": DATE_TIME,
            "level": {"enum": ["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]},
            "logger": STRING,
            "message": STRING,
            "context": {"type": "object"},
        }
    )
    example = {
        "timestamp": "2025-06-01T12:00:03.250Z",
        "level": "ERROR",
        "logger": "payments.webhook",
        "message": "signature mismatch",
        "context": {"request_id": "r-81f", "attempt": 2, "tags": ["retry"], "ok": False},
    }
    return "api_log_entry", schema, example


def _tool_call_union() -> Entry:
    schema = {
        "anyOf": [
            obj({"name": {"const": "get_weather"}, "arguments": _weather()[1]}),
            obj({"name": {"const": "web_search"}, "arguments": _web_search()[1]}),
            obj({"name": {"const": "book_flight"}, "arguments": _book_flight()[1]}),
        ]
    }
    example = {"name": "book_flight", "arguments": _book_flight()[2]}
    return "tool_call_union_3", schema, example


def _server_config() -> Entry:
    tls = obj({"enabled": {"type": "boolean"}, "cert_path": {"type": ["string", "null"]}})
    schema = obj(
        {
            "server": obj({"host": STRING, "port": {"type": "integer", "minimum": 1, "maximum": 65535}, "tls": tls}),
            "workers": {"type": "integer", "minimum": 1, "maximum": 256},
            "features": {"type": "array", "items": {"enum": ["metrics", "tracing", "auth", "cors", "gzip"]}},
            "limits": obj({"requests_per_minute": {"type": "integer"}, "burst": {"type": "integer"}}),
        }
    )
    example = {
        "server": {"host": "0.0.0.0", "port": 8443, "tls": {"enabled": True, "cert_path": "/etc/tls/cert.pem"}},
        "workers": 4,
        "features": ["metrics", "gzip"],
        "limits": {"requests_per_minute": 600, "burst": 50},
    }
    return "api_server_config", schema, example


def _calendar_event() -> Entry:
    schema = obj(
        {
            "title": STRING,
            "start": DATE_TIME,
            "end": DATE_TIME,
            "attendees": {"type": "array", "items": EMAIL},
            "location": {"type": ["string", "null"]},
            "recurrence": {"enum": ["none", "daily", "weekly", "monthly", None]},
        },
        required=["title", "start", "end"],
    )
    example = {
        "title": "Design review",
        "start": "2025-02-11T15:00:00+01:00",
        "end": "2025-02-11T16:00:00+01:00",
        "attendees": ["sam@example.com"],
        "location": None,
        "recurrence": "weekly",
    }
    return "tool_calendar_event", schema, example


def _shell_command() -> Entry:
    schema = obj(
        {
            "command": {"type": "array", "items": STRING, "minItems": 1},
            "cwd": STRING,
            "timeout_s": {"type": "number", "exclusiveMinimum": 0, "maximum": 600},
            "env": {"type": "object", "additionalProperties": STRING},
        },
        required=["command"],
    )
    example = {"command": ["git", "log", "--oneline", "-5"], "cwd": "/srv/repo", "timeout_s": 30.5, "env": {}}
    return "tool_shell_command", schema, example


def _boolean_decision() -> Entry:
    schema = obj({"decision": {"type": "boolean"}, "reason": {"type": "string", "maxLength": 300}})
    return "tiny_boolean_decision", schema, {"decision": True, "reason": "The refund request is within 30 days."}


def _http_request() -> Entry:
    schema = obj(
        {
            "method": {"enum": ["GET", "POST", "PUT", "PATCH", "DELETE"]},
            "url": {"type": "string", "format": "uri"},
            "headers": {"type": "object", "additionalProperties": STRING},
            "body": {"anyOf": [{"type": "object"}, {"type": "string"}, {"type": "null"}]},
        },
        required=["method", "url"],
    )
    example = {
        "method": "POST",
        "url": "https://api.example.com/v2/orders?dry_run=true",
        "headers": {"Content-Type": "application/json", "Authorization": "Bearer abc.def"},
        "body": {"sku": "A-100", "qty": 2},
    }
    return "tool_http_request", schema, example


def api_schemas() -> list[Entry]:
    return [
        _weather(),
        _web_search(),
        _sql_query(),
        _send_email(),
        _book_flight(),
        _create_issue(),
        _payment_intent(),
        _json_patch(),
        _geojson(),
        _deployment(),
        _log_entry(),
        _tool_call_union(),
        _server_config(),
        _calendar_event(),
        _shell_command(),
        _boolean_decision(),
        _http_request(),
    ]

"""How the server and its engine processes write logs: plain text lines, or one JSON
object per line (`--log-format json`) for log collectors.

A JSON line has `time` (ISO 8601, UTC), `level`, `logger`, `message`, the API request's
id while one is being served (`request_id`, from its X-Request-Id), and whatever a call
passes as `extra={"fields": {...}}` (the per-request summary line does).
"""

from __future__ import annotations

import contextvars
import datetime
import json
import logging

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# The API request being served by the current task (server/request_ids.py sets it).
CURRENT_REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("cadence_request_id", default=None)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc).isoformat(),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        request_id = CURRENT_REQUEST_ID.get()
        if request_id is not None:
            entry["request_id"] = request_id
        entry.update(getattr(record, "fields", {}))
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False, default=str)


def configure_logging(level: int | str, log_format: str = "text") -> None:
    """Set up the root logger of this process (replacing handlers set before)."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, got {log_format!r}")
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level, handlers=[handler], force=True)
    logging.captureWarnings(log_format == "json")  # warnings.warn would print plain text lines


def current_log_format() -> str:
    """The format this process's root logger writes, for the processes it starts."""
    handlers = logging.getLogger().handlers
    return "json" if any(isinstance(h.formatter, JsonFormatter) for h in handlers) else "text"

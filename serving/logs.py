"""The servers' logs (`--log-format`): readable text lines, or one JSON object a line for
a log pipeline, with the structured fields a record carries (`extra=`) as keys of their
own; and the W3C trace id a call's `traceparent` header names, so that a request's log
line joins its trace."""

from __future__ import annotations

import datetime
import json
import logging
import re
from typing import Any

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# The attributes every LogRecord has; anything else on a record came from `extra=`.
_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime", "taskName"}
# version-traceid-parentid-flags (https://www.w3.org/TR/trace-context/#traceparent-header);
# version ff is invalid, as is an all-zero trace or parent id.
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time (UTC, ISO 8601), level, logger, message, the record's
    structured fields, and an exception's traceback as one field (newlines escaped, so a
    traceback never splits the line)."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        line.update({k: v for k, v in vars(record).items() if k not in _STANDARD})
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def configure_logging(log_format: str = "text") -> None:
    """Logs INFO and above to stderr in `log_format` (one of `LOG_FORMATS`), unless the
    root logger has handlers already (a program embedding a server keeps its own)."""
    handler = logging.StreamHandler()
    json_lines = log_format == "json"
    handler.setFormatter(JsonFormatter() if json_lines else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=logging.INFO, handlers=[handler])


def trace_id(traceparent: str | None) -> str | None:
    """The trace id of a W3C `traceparent` header value; None when there is none or it
    is not valid."""
    if traceparent is None:
        return None
    match = _TRACEPARENT.fullmatch(traceparent.strip())
    if match is None:
        return None
    version, trace, parent, _, rest = match.groups()
    # Version 00 has exactly four fields; later versions may append more.
    if version == "ff" or (version == "00" and rest) or not int(trace, 16) or not int(parent, 16):
        return None
    return trace

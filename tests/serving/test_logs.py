"""`--log-format`: the JSON formatter (one valid JSON object a line, structured fields
as keys, an exception in a field of the same line) and the trace id of a W3C
`traceparent` header."""

from __future__ import annotations

import json
import logging
import sys

import pytest

from hydra_jury.serving.logs import JsonFormatter, trace_id

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"


def record(message: str, *args, exc_info=None, **extra) -> logging.LogRecord:
    return logging.getLogger("hydra_jury.test").makeRecord(
        "hydra_jury.test", logging.WARNING, __file__, 1, message, args, exc_info, extra=extra
    )


def test_a_record_is_one_json_line_with_its_fields():
    line = JsonFormatter().format(record("%d tokens\nin a line", 3, request_id="r1", rounds=2))
    assert "\n" not in line
    parsed = json.loads(line)
    assert parsed["message"] == "3 tokens\nin a line"
    assert (parsed["level"], parsed["logger"]) == ("WARNING", "hydra_jury.test")
    assert (parsed["request_id"], parsed["rounds"]) == ("r1", 2)
    assert parsed["time"].endswith("+00:00")
    assert "args" not in parsed and "exception" not in parsed


def test_an_exception_is_a_field_of_the_same_line():
    try:
        raise ValueError("bad value")
    except ValueError:
        line = JsonFormatter().format(record("failed", exc_info=sys.exc_info()))
    assert "\n" not in line
    exception = json.loads(line)["exception"]
    assert exception.startswith("Traceback") and "ValueError: bad value" in exception


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        (f"00-{TRACE}-00f067aa0ba902b7-01", TRACE),
        (f" 00-{TRACE}-00f067aa0ba902b7-00 ", TRACE),
        (f"01-{TRACE}-00f067aa0ba902b7-01-later-fields", TRACE),  # a later version
        (None, None),
        ("", None),
        (f"00-{TRACE}-00f067aa0ba902b7-01-extra", None),  # version 00 has four fields
        (f"ff-{TRACE}-00f067aa0ba902b7-01", None),
        (f"00-{'0' * 32}-00f067aa0ba902b7-01", None),
        (f"00-{TRACE}-{'0' * 16}-01", None),
        (f"00-{TRACE.upper()}-00f067aa0ba902b7-01", None),  # lowercase hex only
        (f"00-{TRACE[:-1]}-00f067aa0ba902b7-01", None),
    ],
)
def test_the_trace_id_of_a_traceparent_header(header, expected):
    assert trace_id(header) == expected

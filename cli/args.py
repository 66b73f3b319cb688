"""What the commands share: their options read from flags named after the fields, and
progress lines on stderr (stdout is the command's answer alone)."""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields
from typing import Any, TypeVar

T = TypeVar("T")


def from_flags(options: type[T], args: argparse.Namespace, **given: Any) -> T:
    """The dataclass `options`, each field not in `given` from the flag of its name (a
    field without a flag is an AttributeError: the flags are made to match)."""
    names = [field.name for field in fields(options) if field.name not in given]
    return options(**given, **{name: getattr(args, name) for name in names})


def log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)

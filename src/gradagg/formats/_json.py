"""JSON and JSON Lines by the rules of :mod:`gradagg.formats.text`: no float overflow, no repeated key."""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Iterator
from typing import Any

from gradagg.errors import FormatError, short_repr
from gradagg.formats._csv import too_many_digits

_JSON_SPACE = " \t\r"


class _NumberTooLarge(Exception):
    def __init__(self, token: str) -> None:
        super().__init__(token)
        self.token = token


class _RepeatedKey(Exception):
    pass


def _float(token: str) -> float:
    value = float(token)
    if math.isinf(value):  # only a literal such as 1e400 gets here; Infinity is a constant, not a float token
        raise _NumberTooLarge(token)
    return value


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    value = dict(pairs)
    if len(value) < len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _RepeatedKey(key)
            seen.add(key)
    return value


def load_json(text: str, source: str, line: int = 1) -> Any:
    """The JSON value of ``text``, with the rules of this module (no float overflow, no repeated key).

    Args:
        text: one JSON document.
        source: its name for messages.
        line: the line ``text`` starts on (for JSON Lines).

    Returns:
        The value; ``NaN``, ``Infinity`` and ``-Infinity`` are accepted as floats.

    Raises:
        FormatError: naming the line and column where known.

    >>> load_json('{"a": [1, 2.5, NaN]}', "x.json")
    {'a': [1, 2.5, nan]}
    """
    try:
        return json.loads(text, parse_float=_float, object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as exc:
        where = f"line {line + exc.lineno - 1} column {exc.colno}"
        raise FormatError(f"{source}: {where}: invalid JSON: {exc.msg}") from None
    except _NumberTooLarge as exc:
        raise FormatError(f"{source}: {_locate(text, exc.token, line)}number {short_repr(exc.token)} is too large "
                          "for a float (over 1.8e308)") from None
    except _RepeatedKey as exc:
        key = short_repr(exc.args[0])
        raise FormatError(f"{source}: {_line(text, line)}an object has the key {key} twice") from None
    except RecursionError:
        raise FormatError(f"{source}: {_line(text, line)}JSON nested too deeply (Python's parser stops near "
                          f"{sys.getrecursionlimit()} levels)") from None
    except ValueError as exc:  # the integer digit limit: int() refuses the token
        token = _long_integer(text)
        if token is None:
            raise FormatError(f"{source}: {_line(text, line)}{exc}") from None
        raise FormatError(f"{source}: {_locate(text, token, line)}{too_many_digits(token)}") from None


def _line(text: str, line: int) -> str:
    """Where an error without a position is: known only when the text is one line."""
    return "" if "\n" in text.rstrip("\n") else f"line {line}: "


def _long_integer(text: str) -> str | None:
    limit = sys.get_int_max_str_digits()
    match = re.search(rf"-?[0-9]{{{limit + 1},}}", text) if limit else None
    return match.group() if match else None


def _locate(text: str, token: str, line: int) -> str:
    at = text.find(token)
    if at < 0:
        return ""
    return f"line {line + text.count(chr(10), 0, at)} column {at - text.rfind(chr(10), 0, at)}: "


def json_lines(text: str, source: str) -> Iterator[tuple[int, Any]]:
    """One JSON value a line; a blank line is an error (JSON Lines has no empty value)."""
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()  # the newline that ends the last line
    for number, line in enumerate(lines, start=1):
        if not line.strip(_JSON_SPACE):
            raise FormatError(f"{source}: line {number}: blank line; JSON Lines holds one JSON value a line "
                              "(a microbatch whose parameters are all absent is [null, ...])")
        yield number, load_json(line, source, number)

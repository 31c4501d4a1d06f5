"""JSON and JSON Lines by the rules of :mod:`gradagg.rows.formats.text`: no float overflow, no repeated key.

The readers of both contracts' JSON and JSON Lines inputs are here, so that a JSON input is read in this module
from its text to its rows.
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Iterator
from typing import Any

from gradagg.errors import FormatError, short_repr

_JSON_SPACE = " \t\r"
OWNER_FIELDS = ("shard_id", "worker_id", "owner_id", "gradient")


def owner_rows(text: str, fmt: str, source: str) -> list[Any]:
    """Owner-sum rows of a ``json`` or ``jsonl`` input (see :func:`gradagg.rows.formats.text.read_owner_rows`)."""
    if fmt == "jsonl":
        return [_owner_row_from_json(value, line, source) for line, value in json_lines(text, source)]
    rows = load_json(text, source)
    if not isinstance(rows, list):
        raise FormatError(f"{source}: expected a JSON array of rows, got {type(rows).__name__}")
    return rows


def microbatches(text: str, fmt: str, source: str) -> tuple[list[Any], Any]:
    """``(rows, active_counts)`` of a ``json`` or ``jsonl`` input (see ``text.read_microbatches``)."""
    if fmt == "jsonl":
        return [value for _, value in json_lines(text, source)], None
    return _microbatches_from_json(load_json(text, source), source)


def too_many_digits(digits: str) -> str:
    """The message for an integer longer than Python converts from text."""
    return (f"an integer of {len(digits.lstrip('+-'))} digits, over Python's limit of "
            f"{sys.get_int_max_str_digits()} digits for reading one as text")



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


def _owner_row_from_json(value: Any, line: int, source: str) -> Any:
    if not isinstance(value, dict):
        return value  # an array row, or garbage that the reference names by row
    if set(value) != set(OWNER_FIELDS):
        missing = sorted(set(OWNER_FIELDS) - set(value))
        extra = sorted(set(value) - set(OWNER_FIELDS))
        raise FormatError(
            f"{source}: line {line}: object keys must be {', '.join(OWNER_FIELDS)}; "
            f"missing {missing}, unexpected {short_repr(extra)}"
        )
    return [value[k] for k in OWNER_FIELDS]


def _microbatches_from_json(data: Any, source: str) -> tuple[list[Any], Any]:
    if isinstance(data, list):
        return data, None
    if not isinstance(data, dict) or "rows" not in data:
        raise FormatError(f'{source}: expected {{"rows": [...], "active_counts": [...]}} or an array of rows')
    extra = sorted(set(data) - {"rows", "active_counts"})
    if extra:
        raise FormatError(f"{source}: unexpected keys {short_repr(extra)}; allowed are rows, active_counts")
    rows = data["rows"]
    if not isinstance(rows, list):
        raise FormatError(f'{source}: "rows" must be an array, got {type(rows).__name__}')
    return rows, data.get("active_counts")

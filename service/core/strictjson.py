"""JSON as RFC 8259 means it, for everything a user sends: request bodies and uploaded lines.

Python's ``json`` module accepts more than JSON: ``NaN`` and ``Infinity``, numbers too large for a
double (``1e309`` becomes infinity), lone surrogates (``"\\ud800"``, which no UTF-8 text can hold),
and nesting until the interpreter's stack runs out. Each of those, once stored, breaks whatever
renders or stores it later (a 500 on every page that lists it, PostgreSQL refusing the row), so
they are refused at the door with a 400 that names where they are. So is a NUL character
(``\\u0000``): PostgreSQL's text cannot hold it, and no model means anything by it.

The checks cost almost nothing on clean input: the parser's hooks flag non-finite numbers, the
depth is counted over arrays and objects only, and the walk that finds where a problem is runs only
when there is one.

Before any parsing, a text with more than ``MAX_CONTAINERS`` arrays and objects or ``MAX_VALUES``
values is refused (``TooMany``): counted in the raw text at C speed (brackets and commas; inside
strings too, so a text near the limit is counted again with its strings left out). Parsing and
validating 2.7 million empty objects held the API's event loop for seconds; no request of ours needs
a hundredth of that.
"""

from __future__ import annotations

import json
import math
import re
from json.decoder import scanstring  # type: ignore[attr-defined]
from typing import Any

MAX_BODY_DEPTH = 128
"""Levels of nested arrays and objects in a request body: a dataset line may have 100 (an item of
a grader's dry run sits one level down), a grader spec a few dozen."""

MAX_CONTAINERS = 100_000
"""Arrays and objects in one text: a 4,096-message chat holds ~8,200, a training line a few dozen."""
MAX_VALUES = 1_000_000
"""Values (array items and object members) in one text."""

_SUSPECT = re.compile(r"\\u(?:[dD][89a-fA-F]|0000)")  # a surrogate's or a NUL's escape


class InvalidJSON(ValueError):
    def __init__(self, problem: str, path: str | None) -> None:
        super().__init__(problem)
        self.problem, self.path = problem, path

    def where(self) -> str:
        return f" (at {self.path})" if self.path else ""


class TooMany(InvalidJSON):
    """More arrays and objects, or values, than one text may hold: refused before it is parsed."""


def _count_structure(text: str, max_containers: int, max_values: int) -> None:
    containers, separators = text.count("{") + text.count("["), text.count(",")
    if containers <= max_containers and separators < max_values:
        return
    # Brackets and commas inside strings are text, not structure: count again between the strings,
    # each skipped by the json module's own scanner (C, linear: a string that never ends stops the
    # count, and the parse reports it), a string at a time (a thread running this lets others run
    # between them), stopping once past.
    containers = separators = at = 0
    while True:
        quote = text.find('"', at)
        end = len(text) if quote < 0 else quote
        containers += text.count("{", at, end) + text.count("[", at, end)
        separators += text.count(",", at, end)
        if quote < 0 or containers > max_containers or separators >= max_values:
            break
        try:
            at = scanstring(text, quote + 1, False)[1]
        except ValueError:  # unterminated, or a bad escape: not JSON, which the parse says
            return
    if containers > max_containers:
        raise TooMany(f"it holds more than {max_containers:,} arrays and objects", None)
    if separators >= max_values:
        raise TooMany(f"it holds more than {max_values:,} values", None)


class _NonFinite:
    def __init__(self, token: str) -> None:
        self.token = token


def loads(
    text: str,
    *,
    max_depth: int = MAX_BODY_DEPTH,
    max_containers: int = MAX_CONTAINERS,
    max_values: int = MAX_VALUES,
) -> Any:
    """``text`` parsed, or ``InvalidJSON`` saying what is wrong and where (``TooMany`` before any
    parsing); a syntax error is ``json.JSONDecodeError`` as usual. Text, not bytes: ``json.loads``
    would take bytes in UTF-16, or UTF-8 with encoded surrogates, past the checks here; the caller
    decodes strictly."""
    _count_structure(text, max_containers, max_values)
    flagged = False

    def non_finite(token: str) -> _NonFinite:
        nonlocal flagged
        flagged = True
        return _NonFinite(token)

    def number(token: str) -> float | _NonFinite:
        value = float(token)
        return value if math.isfinite(value) else non_finite(token)

    try:
        obj = json.loads(text, parse_constant=non_finite, parse_float=number)
    except RecursionError:
        raise InvalidJSON(f"it nests arrays or objects more than {max_depth} levels deep; flatten it", None) from None
    deep = text.count("[") + text.count("{") > max_depth and depth(obj, max_depth) > max_depth
    if flagged or deep or _SUSPECT.search(text):
        _walk(obj, max_depth)
    return obj


def depth(obj: Any, limit: int) -> int:
    """Levels of nested arrays and objects in parsed JSON, counted up to ``limit + 1`` (iteratively:
    no recursion limit to hit; only arrays and objects are visited)."""
    if not isinstance(obj, (dict, list)):
        return 0
    deepest, stack = 0, [(obj, 1)]
    while stack:
        node, level = stack.pop()
        deepest = max(deepest, level)
        if level > limit:
            break
        children = node.values() if isinstance(node, dict) else node
        stack.extend((child, level + 1) for child in children if isinstance(child, (dict, list)))
    return deepest


def _walk(obj: Any, max_depth: int) -> None:
    """Find the first value that is no JSON, depth first, with its dotted path (made only for the
    arrays and objects it goes into, and for the value it reports)."""
    _check_value(obj, "")
    stack: list[tuple[Any, str, int]] = [(obj, "", 1)] if isinstance(obj, (dict, list)) else []
    while stack:
        node, path, depth = stack.pop()
        if depth > max_depth:
            raise InvalidJSON(f"it nests arrays or objects more than {max_depth} levels deep; flatten it", path or None)
        inner: list[tuple[Any, str, int]] = []
        if isinstance(node, dict):
            for key, value in node.items():
                shown = key.encode("utf-8", "backslashreplace").decode()  # a path fit to print
                child = f"{path}.{shown}" if path else shown
                _check_text(key, child)
                if isinstance(value, (dict, list)):
                    inner.append((value, child, depth + 1))
                else:
                    _check_value(value, child)
        else:
            for i, value in enumerate(node):
                if isinstance(value, (dict, list)):
                    inner.append((value, f"{path}[{i}]", depth + 1))
                elif isinstance(value, (str, _NonFinite)):
                    _check_value(value, f"{path}[{i}]")
        stack.extend(reversed(inner))


def _check_value(value: Any, path: str) -> None:
    if isinstance(value, _NonFinite):
        raise InvalidJSON(f"{value.token} is not a finite number; JSON numbers are finite", path or None)
    if isinstance(value, str):
        _check_text(value, path)


def _check_text(text: str, path: str) -> None:
    if "\x00" in text:
        raise InvalidJSON("a string holds a NUL character (\\u0000), which cannot be stored; remove it", path or None)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        code = f"\\u{ord(text[exc.start]):04x}"
        raise InvalidJSON(
            f"a string holds a lone surrogate ({code}), which is not Unicode text; pair it or remove it", path or None
        ) from None

"""JSON as RFC 8259 means it, for everything a user sends: request bodies and uploaded lines.

Python's ``json`` module accepts more than JSON: ``NaN`` and ``Infinity``, numbers too large for a
double (``1e309`` becomes infinity), lone surrogates (``"\\ud800"``, which no UTF-8 text can hold),
and nesting until the interpreter's stack runs out. Each of those, once stored, breaks whatever
renders or stores it later (a 500 on every page that lists it, PostgreSQL refusing the row), so
they are refused at the door with a 400 that names where they are. So is a NUL character
(``\\u0000``): PostgreSQL's text cannot hold it, and no model means anything by it.

The checks cost almost nothing on clean input: the parser's hooks flag non-finite numbers, and the
walk that finds where a problem is (and the surrogates, NULs and depth) runs only when the raw text
says it may be needed.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

MAX_BODY_DEPTH = 128
"""Levels of nested arrays and objects in a request body: a dataset line may have 100 (an item of
a grader's dry run sits one level down), a grader spec a few dozen."""

_SUSPECT = re.compile(r"\\u(?:[dD][89a-fA-F]|0000)")  # a surrogate's or a NUL's escape


class InvalidJSON(ValueError):
    def __init__(self, problem: str, path: str | None) -> None:
        super().__init__(problem)
        self.problem, self.path = problem, path

    def where(self) -> str:
        return f" (at {self.path})" if self.path else ""


class _NonFinite:
    def __init__(self, token: str) -> None:
        self.token = token


def loads(text: str, *, max_depth: int = MAX_BODY_DEPTH) -> Any:
    """``text`` parsed, or ``InvalidJSON`` saying what is wrong and where; a syntax error is
    ``json.JSONDecodeError`` as usual. Text, not bytes: ``json.loads`` would take bytes in UTF-16,
    or UTF-8 with encoded surrogates, past the checks here; the caller decodes strictly."""
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
    if flagged or _SUSPECT.search(text) or text.count("[") + text.count("{") > max_depth:
        _walk(obj, max_depth)
    return obj


def depth(obj: Any, limit: int) -> int:
    """Levels of nested arrays and objects in parsed JSON, counted up to ``limit + 1`` (iteratively:
    no recursion limit to hit)."""
    deepest, stack = 0, [(obj, 1)]
    while stack:
        node, level = stack.pop()
        if isinstance(node, (dict, list)):
            deepest = max(deepest, level)
            if level > limit:
                break
            stack.extend((child, level + 1) for child in (node.values() if isinstance(node, dict) else node))
    return deepest


def _walk(obj: Any, max_depth: int) -> None:
    """Find the first value that is no JSON, depth first, with its dotted path."""
    stack: list[tuple[Any, str, int]] = [(obj, "", 1)]
    while stack:
        node, path, depth = stack.pop()
        if isinstance(node, _NonFinite):
            raise InvalidJSON(f"{node.token} is not a finite number; JSON numbers are finite", path or None)
        if isinstance(node, str):
            _check_text(node, path)
        elif isinstance(node, (dict, list)):
            if depth > max_depth:
                raise InvalidJSON(
                    f"it nests arrays or objects more than {max_depth} levels deep; flatten it", path or None
                )
            children = []
            if isinstance(node, dict):
                for key, value in node.items():
                    shown = key.encode("utf-8", "backslashreplace").decode()  # a path fit to print
                    child = f"{path}.{shown}" if path else shown
                    _check_text(key, child)
                    children.append((value, child, depth + 1))
            else:
                children = [(value, f"{path}[{i}]", depth + 1) for i, value in enumerate(node)]
            stack.extend(reversed(children))


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

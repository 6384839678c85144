"""``calculate_output``: a tiny arithmetic language over sub-grader names, parsed and run by hand.

The formula is user text, so it is read by this small tokenizer and recursive-descent parser into
our own expression nodes, which ``evaluate`` interprets. Python's ``eval``/``exec``/``compile``
never see it, and its length and nesting are bounded so hostile input cannot exhaust the stack.
This module imports nothing of the project's: it can be reviewed alone.

The language: numbers, names, ``+ - * /``, parentheses, and ``abs(x)``, ``clip(x, lo, hi)``,
``max(a, b, ...)``, ``min(a, b, ...)``. NaN in, NaN out; ``x / 0`` is NaN, not an exception.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "FUNCTIONS",
    "IDENTIFIER",
    "MAX_FORMULA_DEPTH",
    "MAX_FORMULA_LENGTH",
    "Expr",
    "FormulaError",
    "evaluate",
    "parse",
]

NAN = float("nan")

MAX_FORMULA_LENGTH = 1000
"""Longest ``calculate_output`` accepted, in characters: a reward formula is one line, not a program."""

MAX_FORMULA_DEPTH = 50
"""Deepest nesting of parentheses, calls and unary signs in ``calculate_output``; bounds recursion."""


class FormulaError(ValueError):
    """A formula that does not parse; the message says where and what to write instead."""


@dataclass(frozen=True)
class _Num:
    value: float


@dataclass(frozen=True)
class _Name:
    name: str


@dataclass(frozen=True)
class _Unary:
    op: str  # "-" or "+"
    operand: Expr


@dataclass(frozen=True)
class _Binary:
    op: str  # "+", "-", "*", "/"
    left: Expr
    right: Expr


@dataclass(frozen=True)
class _Call:
    func: str
    args: tuple[Expr, ...]


Expr = _Num | _Name | _Unary | _Binary | _Call

# name -> (min args, max args or None for unbounded)
FUNCTIONS: dict[str, tuple[int, int | None]] = {
    "abs": (1, 1),
    "clip": (3, 3),
    "max": (1, None),
    "min": (1, None),
}
_FUNCTION_USAGE = "abs(x), clip(x, lo, hi), max(a, b, ...), min(a, b, ...)"

IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_NUMBER = re.compile(r"(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
_PUNCT = "+-*/(),"

# Characters that mean the user is writing Python, with the reason it is refused.
_REFUSED_CHARS = {
    ".": "attribute access ('.') is not allowed",
    "[": "subscripts ('[...]') are not allowed",
    "]": "subscripts ('[...]') are not allowed",
    "'": "strings are not allowed",
    '"': "strings are not allowed",
    ":": "':' is not allowed (no lambdas, slices or dicts)",
    "=": "'=' is not allowed (no assignments or comparisons)",
    "%": "'%' is not supported",
    "{": "braces are not allowed; write sub-grader names bare, not as templates",
    "}": "braces are not allowed; write sub-grader names bare, not as templates",
}


@dataclass(frozen=True)
class _Token:
    kind: str  # "num", "name", "op", "end"
    text: str
    pos: int


def _tokenize(text: str, fail: Callable[[str], FormulaError]) -> list[_Token]:
    tokens: list[_Token] = []
    i = 0
    while i < len(text):
        ch = text[i]
        if ch.isspace():
            i += 1
            continue
        number = _NUMBER.match(text, i)
        if number:
            tokens.append(_Token("num", number.group(), i))
            i = number.end()
            continue
        ident = IDENTIFIER.match(text, i)
        if ident:
            tokens.append(_Token("name", ident.group(), i))
            i = ident.end()
            continue
        if text.startswith("**", i):
            raise fail(f"'**' (power) at position {i} is not supported; multiply instead (x * x)")
        if text.startswith("//", i):
            raise fail(f"'//' at position {i} is not supported; use '/'")
        if ch in _PUNCT:
            tokens.append(_Token("op", ch, i))
            i += 1
            continue
        reason = _REFUSED_CHARS.get(ch, f"unexpected character {ch!r}")
        raise fail(
            f"{reason} (position {i}); use numbers, sub-grader names, + - * /, parentheses and {_FUNCTION_USAGE}"
        )
    tokens.append(_Token("end", "", len(text)))
    return tokens


class _FormulaParser:
    """Recursive descent over the grammar below; every recursion step counts toward the depth cap.

    ``expr  := term (('+' | '-') term)*``
    ``term  := unary (('*' | '/') unary)*``
    ``unary := ('-' | '+') unary | atom``
    ``atom  := NUMBER | NAME | FUNC '(' expr (',' expr)* ')' | '(' expr ')'``
    """

    def __init__(self, text: str, names: Sequence[str]) -> None:
        self.text = text
        self.names = frozenset(names)
        self.known = ", ".join(sorted(names)) or "(none)"
        self.tokens = _tokenize(text, self.fail)
        self.index = 0
        self.depth = 0

    def fail(self, message: str) -> FormulaError:
        return FormulaError(f"calculate_output: {message}")

    def parse(self) -> Expr:
        if self.peek().kind == "end":
            raise self.fail("the formula is empty; write e.g. '0.7 * correct + 0.3 * fluent'")
        expr = self.expr()
        token = self.peek()
        if token.kind != "end":
            raise self.fail(
                f"unexpected {token.text!r} at position {token.pos}; expected an operator "
                "(+ - * /) or the end of the formula"
            )
        return expr

    def peek(self) -> _Token:
        return self.tokens[self.index]

    def advance(self) -> _Token:
        token = self.tokens[self.index]
        self.index += 1
        return token

    def enter(self) -> None:
        self.depth += 1
        if self.depth > MAX_FORMULA_DEPTH:
            raise self.fail(
                f"nesting is deeper than {MAX_FORMULA_DEPTH} (parentheses, calls and signs); simplify the formula"
            )

    def expect(self, text: str, what: str) -> None:
        token = self.peek()
        if token.kind != "op" or token.text != text:
            found = "the end of the formula" if token.kind == "end" else repr(token.text)
            raise self.fail(f"expected {what} at position {token.pos}, found {found}")
        self.advance()

    def expr(self) -> Expr:
        left = self.term()
        while self.peek().kind == "op" and self.peek().text in "+-":
            op = self.advance().text
            left = _Binary(op, left, self.term())
        return left

    def term(self) -> Expr:
        left = self.unary()
        while self.peek().kind == "op" and self.peek().text in "*/":
            op = self.advance().text
            left = _Binary(op, left, self.unary())
        return left

    def unary(self) -> Expr:
        token = self.peek()
        if token.kind == "op" and token.text in "+-":
            self.advance()
            self.enter()
            operand = self.unary()
            self.depth -= 1
            return _Unary(token.text, operand)
        return self.atom()

    def atom(self) -> Expr:
        token = self.advance()
        if token.kind == "num":
            value = float(token.text)
            if not math.isfinite(value):
                raise self.fail(f"number {token.text!r} at position {token.pos} is too large")
            return _Num(value)
        if token.kind == "name":
            if self.peek().kind == "op" and self.peek().text == "(":
                return self.call(token)
            if token.text in FUNCTIONS:
                raise self.fail(f"'{token.text}' at position {token.pos} is a function; call it as {token.text}(...)")
            if token.text not in self.names:
                raise self.fail(f"unknown name '{token.text}' at position {token.pos}; known sub-graders: {self.known}")
            return _Name(token.text)
        if token.kind == "op" and token.text == "(":
            self.enter()
            inner = self.expr()
            self.expect(")", "')'")
            self.depth -= 1
            return inner
        found = "the end of the formula" if token.kind == "end" else repr(token.text)
        raise self.fail(f"expected a number, a sub-grader name or '(' at position {token.pos}, found {found}")

    def call(self, name: _Token) -> Expr:
        if name.text not in FUNCTIONS:
            what = "a sub-grader, not a function" if name.text in self.names else "not a function"
            raise self.fail(f"'{name.text}' at position {name.pos} is {what}; the functions are {_FUNCTION_USAGE}")
        self.advance()  # "("
        self.enter()
        args: list[Expr] = []
        if not (self.peek().kind == "op" and self.peek().text == ")"):
            args.append(self.expr())
            while self.peek().kind == "op" and self.peek().text == ",":
                self.advance()
                args.append(self.expr())
        self.expect(")", "')' or ','")
        self.depth -= 1
        lo, hi = FUNCTIONS[name.text]
        if len(args) < lo or (hi is not None and len(args) > hi):
            expected = f"exactly {lo}" if lo == hi else f"at least {lo}"
            raise self.fail(
                f"{name.text}() at position {name.pos} takes {expected} argument"
                f"{'' if lo == 1 else 's'}, got {len(args)}"
            )
        return _Call(name.text, tuple(args))


def parse(text: str, names: Sequence[str]) -> Expr:
    """The formula's expression tree; ``names`` are the sub-graders it may use."""
    if len(text) > MAX_FORMULA_LENGTH:
        raise FormulaError(f"calculate_output is {len(text)} characters; the limit is {MAX_FORMULA_LENGTH}")
    return _FormulaParser(text, names).parse()


def evaluate(expr: Expr, env: Mapping[str, float]) -> float:
    """Interpret a parsed formula for one sample. NaN in, NaN out; x / 0 is NaN, not an exception."""
    if isinstance(expr, _Num):
        return expr.value
    if isinstance(expr, _Name):
        return env[expr.name]
    if isinstance(expr, _Unary):
        value = evaluate(expr.operand, env)
        return -value if expr.op == "-" else value
    if isinstance(expr, _Binary):
        left = evaluate(expr.left, env)
        right = evaluate(expr.right, env)
        if expr.op == "+":
            return left + right
        if expr.op == "-":
            return left - right
        if expr.op == "*":
            return left * right
        return NAN if right == 0 else left / right
    args = [evaluate(a, env) for a in expr.args]
    # Python's min/max answer depends on argument order when one is NaN; make NaN win always.
    if any(math.isnan(a) for a in args):
        return NAN
    if expr.func == "abs":
        return abs(args[0])
    if expr.func == "min":
        return min(args)
    if expr.func == "max":
        return max(args)
    x, lo, hi = args  # clip; with lo > hi this gives hi, as numpy.clip does
    return min(max(x, lo), hi)

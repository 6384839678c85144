"""The built-in tools: deterministic, in-process, for tests and examples (``runtime: {type:
"builtin"}``). Each takes the call's arguments (already checked against its schema) and returns the
text the model reads, or raises ``ToolFailed`` with the error it reads instead."""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable
from decimal import ROUND_FLOOR, Decimal, InvalidOperation, localcontext
from typing import Any

from service.tools.errors import ToolFailed

CALCULATOR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"expression": {"type": "string", "description": "Arithmetic: + - * / // % ** and parentheses."}},
    "required": ["expression"],
    "additionalProperties": False,
}
"""The calculator's ``parameters``, which a job may leave out (the built-in's own is used)."""

_MAX_EXPRESSION = 256
_MAX_DIGITS = 64
_BINARY: dict[type, Callable[[Decimal, Decimal], Decimal]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: lambda a, b: _floor(a / b),
    ast.Mod: lambda a, b: a - b * _floor(a / b),  # Python's: the sign of the divisor
    ast.Pow: operator.pow,
}


def calculator(arguments: dict[str, Any]) -> str:
    """``expression`` evaluated exactly (decimal arithmetic, 64 significant digits, ``//`` and ``%``
    floored as Python's): integers stay
    integers (``12345+678`` is ``13023``), a quotient is written without trailing zeros. Names,
    calls and anything but numbers and the operators above are refused, and so are results (or
    powers) past 64 digits."""
    expression = arguments.get("expression")
    if not isinstance(expression, str) or not expression.strip():
        raise ToolFailed("expression must be a non-empty string such as '12 * (3 + 4)'")
    if len(expression) > _MAX_EXPRESSION:
        raise ToolFailed(f"expression is longer than {_MAX_EXPRESSION} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ToolFailed(f"cannot parse {expression!r} as arithmetic") from None
    with localcontext() as ctx:
        ctx.prec = _MAX_DIGITS
        try:
            value = _evaluate(tree.body)
        except (InvalidOperation, ZeroDivisionError, OverflowError):
            raise ToolFailed(f"{expression!r} has no finite value (a division by zero?)") from None
    return _written(value)


def _evaluate(node: ast.AST) -> Decimal:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        if len(str(node.value)) > _MAX_DIGITS:
            raise ToolFailed(f"numbers are at most {_MAX_DIGITS} digits")
        return Decimal(str(node.value))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and (abs(right) > 256 or right != right.to_integral_value()):
            raise ToolFailed("exponents are whole numbers of at most 256")
        value = _BINARY[type(node.op)](left, right)
        if value.is_finite() and value != 0 and value.adjusted() >= _MAX_DIGITS:
            raise ToolFailed(f"the result is longer than {_MAX_DIGITS} digits")
        return value
    raise ToolFailed("only numbers, + - * / // % ** and parentheses are allowed")


def _floor(value: Decimal) -> Decimal:
    return value.to_integral_value(rounding=ROUND_FLOOR)


def _written(value: Decimal) -> str:
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")


BUILTINS: dict[str, tuple[Callable[[dict[str, Any]], str], dict[str, Any], str]] = {
    "calculator": (calculator, CALCULATOR_SCHEMA, "Evaluate an arithmetic expression exactly."),
}
"""Each built-in's function, default ``parameters`` and default ``description``."""

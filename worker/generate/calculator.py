"""A built-in agent tool: ``calculate``, safe arithmetic for tool-calling math runs.

Name it in a run config as ``[agent] tools = ["worker.generate.calculator:calculate"]``. It runs in the worker's
tool process (``worker.generate.tool_process``) like any user tool: its type hints and Google-style docstring
are the JSON schema the model sees, and a refused expression raises ``ValueError``, which the tool process turns
into an error observation the model reads (a counted tool failure).

The expression is parsed with ``ast`` and evaluated node by node; nothing is ``eval``-ed. Allowed: int and
float literals, ``+ - * / // % **``, unary ``+``/``-`` and parentheses. Everything else (names, calls,
attributes, subscripts, comparisons, strings, ``^``...) is refused, and so is whatever could hang the process
or exhaust its memory: input longer than ``MAX_EXPRESSION_CHARS``, an exponent beyond ``MAX_EXPONENT``, any
value beyond ``10**MAX_DIGITS`` in size (checked before a power is computed, and after every operation), and
division by zero.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable

# Longest expression accepted, in characters.
MAX_EXPRESSION_CHARS = 500
# Largest exponent's magnitude in a power.
MAX_EXPONENT = 1000
# Largest magnitude of any value, literal, intermediate or result: 10**MAX_DIGITS.
MAX_DIGITS = 100
# Significant digits of a float result.
FLOAT_DIGITS = 12

_LIMIT = 10**MAX_DIGITS
_ALLOWED = "numbers, + - * / // % **, unary + and -, and parentheses"

_BINARY: dict[type[ast.operator], tuple[str, Callable[[float, float], float]]] = {
    ast.Add: ("+", operator.add),
    ast.Sub: ("-", operator.sub),
    ast.Mult: ("*", operator.mul),
    ast.Div: ("/", operator.truediv),
    ast.FloorDiv: ("//", operator.floordiv),
    ast.Mod: ("%", operator.mod),
    ast.Pow: ("**", operator.pow),
}
_UNARY: dict[type[ast.unaryop], Callable[[float], float]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
# What a refused node is, in the message the model reads.
_REFUSED_NODES: dict[type[ast.AST], str] = {
    ast.Name: "names",
    ast.Call: "function calls",
    ast.Attribute: "attributes",
    ast.Subscript: "subscripts",
    ast.Compare: "comparisons",
    ast.BoolOp: "'and'/'or'",
    ast.Lambda: "lambdas",
}


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression and return its value.

    Args:
        expression: The arithmetic to evaluate, e.g. "(12 + 3) * 4 / 5". Only numbers, + - * / // % ** and
            parentheses are allowed; use ** for powers.

    Returns:
        The value as text: an integer without a decimal point, or a float rounded to 12 significant digits.
    """
    if not isinstance(expression, str):
        raise ValueError(f"expression must be text, got {type(expression).__name__}")
    text = expression.strip()
    if not text:
        raise ValueError(f"the expression is empty; write arithmetic using {_ALLOWED}")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise ValueError(
            f"the expression is {len(text)} characters long, over the limit of {MAX_EXPRESSION_CHARS}; "
            "split it into smaller calculations"
        )
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as error:
        reason = error.msg if isinstance(error, SyntaxError) else str(error) or type(error).__name__
        shown = text if len(text) <= 60 else text[:57] + "..."
        raise ValueError(f"{shown!r} is not an arithmetic expression ({reason}); use only {_ALLOWED}") from None
    try:
        value = _evaluate(tree.body)
    except RecursionError:
        raise ValueError("the expression is nested too deeply; split it into smaller calculations") from None
    return _format(value)


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant):
        value = node.value
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{value!r} is not a number; use only {_ALLOWED}")
        return _bounded(value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _bounded(_UNARY[type(node.op)](_evaluate(node.operand)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        symbol, apply = _BINARY[type(node.op)]
        left, right = _evaluate(node.left), _evaluate(node.right)
        if symbol == "**":
            _check_power(left, right)
        elif symbol in ("/", "//", "%") and right == 0:
            raise ValueError(f"division by zero ({symbol} 0)")
        try:
            result = apply(left, right)
        except ZeroDivisionError:
            raise ValueError("division by zero (0 to a negative power)") from None
        except OverflowError:
            raise ValueError(f"the result is too large (over 10**{MAX_DIGITS})") from None
        return _bounded(result)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitXor):
        raise ValueError("'^' is not a power here; write powers with **, e.g. 2**10")
    for kind, what in _REFUSED_NODES.items():
        if isinstance(node, kind):
            raise ValueError(f"{what} are not allowed; use only {_ALLOWED}")
    raise ValueError(f"{type(node).__name__} is not allowed; use only {_ALLOWED}")


def _check_power(base: int | float, exponent: int | float) -> None:
    """Refuse a power before computing it when its exponent or its result would be too large."""
    if abs(exponent) > MAX_EXPONENT:
        raise ValueError(f"the exponent {_format(exponent)} is too large (at most {MAX_EXPONENT} in magnitude)")
    if base < 0 and exponent != int(exponent):
        raise ValueError("a negative number to a fractional power is not a real number")
    if base != 0 and exponent * math.log10(abs(base)) > MAX_DIGITS:
        raise ValueError(f"the result is too large (over 10**{MAX_DIGITS})")


def _bounded(value: int | float) -> int | float:
    if isinstance(value, complex):  # not reachable after _check_power; kept so no complex is ever formatted
        raise ValueError("the result is not a real number")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("the result is not a finite number")
    if abs(value) > _LIMIT:
        raise ValueError(f"the result is too large (over 10**{MAX_DIGITS})")
    return value


def _format(value: int | float) -> str:
    """An int as is; a float with FLOAT_DIGITS significant digits, without '.0' when it is whole."""
    if isinstance(value, int):
        return str(value)
    rounded = float(f"{value:.{FLOAT_DIGITS}g}")
    if rounded == 0:
        return "0"
    if rounded.is_integer() and abs(rounded) < 10**FLOAT_DIGITS:
        return str(int(rounded))
    return f"{rounded:.{FLOAT_DIGITS}g}"

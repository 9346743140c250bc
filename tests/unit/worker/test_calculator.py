"""The built-in ``calculate`` tool (``worker.generate.calculator``): arithmetic evaluated with ``ast``; anything
else, or anything too large to compute quickly, raises ValueError, which the tool process shows the model."""

from __future__ import annotations

import time
import uuid

import pytest
from transformers.utils import get_json_schema

from worker.generate.calculator import MAX_DIGITS, MAX_EXPONENT, MAX_EXPRESSION_CHARS, calculate
from worker.generate.tool_process import ToolAnswer, ToolProcess

CALCULATOR = "worker.generate.calculator:calculate"


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("1 + 2", "3"),
        ("2 + 3 * 4", "14"),
        ("(2 + 3) * 4", "20"),
        ("((1 + 2) * (3 + 4)) - 5", "16"),
        ("-5 + 2", "-3"),
        ("- -3", "3"),
        ("+7", "7"),
        ("-2 ** 2", "-4"),  # Python's precedence: the power binds tighter than the sign
        ("(-2) ** 2", "4"),
        ("2 ** 3 ** 2", "512"),  # right-associative
        ("2 ** 10", "1024"),
        ("7 // 2", "3"),
        ("-7 // 2", "-4"),
        ("-7 % 3", "2"),
        ("17 % 5", "2"),
        ("10 - 2 - 3", "5"),  # left-associative
        ("48 / 2 * 3", "72"),
        ("6 / 3", "2"),  # a whole float is shown without ".0"
        ("3.0 * 2", "6"),
        ("7 / 2", "3.5"),
        ("2 ** -2", "0.25"),
        ("0.1 + 0.2", "0.3"),  # rounded to 12 significant digits
        ("1 / 3", "0.333333333333"),
        ("2 ** 0.5", "1.41421356237"),
        ("-1 / 8", "-0.125"),
        ("0 * -1.5", "0"),  # no "-0"
        ("1e20", "1e+20"),
        ("1_000 * 3", "3000"),
        ("  12 * 12  ", "144"),
        (f"10 ** {MAX_DIGITS}", "1" + "0" * MAX_DIGITS),  # the largest value allowed
        ("123456789 * 987654321", "121932631112635269"),  # ints stay exact
    ],
)
def test_arithmetic_results(expression: str, expected: str) -> None:
    assert calculate(expression) == expected


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("x + 1", "names are not allowed"),
        ("__import__('os')", "function calls are not allowed"),
        ("abs(-3)", "function calls are not allowed"),
        ("(1).real", "attributes are not allowed"),
        ("(2).__class__", "attributes are not allowed"),
        ("[1, 2][0]", "subscripts are not allowed"),
        ("1 < 2", "comparisons are not allowed"),
        ("1 and 2", "'and'/'or'"),
        ("lambda: 1", "lambdas are not allowed"),
        ("[1]", "List is not allowed"),
        ("1, 2", "Tuple is not allowed"),
        ("2 ^ 3", "write powers with **"),
        ("1 & 3", "BinOp is not allowed"),
        ("~1", "UnaryOp is not allowed"),
        ("not 1", "UnaryOp is not allowed"),
        ("True + 1", "True is not a number"),
        ("'a' * 3", "'a' is not a number"),
        ("2j", "2j is not a number"),
        ("9 ** 9 ** 9", "exponent 387420489 is too large"),
        (f"2 ** {MAX_EXPONENT + 1}", f"at most {MAX_EXPONENT}"),
        ("10 ** 101", "result is too large"),
        ("0.5 ** -400", "result is too large"),
        ("10 ** 99 * 10 ** 99", "result is too large"),
        ("1e308 * 10", "result is too large"),
        ("1" * 101, "result is too large"),  # a literal too
        ("(-8) ** 0.5", "not a real number"),
        ("1 / 0", "division by zero"),
        ("1 // 0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("1 / (2 - 2)", "division by zero"),
        ("1.5 / 0.0", "division by zero"),
        ("0 ** -1", "division by zero"),
        ("", "empty"),
        ("   ", "empty"),
        ("hello world", "not an arithmetic expression"),
        ("import os", "not an arithmetic expression"),
        ("1 +", "not an arithmetic expression"),
        ("2 = 2", "not an arithmetic expression"),
        ("(" * 300 + "1" + ")" * 300, "characters long"),
        ("1+" * (MAX_EXPRESSION_CHARS // 2) + "1", "characters long"),
    ],
)
def test_refusals_raise_value_error_saying_why(expression: str, message: str) -> None:
    with pytest.raises(ValueError) as caught:
        calculate(expression)
    assert message in str(caught.value), str(caught.value)


def test_every_refusal_says_what_is_allowed() -> None:
    for expression in ("x", "f(1)", "a.b", "hello world", ""):
        with pytest.raises(ValueError, match=r"\+ - \* / // % \*\*"):
            calculate(expression)


def test_huge_powers_are_refused_without_computing_them() -> None:
    started = time.monotonic()
    for expression in ("9**9**9", "999**999", "(10**100)**(10**100)", "2**1000*2**1000", "-(9**999)"):
        with pytest.raises(ValueError, match="too large"):
            calculate(expression)
    assert time.monotonic() - started < 1.0


def test_long_chains_within_the_length_limit_evaluate() -> None:
    assert calculate("1+" * 200 + "1") == "201"
    assert calculate("-" * 400 + "1") == "1"
    assert calculate("(" * 150 + "2" + ")" * 150) == "2"


@pytest.mark.parametrize("depth", [199, 240])
def test_nesting_within_the_length_limit_evaluates_or_is_refused(depth: int) -> None:
    # Python's parser refuses about 200 nested parentheses: a refusal must still be a ValueError.
    try:
        assert calculate("(" * depth + "3" + ")" * depth) == "3"
    except ValueError as error:
        assert "not an arithmetic expression" in str(error)


def test_non_text_is_refused() -> None:
    with pytest.raises(ValueError, match="must be text"):
        calculate(12)  # type: ignore[arg-type]


def test_json_schema_describes_the_expression_parameter() -> None:
    schema = get_json_schema(calculate)
    function = schema["function"]
    assert function["name"] == "calculate"
    assert function["description"].startswith("Evaluate an arithmetic expression")
    assert function["parameters"]["required"] == ["expression"]
    expression = function["parameters"]["properties"]["expression"]
    assert expression["type"] == "string"
    assert "parentheses" in expression["description"]
    assert function["return"]["type"] == "string"


@pytest.mark.processes
def test_the_tool_process_answers_results_and_shows_refusals_to_the_model() -> None:
    with ToolProcess([CALCULATOR], None, timeout_s=5) as process:
        (schemas,) = process.describe().values()
        assert [schema["function"]["name"] for schema in schemas] == ["calculate"]
        conversation = uuid.uuid4().hex
        process.start(conversation, None, "What is 12 * 7?", "84")
        assert process.call(conversation, "calculate", {"expression": "12 * 7"}) == ToolAnswer("84", failed=False)
        bad = process.call(conversation, "calculate", {"expression": "9**9**9"})
        assert bad.failed and bad.text.startswith("Error: tool calculate raised ValueError: ")
        assert "exponent 387420489 is too large" in bad.text and bad.error is not None
        by_zero = process.call(conversation, "calculate", {"expression": "1/0"})
        assert by_zero.failed and "division by zero" in by_zero.text
        wrong = process.call(conversation, "calculate", {"expr": "1 + 1"})
        assert wrong.failed and "bad arguments" in wrong.text
        # The child survived every refusal: a good call still answers.
        assert process.call(conversation, "calculate", {"expression": "(1 + 2) / 4"}).text == "0.75"
        process.end(conversation)

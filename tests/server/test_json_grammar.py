"""An integer's bounds in a JSON schema are kept by the grammar (llama-cpp-python's converter lets
any integer through), and bounds a grammar cannot keep are refused by name, never ignored."""

from __future__ import annotations

import re

import pytest

from skippy_stage.errors import InvalidFieldError
from skippy_stage.server.openai_api.json_grammar import integer_range, schema_grammar, unenforced
from skippy_stage.server.openai_api.request import _check_schema_bounds


def as_regex(expression: str) -> re.Pattern[str]:
    """The GBNF expression (literals, classes, groups, alternation) as the same regular expression."""
    return re.compile("^" + expression.replace('"', "").replace(" ", "") + "$")


@pytest.mark.parametrize("low, high", [(0, 150), (5, 5), (-20, 7), (-150, -3), (13, 987), (0, None), (None, 42),
                                       (100, None), (None, -5), (-1000, 1000)])
def test_an_integer_range_matches_exactly_the_integers_within_its_bounds(low, high):
    matches = as_regex(integer_range(low, high))
    wrong = [n for n in range(-1300, 1300)
             if bool(matches.match(str(n))) != ((low is None or n >= low) and (high is None or n <= high))]
    assert wrong == []
    assert not matches.match("007") and not matches.match("-0"), "JSON writes no leading zeros"


def test_a_schemas_bounded_integer_becomes_a_rule_of_its_own_that_llama_cpp_parses():
    from llama_cpp import LlamaGrammar

    schema = {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 150},
                                               "n": {"type": "integer"}}, "required": ["age", "n"]}
    grammar = schema_grammar(schema)
    age = next(line for line in grammar.splitlines() if line.startswith("age ::= "))
    assert as_regex(age.removeprefix("age ::= ").removesuffix(" space")).match("150")
    assert "integer" in grammar, "an unbounded integer stays the converter's own rule"
    LlamaGrammar.from_string(grammar, verbose=False)


@pytest.mark.parametrize("node, keyword", [
    ({"type": "integer", "exclusiveMaximum": 10}, "exclusiveMaximum"),
    ({"type": "integer", "multipleOf": 5}, "multipleOf"),
    ({"type": "number", "minimum": 0.5}, "minimum"),
    ({"type": "integer", "maximum": 2.5}, "maximum"),
    ({"type": "integer", "minimum": 10 ** 19}, "minimum"),
])
def test_bounds_a_grammar_cannot_keep_are_refused_naming_the_field(node, keyword):
    assert unenforced(node) == keyword
    schema = {"type": "object", "properties": {"x": node}}
    with pytest.raises(InvalidFieldError) as info:
        _check_schema_bounds(schema, "response_format.json_schema.schema")
    assert f"response_format.json_schema.schema.properties.x.{keyword}=" in str(info.value)
    assert unenforced({"type": "integer", "minimum": -3, "maximum": 3}) is None

"""Tests for the service/graders package. Expected values are worked by hand in the comments."""

from __future__ import annotations

import ast
import builtins
import dataclasses
import math
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from service import graders as graders_module
from service.graders import (
    TEXT_SIMILARITY_METRICS,
    Batch,
    GraderError,
    MultiGrader,
    PythonGrader,
    RewardModelGrader,
    Sample,
    StringCheckGrader,
    TemplateKeyError,
    grade_batch,
    grade_one,
    grader_to_dict,
    is_model_grader,
    parse_grader,
    referenced_item_keys,
    render,
    render_reward_model_inputs,
    template_item_keys,
)

# --------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------


def string_check(
    name: str, operation: str, inp: str = "{{ sample.output_text }}", ref: str = "{{ item.answer }}"
) -> dict[str, Any]:
    return {"type": "string_check", "name": name, "input": inp, "reference": ref, "operation": operation}


def fuzzy(name: str, inp: str = "{{ sample.output_text }}", ref: str = "{{ item.answer }}") -> dict[str, Any]:
    return {
        "type": "text_similarity",
        "name": name,
        "input": inp,
        "reference": ref,
        "evaluation_metric": "fuzzy_match",
    }


def reward_model(name: str, model: Any = "org/rm", **extra: Any) -> dict[str, Any]:
    return {"type": "reward_model", "name": name, "model": model, **extra}


def multi(formula: Any, graders: Any, name: str = "total") -> dict[str, Any]:
    return {"type": "multi", "name": name, "graders": graders, "calculate_output": formula}


def score_one(spec: Mapping[str, Any], output: str, item: Mapping[str, Any]) -> float:
    reward, _ = grade_one(parse_grader(spec), Sample(output), item)
    return reward


class FakeScorer:
    """Stands in for the worker's reward model: fixed scores per grader name, records each call."""

    def __init__(self, scores: Mapping[str, list[float]]) -> None:
        self.scores = scores
        self.calls: list[tuple[str, int]] = []

    def __call__(self, grader: RewardModelGrader, batch: Batch) -> list[float]:
        self.calls.append((grader.name, len(batch.samples)))
        return list(self.scores[grader.name])


def formula_value(formula: str, **values: float) -> float:
    """Evaluate ``formula`` over sub-graders whose scores are ``values`` (one sample)."""
    spec = multi(formula, {name: reward_model(name) for name in values})
    scorer = FakeScorer({name: [value] for name, value in values.items()})
    reward, _ = grade_one(parse_grader(spec), Sample("x"), {}, scorers={RewardModelGrader: scorer})
    return reward


# --------------------------------------------------------------------------------------------------
# string_check
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("operation", "output", "answer", "expected"),
    [
        ("eq", "42", "42", 1.0),
        ("eq", "42 ", "42", 0.0),  # eq is exact: a trailing space fails
        ("ne", "41", "42", 1.0),
        ("ne", "42", "42", 0.0),
        ("like", "The answer is 42", "42", 1.0),  # reference is a substring of input
        ("like", "42", "The answer is 42", 0.0),  # ...not the other way round
        ("like", "The answer is PARIS", "Paris", 0.0),  # like is case-sensitive
        ("ilike", "The answer is PARIS", "Paris", 1.0),  # ilike is not
        ("ilike", "The answer is Lyon", "Paris", 0.0),
    ],
)
def test_string_check_operations(operation: str, output: str, answer: str, expected: float) -> None:
    assert score_one(string_check("c", operation), output, {"answer": answer}) == expected


# --------------------------------------------------------------------------------------------------
# text_similarity / fuzzy_match
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("output", "answer", "expected"),
    [
        ("Paris", "Paris", 1.0),
        ("", "", 1.0),  # identical, even empty (WRatio alone would give 0 for empty strings)
        # Indel ratio = 2 * LCS / (len1 + len2); LCS("kitten", "sitting") = "ittn" (4), so 8/13.
        # Lengths 6 vs 7 (ratio < 1.5), one word each, so WRatio = max(ratio, 0.95 * token) = ratio.
        ("kitten", "sitting", 8 / 13),
        # 19 vs 5 chars: length ratio 3.8 (>= 1.5, < 8) so WRatio takes partial_ratio * 0.9; "Paris"
        # is a substring, partial_ratio = 100, so 0.9. (Plain ratio would be 2*5/24 = 0.417.)
        ("The answer is Paris", "Paris", 0.9),
        # Same length; the token-sorted strings are identical, so token ratio 100 * 0.95 = 0.95,
        # which beats the plain ratio of the scrambled strings.
        ("mets york new", "new york mets", 0.95),
    ],
)
def test_fuzzy_match_by_hand(output: str, answer: str, expected: float) -> None:
    assert score_one(fuzzy("f"), output, {"answer": answer}) == pytest.approx(expected, abs=1e-9)


# The other metrics on one pair, worked by hand. Reference "the cat sat on the mat", output "the cat
# is on the mat" (6 words each). Matching n-grams: 1-grams the, the, cat, on, mat = 5 of 6; 2-grams
# "the cat", "on the", "the mat" = 3 of 5; 3-grams "on the mat" = 1 of 4; 4-grams 0 of 3.
CAT_REF, CAT_OUT = "the cat sat on the mat", "the cat is on the mat"
CAT_CASES = {
    # BLEU: equal lengths, so no brevity penalty; the zero 4-gram count is smoothed to 1/2 (sacrebleu's
    # "exp" smoothing: 1 / (2 * 3) for 3 4-grams); geometric mean (5/6 * 3/5 * 1/4 * 1/6) ** (1/4).
    "bleu": (5 / 6 * 3 / 5 * 1 / 4 * 1 / 6) ** 0.25,
    # GLEU: min(precision, recall) over all 1..4-grams together: 9 matches of 18 on both sides.
    "gleu": 9 / 18,
    # METEOR: 5 unigram matches, P = R = 5/6, Fmean = 10PR / (R + 9P) = 5/6; aligned in 2 chunks
    # ("the cat", "on the mat"), penalty 0.5 * (2/5) ** 3 = 0.032; score 5/6 * (1 - 0.032).
    "meteor": 5 / 6 * (1 - 0.5 * (2 / 5) ** 3),
    # ROUGE F-measures: 1-grams 5/6 both ways; 2-grams 3/5; LCS "the cat on the mat" = 5 of 6.
    "rouge_1": 5 / 6,
    "rouge_2": 3 / 5,
    "rouge_3": 1 / 4,
    "rouge_4": 0.0,
    "rouge_5": 0.0,  # 2 5-grams each side, none shared
    "rouge_l": 5 / 6,
}


@pytest.mark.parametrize(("metric", "expected"), sorted(CAT_CASES.items()))
def test_text_similarity_metrics_by_hand(metric: str, expected: float) -> None:
    spec = {**fuzzy("m"), "evaluation_metric": metric}
    assert score_one(spec, CAT_OUT, {"answer": CAT_REF}) == pytest.approx(expected, abs=1e-9)
    assert score_one(spec, CAT_REF, {"answer": CAT_REF}) == 1.0  # identical
    assert score_one(spec, "", {"answer": ""}) == 1.0  # identical, even empty
    assert score_one(spec, "", {"answer": CAT_REF}) == 0.0
    assert score_one(spec, "zebra quartz", {"answer": CAT_REF}) == 0.0  # nothing in common


def test_meteor_matches_stems_without_wordnet() -> None:
    """The WordNet stage needs a download; exact and Porter-stem matches still count: "cats" and
    "cat" share the stem "cat", so all 3 words match in one chunk: P = R = 1, penalty 0.5 * (1/3) ** 3."""
    spec = {**fuzzy("m"), "evaluation_metric": "meteor"}
    assert score_one(spec, "the cats sat", {"answer": "the cat sat"}) == pytest.approx(1 - 0.5 / 27, abs=1e-9)


def test_unknown_metric_lists_supported_ones() -> None:
    spec = {**fuzzy("f"), "evaluation_metric": "bleu_9000"}
    with pytest.raises(GraderError) as info:
        parse_grader(spec)
    assert info.value.param == "grader.evaluation_metric"
    assert "bleu_9000" in info.value.message
    for metric in TEXT_SIMILARITY_METRICS:
        assert metric in info.value.message


# --------------------------------------------------------------------------------------------------
# templates
# --------------------------------------------------------------------------------------------------


def test_render_nested_keys_whitespace_and_literal_text() -> None:
    item = {"meta": {"city": {"name": "Paris"}}, "choices": ["a", "b"]}
    out = render("Q: {{item.meta.city.name}} / {{   item.choices.1 }}!", sample=Sample("x"), item=item)
    assert out == "Q: Paris / b!"


def test_render_non_strings_as_json_and_strings_as_is() -> None:
    item = {"n": 42, "ok": True, "none": None, "obj": {"a": [1, 2]}, "s": 'say "hi"'}
    out = render("{{ item.n }}|{{ item.ok }}|{{ item.none }}|{{ item.obj }}|{{ item.s }}", sample=Sample(""), item=item)
    assert out == '42|true|null|{"a": [1, 2]}|say "hi"'


def test_render_sample_output_text_and_output_json() -> None:
    sample = Sample('{"answer": {"value": 7}, "steps": ["a"]}')
    assert render("{{ sample.output_json.answer.value }}", sample=sample, item={}) == "7"
    assert render("{{sample.output_text}}", sample=sample, item={}) == sample.output_text
    assert render("{{ sample.output_json.steps }}", sample=sample, item={}) == '["a"]'


def test_sample_output_json_is_none_when_not_json_and_cached() -> None:
    assert Sample("not json {").output_json is None
    sample = Sample('{"a": 1}')
    first = sample.output_json
    assert first == {"a": 1}
    assert sample.output_json is first  # cached, not re-parsed


@pytest.mark.parametrize(
    ("template", "sample", "item", "mentions"),
    [
        ("{{ item.answer }}", "x", {"question": "q"}, "answer"),
        ("{{ item.meta.city }}", "x", {"meta": {"country": "FR"}}, "city"),
        ("{{ item.meta.city }}", "x", {"meta": "flat"}, "a string"),
        ("{{ item.choices.5 }}", "x", {"choices": ["a"]}, "1 elements"),
        ("{{ sample.output_json.score }}", "not json", {}, "not valid JSON"),
        ("{{ sample.output_json.score }}", '{"other": 1}', {}, "score"),
    ],
)
def test_render_missing_key_raises_template_key_error(template: str, sample: str, item: dict, mentions: str) -> None:
    with pytest.raises(TemplateKeyError) as info:
        render(template, sample=Sample(sample), item=item)
    assert isinstance(info.value, KeyError)
    assert mentions in str(info.value)


def test_missing_key_gives_nan_and_counts_error_in_batch() -> None:
    grader = parse_grader(string_check("correct", "eq"))
    items = [{"answer": "1"}, {"question": "no answer here"}, {"answer": "3"}]
    result = grade_batch(grader, [Sample("1"), Sample("2"), Sample("x")], items)
    assert result.rewards[0] == 1.0
    assert math.isnan(result.rewards[1])
    assert result.rewards[2] == 0.0
    assert result.errors == {"correct": 1}
    assert result.sub_rewards.keys() == {"correct"}
    assert result.sub_rewards["correct"] is result.rewards


def test_clean_batch_has_no_errors() -> None:
    result = grade_batch(parse_grader(string_check("c", "eq")), [Sample("1")], [{"answer": "1"}])
    assert result.errors == {}


def test_template_item_keys() -> None:
    template = "{{ item.question }} {{item.meta.lang}} {{ sample.output_json.answer }} {{ item.question }}"
    assert template_item_keys(template) == {"question", "meta"}
    assert template_item_keys("no templates") == set()


@pytest.mark.parametrize(
    ("template", "mentions"),
    [
        ("{{ foo.bar }}", "must start with 'item.'"),
        ("{{ item.answer", "unclosed"),
        ("{{ }}", "empty"),
        ("{{ sample.output_text.x }}", "has no keys"),
        ("{{ sample.output_tokens }}", "sample.output_text"),
        ("{{ item..a }}", "not a valid reference"),
    ],
)
def test_malformed_template_rejected_at_parse_time(template: str, mentions: str) -> None:
    with pytest.raises(GraderError) as info:
        parse_grader(string_check("c", "eq", ref=template))
    assert info.value.param == "grader.reference"
    assert mentions in info.value.message


# --------------------------------------------------------------------------------------------------
# multi formulas
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("formula", "expected"),
    [
        ("a + b * c", 2 + 3 * 4),  # * binds tighter: 14
        ("(a + b) * c", 20),
        ("a - b - c", -5),  # left-associative: (2 - 3) - 4
        ("c / a / a", 1),  # (4 / 2) / 2
        ("-a * b", -6),
        ("a * -b", -6),
        ("- -a", 2),
        ("+a", 2),
        ("-(a - c)", 2),
        ("0.5 * a + 1e-1 * c", 1.4),
        ("min(a, b, c)", 2),
        ("max(a, b, c)", 4),
        ("min(a)", 2),
        ("abs(a - c)", 2),
        ("clip(c, 0, 3)", 3),
        ("clip(-c, 0, 3)", 0),
        ("clip(b, 0, 5)", 3),
        ("clip(a, c, b)", 3),  # lo (4) > hi (3): hi wins, as numpy.clip does
        ("max(min(a, b), abs(-c) / 2)", 2),
    ],
)
def test_formula_arithmetic(formula: str, expected: float) -> None:
    assert formula_value(formula, a=2, b=3, c=4) == pytest.approx(expected)


@pytest.mark.parametrize("formula", ["a / b", "a / (b - b)", "0 / b", "a / -b"])
def test_division_by_zero_is_nan_not_an_exception(formula: str) -> None:
    assert math.isnan(formula_value(formula, a=1, b=0))


def test_multi_weighted_sum_with_sub_rewards() -> None:
    spec = multi(
        "0.7 * correct + 0.3 * close",
        {"correct": string_check("correct", "like"), "close": fuzzy("close", ref="{{ item.full }}")},
    )
    reward, subs = grade_one(
        parse_grader(spec), Sample("The answer is 42"), {"answer": "42", "full": "The answer is 42"}
    )
    assert subs == {"correct": 1.0, "close": 1.0}
    assert reward == pytest.approx(1.0)
    reward, subs = grade_one(parse_grader(spec), Sample("kitten"), {"answer": "42", "full": "sitting"})
    assert subs["correct"] == 0.0
    assert reward == pytest.approx(0.3 * 8 / 13)


@pytest.mark.parametrize("formula", ["a + b", "min(a, b)", "min(b, a)", "max(b, a)", "clip(a, b, 1)", "0 * b"])
def test_nan_sub_grader_makes_reward_nan(formula: str) -> None:
    # Python's own min(1.0, nan) is 1.0 but min(nan, 1.0) is nan; the formula must not depend on order.
    assert math.isnan(formula_value(formula, a=1.0, b=float("nan")))


def test_nan_in_batch_counts_per_sub_grader() -> None:
    spec = multi("a + b", {"a": string_check("a", "eq"), "b": string_check("b", "eq", ref="{{ item.other }}")})
    result = grade_batch(
        parse_grader(spec), [Sample("1"), Sample("1")], [{"answer": "1", "other": "1"}, {"answer": "1"}]
    )
    assert result.rewards[0] == 2.0
    assert math.isnan(result.rewards[1])
    assert result.sub_rewards["a"] == [1.0, 1.0]
    assert result.errors == {"total": 1, "b": 1}


def test_overflow_to_infinity_is_nan() -> None:
    assert math.isnan(formula_value("a * 1e308 * 10", a=1.0))


def test_nested_multi_sub_rewards_use_dotted_paths() -> None:
    inner = multi("x + y", {"x": string_check("x", "eq"), "y": string_check("y", "ne")}, name="inner")
    spec = multi("2 * inner", {"inner": inner})
    result = grade_batch(parse_grader(spec), [Sample("1")], [{"answer": "1"}])
    assert result.rewards == [2.0]  # x = 1 (eq), y = 0 (ne), inner = 1, total = 2
    assert result.sub_rewards == {"inner.x": [1.0], "inner.y": [0.0], "inner": [1.0]}


def test_list_form_graders_named_by_their_name_field() -> None:
    spec = multi("a - b", [string_check("a", "eq"), string_check("b", "ne")])
    grader = parse_grader(spec)
    assert isinstance(grader, MultiGrader)
    assert [name for name, _ in grader.graders] == ["a", "b"]
    assert grade_one(grader, Sample("1"), {"answer": "1"})[0] == 1.0


def test_list_form_duplicate_names_rejected() -> None:
    with pytest.raises(GraderError) as info:
        parse_grader(multi("a", [string_check("a", "eq"), string_check("a", "ne")]))
    assert info.value.param == "grader.graders.1.name"
    assert "unique" in info.value.message


@pytest.mark.parametrize(
    ("key", "mentions"),
    [
        ("my-grader", "letters, digits"),
        ("1st", "letters, digits"),
        ("min", "function"),
        ("total", "own name"),
    ],
)
def test_sub_grader_names_must_be_usable_in_formula(key: str, mentions: str) -> None:
    with pytest.raises(GraderError) as info:
        parse_grader(multi("1", {key: string_check(key, "eq")}))
    assert info.value.param == f"grader.graders.{key}"
    assert mentions in info.value.message


def test_multi_needs_graders() -> None:
    with pytest.raises(GraderError) as info:
        parse_grader(multi("1", {}))
    assert info.value.param == "grader.graders"
    with pytest.raises(GraderError) as info:
        parse_grader(multi("1", "a,b"))
    assert info.value.param == "grader.graders"


def test_multi_nesting_is_bounded() -> None:
    spec: dict[str, Any] = string_check("leaf", "eq")
    for depth in range(20):
        spec = multi("g", {"g": spec}, name=f"m{depth}")
    with pytest.raises(GraderError) as info:
        parse_grader(spec)
    assert "nest at most" in info.value.message


# --------------------------------------------------------------------------------------------------
# the formula parser against hostile input
# --------------------------------------------------------------------------------------------------

HOSTILE = [
    ("__import__('os').system('x')", "strings"),
    ("__import__(os)", "not a function"),
    ("().__class__", "attribute access"),
    ("a.b", "attribute access"),
    ("a.__class__.__bases__", "attribute access"),
    ("a[0]", "subscripts"),
    ("lambda: 1", "':'"),
    ('"s"', "strings"),
    ("'s'", "strings"),
    ("9**9**9", "'**'"),
    ("a // b", "'//'"),
    ("[x for x in a]", "subscripts"),
    ("{a: b}", "braces"),
    ("a if b else a", "unexpected 'if'"),
    ("a == b", "'='"),
    ("a % b", "'%'"),
    ("a; b", "unexpected character ';'"),
    ("a @ b", "unexpected character '@'"),
    ("a +", "found the end"),
    ("(a", "expected ')'"),
    ("a)", "unexpected ')'"),
    ("min(a,)", "found ')'"),
    ("a b", "unexpected 'b'"),
    ("", "empty"),
    ("   ", "empty"),
    ("(" * 1000, "deeper than 50"),
    ("-" * 200 + "a", "deeper than 50"),
    ("a + " * 300 + "a", "limit is 1000"),
    ("answer", "unknown name 'answer'"),
    ("print(a)", "not a function"),
    ("eval(a)", "not a function"),
    ("a(b)", "a sub-grader, not a function"),
    ("min", "is a function"),
    ("abs(a, b)", "exactly 1 argument"),
    ("abs()", "exactly 1 argument"),
    ("clip(a, 0)", "exactly 3 arguments"),
    ("clip(a, 0, 1, 2)", "exactly 3 arguments"),
    ("max()", "at least 1 argument"),
    ("1e999", "too large"),
    ("a\x00", "unexpected character"),
]


@pytest.mark.parametrize(("formula", "mentions"), HOSTILE)
def test_hostile_formula_rejected_without_executing(
    formula: str, mentions: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    executed: list[str] = []

    def trap(name: str):
        def _trap(*args: Any, **kwargs: Any) -> Any:
            executed.append(name)
            raise AssertionError(f"{name} called while parsing a formula")

        return _trap

    monkeypatch.setattr(os, "system", trap("os.system"))
    spec = multi(formula, {"a": string_check("a", "eq"), "b": string_check("b", "eq")})
    real = {name: getattr(builtins, name) for name in ("eval", "exec", "compile", "__import__")}
    for name in real:
        setattr(builtins, name, trap(name))
    try:
        with pytest.raises(GraderError) as info:
            parse_grader(spec, param="method.reinforcement.grader")
    finally:
        for name, fn in real.items():
            setattr(builtins, name, fn)
    assert executed == []
    assert info.value.param == "method.reinforcement.grader.calculate_output"
    assert mentions in info.value.message


def test_unknown_name_lists_known_ones() -> None:
    with pytest.raises(GraderError) as info:
        parse_grader(multi("corect", {"correct": string_check("correct", "eq"), "fluent": fuzzy("fluent")}))
    assert "'corect'" in info.value.message
    assert "correct, fluent" in info.value.message


def test_nesting_limit_is_exactly_50() -> None:
    names = {"a": string_check("a", "eq")}
    parse_grader(multi("(" * 50 + "a" + ")" * 50, names))  # 50 deep: accepted
    with pytest.raises(GraderError):
        parse_grader(multi("(" * 51 + "a" + ")" * 51, names))


def test_length_limit_is_exactly_1000() -> None:
    names = {"a": string_check("a", "eq")}
    formula = "a" + " " * 999
    assert len(formula) == 1000
    parse_grader(multi(formula, names))
    with pytest.raises(GraderError):
        parse_grader(multi(formula + " ", names))


def test_package_never_calls_eval_exec_or_compile() -> None:
    """The graders the API parses and the worker scores in its own process never run a string as code.
    The python grader's own modules are the exception by design: ``sandbox.py`` starts a sandboxed
    child process and ``sandbox_runner.py`` is the program run inside it (by path, never imported)."""
    forbidden = {"eval", "exec", "compile", "__import__", "getattr", "globals", "locals"}
    out_of_process = {"sandbox.py", "sandbox_runner.py"}
    package = Path(graders_module.__file__).parent
    modules = sorted(p for p in package.glob("*.py") if p.name not in out_of_process)
    assert len(modules) >= 8  # the package's modules, formula.py among them
    assert all(
        "sandbox_runner" not in ast.dump(node)
        for p in package.glob("*.py")
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, ast.Import | ast.ImportFrom)
    )  # the runner is never imported, only run
    for module in modules:
        called = {
            node.func.id
            for node in ast.walk(ast.parse(module.read_text()))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in forbidden
        }
        assert called == set(), module.name


def test_module_imports_no_heavy_dependencies() -> None:
    code = (
        "import sys, service.graders; "
        "bad = sorted({'torch', 'transformers', 'numpy'} & set(sys.modules)); "
        "assert not bad, bad"
    )
    repo = Path(__file__).resolve().parents[3]
    proc = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


# --------------------------------------------------------------------------------------------------
# spec validation
# --------------------------------------------------------------------------------------------------


def test_unknown_key_named_with_param() -> None:
    spec = {**string_check("c", "eq"), "pass_threshold": 0.5}
    with pytest.raises(GraderError) as info:
        parse_grader(spec)
    assert info.value.param == "grader.pass_threshold"
    assert "'pass_threshold'" in info.value.message
    assert "allowed keys" in info.value.message


def test_unknown_type_lists_types() -> None:
    with pytest.raises(GraderError) as info:
        parse_grader({"type": "sentiment_model", "name": "x"})
    assert info.value.param == "grader.type"
    assert "'sentiment_model'" in info.value.message
    assert "string_check" in info.value.message and "label_model" in info.value.message


def test_bad_operation_in_nested_grader_has_full_param() -> None:
    spec = multi("correct", {"correct": string_check("correct", "equals")})
    with pytest.raises(GraderError) as info:
        parse_grader(spec, param="method.reinforcement.grader")
    assert info.value.param == "method.reinforcement.grader.graders.correct.operation"
    assert info.value.message == "operation must be one of eq, ne, like, ilike; got 'equals'"
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    ("spec", "param", "mentions"),
    [
        ([], "grader", "JSON object"),
        ({"name": "x"}, "grader.type", "type is required"),
        ({"type": 3, "name": "x"}, "grader.type", "a number"),
        ({k: v for k, v in string_check("c", "eq").items() if k != "name"}, "grader.name", "required"),
        ({**string_check("c", "eq"), "name": "  "}, "grader.name", "empty"),
        ({**string_check("c", "eq"), "name": 5}, "grader.name", "must be a string"),
        ({**string_check("c", "eq"), "input": None}, "grader.input", "must be a string"),
        (
            {k: v for k, v in string_check("c", "eq").items() if k != "reference"},
            "grader.reference",
            "required",
        ),
        (reward_model("rm", model=""), "grader.model", "empty"),
        (reward_model("rm", model=["m"]), "grader.model", "must be a string"),
        (reward_model("rm", input=7), "grader.input", "must be a string"),
        (multi(1, {"a": string_check("a", "eq")}), "grader.calculate_output", "must be a string"),
        (multi("a", {"a": {"type": "nope", "name": "a"}}), "grader.graders.a.type", "unknown grader type"),
        (
            multi("a", [string_check("a", "eq"), {"type": "string_check"}]),
            "grader.graders.1.name",
            "required",
        ),
    ],
)
def test_invalid_specs(spec: Any, param: str, mentions: str) -> None:
    with pytest.raises(GraderError) as info:
        parse_grader(spec)
    assert info.value.param == param
    assert mentions in info.value.message


# --------------------------------------------------------------------------------------------------
# python grader
# --------------------------------------------------------------------------------------------------

PYTHON_SPEC = {"type": "python", "name": "py", "source": "def grade(sample, item):\n    return 1.0\n"}


def test_python_grader_disabled_by_default() -> None:
    with pytest.raises(GraderError) as info:
        parse_grader(PYTHON_SPEC)
    assert info.value.param == "grader.type"
    assert info.value.message == (
        "the python grader is disabled on this server; the operator enables it with RLOO_ALLOW_PYTHON_GRADER=1"
    )


def test_python_grader_disabled_inside_multi() -> None:
    with pytest.raises(GraderError) as info:
        parse_grader(multi("py", {"py": PYTHON_SPEC}))
    assert info.value.param == "grader.graders.py.type"


def test_python_grader_runs_when_allowed_and_reports_each_samples_error() -> None:
    spec = {
        "type": "python",
        "name": "py",
        "source": (
            "def grade(sample, item):\n"
            "    if sample['output_json'] is not None:\n"
            "        return float(sample['output_json']['n'] == item['n'])\n"
            "    return len(sample['output_text']) / item['n']\n"
        ),
    }
    grader = parse_grader(spec, allow_python=True)
    assert isinstance(grader, PythonGrader) and grader_to_dict(grader) == spec
    samples = [Sample('{"n": 3}'), Sample("abcd"), Sample("ab")]
    result = grade_batch(grader, samples, [{"n": 3}, {"n": 2}, {"n": 0}])
    assert result.rewards[:2] == [1.0, 2.0] and math.isnan(result.rewards[2])  # 2 / 0
    assert result.errors == {"py": 1}
    assert result.messages == {"py": "ZeroDivisionError: division by zero"}


# --------------------------------------------------------------------------------------------------
# reward_model leaves
# --------------------------------------------------------------------------------------------------


def test_reward_model_scored_once_per_leaf_per_batch() -> None:
    spec = multi("rm1 - rm2", {"rm1": reward_model("rm1"), "rm2": reward_model("rm2", model="org/other")})
    scorer = FakeScorer({"rm1": [0.5, 2.0, 1.0], "rm2": [0.25, 0.5, float("inf")]})
    samples = [Sample("a"), Sample("b"), Sample("c")]
    result = grade_batch(parse_grader(spec), samples, [{}, {}, {}], scorers={RewardModelGrader: scorer})
    assert sorted(scorer.calls) == [("rm1", 3), ("rm2", 3)]  # one call per leaf, whole batch each
    assert result.rewards[:2] == [0.25, 1.5]
    assert math.isnan(result.rewards[2])  # a non-finite model score is NaN
    assert result.errors == {"total": 1, "rm2": 1}


def test_reward_model_scorer_receives_grader_and_batch() -> None:
    seen: list[tuple[RewardModelGrader, list[str], list[Mapping]]] = []

    def scorer(grader: RewardModelGrader, batch: Batch) -> list[float]:
        seen.append((grader, [s.output_text for s in batch.samples], list(batch.items)))
        return [float(len(s.output_text)) for s in batch.samples]

    grader = parse_grader(reward_model("rm", model="org/rm-7b"))
    result = grade_batch(
        grader, [Sample("ab"), Sample("abcd")], [{"i": 1}, {"i": 2}], scorers={RewardModelGrader: scorer}
    )
    assert result.rewards == [2.0, 4.0]
    assert result.sub_rewards == {"rm": [2.0, 4.0]}
    assert len(seen) == 1
    assert seen[0][0].model == "org/rm-7b"
    assert seen[0][1] == ["ab", "abcd"]
    assert seen[0][2] == [{"i": 1}, {"i": 2}]


def test_reward_model_without_scorer_says_it_runs_on_the_worker() -> None:
    grader = parse_grader(multi("rm", {"rm": reward_model("rm")}))
    with pytest.raises(GraderError, match="run on the worker"):
        grade_batch(grader, [Sample("x")], [{}])


def test_reward_model_scorer_wrong_length_is_a_bug() -> None:
    grader = parse_grader(reward_model("rm"))
    with pytest.raises(ValueError, match="1 scores for 2 samples"):
        grade_batch(grader, [Sample("a"), Sample("b")], [{}, {}], scorers={RewardModelGrader: lambda g, b: [1.0]})


def test_render_reward_model_inputs() -> None:
    plain = parse_grader(reward_model("rm"))
    templated = parse_grader(reward_model("rm", input="Q: {{ item.q }}\nA: {{ sample.output_text }}"))
    assert isinstance(plain, RewardModelGrader) and isinstance(templated, RewardModelGrader)
    samples, items = [Sample("4"), Sample("5")], [{"q": "2+2"}, {}]
    assert render_reward_model_inputs(plain, samples, items) == ["4", "5"]
    assert render_reward_model_inputs(templated, samples, items) == ["Q: 2+2\nA: 4", None]


def test_is_model_grader() -> None:
    assert not is_model_grader(parse_grader(string_check("c", "eq")))
    assert is_model_grader(parse_grader(reward_model("rm")))
    nested = multi("m", {"m": multi("rm + c", {"rm": reward_model("rm"), "c": string_check("c", "eq")}, name="m")})
    assert is_model_grader(parse_grader(nested))


# --------------------------------------------------------------------------------------------------
# introspection, serialisation, misc
# --------------------------------------------------------------------------------------------------


def test_referenced_item_keys_over_a_multi_tree() -> None:
    spec = multi(
        "a + inner",
        {
            "a": string_check("a", "eq", ref="{{ item.answer }}"),
            "inner": multi(
                "s + rm",
                {
                    "s": fuzzy("s", inp="{{ sample.output_json.text }}", ref="{{ item.reference.text }}"),
                    "rm": reward_model("rm", input="{{ item.prompt }} {{ sample.output_text }}"),
                },
                name="inner",
            ),
        },
    )
    grader = parse_grader(spec)
    assert referenced_item_keys(grader) == {"answer", "reference", "prompt"}
    assert referenced_item_keys(parse_grader(reward_model("rm"))) == set()


def test_grader_to_dict_round_trips() -> None:
    spec = multi(
        "0.5 * a + 0.5 * max(b, rm)",
        {
            "a": string_check("a", "ilike"),
            "b": fuzzy("b"),
            "rm": reward_model("rm", input="{{ sample.output_text }}"),
        },
    )
    grader = parse_grader(spec)
    assert grader_to_dict(grader) == spec
    assert parse_grader(grader_to_dict(grader)) == grader
    assert grader.to_dict() == spec
    bare = reward_model("rm")
    assert grader_to_dict(parse_grader(bare)) == bare  # no "input": null added


def test_a_multi_keeps_the_form_its_graders_came_in() -> None:
    """OpenAI's schema has one grader, its documentation a list; ours a map too: each answered as sent."""
    for graders in (
        [string_check("a", "eq"), string_check("b", "ne")],
        {"a": string_check("a", "eq"), "b": string_check("b", "ne")},
        string_check("a", "eq"),
    ):
        formula = "a" if isinstance(graders, dict) and "type" in graders else "a + b"
        spec = multi(formula, graders)
        grader = parse_grader(spec)
        assert grader_to_dict(grader) == spec
        assert [name for name, _ in grader.children()] == (["a"] if formula == "a" else ["a", "b"])
    with pytest.raises(GraderError) as err:
        parse_grader(multi("a", {"type": "string_check", "input": "x", "reference": "y", "operation": "eq"}))
    assert err.value.param == "grader.graders.name"


def test_parsed_graders_are_immutable() -> None:
    grader = parse_grader(string_check("c", "eq"))
    assert isinstance(grader, StringCheckGrader)
    with pytest.raises(dataclasses.FrozenInstanceError):
        grader.operation = "ne"  # type: ignore[misc]


def test_batch_lengths_must_match() -> None:
    with pytest.raises(ValueError, match="2 samples but 1 items"):
        grade_batch(parse_grader(string_check("c", "eq")), [Sample("a"), Sample("b")], [{}])


def test_empty_batch_calls_no_model() -> None:
    scorer = FakeScorer({"rm": []})
    result = grade_batch(parse_grader(reward_model("rm")), [], [], scorers={RewardModelGrader: scorer})
    assert result.rewards == []
    assert scorer.calls == []


# --------------------------------------------------------------------------------------------------
# what /graders/run answers (OpenAI's RunGraderResponse)
# --------------------------------------------------------------------------------------------------


def _dry_run(spec: dict[str, Any], output: str, item: dict[str, Any]) -> dict[str, Any]:
    """A dry run's answer as the worker gives it, turned into the API's."""
    from service.graders.report import run_answer

    grader = parse_grader(spec, allow_python=True)
    result = grade_batch(grader, [Sample(output)], [item])

    def finite(v: float) -> float | None:
        return None if math.isnan(v) else v

    scores = {
        "reward": finite(result.rewards[0]),
        "sub_rewards": {k: finite(v[0]) for k, v in result.sub_rewards.items()},
        "errors": result.errors,
        "messages": result.messages,
    }
    return run_answer(grader, Sample(output), item, scores, execution_time=0.01)


def _flags(answer: dict[str, Any]) -> set[str]:
    return {k for k, v in answer["metadata"]["errors"].items() if k.endswith("_error") and v is True}


def test_a_scored_sample_raises_no_flag() -> None:
    answer = _dry_run(string_check("c", "eq"), "Paris", {"answer": "Paris"})
    assert answer["reward"] == 1.0 and _flags(answer) == set()
    assert answer["metadata"]["scores"] == {"c": 1.0} and answer["model_grader_token_usage_per_model"] == {}


def test_unscored_samples_are_0_with_the_flag_that_says_why() -> None:
    missing = _dry_run(string_check("c", "eq"), "Paris", {})
    assert missing["reward"] == 0.0 and _flags(missing) == {"invalid_variable_error"}
    assert missing["metadata"]["error_counts"] == {"c": 1}
    assert "item.answer" in missing["metadata"]["error_messages"]["c"]  # the flag says which variable
    not_json = _dry_run(string_check("c", "eq", inp="{{ sample.output_json.city }}"), "Paris", {"answer": "Paris"})
    assert _flags(not_json) == {"sample_parse_error"}
    divided = _dry_run(
        multi("a / b", {"a": string_check("a", "eq"), "b": string_check("b", "ne")}), "x", {"answer": "x"}
    )
    assert divided["sub_rewards"] == {"a": 1.0, "b": 0.0} and _flags(divided) == {"other_error"}


def test_a_judge_whose_template_misses_a_key_is_an_invalid_variable_not_a_parse_error() -> None:
    from service.graders.report import run_answer

    judge = parse_grader(
        {"type": "score_model", "name": "judge", "model": "m", "input": [{"role": "user", "content": "{{ item.q }}"}]}
    )
    unscored = {"reward": None, "sub_rewards": {}, "errors": {"judge": 1}, "messages": {}}
    missing = run_answer(judge, Sample("x"), {}, unscored, execution_time=0.01)
    assert _flags(missing) == {"invalid_variable_error"}
    no_number = run_answer(judge, Sample("x"), {"q": "?"}, unscored, execution_time=0.01)
    assert _flags(no_number) == {"model_grader_parse_error"}


def test_the_parts_of_a_batch_join_as_the_batchs_results() -> None:
    """A job's ranks score consecutive shares; joined, they are the batch's results: rewards and
    sub-rewards in order, NaN counts added, each grader's first message kept."""
    from service.graders import GradeResult

    nan = float("nan")
    a = GradeResult([1.0, nan], {"x": [1.0, nan]}, {"m": 1, "x": 1}, {"x": "first"})
    b = GradeResult([nan, 0.5], {"x": [nan, 0.5]}, {"m": 1, "x": 1}, {"x": "second"})
    joined = GradeResult.joined([a, b])
    assert joined.rewards[::3] == [1.0, 0.5] and all(r != r for r in joined.rewards[1:3])
    assert joined.sub_rewards["x"][0] == 1.0 and joined.sub_rewards["x"][3] == 0.5
    assert joined.errors == {"m": 2, "x": 2} and joined.messages == {"x": "first"}
    assert GradeResult.joined([a]) is a

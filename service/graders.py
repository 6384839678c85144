"""Graders: the reward specs of a fine-tuning job, parsed, validated and run on batches.

A grader scores one completion (``sample``) of one training-file line (``item``) as a float, with
OpenAI's RFT grader shapes (``string_check``, ``text_similarity``, ``multi``, ``python``) plus
``reward_model``, a Hugging Face sequence classifier that the worker runs.

Why this module looks the way it does:

* The API process imports it to validate a spec at job creation (and for ``/graders/validate`` and
  ``/graders/run``), so it is pure Python: no torch, transformers or numpy.
* Every mistake a user can make is a ``GraderError`` carrying the dotted path (``param``) of the
  offending field and a message saying what to change.
* ``calculate_output`` is user text, so it is parsed by a small hand-written tokenizer and
  recursive-descent parser into our own expression nodes, which we interpret ourselves. Python's
  ``eval``/``exec``/``compile`` never see it, and length and nesting are bounded so hostile input
  cannot exhaust the stack.
* A completion that cannot be scored (missing template key, non-finite value, division by zero) gets
  a NaN reward, never an exception: RLOO leaves NaN out of its group's baseline (see RLOO.md), and
  one bad sample must not kill a training step.
* Scoring is batched so that reward-model leaves cost one forward pass per batch, not per sample.
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, ClassVar

from rapidfuzz import fuzz

from service.settings import redact_url

__all__ = [
    "GradeResult",
    "Grader",
    "GraderError",
    "ModelScorer",
    "MultiGrader",
    "PythonGrader",
    "RewardModelGrader",
    "Sample",
    "StringCheckGrader",
    "TemplateKeyError",
    "TextSimilarityGrader",
    "TEXT_SIMILARITY_METRICS",
    "GraderUnavailable",
    "HttpGrader",
    "grade_batch",
    "grade_one",
    "grader_to_dict",
    "is_model_grader",
    "parse_grader",
    "referenced_item_keys",
    "render",
    "parse_judge_score",
    "render_judge_messages",
    "render_pairs",
    "render_reward_model_inputs",
    "template_item_keys",
]

NAN = float("nan")

MAX_FORMULA_LENGTH = 1000
"""Longest ``calculate_output`` accepted, in characters: a reward formula is one line, not a program."""

MAX_FORMULA_DEPTH = 50
"""Deepest nesting of parentheses, calls and unary signs in ``calculate_output``; bounds recursion."""

MAX_GRADER_DEPTH = 8
"""Deepest nesting of ``multi`` graders; bounds recursion on a hostile JSON spec."""


# --------------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------------


class GraderError(ValueError):
    """A grader spec the user must fix (or a grader that cannot run here).

    ``param`` is the dotted path of the offending field, as the API reports it in its error body
    (``method.reinforcement.grader.graders.correct.operation``), so a user can find the field.
    """

    def __init__(self, message: str, *, param: str) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class TemplateKeyError(KeyError):
    """A template referenced a key that this sample's item or completion lacks.

    Raised at grading time, not parse time: the key may exist on most lines and be missing on one.
    Grading turns it into a NaN reward for that sample. Subclasses ``KeyError`` because that is what
    it is; ``__str__`` is overridden since ``KeyError`` would quote the whole message.
    """

    def __init__(self, message: str, *, path: str) -> None:
        super().__init__(message)
        self.message = message
        self.path = path

    def __str__(self) -> str:
        return self.message


def _describe(value: object) -> str:
    """A short, JSON-flavoured name of a value's type for error messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, Mapping):
        return "an object"
    if isinstance(value, (list, tuple)):
        return "an array"
    return type(value).__name__


# --------------------------------------------------------------------------------------------------
# Samples and templates
# --------------------------------------------------------------------------------------------------


@dataclass
class Sample:
    """One completion to grade, as templates see it (``{{ sample.output_text }}``)."""

    output_text: str

    @cached_property
    def output_json(self) -> object | None:
        """The completion parsed as JSON, or None when it is not JSON.

        Cached because every template of every grader in a ``multi`` tree may ask for it.
        """
        try:
            return json.loads(self.output_text)
        except (ValueError, TypeError):
            return None


_TEMPLATE_OPEN = "{{"
_TEMPLATE_CLOSE = "}}"
_SAMPLE_FIELDS = ("output_text", "output_json")


def _template_refs(template: str) -> list[tuple[int, int, str]]:
    """``(start, end, path)`` for each ``{{ path }}`` in ``template``, whitespace stripped.

    Raises ``ValueError`` with a message saying what to change for an unclosed ``{{`` or an empty
    ``{{ }}``: either would otherwise be compared literally and silently earn a reward of zero on
    every sample.
    """
    refs: list[tuple[int, int, str]] = []
    pos = 0
    while True:
        start = template.find(_TEMPLATE_OPEN, pos)
        if start < 0:
            return refs
        end = template.find(_TEMPLATE_CLOSE, start + len(_TEMPLATE_OPEN))
        if end < 0:
            raise ValueError(f"unclosed '{{{{' at position {start}; close it with '}}}}' as in '{{{{ item.answer }}}}'")
        path = template[start + len(_TEMPLATE_OPEN) : end].strip()
        if not path:
            raise ValueError(
                f"empty '{{{{ }}}}' at position {start}; write a reference such as "
                "'{{ item.answer }}' or '{{ sample.output_text }}'"
            )
        refs.append((start, end + len(_TEMPLATE_CLOSE), path))
        pos = end + len(_TEMPLATE_CLOSE)


def _check_path(path: str) -> list[str]:
    """Split a template reference into segments and check its root; ``ValueError`` if malformed."""
    parts = path.split(".")
    if any(not p or any(ch.isspace() for ch in p) for p in parts):
        raise ValueError(
            f"'{{{{ {path} }}}}' is not a valid reference; use dotted keys without spaces, "
            "such as 'item.answer' or 'sample.output_json.score'"
        )
    root = parts[0]
    if root == "item":
        return parts
    if root == "sample":
        if len(parts) < 2 or parts[1] not in _SAMPLE_FIELDS:
            raise ValueError(
                f"'{{{{ {path} }}}}' is not a sample field; use sample.output_text or "
                "sample.output_json (optionally followed by .key)"
            )
        if parts[1] == "output_text" and len(parts) > 2:
            raise ValueError(
                f"'{{{{ {path} }}}}': sample.output_text is a string and has no keys; "
                "use sample.output_json.KEY to read a field of a JSON completion"
            )
        return parts
    raise ValueError(
        f"'{{{{ {path} }}}}' must start with 'item.' (a field of the training-file line) or 'sample.' (the completion)"
    )


def _validate_template(template: str, *, param: str) -> None:
    """Parse-time check of a template, so a typo fails job creation instead of training."""
    try:
        for _, _, path in _template_refs(template):
            _check_path(path)
    except ValueError as exc:
        raise GraderError(str(exc), param=param) from None


def template_item_keys(template: str) -> set[str]:
    """The top-level ``item`` keys that ``template`` references (``{{ item.a.b }}`` gives ``a``).

    Used at job creation to check every training-file line has them. Malformed references are
    skipped here; ``parse_grader`` reports them.
    """
    keys: set[str] = set()
    try:
        refs = _template_refs(template)
    except ValueError:
        return keys
    for _, _, path in refs:
        parts = path.split(".")
        if len(parts) >= 2 and parts[0] == "item" and parts[1]:
            keys.add(parts[1])
    return keys


def _lookup(value: object, parts: list[str], *, path: str) -> object:
    """Walk ``parts`` into ``value``; integer segments index arrays (``item.choices.0``)."""
    walked = parts[0]
    for part in parts[1:]:
        if isinstance(value, Mapping):
            if part not in value:
                raise TemplateKeyError(
                    f"template references {{{{ {path} }}}}, but {walked} has no key '{part}'",
                    path=path,
                )
            value = value[part]
        elif isinstance(value, (list, tuple)) and part.isascii() and part.isdigit():
            index = int(part)
            if index >= len(value):
                raise TemplateKeyError(
                    f"template references {{{{ {path} }}}}, but {walked} has only {len(value)} elements",
                    path=path,
                )
            value = value[index]
        else:
            raise TemplateKeyError(
                f"template references {{{{ {path} }}}}, but {walked} is {_describe(value)}, which has no key '{part}'",
                path=path,
            )
        walked = f"{walked}.{part}"
    return value


def _resolve(path: str, *, sample: Sample, item: Mapping[str, object]) -> object:
    try:
        parts = _check_path(path)
    except ValueError as exc:
        # Only reachable for templates that bypassed parse_grader; still a per-sample failure.
        raise TemplateKeyError(str(exc), path=path) from None
    if parts[0] == "item":
        return _lookup(item, parts, path=path)
    if parts[1] == "output_text":
        return sample.output_text
    parsed = sample.output_json
    if parsed is None:
        raise TemplateKeyError(
            f"template references {{{{ {path} }}}}, but the completion is not valid JSON",
            path=path,
        )
    return _lookup(parsed, ["sample.output_json", *parts[2:]], path=path)


def _to_text(value: object) -> str:
    """Strings as-is (no quotes), anything else as JSON, so ``{{ item.n }}`` of 42 gives ``42``."""
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False)


def render(template: str, *, sample: Sample, item: Mapping[str, object]) -> str:
    """Fill ``{{ item.key }}``, ``{{ sample.output_text }}`` and ``{{ sample.output_json.key }}``.

    Text outside the braces is kept literally. Raises ``TemplateKeyError`` when a referenced key is
    missing (or the completion is not JSON for ``output_json``).
    """
    try:
        refs = _template_refs(template)
    except ValueError as exc:
        raise TemplateKeyError(str(exc), path="") from None
    if not refs:
        return template
    pieces: list[str] = []
    pos = 0
    for start, end, path in refs:
        pieces.append(template[pos:start])
        pieces.append(_to_text(_resolve(path, sample=sample, item=item)))
        pos = end
    pieces.append(template[pos:])
    return "".join(pieces)


# --------------------------------------------------------------------------------------------------
# calculate_output: a tiny arithmetic language, parsed by hand
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Num:
    value: float


@dataclass(frozen=True)
class _Name:
    name: str


@dataclass(frozen=True)
class _Unary:
    op: str  # "-" or "+"
    operand: _Expr


@dataclass(frozen=True)
class _Binary:
    op: str  # "+", "-", "*", "/"
    left: _Expr
    right: _Expr


@dataclass(frozen=True)
class _Call:
    func: str
    args: tuple[_Expr, ...]


_Expr = _Num | _Name | _Unary | _Binary | _Call

# name -> (min args, max args or None for unbounded)
_FUNCTION_ARITY: dict[str, tuple[int, int | None]] = {
    "abs": (1, 1),
    "clip": (3, 3),
    "max": (1, None),
    "min": (1, None),
}
_FUNCTION_USAGE = "abs(x), clip(x, lo, hi), max(a, b, ...), min(a, b, ...)"

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
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


def _tokenize(text: str, fail: Callable[[str], GraderError]) -> list[_Token]:
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
        ident = _IDENTIFIER.match(text, i)
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

    def __init__(self, text: str, names: Sequence[str], *, param: str) -> None:
        self.text = text
        self.names = frozenset(names)
        self.known = ", ".join(sorted(names)) or "(none)"
        self.param = param
        self.tokens = _tokenize(text, self.fail)
        self.index = 0
        self.depth = 0

    def fail(self, message: str) -> GraderError:
        return GraderError(f"calculate_output: {message}", param=self.param)

    def parse(self) -> _Expr:
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

    def expr(self) -> _Expr:
        left = self.term()
        while self.peek().kind == "op" and self.peek().text in "+-":
            op = self.advance().text
            left = _Binary(op, left, self.term())
        return left

    def term(self) -> _Expr:
        left = self.unary()
        while self.peek().kind == "op" and self.peek().text in "*/":
            op = self.advance().text
            left = _Binary(op, left, self.unary())
        return left

    def unary(self) -> _Expr:
        token = self.peek()
        if token.kind == "op" and token.text in "+-":
            self.advance()
            self.enter()
            operand = self.unary()
            self.depth -= 1
            return _Unary(token.text, operand)
        return self.atom()

    def atom(self) -> _Expr:
        token = self.advance()
        if token.kind == "num":
            value = float(token.text)
            if not math.isfinite(value):
                raise self.fail(f"number {token.text!r} at position {token.pos} is too large")
            return _Num(value)
        if token.kind == "name":
            if self.peek().kind == "op" and self.peek().text == "(":
                return self.call(token)
            if token.text in _FUNCTION_ARITY:
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

    def call(self, name: _Token) -> _Expr:
        if name.text not in _FUNCTION_ARITY:
            what = "a sub-grader, not a function" if name.text in self.names else "not a function"
            raise self.fail(f"'{name.text}' at position {name.pos} is {what}; the functions are {_FUNCTION_USAGE}")
        self.advance()  # "("
        self.enter()
        args: list[_Expr] = []
        if not (self.peek().kind == "op" and self.peek().text == ")"):
            args.append(self.expr())
            while self.peek().kind == "op" and self.peek().text == ",":
                self.advance()
                args.append(self.expr())
        self.expect(")", "')' or ','")
        self.depth -= 1
        lo, hi = _FUNCTION_ARITY[name.text]
        if len(args) < lo or (hi is not None and len(args) > hi):
            expected = f"exactly {lo}" if lo == hi else f"at least {lo}"
            raise self.fail(
                f"{name.text}() at position {name.pos} takes {expected} argument"
                f"{'' if lo == 1 else 's'}, got {len(args)}"
            )
        return _Call(name.text, tuple(args))


def _parse_formula(text: str, names: Sequence[str], *, param: str) -> _Expr:
    if len(text) > MAX_FORMULA_LENGTH:
        raise GraderError(
            f"calculate_output is {len(text)} characters; the limit is {MAX_FORMULA_LENGTH}",
            param=param,
        )
    return _FormulaParser(text, names, param=param).parse()


def _evaluate(expr: _Expr, env: Mapping[str, float]) -> float:
    """Interpret a parsed formula for one sample. NaN in, NaN out; x / 0 is NaN, not an exception."""
    if isinstance(expr, _Num):
        return expr.value
    if isinstance(expr, _Name):
        return env[expr.name]
    if isinstance(expr, _Unary):
        value = _evaluate(expr.operand, env)
        return -value if expr.op == "-" else value
    if isinstance(expr, _Binary):
        left = _evaluate(expr.left, env)
        right = _evaluate(expr.right, env)
        if expr.op == "+":
            return left + right
        if expr.op == "-":
            return left - right
        if expr.op == "*":
            return left * right
        return NAN if right == 0 else left / right
    args = [_evaluate(a, env) for a in expr.args]
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


# --------------------------------------------------------------------------------------------------
# Text similarity metrics
# --------------------------------------------------------------------------------------------------


def _fuzzy_match(text: str, reference: str) -> float:
    """rapidfuzz ``fuzz.WRatio`` scaled to 0..1.

    Why WRatio and not ``fuzz.ratio``: OpenAI documents fuzzy_match as rapidfuzz-based, and WRatio
    is rapidfuzz's general-purpose scorer. It takes the best of the plain Indel ratio, a
    word-order-insensitive token ratio (x0.95) and, when one string is 1.5x+ longer, a substring
    (partial) ratio (x0.9, or x0.6 at 8x+). So "The answer is Paris" against "Paris" scores 0.9
    instead of ratio's 0.42, which is the behaviour a reward for "says the right thing" wants.
    No processor is applied (rapidfuzz's default), so case matters, as in ``string_check`` ``like``.
    Identical strings score 1.0 even when both are empty (WRatio returns 0 for empty input); each
    string is read up to ``SIMILARITY_MAX_CHARS``, as every metric does.
    """
    if text == reference:
        return 1.0
    return fuzz.WRatio(text[:SIMILARITY_MAX_CHARS], reference[:SIMILARITY_MAX_CHARS]) / 100.0


SIMILARITY_MAX_CHARS = 10_000
"""Every metric reads this much of each string: their costs grow with the product of the lengths
(ROUGE-L's and fuzzy_match's alignments), and a completion or a reference longer than this is no
sentence to compare."""


def _same_or(metric: Callable[[str, str], float]) -> Callable[[str, str], float]:
    """Identical strings score 1.0 (even both empty, where n-gram metrics have nothing to count);
    an empty string against a non-empty one scores 0.0; each string is read up to
    ``SIMILARITY_MAX_CHARS``."""

    def score(text: str, reference: str) -> float:
        if text == reference:
            return 1.0
        text, reference = text[:SIMILARITY_MAX_CHARS], reference[:SIMILARITY_MAX_CHARS]
        if not text.strip() or not reference.strip():
            return 0.0
        return float(metric(text, reference))

    return score


def _bleu(text: str, reference: str) -> float:
    """sacrebleu's sentence BLEU (13a tokenization, exponential smoothing, brevity penalty), / 100."""
    import sacrebleu

    return float(sacrebleu.sentence_bleu(text, [reference]).score) / 100.0


def _gleu(text: str, reference: str) -> float:
    """Google-BLEU (nltk ``sentence_gleu``, 1- to 4-grams) on whitespace tokens."""
    from nltk.translate.gleu_score import sentence_gleu

    return float(sentence_gleu([reference.split()], text.split()))


class _NoSynonyms:
    """METEOR's WordNet stage, empty: the WordNet data is a download, and the service runs offline.
    METEOR then matches exact words and Porter stems (its first two stages)."""

    @staticmethod
    def synsets(*_: object, **__: object) -> list[object]:
        return []


def _meteor(text: str, reference: str) -> float:
    """METEOR (nltk ``single_meteor_score``: alpha 0.9, beta 3, gamma 0.5) on whitespace tokens,
    exact and stem matches (no WordNet synonyms: see ``_NoSynonyms``)."""
    from nltk.translate.meteor_score import single_meteor_score

    return float(single_meteor_score(reference.split(), text.split(), wordnet=_NoSynonyms()))


def _rouge(kind: str) -> Callable[[str, str], float]:
    """ROUGE-N or ROUGE-L F-measure, Google's ``rouge-score`` (its tokenizer: lowercase, alphanumeric)."""

    def score(text: str, reference: str) -> float:
        from rouge_score import rouge_scorer

        return float(_rouge_scorer(kind, rouge_scorer).score(reference, text)[kind].fmeasure)

    return score


@functools.cache
def _rouge_scorer(kind: str, module: Any) -> Any:
    return module.RougeScorer([kind])


TEXT_SIMILARITY_METRICS: dict[str, Callable[[str, str], float]] = {
    "fuzzy_match": _fuzzy_match,
    "bleu": _same_or(_bleu),
    "gleu": _same_or(_gleu),
    "meteor": _same_or(_meteor),
    **{f"rouge_{n}": _same_or(_rouge(f"rouge{n}")) for n in range(1, 6)},
    "rouge_l": _same_or(_rouge("rougeL")),
    # Sentence embeddings from a local model: run where models run (the worker's ModelScorer).
    "cosine": lambda text, reference: NAN,
}
MODEL_METRICS = frozenset({"cosine"})
"""``evaluation_metric`` names that need a model: scored by the worker, like a reward model."""
"""``evaluation_metric`` name -> ``f(input, reference) -> score``; the API lists the keys."""


# --------------------------------------------------------------------------------------------------
# Grader types
# --------------------------------------------------------------------------------------------------

_STRING_CHECK_OPERATIONS = ("eq", "ne", "like", "ilike")


@dataclass(frozen=True)
class Grader:
    """Base of the parsed, immutable graders. ``name`` labels its scores in metrics and errors."""

    type: ClassVar[str] = ""
    name: str

    def item_keys(self) -> set[str]:
        """Top-level ``item`` keys referenced anywhere in this grader (see ``referenced_item_keys``)."""
        return referenced_item_keys(self)

    def to_dict(self) -> dict[str, object]:
        return grader_to_dict(self)


@dataclass(frozen=True)
class StringCheckGrader(Grader):
    """1.0 if ``input`` compares true to ``reference`` under ``operation``, else 0.0.

    ``eq``/``ne``: exact equality / inequality. ``like``: reference is a substring of input;
    ``ilike``: the same, case-insensitive (OpenAI's semantics).
    """

    type: ClassVar[str] = "string_check"
    input: str
    reference: str
    operation: str


@dataclass(frozen=True)
class TextSimilarityGrader(Grader):
    """``TEXT_SIMILARITY_METRICS[evaluation_metric](input, reference)``, a score in 0..1."""

    type: ClassVar[str] = "text_similarity"
    input: str
    reference: str
    evaluation_metric: str


@dataclass(frozen=True)
class RewardModelGrader(Grader):
    """A Hugging Face sequence classifier (one label) scored on the worker; only parsed here.

    ``input`` is an optional template for the text the model scores; None means the completion
    text. The worker renders it with ``render_reward_model_inputs``.
    """

    type: ClassVar[str] = "reward_model"
    model: str
    input: str | None = None


@dataclass(frozen=True)
class ScoreModelGrader(Grader):
    """An LLM judge: a local causal LM reads ``input`` (chat messages whose contents are templates),
    answers greedily, and the first number of its answer, clamped into ``range``, is the score.
    Scored on the worker (``parse_judge_score`` reads the answer)."""

    type: ClassVar[str] = "score_model"
    model: str
    input: tuple[tuple[str, str], ...]
    """(role, content template) per message."""
    range: tuple[float, float] = (0.0, 1.0)
    max_tokens: int = 16


_JUDGE_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


def parse_judge_score(answer: str, low: float, high: float) -> float:
    """The first number in a judge's answer, clamped into [low, high]; NaN when there is none."""
    match = _JUDGE_NUMBER.search(answer)
    if match is None:
        return NAN
    value = float(match.group())
    return float(min(high, max(low, value))) if math.isfinite(value) else NAN


@dataclass(frozen=True)
class PythonGrader(Grader):
    """User Python code, ``def grade(sample, item) -> float``; parsed only when the operator allows
    it, run in a sandboxed process (``service.sandbox``)."""

    type: ClassVar[str] = "python"
    source: str


@dataclass(frozen=True)
class HttpGrader(Grader):
    """Scores by an HTTP endpoint of the user's (an operator-allowlisted URL): a POST of the batch,
    ``{"samples": [{"sample": {...}, "item": {...}}, ...]}``, answered ``{"scores": [number|null]}``."""

    type: ClassVar[str] = "http"
    url: str
    timeout_seconds: float = 10.0


class GraderUnavailable(RuntimeError):
    """A grader that could not score at all (an http grader's endpoint down or broken): the job
    fails with ``grader_unavailable`` rather than training on nothing."""


@dataclass(frozen=True)
class MultiGrader(Grader):
    """Sub-graders combined by ``calculate_output``, a formula over their names.

    ``graders`` is a tuple of ``(name, grader)`` pairs rather than a dict so the dataclass stays
    immutable and hashable; ``graders_by_name`` gives the mapping. ``formula`` is the parsed form of
    ``calculate_output`` and is not part of equality (it is derived from it).
    """

    type: ClassVar[str] = "multi"
    graders: tuple[tuple[str, Grader], ...]
    calculate_output: str
    formula: _Expr = field(compare=False, repr=False)

    @property
    def graders_by_name(self) -> dict[str, Grader]:
        return dict(self.graders)


ModelScorer = Callable[[Any, list[Sample], list[Mapping[str, object]]], list[float]]
"""Scores every sample of a batch with one model leaf (a ``RewardModelGrader``, or a
``TextSimilarityGrader`` with a model metric); the worker's batched forward pass."""

_GRADER_CLASSES: dict[str, type[Grader]] = {
    cls.type: cls
    for cls in (
        StringCheckGrader,
        TextSimilarityGrader,
        RewardModelGrader,
        ScoreModelGrader,
        MultiGrader,
        PythonGrader,
        HttpGrader,
    )
}

# type -> (required keys, optional keys); "type" and "name" are common to all.
_GRADER_KEYS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "string_check": (("input", "reference", "operation"), ()),
    "text_similarity": (("input", "reference", "evaluation_metric"), ()),
    "reward_model": (("model",), ("input",)),
    "score_model": (("model", "input"), ("range", "sampling_params")),
    "multi": (("graders", "calculate_output"), ()),
    "python": (("source",), ()),
    "http": (("url",), ("timeout_seconds",)),
}

PYTHON_GRADER_DISABLED = (
    "the python grader is disabled on this server; the operator enables it with RLOO_ALLOW_PYTHON_GRADER=1"
)


# --------------------------------------------------------------------------------------------------
# Parsing
# --------------------------------------------------------------------------------------------------


def _require_str(spec: Mapping[str, object], key: str, *, param: str, kind: str) -> str:
    value = spec[key]
    if not isinstance(value, str):
        raise GraderError(
            f"{key} of a {kind} grader must be a string; got {_describe(value)}",
            param=f"{param}.{key}",
        )
    return value


def _require_nonempty(spec: Mapping[str, object], key: str, *, param: str, kind: str) -> str:
    value = _require_str(spec, key, param=param, kind=kind)
    if not value.strip():
        raise GraderError(f"{key} of a {kind} grader must not be empty", param=f"{param}.{key}")
    return value


def _require_template(spec: Mapping[str, object], key: str, *, param: str, kind: str) -> str:
    value = _require_str(spec, key, param=param, kind=kind)
    _validate_template(value, param=f"{param}.{key}")
    return value


def parse_grader(spec: object, *, param: str = "grader", allow_python: bool = False) -> Grader:
    """Validate a JSON-like grader spec and return its immutable parsed form.

    ``param`` is the dotted path of ``spec`` in the request body; errors extend it to the exact
    field. ``allow_python`` is the operator's ``RLOO_ALLOW_PYTHON_GRADER`` setting.
    """
    return _parse(spec, param=param, allow_python=allow_python, depth=0)


def _parse(spec: object, *, param: str, allow_python: bool, depth: int) -> Grader:
    if not isinstance(spec, Mapping):
        raise GraderError(f"a grader must be a JSON object with a 'type'; got {_describe(spec)}", param=param)
    types = ", ".join(sorted(_GRADER_CLASSES))
    if "type" not in spec:
        raise GraderError(f"type is required; use one of {types}", param=f"{param}.type")
    kind = spec["type"]
    if not isinstance(kind, str) or kind not in _GRADER_CLASSES:
        got = repr(kind) if isinstance(kind, str) else _describe(kind)
        raise GraderError(f"unknown grader type {got}; use one of {types}", param=f"{param}.type")
    if kind == "python" and not allow_python:
        raise GraderError(PYTHON_GRADER_DISABLED, param=f"{param}.type")

    required, optional = _GRADER_KEYS[kind]
    allowed = ("type", "name", *required, *optional)
    unknown = [str(k) for k in spec if k not in allowed]
    if unknown:
        listed = ", ".join(repr(k) for k in unknown)
        raise GraderError(
            f"unknown key{'s' if len(unknown) > 1 else ''} {listed} in a {kind} grader; "
            f"allowed keys: {', '.join(allowed)}",
            param=f"{param}.{unknown[0]}",
        )
    for key in ("name", *required):
        if key not in spec:
            raise GraderError(f"{key} is required in a {kind} grader", param=f"{param}.{key}")

    name = _require_nonempty(spec, "name", param=param, kind=kind)

    if kind == "string_check":
        operation = _require_str(spec, "operation", param=param, kind=kind)
        if operation not in _STRING_CHECK_OPERATIONS:
            raise GraderError(
                f"operation must be one of {', '.join(_STRING_CHECK_OPERATIONS)}; got {operation!r}",
                param=f"{param}.operation",
            )
        return StringCheckGrader(
            name=name,
            input=_require_template(spec, "input", param=param, kind=kind),
            reference=_require_template(spec, "reference", param=param, kind=kind),
            operation=operation,
        )

    if kind == "text_similarity":
        metric = _require_str(spec, "evaluation_metric", param=param, kind=kind)
        if metric not in TEXT_SIMILARITY_METRICS:
            raise GraderError(
                "evaluation_metric must be one of "
                f"{', '.join(sorted(TEXT_SIMILARITY_METRICS))} on this server; got {metric!r}",
                param=f"{param}.evaluation_metric",
            )
        return TextSimilarityGrader(
            name=name,
            input=_require_template(spec, "input", param=param, kind=kind),
            reference=_require_template(spec, "reference", param=param, kind=kind),
            evaluation_metric=metric,
        )

    if kind == "reward_model":
        model = _require_nonempty(spec, "model", param=param, kind=kind)
        template = spec.get("input")
        if template is not None:
            template = _require_template(spec, "input", param=param, kind=kind)
        return RewardModelGrader(name=name, model=model, input=template)

    if kind == "score_model":
        return _parse_score_model(spec, name=name, param=param)

    if kind == "python":
        return PythonGrader(name=name, source=_require_nonempty(spec, "source", param=param, kind=kind))

    if kind == "http":
        return _parse_http(spec, name=name, param=param)

    return _parse_multi(spec, name=name, param=param, allow_python=allow_python, depth=depth)


def _parse_score_model(spec: Mapping[str, object], *, name: str, param: str) -> ScoreModelGrader:
    model = _require_nonempty(spec, "model", param=param, kind="score_model")
    messages = spec["input"]
    if not isinstance(messages, list) or not messages:
        raise GraderError(
            'input of a score_model grader must be a non-empty list of {"role", "content"} messages',
            param=f"{param}.input",
        )
    parsed: list[tuple[str, str]] = []
    for i, message in enumerate(messages):
        where = f"{param}.input.{i}"
        if not isinstance(message, Mapping) or set(message) - {"role", "content", "type"} or "content" not in message:
            raise GraderError('each input message is {"role": ..., "content": "..."}', param=where)
        role, content = message.get("role", "user"), message["content"]
        if role not in ("system", "developer", "user", "assistant") or not isinstance(content, str):
            raise GraderError("role must be system, developer, user or assistant, and content a string", param=where)
        _validate_template(content, param=f"{where}.content")
        parsed.append(("system" if role == "developer" else role, content))
    low_high = spec.get("range", [0, 1])
    if (
        not isinstance(low_high, list)
        or len(low_high) != 2
        or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in low_high)
        or not low_high[0] < low_high[1]
    ):
        raise GraderError(
            f"range must be [low, high] with low < high; got {_describe(low_high)}", param=f"{param}.range"
        )
    sampling = spec.get("sampling_params", {})
    if not isinstance(sampling, Mapping) or set(sampling) - {"max_tokens", "max_completions_tokens"}:
        raise GraderError(
            "sampling_params may set max_tokens only (the judge answers greedily)", param=f"{param}.sampling_params"
        )
    max_tokens = sampling.get("max_tokens", sampling.get("max_completions_tokens", 16))
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or not 1 <= max_tokens <= 256:
        raise GraderError(
            "sampling_params.max_tokens must be an integer in 1..256", param=f"{param}.sampling_params.max_tokens"
        )
    return ScoreModelGrader(
        name=name,
        model=model,
        input=tuple(parsed),
        range=(float(low_high[0]), float(low_high[1])),
        max_tokens=max_tokens,
    )


def render_judge_messages(
    grader: ScoreModelGrader, samples: Sequence[Sample], items: Sequence[Mapping[str, object]]
) -> list[list[dict[str, str]] | None]:
    """The judge's chat messages per sample; None where a template misses a key."""
    out: list[list[dict[str, str]] | None] = []
    for sample, item in zip(samples, items, strict=True):
        try:
            out.append(
                [{"role": role, "content": render(content, sample=sample, item=item)} for role, content in grader.input]
            )
        except TemplateKeyError:
            out.append(None)
    return out


def _url_under(url: str, prefix: str) -> bool:
    """Same scheme and host (and port), and the path under the prefix's: "https://a.io" does not
    admit "https://a.io.evil.net/", nor "https://a.io/x" admit "https://a.io/xy"."""
    from urllib.parse import unquote, urlsplit

    if any(ord(c) < 33 or c == "\\" for c in url):  # control characters, spaces, backslashes: refused
        return False
    u, p = urlsplit(url), urlsplit(prefix)
    if (u.scheme, u.netloc.lower()) != (p.scheme, p.netloc.lower()) or u.scheme not in ("http", "https"):
        return False
    if any(segment in (".", "..") for segment in unquote(u.path).split("/")):
        return False  # "/graders/../admin" would leave the prefix once the client resolves it
    base = p.path.rstrip("/")
    return u.path == base or u.path.startswith(base + "/") or not base


def _parse_http(spec: Mapping[str, object], *, name: str, param: str) -> HttpGrader:
    from service.settings import get_settings

    url = _require_nonempty(spec, "url", param=param, kind="http")
    allowed = get_settings().http_grader_urls
    if not any(_url_under(url, prefix) for prefix in allowed):
        # The operator's prefixes may hold credentials (user:password@): never shown to a caller.
        shown = ", ".join(map(redact_url, allowed))
        where = f"one of: {shown}" if allowed else "none: http graders are off on this server"
        raise GraderError(
            f"url {redact_url(url)!r} is not on the operator's allowlist "
            f"(RLOO_HTTP_GRADER_URLS, URL prefixes; {where})",
            param=f"{param}.url",
        )
    timeout = spec.get("timeout_seconds", 10.0)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= 120:
        raise GraderError(
            f"timeout_seconds must be a number in (0, 120]; got {_describe(timeout)}", param=f"{param}.timeout_seconds"
        )
    return HttpGrader(name=name, url=url, timeout_seconds=float(timeout))


def _parse_multi(spec: Mapping[str, object], *, name: str, param: str, allow_python: bool, depth: int) -> MultiGrader:
    if depth >= MAX_GRADER_DEPTH:
        raise GraderError(
            f"multi graders nest at most {MAX_GRADER_DEPTH} deep; flatten this one",
            param=param,
        )
    raw = spec["graders"]
    graders_param = f"{param}.graders"
    # (formula name, param of the spec, spec)
    entries: list[tuple[str, str, object]] = []
    if isinstance(raw, Mapping):
        for key, sub in raw.items():
            entries.append((str(key), f"{graders_param}.{key}", sub))
    elif isinstance(raw, (list, tuple)):
        for i, sub in enumerate(raw):
            sub_param = f"{graders_param}.{i}"
            sub_name = sub.get("name") if isinstance(sub, Mapping) else None
            if not isinstance(sub_name, str) or not sub_name.strip():
                # Let the sub-grader's own validation produce the precise message.
                _parse(sub, param=sub_param, allow_python=allow_python, depth=depth + 1)
                raise GraderError("name is required", param=f"{sub_param}.name")
            entries.append((sub_name, sub_param, sub))
    else:
        raise GraderError(
            f"graders must be an object of name -> grader or an array of graders; got {_describe(raw)}",
            param=graders_param,
        )
    if not entries:
        raise GraderError("graders must contain at least one grader", param=graders_param)

    graders: list[tuple[str, Grader]] = []
    seen: set[str] = set()
    for sub_name, sub_param, sub in entries:
        where = f"{sub_param}.name" if isinstance(raw, (list, tuple)) else sub_param
        if sub_name in seen:
            raise GraderError(f"two sub-graders are named '{sub_name}'; names must be unique", param=where)
        if not _IDENTIFIER.fullmatch(sub_name):
            raise GraderError(
                f"sub-grader name '{sub_name}' cannot be used in calculate_output; use letters, "
                "digits and '_', not starting with a digit",
                param=where,
            )
        if sub_name in _FUNCTION_ARITY:
            raise GraderError(
                f"sub-grader name '{sub_name}' is a function of calculate_output; rename it",
                param=where,
            )
        if sub_name == name:
            raise GraderError(
                f"sub-grader name '{sub_name}' is also the multi grader's own name; rename one "
                "(both label scores in the job's metrics)",
                param=where,
            )
        seen.add(sub_name)
        graders.append((sub_name, _parse(sub, param=sub_param, allow_python=allow_python, depth=depth + 1)))

    text = _require_str(spec, "calculate_output", param=param, kind="multi")
    formula = _parse_formula(text, [n for n, _ in graders], param=f"{param}.calculate_output")
    return MultiGrader(name=name, graders=tuple(graders), calculate_output=text, formula=formula)


# --------------------------------------------------------------------------------------------------
# Introspection and serialisation
# --------------------------------------------------------------------------------------------------


def _leaves(grader: Grader) -> list[Grader]:
    if isinstance(grader, MultiGrader):
        return [leaf for _, sub in grader.graders for leaf in _leaves(sub)]
    return [grader]


def model_leaves(grader: Grader, param: str = "grader") -> list[tuple[RewardModelGrader | ScoreModelGrader, str]]:
    """Leaves naming a model (reward and judge models) with the dotted ``param`` path of each (job
    creation checks their models)."""
    if isinstance(grader, MultiGrader):
        return [pair for name, sub in grader.graders for pair in model_leaves(sub, f"{param}.graders.{name}")]
    return [(grader, param)] if isinstance(grader, (RewardModelGrader, ScoreModelGrader)) else []


def referenced_item_keys(grader: Grader) -> set[str]:
    """Top-level ``item`` keys that any template in the grader tree references.

    Job creation checks each training-file line has them ("the grader references item.answer, which
    line 3 lacks"). A python grader's references cannot be known statically and add nothing.
    """
    keys: set[str] = set()
    for leaf in _leaves(grader):
        if isinstance(leaf, (StringCheckGrader, TextSimilarityGrader)):
            keys |= template_item_keys(leaf.input) | template_item_keys(leaf.reference)
        elif isinstance(leaf, RewardModelGrader) and leaf.input is not None:
            keys |= template_item_keys(leaf.input)
        elif isinstance(leaf, ScoreModelGrader):
            for _, content in leaf.input:
                keys |= template_item_keys(content)
    return keys


def first_missing_item_key(grader: Grader, keys_summary: Mapping[str, Any]) -> tuple[str, int] | None:
    """The first ``item.`` key the grader uses that some dataset line lacks, with that line's number.

    ``keys_summary`` is an upload's summary: ``{"keys": {key: count}, "first_missing": {key: line}}``.
    """
    keys, first_missing = keys_summary.get("keys", {}), keys_summary.get("first_missing", {})
    for key in sorted(referenced_item_keys(grader)):
        line = 1 if key not in keys else first_missing.get(key)
        if line is not None:
            return key, int(line)
    return None


def is_model_grader(grader: Grader) -> bool:
    """True if any leaf needs a model (a reward model, a ``cosine`` similarity): the worker scores it."""
    return any(
        isinstance(leaf, (RewardModelGrader, ScoreModelGrader))
        or (isinstance(leaf, TextSimilarityGrader) and leaf.evaluation_metric in MODEL_METRICS)
        for leaf in _leaves(grader)
    )


def grader_to_dict(grader: Grader) -> dict[str, object]:
    """The JSON form of a parsed grader; ``parse_grader(grader_to_dict(g)) == g``.

    ``multi`` sub-graders always come out as an object keyed by name, whichever form came in.
    """
    out: dict[str, object] = {"type": grader.type, "name": grader.name}
    if isinstance(grader, StringCheckGrader):
        out.update(input=grader.input, reference=grader.reference, operation=grader.operation)
    elif isinstance(grader, TextSimilarityGrader):
        out.update(
            input=grader.input,
            reference=grader.reference,
            evaluation_metric=grader.evaluation_metric,
        )
    elif isinstance(grader, RewardModelGrader):
        out["model"] = grader.model
        if grader.input is not None:
            out["input"] = grader.input
    elif isinstance(grader, PythonGrader):
        out["source"] = grader.source
    elif isinstance(grader, HttpGrader):
        out.update(url=grader.url, timeout_seconds=grader.timeout_seconds)
    elif isinstance(grader, ScoreModelGrader):
        out.update(
            model=grader.model,
            input=[{"role": role, "content": content} for role, content in grader.input],
            range=list(grader.range),
            sampling_params={"max_tokens": grader.max_tokens},
        )
    elif isinstance(grader, MultiGrader):
        out["graders"] = {name: grader_to_dict(sub) for name, sub in grader.graders}
        out["calculate_output"] = grader.calculate_output
    else:
        raise TypeError(f"not a parsed grader: {grader!r}")
    return out


# --------------------------------------------------------------------------------------------------
# Grading
# --------------------------------------------------------------------------------------------------


@dataclass
class GradeResult:
    """Scores of one batch, index-aligned with its samples.

    ``rewards``: the reward per sample, NaN where it could not be scored.
    ``sub_rewards``: scores per grader: for a ``multi``, each sub-grader by name (nested ones as
    ``outer.inner``); for a single grader, ``{its name: rewards}``.
    ``errors``: how many NaN each grader produced (root by its name, sub-graders as in
    ``sub_rewards``); graders without NaN are left out, so a clean batch gives ``{}``.
    """

    rewards: list[float]
    sub_rewards: dict[str, list[float]]
    errors: dict[str, int]
    messages: dict[str, str] = field(default_factory=dict)
    """The first error message of each grader that gave one (python graders: why a sample failed)."""


def _finite_or_nan(value: object) -> float:
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):
        return NAN
    return number if math.isfinite(number) else NAN


def _render_pairs(
    grader: StringCheckGrader | TextSimilarityGrader,
    samples: Sequence[Sample],
    items: Sequence[Mapping[str, object]],
) -> list[tuple[str, str] | None]:
    pairs: list[tuple[str, str] | None] = []
    for sample, item in zip(samples, items, strict=True):
        try:
            pairs.append(
                (
                    render(grader.input, sample=sample, item=item),
                    render(grader.reference, sample=sample, item=item),
                )
            )
        except TemplateKeyError:
            pairs.append(None)
    return pairs


def _string_check(operation: str, text: str, reference: str) -> float:
    if operation == "eq":
        return float(text == reference)
    if operation == "ne":
        return float(text != reference)
    if operation == "like":
        return float(reference in text)
    return float(reference.casefold() in text.casefold())  # ilike


def render_reward_model_inputs(
    grader: RewardModelGrader,
    samples: Sequence[Sample],
    items: Sequence[Mapping[str, object]],
) -> list[str | None]:
    """The text a reward model scores per sample; None where the template misses a key.

    For the worker's ``ModelScorer``: it should return NaN for the None entries.
    """
    if grader.input is None:
        return [s.output_text for s in samples]
    texts: list[str | None] = []
    for sample, item in zip(samples, items, strict=True):
        try:
            texts.append(render(grader.input, sample=sample, item=item))
        except TemplateKeyError:
            texts.append(None)
    return texts


def _grade(
    grader: Grader,
    samples: Sequence[Sample],
    items: Sequence[Mapping[str, object]],
    model_scorer: ModelScorer | None,
    prefix: str,
    sub_rewards: dict[str, list[float]],
    messages: dict[str, str] | None = None,
) -> list[float]:
    """Scores of ``grader`` on the batch; records each descendant of a multi in ``sub_rewards``."""
    if isinstance(grader, StringCheckGrader):
        return [
            NAN if pair is None else _string_check(grader.operation, *pair)
            for pair in _render_pairs(grader, samples, items)
        ]
    if isinstance(grader, TextSimilarityGrader) and grader.evaluation_metric in MODEL_METRICS:
        return _model_scores(grader, samples, items, model_scorer, prefix)
    if isinstance(grader, TextSimilarityGrader):
        metric = TEXT_SIMILARITY_METRICS[grader.evaluation_metric]
        return [
            NAN if pair is None else _finite_or_nan(metric(*pair)) for pair in _render_pairs(grader, samples, items)
        ]
    if isinstance(grader, (RewardModelGrader, ScoreModelGrader)):
        return _model_scores(grader, samples, items, model_scorer, prefix)
    if isinstance(grader, PythonGrader):
        from service.sandbox import Limits, run_python_grader
        from service.settings import get_settings

        settings = get_settings()
        limits = Limits(
            per_sample_seconds=settings.python_grader_seconds,
            batch_seconds=settings.python_grader_seconds * len(samples) + 10,
            memory_mb=settings.python_grader_memory_mb,
        )
        from service.sandbox import SandboxUnavailable

        try:
            outcomes = run_python_grader(
                grader.source,
                [{"output_text": s.output_text, "output_json": s.output_json} for s in samples],
                [dict(item) for item in items],
                limits,
            )
        except SandboxUnavailable as exc:
            raise GraderUnavailable(f"python grader '{grader.name}': {exc}") from None
        first_error = next((o.error for o in outcomes if o.error), None)
        if first_error is not None and messages is not None:
            messages.setdefault(prefix or grader.name, first_error)
        return [o.score for o in outcomes]
    if isinstance(grader, HttpGrader):
        return _grade_http(grader, samples, items)
    if isinstance(grader, MultiGrader):
        columns: dict[str, list[float]] = {}
        for name, sub in grader.graders:
            path = f"{prefix}.{name}" if prefix else name
            columns[name] = _grade(sub, samples, items, model_scorer, path, sub_rewards, messages)
            sub_rewards[path] = columns[name]
        rewards = []
        for i in range(len(samples)):
            value = _evaluate(grader.formula, {name: column[i] for name, column in columns.items()})
            rewards.append(value if math.isfinite(value) else NAN)
        return rewards
    raise TypeError(f"not a parsed grader: {grader!r}")


def _model_scores(
    grader: Grader,
    samples: Sequence[Sample],
    items: Sequence[Mapping[str, object]],
    model_scorer: ModelScorer | None,
    prefix: str,
) -> list[float]:
    if model_scorer is None:
        reward_model = isinstance(grader, (RewardModelGrader, ScoreModelGrader))
        what, field_ = ("its model loaded", "model") if reward_model else ("the embedding model", "evaluation_metric")
        raise GraderError(
            f"{grader.type} grader '{grader.name}' needs {what}; model graders run on the worker",
            param=f"{prefix or grader.name}.{field_}",
        )
    if not samples:
        return []
    scores = list(model_scorer(grader, list(samples), list(items)))  # type: ignore[arg-type]
    if len(scores) != len(samples):
        raise ValueError(f"model_scorer returned {len(scores)} scores for {len(samples)} samples")
    return [_finite_or_nan(s) for s in scores]


def render_pairs(
    grader: TextSimilarityGrader, samples: Sequence[Sample], items: Sequence[Mapping[str, object]]
) -> list[tuple[str, str] | None]:
    """(input, reference) per sample for the worker's model metrics; None where a template misses a key."""
    return _render_pairs(grader, samples, items)


HTTP_GRADER_ATTEMPTS = 3
HTTP_GRADER_BATCH = 256


def _grade_http(grader: HttpGrader, samples: Sequence[Sample], items: Sequence[Mapping[str, object]]) -> list[float]:
    """POST the batch (in chunks of 256); a connection error, a time-out or a 5xx is retried twice
    (after 0.5 s, then 1 s); then, or on any answer that is not the scores, ``GraderUnavailable``."""
    import time

    import httpx

    scores: list[float] = []
    with httpx.Client(timeout=grader.timeout_seconds, follow_redirects=False) as client:
        for start in range(0, len(samples), HTTP_GRADER_BATCH):
            chunk = range(start, min(start + HTTP_GRADER_BATCH, len(samples)))
            body = {
                "samples": [
                    {
                        "sample": {"output_text": samples[i].output_text, "output_json": samples[i].output_json},
                        "item": dict(items[i]),
                    }
                    for i in chunk
                ]
            }
            problem = ""
            for attempt in range(HTTP_GRADER_ATTEMPTS):
                if attempt:
                    time.sleep(0.5 * attempt)
                try:
                    status, data = _post_capped(client, grader, body)
                except (httpx.HTTPError, TimeoutError) as exc:
                    problem = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                    continue
                if status >= 500:
                    problem = f"HTTP {status}"
                    continue
                scores += _http_scores(grader, status, data, len(chunk))
                break
            else:
                raise GraderUnavailable(
                    f"http grader '{grader.name}': {redact_url(grader.url)} did not answer after "
                    f"{HTTP_GRADER_ATTEMPTS} attempts ({problem}); each waits {grader.timeout_seconds:g} s "
                    "(timeout_seconds)"
                )
    return scores


HTTP_GRADER_MAX_BYTES = 16 * 2**20


def _post_capped(client: Any, grader: HttpGrader, body: dict[str, Any]) -> tuple[int, bytes]:
    """POST and read the answer within ``timeout_seconds`` in all (httpx's timeouts are per read, so
    a byte a second would never end) and at most 16 MiB."""
    import time

    deadline = time.monotonic() + grader.timeout_seconds
    with client.stream("POST", grader.url, json=body) as resp:
        data = bytearray()
        for chunk in resp.iter_bytes():
            data += chunk
            if len(data) > HTTP_GRADER_MAX_BYTES:
                raise GraderUnavailable(
                    f"http grader '{grader.name}': {redact_url(grader.url)} answered more than 16 MiB"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(f"the answer took longer than {grader.timeout_seconds:g} s")
        return resp.status_code, bytes(data)


def _http_scores(grader: HttpGrader, status: int, data: bytes, n: int) -> list[float]:
    where = f"http grader '{grader.name}': {redact_url(grader.url)}"  # messages reach events and logs
    text = data[:200].decode("utf-8", errors="replace")
    if status != 200:
        raise GraderUnavailable(f"{where} answered HTTP {status}: {text}")
    try:
        scores = json.loads(data)["scores"]
    except (ValueError, KeyError, TypeError):
        raise GraderUnavailable(f'{where} must answer {{"scores": [...]}}; got {text!r}') from None
    if not isinstance(scores, list) or len(scores) != n:
        got = f"{len(scores)} scores" if isinstance(scores, list) else _describe(scores)
        raise GraderUnavailable(f"{where} answered {got} for {n} samples")
    return [NAN if s is None or isinstance(s, bool) else _finite_or_nan(s) for s in scores]


def grade_batch(
    grader: Grader,
    samples: Sequence[Sample],
    items: Sequence[Mapping[str, object]],
    *,
    model_scorer: ModelScorer | None = None,
) -> GradeResult:
    """Score a batch: ``samples[i]`` is a completion of the training line ``items[i]``.

    Never raises for one bad sample (it gets NaN); raises ``GraderError`` when the grader cannot run
    here at all (a reward model without ``model_scorer``). Each reward-model leaf
    calls ``model_scorer`` once with the whole batch.
    """
    if len(samples) != len(items):
        raise ValueError(f"got {len(samples)} samples but {len(items)} items; pass one item each")
    sub_rewards: dict[str, list[float]] = {}
    messages: dict[str, str] = {}
    rewards = _grade(grader, samples, items, model_scorer, "", sub_rewards, messages)
    if not isinstance(grader, MultiGrader):
        sub_rewards = {grader.name: rewards}
    errors: dict[str, int] = {}
    for name, column in ((grader.name, rewards), *sub_rewards.items()):
        count = sum(1 for r in column if math.isnan(r))
        if count:
            errors[name] = count
    return GradeResult(rewards=rewards, sub_rewards=sub_rewards, errors=errors, messages=messages)


def grade_one(
    grader: Grader,
    sample: Sample,
    item: Mapping[str, object],
    model_scorer: ModelScorer | None = None,
) -> tuple[float, dict[str, float]]:
    """Score one completion, as ``POST /graders/run`` does: ``(reward, {grader name: score})``."""
    result = grade_batch(grader, [sample], [item], model_scorer=model_scorer)
    return result.rewards[0], {name: column[0] for name, column in result.sub_rewards.items()}

"""Graders: the reward specs of a fine-tuning job, parsed, validated and run on batches.

A grader scores one completion (``sample``) of one training-file line (``item``) as a float, with
OpenAI's RFT grader shapes (``string_check``, ``text_similarity``, ``multi``, ``python``,
``score_model``, ``label_model``) plus ``reward_model`` (a Hugging Face sequence classifier) and ``http`` (an
endpoint of the user's).

The package, one concern a module:

* ``types``: the parsed graders (one frozen dataclass per type), ``Sample``, the errors.
* ``templates``: ``{{ item.key }}`` templates, checked at parse time and rendered per sample.
* ``formula``: ``calculate_output``, parsed and interpreted by hand (never ``eval``).
* ``similarity``: the ``text_similarity`` metrics.
* ``spec``: JSON spec -> grader, one parser per type; questions about a parsed grader.
* ``httpgrader``: the http grader's URL allowlist and client.
* ``scoring``: one scorer per grader class in ``SCORERS``; ``grade_batch``.
* ``sandbox``: where a python grader's code runs (bwrap, or a plain process when the operator
  allows it), and ``sandbox_runner``, the program run inside it.

Adding a grader type is a dataclass in ``types``, a parser in ``spec.PARSERS`` and a scorer in
``scoring.SCORERS``. The API process imports this package to validate a spec, so it is pure
Python: no torch, transformers or numpy. Every mistake a user can make is a ``GraderError`` carrying
the dotted path (``param``) of the offending field and a message saying what to change.
"""

from service.graders.scoring import (
    SCORERS,
    Batch,
    GradeResult,
    Scorer,
    grade_batch,
    grade_one,
    parse_judge_score,
    render_judge_messages,
    render_pairs,
    render_reward_model_inputs,
)
from service.graders.similarity import EVALUATION_METRICS, MODEL_METRICS, TEXT_SIMILARITY_METRICS
from service.graders.spec import (
    first_missing_item_key,
    grader_to_dict,
    is_model_grader,
    model_leaves,
    openai_typed,
    parse_grader,
    referenced_item_keys,
)
from service.graders.templates import TemplateKeyError, render, template_item_keys
from service.graders.types import (
    ChatJudgeGrader,
    CosineGrader,
    Grader,
    GraderError,
    GraderUnavailable,
    HttpGrader,
    LabelModelGrader,
    MultiGrader,
    PythonGrader,
    RewardModelGrader,
    Sample,
    ScoreModelGrader,
    StringCheckGrader,
    TextSimilarityGrader,
    leaves,
)

__all__ = [
    "EVALUATION_METRICS",
    "MODEL_METRICS",
    "SCORERS",
    "TEXT_SIMILARITY_METRICS",
    "Batch",
    "CosineGrader",
    "GradeResult",
    "Grader",
    "GraderError",
    "GraderUnavailable",
    "ChatJudgeGrader",
    "HttpGrader",
    "LabelModelGrader",
    "MultiGrader",
    "PythonGrader",
    "RewardModelGrader",
    "Sample",
    "ScoreModelGrader",
    "Scorer",
    "StringCheckGrader",
    "TemplateKeyError",
    "TextSimilarityGrader",
    "first_missing_item_key",
    "grade_batch",
    "grade_one",
    "grader_to_dict",
    "is_model_grader",
    "leaves",
    "model_leaves",
    "openai_typed",
    "parse_grader",
    "parse_judge_score",
    "referenced_item_keys",
    "render",
    "render_judge_messages",
    "render_pairs",
    "render_reward_model_inputs",
    "template_item_keys",
]

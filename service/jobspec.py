"""What job creation checks before anything is stored, shared by ``POST /v1/fine_tuning/jobs`` and
``rloo train``: the two paths accept and refuse exactly the same specs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from service import graders
from service.errors import bad_request
from service.modelroot import resolve_model
from service.schemas import JobCreate, ResolvedHyperparameters
from service.settings import Settings


def check_spec(body: JobCreate, *, settings: Settings) -> tuple[graders.Grader, ResolvedHyperparameters]:
    """Everything checkable without the dataset: returns the parsed grader and resolved hyperparameters.

    Raises a 400 ``APIError`` whose ``param`` names the offending field.
    """
    kind = body.method.type
    prefix = f"method.{kind}"
    if body.hyperparameters:
        raise bad_request(f"Put hyperparameters under {prefix}.hyperparameters.", "hyperparameters")
    if body.integrations:
        raise bad_request("Integrations are not supported by this server; remove them.", "integrations")
    resolve_model(settings.models_dir, body.model, hub_offline=settings.hub_offline, param="model")
    try:
        grader = graders.parse_grader(
            body.method.config.grader, param=f"{prefix}.grader", allow_python=settings.allow_python_grader
        )
    except graders.GraderError as exc:
        raise bad_request(exc.message, exc.param) from None
    for leaf, leaf_param in graders.model_leaves(grader, f"{prefix}.grader"):
        resolve_model(settings.models_dir, leaf.model, hub_offline=settings.hub_offline, param=f"{leaf_param}.model")
    hp = body.method.config.hyperparameters.resolved()
    if hp.eval_interval not in ("auto", 0) and not body.validation_file:
        raise bad_request("eval_interval needs a validation_file to score.", f"{prefix}.hyperparameters.eval_interval")
    if hp.kl_coef > 0 and not hp.kl_in_reward and hp.kl_estimator == "k1":
        raise bad_request(
            "kl_in_reward false makes the KL a loss term, and k1's gradient there is zero in expectation (it "
            "would add noise, not a pull to the reference). Set kl_estimator to 'k3', or keep kl_in_reward true.",
            f"{prefix}.hyperparameters.kl_estimator",
        )
    if hp.batch_size % hp.gradient_accumulation_steps:
        raise bad_request(
            f"gradient_accumulation_steps ({hp.gradient_accumulation_steps}) must divide batch_size "
            f"({hp.batch_size}): each micro-batch holds whole groups of rloo_k completions.",
            f"{prefix}.hyperparameters.gradient_accumulation_steps",
        )
    return grader, hp


def check_item_keys(grader: graders.Grader, keys_summary: Mapping[str, Any], *, source: str, param: str) -> None:
    """Refuse a grader that uses an ``item.`` key some line of the dataset lacks (``source`` names it)."""
    missing = graders.first_missing_item_key(grader, keys_summary)
    if missing is not None:
        key, line = missing
        raise bad_request(
            f"The grader uses item.{key}, but line {line} of {source} has no '{key}' key. "
            "Add it to every line, or change the grader.",
            param,
            "missing_item_key",
        )

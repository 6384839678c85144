"""A job's spec (``JobCreate``: what a user submits) and what job creation checks before anything is
stored, shared by ``POST /v1/fine_tuning/jobs`` and ``rloo train``: the two paths accept and refuse
exactly the same specs."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from service import graders, tools
from service.core.errors import bad_request
from service.core.settings import Settings
from service.core.validation import Strict, check_metadata
from service.files.datasets import first_line_not
from service.jobs.hyperparameters import (
    HYPERPARAMETERS,
    AnyResolved,
    Method,
    ReinforcementHyperparameters,
    ResolvedReinforcementHyperparameters,
    RLConfig,
    SupervisedConfig,
    SupervisedHyperparameters,
    least_rloo_k,
)
from service.registry import inspection, memory_plan, model_ids
from service.registry.model_root import resolve_model


class WandbSpec(Strict):
    """OpenAI's Weights & Biases settings of a job: the run's project, name (the job id if none),
    entity and tags."""

    project: str = Field(min_length=1, max_length=128)
    name: str | None = Field(None, min_length=1, max_length=128)
    entity: str | None = Field(None, min_length=1, max_length=128)
    tags: list[str] | None = Field(None, max_length=50)

    @field_validator("tags")
    @classmethod
    def _tags(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and not all(1 <= len(t) <= 64 for t in v):
            raise ValueError("each tag is 1 to 64 characters")
        return v


class Integration(Strict):
    """OpenAI's ``integrations`` item: ``{type: "wandb", wandb: {...}}``."""

    type: Literal["wandb"]
    wandb: WandbSpec


ACCELERATOR_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,31}$"


class Budget(Strict):
    """Our extension key ``budget``: the most the job may use; at it, the job is paused (an event and
    the ``fine_tuning.job.paused`` webhook), never lost, and a resume goes on from its checkpoint."""

    device_hours: float | None = Field(None, gt=0, le=1e6, description="Device-hours (devices times hours) it may use.")
    cost: float | None = Field(
        None,
        gt=0,
        le=1e9,
        description="What its device time may cost at the operator's prices (RLOO_ACCELERATOR_PRICES).",
    )


class Resources(Strict):
    """Our extension key ``resources``: the devices a job runs on. ``gpus`` ranks, one process a
    device (on a CPU host, ``gpus: 2`` means two processes); ``accelerator`` the kind of device, as
    the workers name theirs (``rloo worker --accelerator``), none meaning any kind."""

    gpus: int = Field(1, ge=1, le=64, description="Devices (one rank each) the job runs on; on a CPU host, processes.")
    accelerator: str | None = Field(
        None,
        pattern=ACCELERATOR_PATTERN,
        description="The kind of device (e.g. 'h100'), as workers name theirs; none means any kind.",
    )


class JobCreate(Strict):
    model: str = Field(min_length=1, max_length=512, description="Model directory under the models root.")
    training_file: str = Field(min_length=1, max_length=64)
    validation_file: str | None = Field(None, min_length=1, max_length=64)
    seed: int | None = Field(None, ge=0, le=2**31 - 1)
    suffix: str | None = Field(None, max_length=64)
    metadata: dict[str, str] | None = Field(None, max_length=64)
    method: Method | None = Field(None, description="How to train; none at all means supervised (OpenAI's default).")
    # OpenAI's deprecated spelling of a supervised job's hyperparameters (method.supervised.hyperparameters).
    hyperparameters: SupervisedHyperparameters | None = None
    integrations: list[Integration] | None = Field(None, max_length=5)
    resources: Resources | None = Field(None, description="Our extension: the devices the job runs on.")
    budget: Budget | None = Field(None, description="Our extension: the most the job may use before it pauses.")

    @model_validator(mode="after")
    def _default_method(self) -> JobCreate:
        """No ``method``: a supervised job, as at OpenAI, whose hyperparameters may come in the
        deprecated top-level ``hyperparameters`` (validated there, so errors name that field)."""
        if self.method is None:
            hp = self.hyperparameters or SupervisedHyperparameters()
            self.method = Method(type="supervised", supervised=SupervisedConfig(hyperparameters=hp))
            self.hyperparameters = None
        return self

    @property
    def method_(self) -> Method:
        """The method (always set once validated)."""
        assert self.method is not None  # _default_method made sure
        return self.method

    @classmethod
    def unknown_field_hint(cls, fields: list[str]) -> str | None:
        return _other_methods_field(fields)

    @field_validator("model", "training_file", "validation_file", "suffix")
    @classmethod
    def _no_nul(cls, v: str | None) -> str | None:
        # These are text columns (and lookups): PostgreSQL refuses NUL in text, a 500 there.
        if v is not None and "\x00" in v:
            raise ValueError("must not contain a NUL character (\\u0000)")
        return v

    _metadata = field_validator("metadata")(check_metadata)


def _other_methods_field(fields: list[str]) -> str | None:
    """A supervised or DPO job given a field only another method takes (``rloo_k``, ``beta``,
    ``grader``): say whose it is."""
    if len(fields) == 2 and fields[0] == "hyperparameters":  # OpenAI's deprecated top-level form
        fields = ["method", "supervised", *fields]
        where = f"hyperparameters.{fields[-1]}"
    else:
        where = ".".join(fields)
    if len(fields) < 3 or fields[0] != "method" or fields[1] not in ("supervised", "dpo"):
        return None
    method, name = fields[1], fields[-1]
    if fields[2] == "grader" and len(fields) == 3:
        return (
            f"A {method} job has no grader: it learns from the training file's "
            f"{'assistant turns' if method == 'supervised' else 'preferred outputs'}. Remove method.{method}.grader, "
            "or set method.type to 'reinforcement'."
        )
    if fields[2] != "hyperparameters" or len(fields) != 4:
        return None
    owners = [
        m for m in ("reinforcement", "supervised", "dpo") if m != method and name in HYPERPARAMETERS[m].model_fields
    ]
    if not owners:
        return None
    if where.startswith("hyperparameters."):
        return (
            f"'{name}' is a hyperparameter of {' and '.join(owners)} jobs; the top-level hyperparameters are a "
            f"supervised job's (OpenAI's deprecated form, for a job without method). Remove {where}, or send "
            f"method: {{type: '{owners[0]}', {owners[0]}: {{hyperparameters: ...}}}}."
        )
    return (
        f"'{name}' is a hyperparameter of {' and '.join(owners)} jobs; a {method} job does not take it. Remove "
        f"{where}, or set method.type to '{owners[0]}'."
    )


def wandb_missing() -> str | None:
    """Why this server cannot log a job to Weights & Biases (its workers share its environment:
    compose gives both the same one), or None: the package, and a key unless W&B runs offline."""
    import importlib.util
    import os

    if importlib.util.find_spec("wandb") is None:
        return "The wandb integration needs the wandb package on this server: pip install 'rloo-service[wandb]'."
    if not os.environ.get("WANDB_API_KEY") and os.environ.get("WANDB_MODE") not in ("offline", "disabled"):
        return (
            "The wandb integration needs WANDB_API_KEY in the server's and workers' environment "
            "(or WANDB_MODE=offline); the operator sets it."
        )
    return None


def check_spec(body: JobCreate, *, settings: Settings) -> tuple[graders.Grader | None, AnyResolved]:
    """Everything checkable without the dataset: returns the parsed grader (None for a method
    without one) and the resolved hyperparameters.

    Raises ``Invalid`` whose ``param`` names the offending field.
    """
    method = body.method_
    prefix = f"method.{method.type}"
    if body.hyperparameters:
        raise bad_request(f"Put hyperparameters under {prefix}.hyperparameters.", "hyperparameters")
    for i, _ in enumerate(body.integrations or []):
        missing = wandb_missing()
        if missing:
            raise bad_request(missing, f"integrations.{i}")
    policy: Path | str | None = None
    if not model_ids.is_fine_tuned(body.model):  # a fine-tuned model's id is the route's to find
        policy = resolve_model(settings.models_dir, body.model, hub_offline=settings.hub_offline, param="model")
        inspection.check_policy(policy, body.model, "model")
        check_context(body, policy)
    grader = None
    if method.grader is not None:
        try:
            grader = graders.parse_grader(
                method.grader, param=f"{prefix}.grader", allow_python=settings.allow_python_grader
            )
        except graders.GraderError as exc:
            raise bad_request(exc.message, exc.param) from None
        check_grader_models(grader, f"{prefix}.grader", settings)
    hp = method.config.hyperparameters.resolved()
    hp_param = f"{prefix}.hyperparameters"
    if hp.eval_interval != "auto" and not body.validation_file:
        raise bad_request("eval_interval needs a validation_file to score.", f"{hp_param}.eval_interval")
    if isinstance(hp, ResolvedReinforcementHyperparameters):
        _check_reinforcement(hp, hp_param)
        job_tools(body, settings=settings, hp=hp)
    if isinstance(policy, Path):
        check_lora_targets(hp, policy, hp_param)
    if body.resources is not None:
        check_resources(body.resources, hp, method.type, settings)
    if hp.batch_size % hp.gradient_accumulation_steps:
        raise bad_request(
            f"gradient_accumulation_steps ({hp.gradient_accumulation_steps}) must divide batch_size "
            f"({hp.batch_size}): each micro-batch holds whole "
            + (
                "prompts (each with its rloo_k completions)."
                if isinstance(hp, ResolvedReinforcementHyperparameters)
                else "examples."
            ),
            f"{hp_param}.gradient_accumulation_steps",
        )
    return grader, hp


def job_tools(body: JobCreate, *, settings: Settings, hp: ResolvedReinforcementHyperparameters) -> tools.Toolset | None:
    """A reinforcement job's tools and multi-turn limits, parsed (``service.tools.parse_tools``), and
    a trajectory budget that holds a turn: ``Invalid`` naming the field otherwise."""
    method = body.method_
    config = method.config
    if not isinstance(config, RLConfig):
        return None
    prefix = f"method.{method.type}"
    toolset = tools.parse_tools(
        config.tools,
        config.multi_turn,
        param=prefix,
        allowed_urls=settings.tool_urls,
        allow_python=settings.allow_python_tools,
    )
    if toolset is not None and hp.stop:
        raise bad_request(
            "stop strings end a turn without its end-of-turn token, which a rollout that calls tools needs to "
            "go on (and would cut a call short). Remove stop, or the tools.",
            f"{prefix}.hyperparameters.stop",
        )
    budget = toolset.limits.max_trajectory_tokens if toolset is not None else None
    if budget is not None and budget <= hp.max_new_tokens:
        raise bad_request(
            f"max_trajectory_tokens ({budget}) cannot hold one turn: a prompt and max_new_tokens "
            f"({hp.max_new_tokens}) new tokens. Give it more than {hp.max_new_tokens} (a tool-using rollout's "
            "prompt, turns and tool results all count), or lower max_new_tokens.",
            f"{prefix}.multi_turn.max_trajectory_tokens",
        )
    return toolset


def check_resources(resources: Resources, hp: AnyResolved, kind: str, settings: Settings) -> None:
    """The devices a job asks for: a kind the operator declared (when they declared any), and a
    batch the ranks can share: each rank takes ``batch_size / gpus`` whole prompts (with their
    ``rloo_k`` completions), in ``gradient_accumulation_steps`` micro-batches."""
    declared = settings.accelerators or {}
    if resources.accelerator is not None and declared and resources.accelerator not in declared:
        raise bad_request(
            f"No accelerator kind '{resources.accelerator}' here; this deployment declares "
            f"{', '.join(sorted(declared))} (RLOO_ACCELERATORS). Name one of them, or leave accelerator out for any.",
            "resources.accelerator",
        )
    if resources.gpus == 1:
        return
    if kind not in ("reinforcement", "rloo"):
        raise bad_request(
            f"resources.gpus > 1 runs the RLOO loop on several ranks; a {kind} job runs on one device. "
            "Set resources.gpus to 1.",
            "resources.gpus",
        )
    share = resources.gpus * hp.gradient_accumulation_steps
    if hp.batch_size % share:
        raise bad_request(
            f"batch_size ({hp.batch_size}) must be a multiple of resources.gpus x gradient_accumulation_steps "
            f"({resources.gpus} x {hp.gradient_accumulation_steps} = {share}): each rank takes whole prompts, "
            "the same number in each of its micro-batches.",
            f"method.{kind}.hyperparameters.batch_size",
        )


def check_context(body: JobCreate, model: Path | str) -> None:
    """Refuse what cannot fit the model's context (``max_position_embeddings`` of its config):
    ``max_new_tokens`` new tokens after at least one prompt token, or examples of ``max_length``."""
    context = inspection.context_length(model)
    if context is None:
        return
    method = body.method_
    hp = method.config.hyperparameters
    param = f"method.{method.type}.hyperparameters"
    config = method.config
    budget = config.multi_turn.max_trajectory_tokens if isinstance(config, RLConfig) and config.multi_turn else None
    if budget is not None and budget > context:
        raise bad_request(
            f"max_trajectory_tokens ({budget}) exceeds the model's context of {context} tokens "
            f"(max_position_embeddings); give at most {context}, or leave it out (the context).",
            f"method.{method.type}.multi_turn.max_trajectory_tokens",
        )
    if isinstance(hp, ReinforcementHyperparameters) and hp.max_new_tokens >= context:
        raise bad_request(
            f"max_new_tokens ({hp.max_new_tokens}) plus the prompt exceeds the model's context of {context} tokens "
            f"(max_position_embeddings); give at most {context - 1} new tokens (prompts are cut to the "
            "context left, keeping their ends).",
            f"{param}.max_new_tokens",
        )
    length = getattr(hp, "max_length", None)
    if length is not None and length > context:
        raise bad_request(
            f"max_length ({length}) exceeds the model's context of {context} tokens (max_position_embeddings); "
            f"give at most {context}.",
            f"{param}.max_length",
        )


def _check_reinforcement(hp: ResolvedReinforcementHyperparameters, hp_param: str) -> None:
    if hp.rloo_k < least_rloo_k(hp.advantage_estimator):
        raise bad_request(
            f"rloo_k 1 leaves advantage_estimator '{hp.advantage_estimator}' no group: its baseline is the other "
            "completions of the same prompt. Give rloo_k at least 2, or set advantage_estimator to 'reinforce' "
            "(no baseline), the one estimator that takes 1.",
            f"{hp_param}.rloo_k",
        )
    if hp.kl_coef > 0 and not hp.kl_in_reward and hp.kl_estimator == "k1":
        raise bad_request(
            "kl_in_reward false makes the KL a loss term, and k1's gradient there is zero in expectation (it "
            "would add noise, not a pull to the reference). Set kl_estimator to 'k3', or keep kl_in_reward true.",
            f"{hp_param}.kl_estimator",
        )
    if hp.drop_constant_groups and hp.rloo_k < 2:
        raise bad_request(
            "drop_constant_groups leaves out groups whose rloo_k rewards are all equal, and a group of one always "
            "is: nothing would train. Give rloo_k at least 2, or set drop_constant_groups false.",
            f"{hp_param}.drop_constant_groups",
        )
    if hp.sampler_correction in ("tis", "mask") and hp.top_p < 1:
        raise bad_request(
            f"sampler_correction '{hp.sampler_correction}' compares the sampler's probabilities with the trainer's, "
            f"and top_p {hp.top_p} renormalises the sampler's over the nucleus (the trainer's are not): the ratio "
            "would be the nucleus's mass, not a mismatch. Set top_p to 1, or sampler_correction to 'auto' or 'none'.",
            f"{hp_param}.sampler_correction",
        )


def check_kept_checkpoints(hp: AnyResolved, total_steps: int, *, cap: int, param: str) -> None:
    """A job keeps at most ``cap`` checkpoints (``RLOO_MAX_KEPT_CHECKPOINTS``): a 400 when its
    ``checkpoint_interval`` and ``keep_checkpoints`` would keep more over its steps (10^7 steps
    checkpointed each step, all kept, fill any disk), saying what to change."""
    interval = hp.checkpoint_interval
    saved = (total_steps // interval + 1) if interval else 1  # and the final one
    kept = min(saved, hp.keep_checkpoints) if hp.keep_checkpoints else saved
    if kept > cap:
        raise bad_request(
            f"This job would keep {kept} checkpoints ({total_steps} steps, a checkpoint every {interval}); a job keeps "
            f"at most {cap} on this server (RLOO_MAX_KEPT_CHECKPOINTS). Set keep_checkpoints to {cap} or fewer, or "
            "a larger checkpoint_interval.",
            f"{param}.keep_checkpoints" if hp.keep_checkpoints else f"{param}.checkpoint_interval",
        )


def check_grader_models(grader: graders.Grader, param: str, settings: Settings) -> None:
    """Each model a grader names is under the models root and fit for its use: a reward_model's a
    one-label sequence classifier, a judge's (score_model, label_model) a causal LM; each with a
    tokenizer."""
    for leaf, leaf_param in graders.model_leaves(grader, param):
        where = f"{leaf_param}.model"
        path = resolve_model(settings.models_dir, leaf.model, hub_offline=settings.hub_offline, param=where)
        if isinstance(leaf, graders.RewardModelGrader):
            inspection.check_reward_model(path, leaf.model, where)
        else:
            inspection.check_policy(path, leaf.model, where)


def check_lora_targets(hp: AnyResolved, model: Path, param: str) -> None:
    """LoRA's ``target_modules`` name modules the model has (as peft matches them: the name, or a
    dotted path's end), read from its safetensors headers; a model whose files do not say is not
    checked here (the worker then says)."""
    lora = getattr(hp, "lora", None)
    if lora is None or not isinstance(lora.target_modules, list):
        return
    try:
        names = memory_plan.module_names(model)
    except memory_plan.UnknownShape:
        return
    for target in lora.target_modules:
        if target == "lm_head":  # every causal LM has its output head, stored or tied to the embeddings
            continue
        if not any(name == target or name.endswith(f".{target}") for name in names):
            linear = sorted({n.rsplit(".", 1)[-1] for n in names if "embed" not in n and "norm" not in n})
            raise bad_request(
                f"The model has no module named '{target}' for LoRA to adapt. Its linear layers are named: "
                f"{', '.join(linear)} (or give 'all-linear').",
                f"{param}.lora.target_modules",
            )


def model_notes(settings: Settings, base_model: str) -> list[str]:
    """What a job's events say of its base model (no chat template: how conversations are rendered)."""
    local = settings.models_dir / base_model
    return inspection.check_policy(local, base_model, "model") if local.is_dir() else []


def notes(hp: AnyResolved) -> list[str]:
    """What a job's creation tells in its events about settings accepted for OpenAI's sake."""
    out = []
    if isinstance(hp, ResolvedReinforcementHyperparameters) and hp.reasoning_effort != "default":
        out.append(
            f"reasoning_effort '{hp.reasoning_effort}' is accepted for OpenAI compatibility and has no effect: "
            "the models trained here have no reasoning mode (max_new_tokens bounds a completion)"
        )
    if isinstance(hp, ResolvedReinforcementHyperparameters) and hp.compute_multiplier != 1.0:
        out.append(f"compute_multiplier {hp.compute_multiplier:g}: rloo_k is {hp.rloo_k} completions per prompt")
    return out


FORMAT_NEEDS = {
    "prompt": "a reinforcement job's lines are prompts: 'prompt', or 'messages' ending in a user turn",
    "chat": "a supervised job's lines are conversations with assistant turns to learn ('messages' ending "
    "in an assistant turn)",
    "preference": "a DPO job's lines are preference pairs: 'input', 'preferred_output' and 'non_preferred_output'",
}


def batch_notes(hp: AnyResolved, lines: int, *, source: str) -> list[str]:
    """A ``batch_size`` over the training file's lines is accepted, as OpenAI's API accepts it, and
    said: each step then takes lines again within its batch."""
    if hp.batch_size <= lines:
        return []
    return [
        f"batch_size {hp.batch_size} is more than the {lines} line(s) of {source}: each step takes some "
        f"lines more than once. Lower batch_size to {lines} or less, or add lines, for a batch of distinct lines."
    ]


def check_format(method: str, keys_summary: Mapping[str, Any], *, source: str, param: str) -> None:
    """Refuse a file with a line the method cannot train on (``source`` names the file)."""
    found = first_line_not(dict(keys_summary), method)
    if found is not None:
        line, wanted = found
        raise bad_request(
            f"Line {line} of {source} is not what this method trains on: {FORMAT_NEEDS[wanted]}.",
            param,
            "invalid_file_format",
        )


def check_item_keys(
    grader: graders.Grader, keys_summary: Mapping[str, Any], *, source: str, param: str, within: int | None = None
) -> None:
    """Refuse a grader that uses an ``item.`` key some line of the dataset lacks (``source`` names it;
    ``within``: only its first lines are read)."""
    missing = graders.first_missing_item_key(grader, keys_summary, within=within)
    if missing is not None:
        key, line = missing
        raise bad_request(
            f"The grader uses item.{key}, but line {line} of {source} has no '{key}' key. "
            "Add it to every line, or change the grader.",
            param,
            "missing_item_key",
        )

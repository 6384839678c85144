"""``rloo train SPEC.json``: one job in the foreground, through the same ``train`` as a Celery job.

SPEC is the job-creation body of docs/api.md, with ``training_file``/``validation_file`` as local JSONL
paths (relative to the spec file). It is validated exactly as the API validates it.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from service import graders
from service.core import strictjson, validation
from service.core.errors import DomainError, Invalid
from service.core.settings import get_settings
from service.files.datasets import store_jsonl
from service.jobs import spec
from service.jobs.hyperparameters import AnyResolved
from service.jobs.spec import JobCreate
from worker.engine.errors import JobError
from worker.engine.recorders import QuietRecorder, Recorder, StdoutRecorder

if TYPE_CHECKING:
    from worker.engine.config import TrainConfig


class SpecError(Invalid, ValueError):
    """A job spec or a local file ``rloo train`` cannot run: the API's checks and wording, the path
    in front."""


def load_spec(spec_path: Path, overrides: dict[str, Any], seed: int | None = None) -> JobCreate:
    try:
        raw = strictjson.loads(spec_path.read_text())  # the API's door: no NaN, no lone surrogate
    except strictjson.InvalidJSON as exc:
        raise SpecError(f"{spec_path}: {exc.problem}{exc.where()}") from None
    except (OSError, ValueError) as exc:
        raise SpecError(f"cannot read {spec_path}: {exc}") from None
    if not isinstance(raw, dict):
        raise SpecError(f"{spec_path} must hold a JSON object (the job-creation body)")
    method = raw.get("method")
    if method is None:  # a supervised job, as at OpenAI
        method = raw["method"] = {
            "type": "supervised",
            "supervised": {"hyperparameters": raw.pop("hyperparameters", {})},
        }
    if seed is not None:
        raw["seed"] = seed
    kind = method.get("type", "reinforcement")
    if overrides:
        if method.get(kind) is None:
            method[kind] = {}
        if isinstance(method[kind], dict):
            method[kind].setdefault("hyperparameters", {}).update(overrides)
    try:
        body = JobCreate.model_validate(raw)
    except ValidationError as exc:
        text, _ = validation.message(exc.errors()[0], JobCreate)  # the API's wording
        raise SpecError(f"{spec_path}: {text}") from None
    return body


def _validate(
    body: JobCreate, base: Path, out: Path, settings: Any
) -> tuple[graders.Grader | None, AnyResolved, dict[str, Path], list[str]]:
    """The API's job-creation checks, on the spec's local files, and the notes a job's first events
    would hold (no chat template, a batch over the file); the checks' errors become SpecError."""
    try:
        grader, hp = spec.check_spec(body, settings=settings)
        notes = [*spec.model_notes(settings, body.model), *spec.notes(hp)]
        files = {}
        for which in ("training_file", "validation_file"):
            name = getattr(body, which)
            if not name:
                continue
            path = (base / name).resolve()
            # The same line checks as an upload, into a scratch copy: a bad line fails here, not at step 40.
            try:
                with open(path, "rb") as src:
                    summary = store_jsonl(
                        src,
                        dest=out / ".validated" / path.name,
                        max_bytes=settings.max_upload_bytes,
                        max_line_bytes=settings.max_line_bytes,
                    )
            except OSError as exc:
                raise SpecError(f"{which}: cannot read {path}: {exc.strerror}") from None
            spec.check_format(body.method_.family, summary.as_dict(), source=str(path), param=which)
            if which == "training_file":
                notes += spec.batch_notes(hp, summary.lines, source=str(path))
            if grader is not None:
                spec.check_item_keys(
                    grader, summary.as_dict(), source=str(path), param=f"method.{body.method_.type}.grader"
                )
            files[which] = path
    except SpecError:
        raise
    except DomainError as exc:  # the API's checks: the field at fault, the API's words
        hint = f" (models root: {settings.models_dir}; set RLOO_MODELS_DIR)" if exc.code == "model_not_found" else ""
        raise SpecError(f"{exc.param}: {exc.message}{hint}") from None
    return grader, hp, files, notes


def spec_config(
    spec_path: Path,
    *,
    overrides: dict[str, Any],
    output_dir: Path | None = None,
    device: str | None = None,
    resume_from: Path | None = None,
    seed: int | None = None,
) -> TrainConfig:
    """The ``TrainConfig`` of SPEC (``seed``, when given, over its own), validated as the API
    validates a job (errors: ``SpecError``)."""
    from worker.engine.config import OperatorOptions, TrainConfig

    settings = get_settings()
    body = load_spec(spec_path, overrides, seed)
    if resume_from is not None:
        from worker.engine.checkpoints import has_training_state

        resume_from = resume_from.resolve()
        if not has_training_state(resume_from):
            raise SpecError(f"--resume {resume_from}: not a checkpoint with a training state (a step-N directory)")
        output_dir = output_dir or resume_from.parent  # the run's checkpoints stay together
    out = Path(output_dir or settings.home_dir / "runs" / time.strftime("run-%Y%m%d-%H%M%S"))
    grader, hp, files, notes = _validate(body, spec_path.resolve().parent, out, settings)
    for note in notes:  # stderr: stdout is the steps' JSON lines
        print(f"note: {note}", file=sys.stderr)
    return TrainConfig(
        model=body.model,
        training_file=files["training_file"],
        validation_file=files.get("validation_file"),
        grader=grader,
        hyperparameters=hp,
        output_dir=out,
        models_dir=settings.models_dir,
        seed=body.seed if body.seed is not None else 0,
        device=device,
        resume_from=resume_from,
        operator=OperatorOptions.from_settings(settings),
        method=body.method_.family,
        gpus=body.resources.gpus if body.resources is not None else 1,
        tools=_tools(body, hp, settings),
    )


def _tools(body: Any, hp: AnyResolved, settings: Any) -> Any:
    """The spec's tools (checked by ``_validate`` already), for a reinforcement run."""
    from service.jobs.hyperparameters import ResolvedReinforcementHyperparameters

    if not isinstance(hp, ResolvedReinforcementHyperparameters):
        return None
    return spec.job_tools(body, settings=settings, hp=hp)


def run_spec(
    spec_path: Path,
    *,
    overrides: dict[str, Any],
    output_dir: Path | None = None,
    device: str | None = None,
    recorder: Recorder | None = None,
    resume_from: Path | None = None,
    seed: int | None = None,
) -> dict[str, Any]:
    from worker.engine.methods.rloo import train

    cfg = spec_config(
        spec_path, overrides=overrides, output_dir=output_dir, device=device, resume_from=resume_from, seed=seed
    )
    rec = recorder or StdoutRecorder()
    t0 = time.perf_counter()
    try:
        if cfg.gpus > 1:  # resources.gpus: its ranks under torch.distributed.run, rank 0 printing the steps
            from worker.engine.distributed.launch import RanksLost, run_ranks

            try:
                result = run_ranks(cfg, timeout_seconds=get_settings().collective_timeout_seconds)
            except RanksLost as exc:
                raise JobError("rank_lost", f"{exc}; continue with --resume from its last checkpoint") from None
        else:
            result = train(cfg, rec)
    except JobError as exc:
        return {"status": "failed", "error": {"code": exc.code, "message": exc.message}}
    return {
        "status": "succeeded" if result.stopped is None else result.stopped,
        "steps": result.steps,
        "resumed_from": result.resumed_from,
        f"first_{_short(result.headline)}": result.first,
        f"last_{_short(result.headline)}": result.last,
        "trained_tokens": result.trained_tokens,
        "final_checkpoint": str(result.final_checkpoint) if result.final_checkpoint else None,
        "wall_s": round(time.perf_counter() - t0, 3),
    }


def evaluate_spec(
    spec_path: Path,
    *,
    overrides: dict[str, Any],
    checkpoint: Path | None = None,
    device: str | None = None,
    seed: int | None = None,
) -> dict[str, Any]:
    """SPEC's validation pass on its starting model, or on ``checkpoint`` (a model directory with its
    tokenizer: a run's step-N, or any ``save_pretrained`` of the same architecture): the pass a
    reinforcement run makes at its eval steps (``eval_samples`` prompts of the validation file, one
    completion each at the job's sampling settings, seeded by the job's seed, scored by its grader).
    A full fine-tuning run's ``valid_reward_mean`` at step N equals this on its step-N checkpoint
    (a LoRA checkpoint is scored with its adapter merged: equal to rounding)."""
    import dataclasses
    import tempfile

    from worker.engine.methods.rloo import validation_pass
    from worker.engine.prepare import prepare

    with tempfile.TemporaryDirectory() as scratch:
        cfg = spec_config(spec_path, overrides=overrides, output_dir=Path(scratch), device=device, seed=seed)
        if cfg.method != "reinforcement":
            raise SpecError(
                f"{spec_path}: rloo score scores a reinforcement job's validation pass; this is {cfg.method}"
            )
        if cfg.validation_file is None:
            raise SpecError(f"{spec_path}: no validation_file to score")
        if checkpoint is not None:
            if not (checkpoint / "config.json").is_file() and not (checkpoint / "adapter_config.json").is_file():
                raise SpecError(f"--checkpoint {checkpoint}: no model there (config.json or adapter_config.json)")
            if not (checkpoint / "tokenizer_config.json").is_file():
                raise SpecError(
                    f"--checkpoint {checkpoint}: no tokenizer there; save_pretrained the tokenizer beside it"
                )
            cfg = dataclasses.replace(cfg, init_from=(checkpoint.resolve(),))
        # A validation pass samples and scores: no reference model (kl_coef 0 loads none).
        cfg = dataclasses.replace(cfg, hyperparameters=cfg.hyperparameters.model_copy(update={"kl_coef": 0.0}))
        try:
            run = prepare(cfg, QuietRecorder())
            with run.autocast:
                score, tool_figures = validation_pass(run, label="score")
        except JobError as exc:
            raise SpecError(f"{exc.code}: {exc.message}") from None
    return {
        "model": cfg.model,
        "checkpoint": str(checkpoint) if checkpoint else None,
        "valid_reward_mean": score,
        "samples": min(cfg.hyperparameters.eval_samples, len(run.valid_items)),
        "seed": cfg.seed,
        **tool_figures,
    }


def _short(headline: str) -> str:
    """``first_reward``/``last_reward`` for RLOO, ``first_loss``/``last_loss`` for the others."""
    return "reward" if headline == "train_reward_mean" else "loss"

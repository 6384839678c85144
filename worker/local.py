"""``rloo train SPEC.json``: one job in the foreground, through the same ``train`` as a Celery job.

SPEC is the job-creation body of API.md, with ``training_file``/``validation_file`` as local JSONL
paths (relative to the spec file). It is validated exactly as the API validates it.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from service import graders
from service.errors import APIError
from service.schemas import JobCreate
from service.settings import get_settings
from service.storage import resolve_model, store_jsonl


class SpecError(ValueError):
    pass


class StdoutRecorder:
    """Prints one JSON object a line per step; events go to stderr."""

    def __init__(self, stream: Any = None) -> None:
        self.stream = stream or sys.stdout
        self.checkpoints: list[dict[str, Any]] = []

    def event(self, message: str, level: str = "info") -> None:
        print(f"[{level}] {message}", file=sys.stderr, flush=True)

    def step(self, step: int, metrics: dict[str, Any]) -> str | None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in metrics.items()}
        print(json.dumps(clean), file=self.stream, flush=True)
        return None

    def checkpoint(self, step: int, path: Path, metrics: dict[str, Any], final: bool) -> None:
        self.checkpoints.append({"step": step, "path": str(path), "final": final})
        self.event(f"checkpoint at step {step}: {path}")


def load_spec(spec_path: Path, overrides: dict[str, Any]) -> tuple[JobCreate, dict[str, Any]]:
    try:
        raw = json.loads(spec_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise SpecError(f"cannot read {spec_path}: {exc}") from None
    if not isinstance(raw, dict):
        raise SpecError(f"{spec_path} must hold a JSON object (the job-creation body)")
    method = raw.get("method") or {}
    kind = method.get("type", "reinforcement")
    method.setdefault(kind, {}).setdefault("hyperparameters", {}).update(overrides)
    try:
        body = JobCreate.model_validate(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        raise SpecError(f"{spec_path}: {loc}: {err['msg']}") from None
    return body, body.method.config.hyperparameters.resolved()


def _validate(body: JobCreate, base: Path, out: Path, settings: Any) -> tuple[Any, dict[str, Path]]:
    """What the API checks at job creation, with the spec's local files: errors become SpecError."""
    param = f"method.{body.method.type}.grader"
    try:
        grader = graders.parse_grader(body.method.config.grader, param=param, allow_python=settings.allow_python_grader)
        resolve_model(settings.models_dir, body.model, hub_offline=settings.hub_offline, param="model")
        for leaf, leaf_param in graders.model_leaves(grader, param):
            resolve_model(
                settings.models_dir, leaf.model, hub_offline=settings.hub_offline, param=f"{leaf_param}.model"
            )
    except graders.GraderError as exc:
        raise SpecError(f"{exc.param}: {exc.message}") from None
    except APIError as exc:
        raise SpecError(
            f"{exc.param}: {exc.message} (models root: {settings.models_dir}; set RLOO_MODELS_DIR)"
        ) from None
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
        except APIError as exc:
            raise SpecError(f"{which} ({path}): {exc.message}") from None
        missing = graders.first_missing_item_key(grader, summary.as_dict())
        if missing:
            raise SpecError(
                f"{param}: the grader uses item.{missing[0]}, but line {missing[1]} of {path} has no '{missing[0]}' key"
            )
        files[which] = path
    return grader, files


def run_spec(
    spec_path: Path,
    *,
    overrides: dict[str, Any],
    output_dir: Path | None = None,
    device: str | None = None,
    recorder: StdoutRecorder | None = None,
) -> dict[str, Any]:
    from worker.config import TrainConfig
    from worker.train import JobError, train

    settings = get_settings()
    body, hp = load_spec(spec_path, overrides)
    out = Path(output_dir or settings.home_dir / "runs" / time.strftime("run-%Y%m%d-%H%M%S"))
    grader, files = _validate(body, spec_path.resolve().parent, out, settings)
    models_dir = settings.models_dir
    cfg = TrainConfig(
        model=body.model,
        training_file=files["training_file"],
        validation_file=files.get("validation_file"),
        grader=graders.grader_to_dict(grader),
        hyperparameters=hp,
        output_dir=Path(out),
        models_dir=models_dir,
        seed=body.seed if body.seed is not None else 0,
        device=device,
        extra={"allow_python_grader": settings.allow_python_grader},
    )
    rec = recorder or StdoutRecorder()
    t0 = time.perf_counter()
    try:
        result = train(cfg, rec)
    except JobError as exc:
        return {"status": "failed", "error": {"code": exc.code, "message": exc.message}}
    return {
        "status": "succeeded" if result.stopped is None else result.stopped,
        "steps": result.steps,
        "first_reward": result.first_reward,
        "last_reward": result.last_reward,
        "trained_tokens": result.trained_tokens,
        "final_checkpoint": str(result.final_checkpoint) if result.final_checkpoint else None,
        "wall_s": round(time.perf_counter() - t0, 3),
    }

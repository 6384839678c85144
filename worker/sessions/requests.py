"""What a worker holding a Tinker training model does with each of its requests: build the model,
forward_backward (the body is the SDK's protobuf), optim_step, save the state or the sampler's
weights, load a state. Each answer is what the SDK's future decodes (JSON, or protobuf for a
forward_backward's output); each failure says whose it is (``user``: the request; ``server``: ours).
"""

from __future__ import annotations

import json
import math
import os
import secrets
import time
from dataclasses import dataclass
from typing import Any

import torch

from service.core.db import session_scope
from service.core.errors import DomainError
from service.core.settings import get_settings
from service.core.tables import TinkerCheckpoint, TinkerModel, TinkerStep, now
from service.infra.artifacts import tree_bytes
from service.tenancy import usage
from service.tinker import sampling, wire
from worker.engine.modeling import pick_device
from worker.engine.tinker import losses
from worker.engine.tinker.model import AdamStep, Datum, LoraSettings, TrainingModel
from worker.jobs.devices import ACCELERATOR_VARIABLE
from worker.jobs.failures import classify

JSON = "application/json"
PROTOBUF = "application/x-protobuf"
RESUME_NAME = "resume"
"""The state a worker saves when it lets a model go (``tinker://<model>/weights/resume``)."""
OUT_OF_MEMORY = (
    "This batch did not fit the device. The gradients accumulated since the last optim_step were "
    "dropped (a backward cut short may have added part of its own): send the batch again in smaller "
    "pieces, which add up until optim_step"
)


@dataclass(frozen=True)
class Failure:
    """A failed request as the SDK's ``RequestFailedResponse``: a message and whose fault it is."""

    message: str
    category: str  # "user" | "server"

    @classmethod
    def of(cls, exc: BaseException) -> Failure:
        if isinstance(exc, (DomainError, wire.WireError, losses.LossInputError)):
            return cls(str(getattr(exc, "message", None) or exc), "user")
        if out_of_memory(exc):
            return cls(f"The device ran out of memory for this request ({type(exc).__name__}).", "user")
        return cls(f"the server failed this request ({type(exc).__name__}); it was logged", "server")

    def body(self) -> bytes:
        return json.dumps({"error": self.message, "category": self.category}).encode()


def out_of_memory(exc: BaseException) -> bool:
    """The device (or the host) had no room for what the request asked (``worker.jobs.failures``)."""
    return isinstance(exc, Exception) and classify(exc)[0] == "out_of_memory"


def checkpoint_dir(model_id: str, kind: str, name: str) -> str:
    """Where a checkpoint of ``model_id`` lives, relative to the artifacts root."""
    return f"tinker/{model_id.replace(':', '.')}/{kind}/{name}"


@dataclass
class StepTally:
    """What the ``forward_backward`` calls since the last ``optim_step`` added up, for that step's row
    (``tinker_steps``): the loss, what it was counted over (the weights' sum for ``cross_entropy``,
    else the tokens with an advantage), datums and input tokens, and the loss function ("mixed" where
    the calls used several). Weights below zero (``forward_backward_custom`` sends gradients as
    weights) count nothing: such a step has no mean loss."""

    loss: float = 0.0
    counted: float = 0.0
    datums: int = 0
    tokens: int = 0
    loss_fn: str = ""

    def add(self, loss_fn: str, data: list[Datum], metrics: dict[str, float]) -> None:
        self.loss += float(metrics.get("loss:sum", 0.0))
        self.counted += _counted(loss_fn, data)
        self.datums += len(data)
        self.tokens += sum(len(d.tokens) for d in data)
        self.loss_fn = loss_fn if self.loss_fn in ("", loss_fn) else "mixed"

    def row(self, model_seq: int, step: int, metrics: dict[str, float]) -> TinkerStep:
        return TinkerStep(
            model_seq=model_seq,
            step=step,
            loss=self.loss if math.isfinite(self.loss) and self.datums else None,
            counted=self.counted if math.isfinite(self.counted) and self.loss_fn != "mixed" else 0.0,
            datums=self.datums,
            tokens=self.tokens,
            loss_fn=self.loss_fn or "none",
            metrics={k: float(v) if math.isfinite(v) else None for k, v in metrics.items()},  # JSON: no NaN
        )


def _counted(loss_fn: str, data: list[Datum]) -> float:
    """What a call's loss is counted over: the weights' sum for ``cross_entropy`` (minus infinity
    where a weight is below zero: a surrogate's gradients, not weights), else the tokens with an
    advantage."""
    if loss_fn != "cross_entropy":
        return sum(float((d.inputs["advantages"] != 0).sum()) for d in data if "advantages" in d.inputs)
    weights = [d.inputs["weights"] for d in data if "weights" in d.inputs]
    if any(bool((w < 0).any()) for w in weights):
        return -math.inf
    return sum(float(w.sum()) for w in weights)


class Holder:
    """One training model in this worker's memory, and the requests it runs."""

    def __init__(self, row: TinkerModel, model: TrainingModel) -> None:
        self.model_id, self.row_seq, self.base_model = row.id, row.seq, row.base_model
        self.model = model
        self.saved_steps = row.state_steps if row.state_path else 0
        self.state_path = row.state_path
        self.unsaved = False
        """Weights changed (a step, a load) since the state it resumes from was saved."""
        self.tally = StepTally()
        self.project_seq = row.project_seq
        self.device_seconds = 0.0
        """Time this model's requests held the device since it was last metered (``_note``)."""

    @classmethod
    def start(cls, model_id: str) -> Holder:
        """The model built from its base (and its newest saved state, when it has one)."""
        settings = get_settings()
        with session_scope() as session:
            from sqlalchemy import select

            row = session.scalar(select(TinkerModel).where(TinkerModel.id == model_id))
            if row is None:
                raise DomainError(f"No training model '{model_id}'.", code="model_not_found")
            session.expunge(row)
        lora = LoraSettings(**row.lora) if row.lora is not None else LoraSettings(rank=0)
        model = TrainingModel(
            settings.models_dir / row.base_model, lora=lora, device=pick_device(None), name=row.base_model
        )
        if row.state_path:
            model.load(settings.artifacts_dir / row.state_path, optimizer=True)
        return cls(row, model)

    def restored_from(self) -> str:
        """What a request sent to a lost worker is told: where the model is back at."""
        where = f"its last saved state (step {self.saved_steps})" if self.state_path else "its base (nothing was saved)"
        return (
            f"The worker holding {self.model_id} stopped before this request ran; the model is back at {where}. "
            "Send the request again."
        )

    def run(self, envelope: dict[str, Any], payload: bytes | None) -> tuple[str, bytes]:
        """One request, its time on the device metered (written with the model's next step or load)."""
        started = time.monotonic()
        try:
            return self._run(envelope, payload)
        finally:
            self.device_seconds += time.monotonic() - started

    def _run(self, envelope: dict[str, Any], payload: bytes | None) -> tuple[str, bytes]:
        kind = envelope["kind"]
        if kind == "create_model":
            return _json({"model_id": self.model_id, "type": "create_model"})
        if kind == "forward_backward":
            return PROTOBUF, self.forward_backward(payload or b"", envelope.get("encoding"))
        if kind == "optim_step":
            tally, self.tally = self.tally, StepTally()  # a step refused (a gradient not finite) drops it too
            metrics = self.model.optim_step(AdamStep(**envelope["adam_params"]))
            self.unsaved = True
            self._note(steps=self.model.steps, step=tally.row(self.row_seq, self.model.steps, metrics))
            return _json({"metrics": metrics, "type": "optim_step"})
        if kind in ("save_weights", "save_weights_for_sampler"):
            return _json(self.save(envelope, sampler=kind == "save_weights_for_sampler"))
        if kind == "save_weights_external":
            return _json(self.save_external(envelope))
        if kind == "load_weights":
            self.model.load(get_settings().artifacts_dir / envelope["source"], optimizer=bool(envelope["optimizer"]))
            self.unsaved, self.tally = True, StepTally()
            self._note(steps=self.model.steps)
            return _json({"path": envelope["path"], "model_id": self.model_id, "type": "load_weights"})
        raise DomainError(f"'{kind}' is not a request of a training model", code="invalid_request")

    def forward_backward(self, payload: bytes, encoding: str | None) -> bytes:
        settings = get_settings()
        call = wire.decode_forward_backward(
            payload,
            content_encoding=encoding,
            max_bytes=settings.tinker_max_request_bytes,
            max_tokens=settings.tinker_max_tokens,
        )
        data = [
            Datum(
                torch.from_numpy(d.tokens.copy()), {k: torch.from_numpy(v.copy()) for k, v in d.loss_fn_inputs.items()}
            )
            for d in call.data
        ]
        try:
            result = self.model.forward_backward(
                data, call.loss_fn, call.loss_fn_config, backward=not call.forward_only
            )
        except Exception as exc:
            if not call.forward_only and out_of_memory(exc):
                self.model.drop_gradients()  # a backward cut short may have added part of its gradients
                self.tally = StepTally()
                raise DomainError(f"{OUT_OF_MEMORY} ({type(exc).__name__})", code="out_of_memory") from exc
            raise
        if not call.forward_only:
            self.tally.add(call.loss_fn, data, result.metrics)
        outputs = [{k: v.detach().cpu().numpy() for k, v in out.items()} for out in result.outputs]
        return wire.encode_forward_backward_output(outputs, result.metrics)

    def save(self, envelope: dict[str, Any], *, sampler: bool) -> dict[str, Any]:
        """The state (weights and optimizer) or the sampler's weights under the asked name (or a new
        one), a checkpoint row, and the SDK's answer."""
        kind = "sampler_weights" if sampler else "weights"
        name = (
            envelope.get("name")
            or f"{'sampler-' if sampler else 'state-'}{self.model.steps:06d}-{secrets.token_hex(3)}"
        )
        relative = checkpoint_dir(self.model_id, kind, name)
        size = self.model.save(
            get_settings().artifacts_dir / relative, optimizer=not sampler, base_model=self.base_model
        )
        ttl = envelope.get("ttl_seconds")
        self._record(kind, name, relative, size, envelope.get("user_metadata") or {}, ttl)
        if not sampler and not ttl:  # the newest state: where the model resumes if this worker dies
            self._resumes_from(relative)
        path = f"tinker://{self.model_id}/{kind}/{name}"
        answer = {"path": path, "type": "save_weights_for_sampler" if sampler else "save_weights"}
        if sampler and not envelope.get("name"):  # save_weights_and_get_sampling_client: a session on it
            answer["sampling_session_id"] = sampling.session_id_of(path=path)
        return answer

    def save_external(self, envelope: dict[str, Any]) -> dict[str, Any]:
        """The weights as one Hugging Face model directory (a LoRA merged into its base, as a job's
        merged export is made), with the tokenizer: what ``from_pretrained`` and ``vllm serve`` load."""
        import shutil
        import tempfile
        from pathlib import Path

        from worker.serving.between_batches import export
        from worker.serving.model_cache import Servable

        settings = get_settings()
        name = envelope["name"]
        relative = checkpoint_dir(self.model_id, "external_weights", name)
        target = settings.artifacts_dir / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent, prefix=".staging-") as staging:
            weights = Path(staging) / "weights"
            self.model.save(weights, optimizer=False, base_model=self.base_model)
            (weights / "tinker_state.json").unlink(missing_ok=True)
            shutil.rmtree(target, ignore_errors=True)
            if self.model.lora.rank == 0:
                weights.rename(target)
            else:
                export(Servable(settings.models_dir / self.base_model, (weights,)), target)
        size = tree_bytes(target)
        self._record("external_weights", name, relative, size, {}, envelope.get("ttl_seconds"))
        path = f"tinker://{self.model_id}/external_weights/{name}"
        return {"path": path, "size_bytes": size, "type": "save_weights_external"}

    def save_resume_state(self) -> None:
        """Before letting the model go: its state, unless nothing changed since the last one saved."""
        if not self.unsaved and not self.model.pending:
            return
        relative = checkpoint_dir(self.model_id, "weights", RESUME_NAME)
        size = self.model.save(get_settings().artifacts_dir / relative, optimizer=True, base_model=self.base_model)
        self._record("weights", RESUME_NAME, relative, size, {}, None)
        self._resumes_from(relative)

    def _resumes_from(self, relative: str) -> None:
        self._note(steps=self.model.steps, state_path=relative)
        self.saved_steps, self.state_path, self.unsaved = self.model.steps, relative, False

    def _record(
        self, kind: str, name: str, relative: str, size: int, metadata: dict[str, Any], ttl: int | None
    ) -> None:
        from sqlalchemy import select

        with session_scope() as session:
            row = session.scalar(
                select(TinkerCheckpoint).where(
                    TinkerCheckpoint.model_seq == self.row_seq,
                    TinkerCheckpoint.kind == kind,
                    TinkerCheckpoint.name == name,
                )
            )
            if row is None:
                row = TinkerCheckpoint(model_seq=self.row_seq, kind=kind, name=name, path=relative)
                session.add(row)
            row.step, row.size_bytes, row.user_metadata = self.model.steps, size, metadata
            row.created_at = now()
            row.expires_at = now() + int(ttl) if ttl else None
            session.commit()

    def _note(self, *, steps: int, state_path: str | None = None, step: TinkerStep | None = None) -> None:
        """The model's row: its steps, when it was last used, its newest state; and a step's row,
        after those of a step it was loaded back before (they belonged to a history it left); and what
        its requests used since the last note (``service.tenancy.usage``), in the same transaction."""
        from sqlalchemy import delete

        with session_scope() as session:
            row = session.get(TinkerModel, self.row_seq)
            if row is None:
                return
            row.steps, row.last_request_at = steps, time.time()
            if state_path is not None:
                row.state_path, row.state_steps = state_path, steps
            if step is not None:
                session.execute(
                    delete(TinkerStep).where(TinkerStep.model_seq == self.row_seq, TinkerStep.step >= step.step)
                )
                session.add(step)
            self._meter(session, trained=step.tokens if step is not None else 0)
            session.commit()
        self.device_seconds = 0.0

    def _meter(self, session: Any, *, trained: int) -> None:
        accelerator = os.environ.get(ACCELERATOR_VARIABLE, "")
        for kind, amount, on in (("device_seconds", self.device_seconds, accelerator), ("tokens_trained", trained, "")):
            usage.add(
                session, project_seq=self.project_seq, subject=self.model_id, kind=kind, amount=amount, accelerator=on
            )


def _json(answer: dict[str, Any]) -> tuple[str, bytes]:
    return JSON, json.dumps(answer, allow_nan=False).encode()

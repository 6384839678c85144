"""What an inference worker does besides answering completions, between its batches:

* exports: a fine-tuned checkpoint as one full model, every LoRA adapter of its chain merged in, saved
  in safetensors with its tokenizer (``from_pretrained`` and ``vllm serve`` load the directory as it
  is), under ``<artifacts>/exports/<job>/step-<N>``; asked by ``GET …/checkpoints/{id}/content?merged=true``,
  merged on the background thread (``worker.serving.background``) in the project's turn;
* remote reward models' batches (``worker.engine.rewards.remote``): a training job's completions scored by
  a reward model kept loaded here;
* evaluations (``worker.serving.evaluate``): checkpoints scored on a file, a few tokens of a chunk at a
  time between batches of completions; its start and grading on the background thread.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from service.infra import inference_bus
from worker.engine.errors import JobError
from worker.serving.model_cache import Servable

log = logging.getLogger("rloo.serve")

POLL_SECONDS = 2.0  # how often an idle worker looks for an evaluation to run


class BetweenBatches:
    def __init__(self, server: Any, *, evaluations: bool = True) -> None:
        """``evaluations``: whether this worker claims evaluations (a dedicated worker of its own
        queue does not)."""
        self.server, self.evaluations = server, evaluations
        self.evaluation: Any = None  # the evaluation in progress (worker.serving.evaluate.EvaluationRun)
        self._claiming: Future[Any] | None = None  # the look for the next, on the background thread
        self._left: Future[Any] | None = None  # the last one's grading, should it outlive it
        self._polled = 0.0

    @property
    def busy(self) -> bool:
        """An evaluation is under way, or being looked for (maybe only waiting for the background)."""
        return self.evaluation is not None or self._claiming is not None

    @property
    def ready(self) -> bool:
        """An evaluation has work for the serving loop now (it is not only waiting for its grading)."""
        return self.evaluation is not None and not self.evaluation.waiting

    def request(self, envelope: dict[str, Any]) -> dict[str, Any] | None:
        """A request that is no completion: its last message (``done`` or ``error``), or None when it
        is answered later (an export, merged on the worker's background thread in its project's
        turn: minutes for a large model, which must not hold the serving loop)."""
        kind = envelope.get("kind")
        if kind == "score":
            return self.score(envelope)
        if kind != "export":
            return inference_bus.error_message(400, "unsupported", f"unknown request kind {kind!r}")
        lane = str(envelope.get("project") or inference_bus.SYSTEM_LANE)
        merged = self.server.background.submit(lane, exported, envelope)
        merged.add_done_callback(lambda done: self.server.answer(envelope["id"], done.result()))
        return None

    def score(self, envelope: dict[str, Any]) -> dict[str, Any]:
        """A remote reward model's batch (``worker.engine.rewards.remote``): its scores, or its error."""
        import torch

        from worker.engine.rewards.remote import answer

        try:
            with self.server.scoring:  # (an evaluation's model grader on the grading thread: in turn)
                return answer(self.server.rewards(), envelope)
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
            return inference_bus.error_message(
                503, "out_of_memory", "The inference worker ran out of GPU memory scoring"
            )
        except Exception as exc:  # a broken model, a bug: this batch's answer, never the worker's end
            log.exception("scoring failed")
            return inference_bus.error_message(500, "score_failed", f"Scoring failed: {type(exc).__name__}: {exc}")

    def beat(self) -> None:
        """The evaluation in progress is alive (from the heartbeat thread, however long a chunk takes);
        one cancelled meanwhile (or taken by another worker) is stopped at its next turn."""
        from worker.serving import evaluate

        running = self.evaluation
        if running is not None and not evaluate.touch(running.seq, self.server.worker):
            running.stopped = True

    def step(self) -> None:
        """One turn of the evaluation in progress, or (at most every POLL_SECONDS, and once no grading
        of the last one is still under way) a look for the next, on the background thread."""
        from worker.serving import evaluate

        if self.evaluation is not None:
            if not self.evaluation.step():
                self._left = self.evaluation.in_flight  # a cancelled one's chunk may still be graded
                self.evaluation = None
            return
        if self._claiming is not None:
            if self._claiming.done():
                claiming, self._claiming = self._claiming, None
                try:
                    self.evaluation = claiming.result()
                except Exception:  # the database away, a bug: logged, and the worker goes on serving
                    log.exception("claiming an evaluation failed")
            return
        idle = time.monotonic() - self._polled < POLL_SECONDS or (self._left is not None and not self._left.done())
        if not self.evaluations or idle:
            time.sleep(0.05)
            return
        self._polled = time.monotonic()
        # Claimed and started (its file and checkpoints fetched) on the background thread.
        self._claiming = self.server.background.submit(inference_bus.SYSTEM_LANE, evaluate.claim_next, self.server)


def exported(envelope: dict[str, Any]) -> dict[str, Any]:
    """An export request's answer, once its merge is done (or failed)."""
    try:
        made = export_to(Servable.from_wire(envelope["servable"]), envelope["target"])
    except JobError as exc:
        return inference_bus.error_message(500, exc.code, exc.message)
    except Exception as exc:  # a disk that is full, a checkpoint half gone: this export's answer
        log.exception("export failed")
        return inference_bus.error_message(500, "export_failed", f"The export failed: {type(exc).__name__}: {exc}")
    if envelope.get("checkpoint"):
        note_export_bytes(str(envelope["checkpoint"]), made)
    return {"t": "done", "usage": None}


def export_to(servable: Servable, target: str) -> Path:
    """``export`` to the API's ``target``: a directory, or (relative) a key of the object store,
    made in this host's cache and published there whole, marker last (``service.infra.artifacts``);
    the directory it made."""
    from service.core.settings import get_settings
    from service.infra.artifacts import open_store

    if Path(target).is_absolute():
        export(servable, Path(target))
        return Path(target)
    store = open_store(get_settings())
    local = store.local(target)
    local.parent.mkdir(parents=True, exist_ok=True)
    export(servable, local)
    store.publish_checkpoint(target, local)
    return local


def note_export_bytes(checkpoint_id: str, made: Path) -> None:
    """The export's bytes on its checkpoint's row: its project's stored bytes count them
    (``service.tenancy.usage.stored_bytes``). Never raises: the database away, or the export removed
    meanwhile (its model deleted), the export's answer goes out all the same."""
    from service.core.db import session_scope
    from service.infra.artifacts import tree_bytes
    from service.tenancy import usage

    try:
        size = tree_bytes(made)
        with session_scope() as session:
            usage.note_export(session, checkpoint_id, size)
            session.commit()
    except Exception:
        log.exception("the bytes of the export of %s were not recorded", checkpoint_id)


def export(servable: Servable, target: Path) -> None:
    """``servable``'s weights as one model directory at ``target`` (written aside, then renamed)."""
    import torch
    from transformers import AutoTokenizer

    from worker.engine.modeling import load_causal_lm
    from worker.engine.prepare import start_from

    if (target / "config.json").is_file():
        return
    tmp = target.with_name(f".tmp-{target.name}-{os.getpid()}-{time.monotonic_ns()}")  # two workers: two names
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        cpu = torch.device("cpu")
        model = start_from(load_causal_lm(servable.base, cpu, name=servable.base.name), servable.chain, cpu)
        model.save_pretrained(tmp, safe_serialization=True)
        AutoTokenizer.from_pretrained(servable.tokenizer_dir).save_pretrained(tmp)  # as trained, unchanged
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # another worker merged it first: the same weights
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise

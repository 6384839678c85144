"""The evaluation engine, on an inference worker. It runs two kinds of work, one loop:

* a job's checkpoint evaluation: each model of it (the job's starting model, then the checkpoints
  asked for) answers the file's first ``samples`` lines once, sampled as the job samples, and is
  scored by the grader the job trained with (or the one given). A model's row holds its reward's
  mean and standard error, each grader's mean, and the mean completion length in tokens;
* an eval's run (OpenAI's Evals API, ``service.evals``): its model answers each item (or the items'
  own samples are taken), every testing criterion grades it, and each item is written as an output
  item with the run's counts; the run's end sends its ``eval.run.*`` webhook.

``worker.serving.eval_scoring`` holds what differs between them; this module the loop they share.

The work goes a chunk of lines at a time (``CHUNK``), and none of it holds the serving loop:

* a chunk's decoding advances ``STEPS_A_TURN`` tokens at a time, between the batches of completions
  (which go first), so a chat asked meanwhile waits a few tokens, not a chunk;
* its grading (a python grader's sandbox, an http endpoint, a reward model) runs on the worker's
  background thread (``worker.serving.background``, in turn by project) while the loop serves on;
  the loop looks at it again when it is done; so does its start (its file and checkpoints fetched).

The row's ``results``, ``done`` and ``heartbeat_at`` are written after each chunk, so a worker that
dies leaves an evaluation whose heartbeat goes stale; the next idle worker takes it again from the
start. Projects take turns (``claim_next``: at most ``RLOO_EVALUATIONS_PER_PROJECT`` running at once
a project, the project that started one longest ago first); an evaluation has
``RLOO_EVALUATION_MAX_SECONDS`` from its first start in all (then it fails, its results so far kept);
a cancelled one (its route, or its file deleted) stops at its next look.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import delete, func, or_, select, update

from service import graders
from service.core.db import session_scope
from service.core.errors import DomainError
from service.core.settings import get_settings, tenant_safe
from service.core.tables import Eval, EvalOutputItem, Evaluation, File, Job, Project
from service.evals import criteria as criteria_
from service.evals import items as items_
from service.graders import GradeResult
from service.infra import outbound
from service.infra.artifacts import open_store
from service.infra.inference_bus import MAX_BYTES_PER_TOKEN
from worker.engine.errors import JobError
from worker.serving.decode import Row
from worker.serving.eval_scoring import Answers, CheckpointScoring, RunScoring
from worker.serving.model_cache import Servable

log = logging.getLogger("rloo.serve")

CHUNK = 16
STEPS_A_TURN = 8
"""Tokens an evaluation's chunk decodes before the serving loop looks for completions again."""
RESTARTS = 3
STALE_SECONDS = 60.0
"""An evaluation whose heartbeat (written every few seconds by its worker's heartbeat thread) is
older than this lost its worker."""


def claim_next(server: Any) -> EvaluationRun | None:
    """The next evaluation by turns between projects, claimed for this worker by a conditional
    update (two workers never run one): queued, or running with a stale heartbeat; of a project with
    fewer than ``RLOO_EVALUATIONS_PER_PROJECT`` running; the project whose last one started longest ago
    first, then the oldest. None when there is none."""
    settings = get_settings()
    now = time.time()
    live = (Evaluation.status == "running") & (Evaluation.heartbeat_at >= now - STALE_SECONDS)
    waiting = or_(Evaluation.status == "queued", (Evaluation.status == "running") & ~live)
    with session_scope() as session:
        busy = (
            select(Evaluation.project_seq)
            .where(live)
            .group_by(Evaluation.project_seq)
            .having(func.count() >= settings.evaluations_per_project)
        )
        last = (
            select(Evaluation.project_seq, func.max(Evaluation.started_at).label("at"))
            .group_by(Evaluation.project_seq)
            .subquery()
        )
        seq = session.scalar(
            select(Evaluation.seq)
            .outerjoin(last, last.c.project_seq == Evaluation.project_seq)
            .where(waiting, Evaluation.project_seq.not_in(busy))
            .order_by(func.coalesce(last.c.at, 0), Evaluation.seq)
            .limit(1)
        )
        if seq is None:
            return None
        claimed = session.execute(
            update(Evaluation)
            .where(Evaluation.seq == seq, waiting)
            .values(
                status="running",
                worker=server.worker,
                heartbeat_at=now,
                results=[],
                summary=None,
                done=0,
                started_at=func.coalesce(Evaluation.started_at, now),
            )
        ).rowcount  # type: ignore[attr-defined]
        if claimed:  # a run taken again starts over: its output items go with the claim, in its transaction
            session.execute(delete(EvalOutputItem).where(EvalOutputItem.run_seq == seq))
        session.commit()
        evaluation = session.get(Evaluation, seq, populate_existing=True) if claimed else None
        if evaluation is None:  # another worker's, or deleted since
            return None
        job = session.get(Job, evaluation.job_seq) if evaluation.job_seq is not None else None
        file = session.scalar(
            select(File).where(File.id == evaluation.file_id, File.project_seq == evaluation.project_seq)
        )
        try:
            return EvaluationRun.start(server, session, evaluation, job, file)
        except Exception as exc:  # a model gone since, a file that no longer parses: this evaluation's end
            message = getattr(exc, "message", None) or f"{type(exc).__name__}: {exc}"
            _fail(seq, server.worker, getattr(exc, "code", None) or "evaluation_failed", message)
            return None


def first_items(path: Path, samples: int) -> list[dict[str, Any]]:
    """The file's first ``samples`` non-blank lines, parsed; the rest is never read (``samples: 1``
    on a 200 MB file parsed every line of it first)."""
    items: list[dict[str, Any]] = []
    with path.open(encoding="utf-8-sig") as lines:
        for line in lines:
            if line.strip():
                items.append(json.loads(line))
                if len(items) >= samples:
                    break
    return items


@dataclass
class Chunk:
    """Lines of one model being answered: decoding (``steps``, on ``loaded``), then grading. A run
    without a model has no rows: its lines' own answers are graded at once."""

    index: int  # which model
    items: list[Any]
    prompts: list[str]
    rows: list[Row]
    loaded: Any = None
    steps: Iterator[Any] | None = None
    grading: Future[Any] | None = None
    given: list[str] | None = None  # the lines' own answers, where no model answers

    def answers(self) -> Answers:
        texts = self.given if self.given is not None else [r.text for r in self.rows]
        return Answers(self.index, self.items, self.prompts, texts, self.rows)


@dataclass
class EvaluationRun:
    server: Any
    seq: int
    scoring: CheckpointScoring | RunScoring
    items: list[Any]
    models: list[tuple[dict[str, Any], Servable]]
    settings: dict[str, Any]
    ends_at: float  # wall clock: its time budget, from its first start
    lane: str = "_"  # its project's id: its turn on the worker's background thread
    position: int = 0  # lines done over all models
    chunk: Chunk | None = None
    stopped: bool = False  # cancelled, or taken by another worker: seen by the heartbeat
    restarts: int = 0

    @classmethod
    def start(cls, server: Any, session: Any, evaluation: Evaluation, job: Any, file: Any) -> EvaluationRun:
        from service.registry import weights

        settings = get_settings()
        scoring: CheckpointScoring | RunScoring
        items: list[Any]
        if evaluation.eval_seq is not None:
            scoring, items = _run_scoring(session, evaluation, file, settings)
        else:
            assert evaluation.grader is not None
            if file is None:
                raise JobError("file_not_found", f"the file {evaluation.file_id} is gone")
            items = first_items(open_store(settings).fetch_file(file.path), int(evaluation.settings["samples"]))
            grader = graders.parse_grader(evaluation.grader, allow_python=settings.allow_python_grader)
            scoring = CheckpointScoring(grader, evaluation.models)
        if not items:
            raise JobError("empty_file", f"the file {evaluation.file_id} has no lines to evaluate on")
        models = []
        for entry in evaluation.models:
            wire = weights.resolve(
                session, settings, project_seq=evaluation.project_seq, name=entry["model"], include_deleted=True
            )
            models.append((entry, Servable.from_wire(wire)))
        ends_at = float(evaluation.started_at or time.time()) + settings.evaluation_max_seconds
        project = session.get(Project, evaluation.project_seq)
        lane = project.id if project is not None else "_"
        return cls(server, evaluation.seq, scoring, items, models, dict(evaluation.settings), ends_at, lane)

    @property
    def total(self) -> int:
        return len(self.items) * max(1, len(self.models))

    @property
    def in_flight(self) -> Future[GradeResult] | None:
        """Its chunk's grading, while it is under way."""
        grading = self.chunk.grading if self.chunk is not None else None
        return grading if grading is not None and not grading.done() else None

    @property
    def waiting(self) -> bool:
        """Its chunk is being graded and is not done yet: nothing to do on the serving loop."""
        return self.chunk is not None and self.chunk.grading is not None and not self.chunk.grading.done()

    def step(self) -> bool:
        """One turn: a few tokens of the chunk's decoding, its grading handed off, or a graded chunk
        counted and written. False once the evaluation has ended (succeeded, failed, cancelled)."""
        try:
            if self.stopped:
                log.info("evaluation %s was cancelled or taken by another worker; stopping", self.seq)
                return False
            if time.time() > self.ends_at:
                minutes = get_settings().evaluation_max_seconds / 60
                raise JobError(
                    "evaluation_timeout",
                    f"the evaluation ran past its {minutes:g} minutes (RLOO_EVALUATION_MAX_SECONDS) and was "
                    f"stopped after {self.position} of {self.total} lines; evaluate fewer samples or checkpoints",
                )
            if self.chunk is None:
                self.chunk = self._next_chunk()
            elif self.chunk.grading is not None:
                return self.waiting or self._graded(self.chunk)
            elif not self._decode_a_few(self.chunk):
                self.chunk.grading = self.server.grade(self.lane, self._grade, self.chunk)
            return True
        except (JobError, graders.GraderError) as exc:
            _fail(self.seq, self.server.worker, getattr(exc, "code", None) or "grader_failed", exc.message)
        except graders.GraderUnavailable as exc:  # an endpoint down, a sandbox that cannot start
            _fail(self.seq, self.server.worker, "grader_unavailable", str(exc))
        except Exception as exc:
            log.exception("evaluation failed")
            _fail(self.seq, self.server.worker, "evaluation_failed", f"{type(exc).__name__}: {exc}")
        return False

    def _next_chunk(self) -> Chunk:
        index, start = divmod(self.position, len(self.items))
        items = self.items[start : start + CHUNK]
        if not self.models:  # the lines' own answers: graded at once
            given = [self.scoring.given_text(item) for item in items]
            return Chunk(index, items, [""] * len(items), [], given=given)
        _, served = self.models[index]
        loaded, adapter = self.server.cache.get(served)
        tok, context = loaded.tokenizer, loaded.context
        budget = int(self.settings["max_tokens"])
        prompts = [self.scoring.prompt(item, tok, start + i + 1) for i, item in enumerate(items)]
        rows = []
        for i, text in enumerate(prompts):
            if context is not None:  # a prompt keeps its last tokens, as training does: tokenize no more
                text = text[-context * MAX_BYTES_PER_TOKEN :]
            ids = tok(text, add_special_tokens=False)["input_ids"]
            if context is not None:
                ids = ids[-max(1, context - budget) :]
            seed = self.settings.get("seed")
            rows.append(
                Row(
                    request=str(i),
                    index=0,
                    prompt_ids=ids,
                    max_tokens=budget,
                    temperature=float(self.settings["temperature"]),
                    top_p=float(self.settings.get("top_p", 1.0)),
                    stop=tuple(self.settings.get("stop") or ()),
                    seed=None if seed is None else seed + start + i,
                    adapter=adapter,
                )
            )
        return Chunk(index, items, prompts, rows, loaded, steps=iter(self.server.cache.decode(loaded, rows)))

    def _decode_a_few(self, chunk: Chunk) -> bool:
        """``STEPS_A_TURN`` tokens of the chunk; False once its decoding has ended. Between turns the
        worker served other batches, which may have unloaded this chunk's model (whose memory the
        paused decoding would then keep past the worker's budget) or its adapter (its decoding
        fails): the chunk starts again (at most ``RESTARTS`` times on a failure)."""
        if chunk.steps is None:
            return False  # nothing to decode: the lines' own answers
        if not self.server.cache.holds(chunk.loaded):
            log.info("evaluation %s: its model was unloaded between turns; the chunk starts again", self.seq)
            chunk.steps = None  # let go of its KV cache and the unloaded weights
            self.chunk = self._next_chunk()
            return True
        try:
            for _ in range(STEPS_A_TURN):
                if next(chunk.steps, None) is None:
                    chunk.steps = None
                    return False
        except Exception:
            self.restarts += 1
            if self.restarts > RESTARTS:
                raise
            log.warning("evaluation %s: a chunk's decoding failed between turns; starting it again", self.seq)
            self.chunk = self._next_chunk()
        return True

    def _grade(self, chunk: Chunk) -> Any:
        """On the grading thread: the chunk's answers scored, within the evaluation's budget."""
        models = self.server.scoring if self.scoring.needs_models else contextlib.nullcontext()
        with models, outbound.within(max(0.0, self.ends_at - time.time())):
            return self.scoring.grade(chunk.answers(), self.server.rewards())

    def _graded(self, chunk: Chunk) -> bool:
        """The graded chunk counted and written; False once the evaluation has ended."""
        assert chunk.grading is not None
        answers = chunk.answers()
        outputs = self.scoring.count(answers, chunk.grading.result())  # its grader's error raises here
        self.position += len(chunk.items)
        self.chunk = None
        finished = self.position >= self.total
        if not self._record(finished, outputs):
            log.info("evaluation %s was cancelled or taken by another worker; stopping", self.seq)
            return False
        return not finished

    def _record(self, finished: bool, outputs: list[dict[str, Any]]) -> bool:
        """The results so far (and the chunk's output items, in the same transaction); False when
        the evaluation is no longer this worker's to run."""
        values: dict[str, Any] = {
            **self.scoring.values(),
            "done": self.position,
            "total": self.total,
            "heartbeat_at": time.time(),
        }
        if finished:
            values.update(status="succeeded", finished_at=int(time.time()))
        with session_scope() as session:
            mine = (Evaluation.seq == self.seq) & (Evaluation.worker == self.server.worker)
            written = session.execute(update(Evaluation).where(mine, Evaluation.status == "running").values(**values))
            if not written.rowcount:  # type: ignore[attr-defined]
                session.rollback()
                return False
            session.add_all(EvalOutputItem(run_seq=self.seq, **row) for row in outputs)
            if finished:
                _announce(session, self.seq, "succeeded")
            session.commit()
        return True


def _run_scoring(
    session: Any, evaluation: Evaluation, file: Any, settings: Any
) -> tuple[RunScoring, list[items_.Item]]:
    """An eval run's scoring and its items, every line checked against the eval's item schema
    (the API checked the first ones; a later line that does not fit fails the run, naming it)."""
    from service.evals import creation, spec

    e = session.get(Eval, evaluation.eval_seq)
    if e is None:
        raise JobError("eval_deleted", "the eval of this run was deleted")
    criteria = creation.parsed_criteria(e, settings)
    source = evaluation.data_source or {}
    needs_sample = not evaluation.models and criteria_.reads_sample(criteria)
    schema = spec.item_schema(e.data_source_config)
    if evaluation.items_inline is not None:
        lines: Any = enumerate(evaluation.items_inline)
        where = "item {n} of the content"
    elif file is None:
        raise JobError("file_not_found", f"the file {evaluation.file_id} is gone")
    else:
        lines = items_.file_lines(open_store(settings).fetch_file(file.path))
        where = f"line {{n}} of file {file.id}"
    try:
        items = items_.check(lines, schema, where=where, param="data_source", needs_sample=needs_sample)
    except DomainError as exc:
        raise JobError(exc.code or "invalid_item", exc.message) from None
    model = evaluation.models[0]["model"] if evaluation.models else None
    return RunScoring(criteria, model, source.get("input_messages"), dict(evaluation.settings)), items


def _announce(session: Any, seq: int, status: str) -> None:
    """An eval run's end, as its webhook (nothing for a checkpoint evaluation)."""
    from service.evals import runs

    row = session.get(Evaluation, seq)
    if row is not None:
        runs.ended(session, row, status)


def touch(seq: int, worker: str) -> bool:
    """The heartbeat of a running evaluation; False when it is no longer this worker's to run
    (cancelled, or taken by another)."""
    with session_scope() as session:
        mine = (Evaluation.seq == seq) & (Evaluation.worker == worker) & (Evaluation.status == "running")
        written = session.execute(update(Evaluation).where(mine).values(heartbeat_at=time.time()))
        session.commit()
    return bool(written.rowcount)  # type: ignore[attr-defined]


def _fail(seq: int, worker: str, code: str, message: str) -> None:
    """The evaluation failed, unless it is no longer this worker's."""
    with session_scope() as session:
        failed = session.execute(
            update(Evaluation)
            .where(Evaluation.seq == seq, Evaluation.worker == worker, Evaluation.status == "running")
            .values(
                status="failed", error={"code": code, "message": tenant_safe(message)}, finished_at=int(time.time())
            )
        )
        if failed.rowcount:  # type: ignore[attr-defined]
            _announce(session, seq, "failed")
        session.commit()

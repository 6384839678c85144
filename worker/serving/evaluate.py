"""An evaluation on an inference worker: each model of it (the job's starting model, then the
checkpoints asked for) answers the file's first ``samples`` lines once, sampled as the job samples, and
is scored by the grader the job trained with (or the one given). A model's row holds its reward's mean
and standard error, each grader's mean, and the mean completion length in tokens.

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
import math
import time
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import func, or_, select, update

from service import graders
from service.core.db import session_scope
from service.core.settings import get_settings, tenant_safe
from service.core.tables import Evaluation, File, Job, Project
from service.graders import GradeResult
from service.infra import outbound
from service.infra.artifacts import open_store
from service.infra.inference_bus import MAX_BYTES_PER_TOKEN
from worker.engine.errors import JobError
from worker.serving.decode import Row
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
            select(Job.project_seq)
            .join(Evaluation, Evaluation.job_seq == Job.seq)
            .where(live)
            .group_by(Job.project_seq)
            .having(func.count() >= settings.evaluations_per_project)
        )
        last = (
            select(Job.project_seq, func.max(Evaluation.started_at).label("at"))
            .join(Evaluation, Evaluation.job_seq == Job.seq)
            .group_by(Job.project_seq)
            .subquery()
        )
        seq = session.scalar(
            select(Evaluation.seq)
            .join(Job, Job.seq == Evaluation.job_seq)
            .outerjoin(last, last.c.project_seq == Job.project_seq)
            .where(waiting, Job.project_seq.not_in(busy))
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
                done=0,
                started_at=func.coalesce(Evaluation.started_at, now),
            )
        ).rowcount  # type: ignore[attr-defined]
        session.commit()
        if not claimed:
            return None
        evaluation = session.get(Evaluation, seq, populate_existing=True)
        assert evaluation is not None
        job = session.get(Job, evaluation.job_seq)
        file = session.scalar(select(File).where(File.id == evaluation.file_id))
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
class Tally:
    """One model's sums so far."""

    model: str
    step_number: int | None
    n: int = 0
    total: float = 0.0
    squares: float = 0.0
    tokens: int = 0
    unscored: int = 0
    graders: dict[str, list[float]] = field(default_factory=dict)  # name -> [sum, count]

    def row(self) -> dict[str, Any]:
        mean = self.total / self.n if self.n else None
        error = None
        if self.n > 1 and mean is not None:
            variance = max(0.0, (self.squares - self.n * mean * mean) / (self.n - 1))
            error = math.sqrt(variance / self.n)
        return {
            "model": self.model,
            "step_number": self.step_number,
            "reward_mean": mean,
            "reward_std_error": error,
            "grader_means": {k: s / c if c else None for k, (s, c) in self.graders.items()},
            "completion_length_mean": self.tokens / (self.n + self.unscored) if self.n + self.unscored else None,
            "samples": self.n,
            "unscored": self.unscored,
        }

    def add(self, result: GradeResult, rows: list[Row]) -> None:
        for i, reward in enumerate(result.rewards):
            self.tokens += rows[i].sampled
            if not math.isfinite(reward):
                self.unscored += 1
                continue
            self.n += 1
            self.total += reward
            self.squares += reward * reward
        for name, column in result.sub_rewards.items():
            sums = self.graders.setdefault(name, [0.0, 0.0])
            for value in column:
                if math.isfinite(value):
                    sums[0] += value
                    sums[1] += 1


@dataclass
class Chunk:
    """Lines of one model being answered: decoding (``steps``, on ``loaded``), then grading."""

    index: int  # which model
    items: list[dict[str, Any]]
    prompts: list[str]
    rows: list[Row]
    loaded: Any = None
    steps: Iterator[Any] | None = None
    grading: Future[GradeResult] | None = None


@dataclass
class EvaluationRun:
    server: Any
    seq: int
    grader: Any
    items: list[dict[str, Any]]
    models: list[tuple[dict[str, Any], Servable]]
    settings: dict[str, Any]
    tallies: list[Tally]
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
        grader = graders.parse_grader(evaluation.grader, allow_python=settings.allow_python_grader)
        if file is None:
            raise JobError("file_not_found", f"the file {evaluation.file_id} is gone")
        items = first_items(open_store(settings).fetch_file(file.path), int(evaluation.settings["samples"]))
        if not items:
            raise JobError("empty_file", f"the file {evaluation.file_id} has no lines to evaluate on")
        models = []
        for entry in evaluation.models:
            wire = weights.resolve(
                session, settings, project_seq=job.project_seq, name=entry["model"], include_deleted=True
            )
            models.append((entry, Servable.from_wire(wire)))
        tallies = [Tally(entry["model"], entry["step_number"]) for entry, _ in models]
        ends_at = float(evaluation.started_at or time.time()) + settings.evaluation_max_seconds
        project = session.get(Project, job.project_seq)
        lane = project.id if project is not None else "_"
        return cls(server, evaluation.seq, grader, items, models, dict(evaluation.settings), tallies, ends_at, lane)

    @property
    def total(self) -> int:
        return len(self.items) * len(self.models)

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
        from worker.engine.data import prompt_text

        index, start = divmod(self.position, len(self.items))
        items = self.items[start : start + CHUNK]
        _, served = self.models[index]
        loaded, adapter = self.server.cache.get(served)
        tok, context = loaded.tokenizer, loaded.context
        budget = int(self.settings["max_tokens"])
        prompts = [prompt_text(item, tok) for item in items]
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
        assert chunk.steps is not None
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

    def _grade(self, chunk: Chunk) -> GradeResult:
        """On the grading thread: the chunk's completions scored, within the evaluation's budget."""
        from worker.engine.rewards.scoring import score_batch

        models = self.server.scoring if graders.is_model_grader(self.grader) else contextlib.nullcontext()
        with models, outbound.within(max(0.0, self.ends_at - time.time())):
            return score_batch(
                self.grader,
                prompts=chunk.prompts,
                texts=[r.text for r in chunk.rows],
                items=chunk.items,
                reward_models=self.server.rewards(),
            )

    def _graded(self, chunk: Chunk) -> bool:
        """The graded chunk counted and written; False once the evaluation has ended."""
        assert chunk.grading is not None
        self.tallies[chunk.index].add(chunk.grading.result(), chunk.rows)  # its grader's error raises here
        self.position += len(chunk.items)
        self.chunk = None
        finished = self.position >= self.total
        if not self._record(finished):
            log.info("evaluation %s was cancelled or taken by another worker; stopping", self.seq)
            return False
        return not finished

    def _record(self, finished: bool) -> bool:
        """The results so far; False when the evaluation is no longer this worker's to run."""
        values: dict[str, Any] = {
            "results": [t.row() for t in self.tallies],
            "done": self.position,
            "total": self.total,
            "heartbeat_at": time.time(),
        }
        if finished:
            values.update(status="succeeded", finished_at=int(time.time()))
        with session_scope() as session:
            mine = (Evaluation.seq == self.seq) & (Evaluation.worker == self.server.worker)
            written = session.execute(update(Evaluation).where(mine, Evaluation.status == "running").values(**values))
            session.commit()
        return bool(written.rowcount)  # type: ignore[attr-defined]


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
        session.execute(
            update(Evaluation)
            .where(Evaluation.seq == seq, Evaluation.worker == worker, Evaluation.status == "running")
            .values(
                status="failed", error={"code": code, "message": tenant_safe(message)}, finished_at=int(time.time())
            )
        )
        session.commit()

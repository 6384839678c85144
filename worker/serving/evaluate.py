"""An evaluation on an inference worker: each model of it (the job's starting model, then the
checkpoints asked for) answers the file's first ``samples`` lines once, sampled as the job samples, and
is scored by the grader the job trained with (or the one given). A model's row holds its reward's mean
and standard error, each grader's mean, and the mean completion length in tokens.

The work goes a chunk of lines at a time (``CHUNK``): completions asked meanwhile are answered between
chunks, and the row's ``results``, ``done`` and ``heartbeat_at`` are written after each, so a worker
that dies leaves an evaluation whose heartbeat goes stale; the next idle worker takes it again from
the start.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import or_, select, update

from service import graders
from service.artifacts import open_store
from service.db import session_scope
from service.models import Evaluation, File, Job
from service.settings import get_settings
from worker.records import JobError
from worker.serving.decode import Row
from worker.serving.models import Servable

log = logging.getLogger("rloo.serve")

CHUNK = 16
STALE_SECONDS = 60.0
"""An evaluation whose heartbeat (written every few seconds by its worker's heartbeat thread) is
older than this lost its worker."""


def claim_next(server: Any) -> Run | None:
    """The oldest evaluation that is queued, or running with a stale heartbeat, claimed for this
    worker by a conditional update (two workers never run one); None when there is none."""
    now = time.time()
    with session_scope() as session:
        waiting = or_(
            Evaluation.status == "queued",
            (Evaluation.status == "running") & (Evaluation.heartbeat_at < now - STALE_SECONDS),
        )
        seq = session.scalar(select(Evaluation.seq).where(waiting).order_by(Evaluation.seq).limit(1))
        if seq is None:
            return None
        claimed = session.execute(
            update(Evaluation)
            .where(Evaluation.seq == seq, waiting)
            .values(status="running", worker=server.worker, heartbeat_at=now, results=[], done=0)
        ).rowcount  # type: ignore[attr-defined]
        session.commit()
        if not claimed:
            return None
        evaluation = session.get(Evaluation, seq)
        assert evaluation is not None
        job = session.get(Job, evaluation.job_seq)
        file = session.scalar(select(File).where(File.id == evaluation.file_id))
        try:
            return Run.start(server, session, evaluation, job, file)
        except Exception as exc:  # a model gone since, a file that no longer parses: this evaluation's end
            message = getattr(exc, "message", None) or f"{type(exc).__name__}: {exc}"
            _fail(seq, server.worker, getattr(exc, "code", None) or "evaluation_failed", message)
            return None


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


@dataclass
class Run:
    server: Any
    seq: int
    grader: Any
    items: list[dict[str, Any]]
    models: list[tuple[dict[str, Any], Servable]]
    settings: dict[str, Any]
    tallies: list[Tally]
    position: int = 0  # lines done over all models

    @classmethod
    def start(cls, server: Any, session: Any, evaluation: Evaluation, job: Any, file: Any) -> Run:
        from service import servable

        settings = get_settings()
        grader = graders.parse_grader(evaluation.grader, allow_python=settings.allow_python_grader)
        if file is None:
            raise JobError("file_not_found", f"the file {evaluation.file_id} is gone")
        lines = open_store(settings).fetch_file(file.path).read_text(encoding="utf-8-sig").splitlines()
        items = [json.loads(line) for line in lines if line.strip()][: evaluation.settings["samples"]]
        if not items:
            raise JobError("empty_file", f"the file {evaluation.file_id} has no lines to evaluate on")
        models = []
        for entry in evaluation.models:
            wire = servable.resolve(
                session, settings, project_seq=job.project_seq, name=entry["model"], include_deleted=True
            )
            models.append((entry, Servable.from_wire(wire)))
        tallies = [Tally(entry["model"], entry["step_number"]) for entry, _ in models]
        return cls(server, evaluation.seq, grader, items, models, dict(evaluation.settings), tallies)

    @property
    def total(self) -> int:
        return len(self.items) * len(self.models)

    def step(self) -> bool:
        """One chunk; False once the evaluation has ended (succeeded or failed)."""
        try:
            index, start = divmod(self.position, len(self.items))
            chunk = self.items[start : start + CHUNK]
            self._score(index, start, chunk)
            self.position += len(chunk)
            finished = self.position >= self.total
            if not self._record(finished):
                log.warning("evaluation %s was taken by another worker; stopping", self.seq)
                return False
            return not finished
        except (JobError, graders.GraderError) as exc:
            _fail(self.seq, self.server.worker, getattr(exc, "code", "grader_failed"), exc.message)
        except Exception as exc:
            log.exception("evaluation failed")
            _fail(self.seq, self.server.worker, "evaluation_failed", f"{type(exc).__name__}: {exc}")
        return False

    def _score(self, index: int, start: int, chunk: list[dict[str, Any]]) -> None:
        from worker.data import prompt_text
        from worker.rewards import score_batch

        entry, served = self.models[index]
        loaded, adapter = self.server.cache.get(served)
        tok, context = loaded.tokenizer, loaded.context
        budget = int(self.settings["max_tokens"])
        prompts = [prompt_text(item, tok) for item in chunk]
        rows = []
        for i, text in enumerate(prompts):
            ids = tok(text, add_special_tokens=False)["input_ids"]
            if context is not None:
                ids = ids[-max(1, context - budget) :]  # a prompt keeps its last tokens, as training does
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
        for _ in self.server.cache.decode(loaded, rows):
            pass
        result = score_batch(
            self.grader, prompts=prompts, texts=[r.text for r in rows], items=chunk, reward_models=self.server.rewards()
        )
        tally = self.tallies[index]
        for i, reward in enumerate(result.rewards):
            tally.tokens += rows[i].sampled
            if not math.isfinite(reward):
                tally.unscored += 1
                continue
            tally.n += 1
            tally.total += reward
            tally.squares += reward * reward
        for name, column in result.sub_rewards.items():
            sums = tally.graders.setdefault(name, [0.0, 0.0])
            for value in column:
                if math.isfinite(value):
                    sums[0] += value
                    sums[1] += 1

    def _record(self, finished: bool) -> bool:
        """The results so far; False when the evaluation is no longer this worker's."""
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


def touch(seq: int, worker: str) -> None:
    with session_scope() as session:
        mine = (Evaluation.seq == seq) & (Evaluation.worker == worker) & (Evaluation.status == "running")
        session.execute(update(Evaluation).where(mine).values(heartbeat_at=time.time()))
        session.commit()


def _fail(seq: int, worker: str, code: str, message: str) -> None:
    """The evaluation failed, unless it is no longer this worker's."""
    with session_scope() as session:
        session.execute(
            update(Evaluation)
            .where(Evaluation.seq == seq, Evaluation.worker == worker, Evaluation.status == "running")
            .values(status="failed", error={"code": code, "message": message}, finished_at=int(time.time()))
        )
        session.commit()

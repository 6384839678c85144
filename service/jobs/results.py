"""A job's results file (OpenAI's ``result_files``): a CSV of its per-step metrics, written when the
job succeeds, stored as a file of purpose ``fine-tune-results`` that ``GET /v1/files/{id}/content``
downloads.

Columns: ``step``, then OpenAI's (``train_loss``, ``train_accuracy``, ``valid_loss``,
``valid_mean_token_accuracy``; empty where the method has none), then every metric the job
recorded, in the order it first appeared. The file's id is a function of the job's, so a write
tried again (the database went away mid-commit) makes the same file, never a second one.
"""

from __future__ import annotations

import csv
import hashlib
import io
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.core import crud
from service.core.settings import get_settings
from service.core.tables import File, Job, Project
from service.infra.artifacts import open_store

PURPOSE = "fine-tune-results"
OPENAI_COLUMNS = ("step", "train_loss", "train_accuracy", "valid_loss", "valid_mean_token_accuracy")


def results_file_id(job_id: str) -> str:
    return "file-" + hashlib.sha256(f"results:{job_id}".encode()).hexdigest()[:24]


def metrics_csv(rows: list[dict[str, Any]]) -> str:
    """The CSV text of per-step metrics rows (``{"step": n, ...}``)."""
    columns = list(OPENAI_COLUMNS)
    for row in rows:
        columns += [key for key in row if key not in columns]
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=columns, lineterminator="\n", extrasaction="ignore")
    writer.writeheader()
    for row in rows:
        full = dict(row)
        full.setdefault("train_loss", row.get("loss"))
        full.setdefault("train_accuracy", row.get("train_mean_token_accuracy"))
        writer.writerow({k: "" if full.get(k) is None else full[k] for k in columns})
    return out.getvalue()


def write_results(*, session: Session, job: Job, artifacts_dir: Path) -> str:
    """Write the job's results file (once), add its row and record it on the job; not committed.
    Returns its id."""
    file_id = results_file_id(job.id)
    if session.scalar(select(File.id).where(File.id == file_id)) is not None:
        return file_id  # written by an earlier try, with its job's result_files
    rows = [{"step": m.step, **m.data} for m in crud.list_metrics(session=session, job=job)]
    project_id = session.scalar(select(Project.id).where(Project.seq == job.project_seq))
    rel = f"files/{project_id}/{file_id}.csv"
    data = metrics_csv(rows).encode()
    open_store(get_settings(), artifacts_dir).put_bytes(rel, data)  # written whole before its row
    session.add(
        File(
            id=file_id,
            project_seq=job.project_seq,
            filename="step_metrics.csv",
            purpose=PURPOSE,
            bytes=len(data),
            path=rel,
            line_count=len(rows),
            keys_summary={},
        )
    )
    crud.set_result_files(session=session, job=job, file_ids=[file_id])
    return file_id


def discard_results(*, session: Session, job: Job, artifacts_dir: Path) -> None:
    """Undo ``write_results`` for a job that did not succeed after all (cancelled, or taken by
    another worker, as it finished): its row, its record on the job and its file; committed."""
    file_id = results_file_id(job.id)
    row = session.scalar(select(File).where(File.id == file_id))
    if row is None:
        return
    store, path = open_store(get_settings(), artifacts_dir), row.path
    store.local(path)  # (a tampered row's path is refused before anything is deleted)
    session.delete(row)
    crud.set_result_files(session=session, job=job, file_ids=[])
    session.commit()
    store.delete(path)

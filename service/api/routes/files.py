"""Files: JSONL prompt datasets, streamed to the artifacts store (``service.infra.artifacts``: the directory,
or an object store), validated line by line."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import quote

from fastapi import APIRouter, Form, Header, UploadFile
from fastapi.responses import FileResponse, Response, StreamingResponse
from sqlalchemy.exc import IntegrityError

from service.api.deps import FilePagingDep, ProjectDep, SessionDep, SettingsDep
from service.api.errors import APIError
from service.api.responses import JSON, page, replayed
from service.api.routing import StrictJSONRoute
from service.core import crud
from service.core.db import ends_session, write_lock
from service.core.errors import bad_request, not_found
from service.core.settings import Settings
from service.core.tables import Evaluation, File, new_id
from service.evals import runs as evaluations
from service.files.datasets import PURPOSES, UploadSummary, copy_jsonl, store_jsonl
from service.files.upload_sweep import confined, staged_path
from service.infra.artifacts import S3Store, open_store
from service.jobs import idempotency, lifecycle
from service.tenancy import quotas

router = APIRouter(prefix="/v1/files", route_class=StrictJSONRoute, tags=["files"])


def file_object(f: File) -> dict[str, Any]:
    return {
        "id": f.id,
        "object": "file",
        "bytes": f.bytes,
        "created_at": f.created_at,
        "filename": f.filename,
        "purpose": f.purpose,
        "status": f.status,
        "line_count": f.line_count,
        # Ours: how many lines are prompts, chat examples, preference pairs (what the file can train or
        # evaluate); null for a file stored before formats were recorded (prompts only) and a result file.
        "line_formats": (f.keys_summary or {}).get("formats"),
    }  # no status_details or expires_at: OpenAI's are optional, and a file here never expires


@router.post("", summary="Upload a JSONL prompt dataset")
@ends_session
def create_file(
    session: SessionDep,
    project: ProjectDep,
    settings: SettingsDep,
    file: UploadFile,
    purpose: Annotated[str, Form(description="fine-tune, or evals (an eval's items)")],
    idempotency_key: Annotated[str | None, Header(alias=idempotency.HEADER)] = None,
) -> JSON:
    key = idempotency.check_key(idempotency_key)
    if purpose not in PURPOSES:
        raise bad_request(f"purpose must be one of {', '.join(PURPOSES)}; got '{purpose}'.", "purpose")
    # No path separators; no NUL either (PostgreSQL refuses NUL in text: a 500 there).
    filename = (file.filename or "upload.jsonl").replace("/", "_").replace("\\", "_").replace("\x00", "_")[:255]
    quotas.check_storage(session, project.seq, 1, lock=False)  # a project at its quota: refused before staging
    session.rollback()
    file_id = new_id("file")
    rel = f"files/{project.id}/{file_id}.jsonl"
    store = open_store(settings)
    staged: _StagedLocal | _StagedRemote = (
        _stage_remote(file, settings, store, rel, purpose)
        if isinstance(store, S3Store)
        else _stage_local(file, settings, rel, purpose)
    )
    summary = staged.summary
    row = File(
        id=file_id,
        project_seq=project.seq,
        filename=filename,
        purpose=purpose,
        bytes=summary.bytes,
        path=rel,
        line_count=summary.lines,
        keys_summary=summary.as_dict(),
    )
    digest = ""
    committing = False
    try:
        if key is not None:
            digest = idempotency.request_hash([filename, purpose, staged.sha256()])
            stored = idempotency.replay(session, project_seq=project.seq, route="files", key=key, digest=digest)
            if stored is not None:
                staged.discard()  # the first upload's file is the one
                return replayed(stored)
        with write_lock(session):
            quotas.check_storage(session, project.seq, summary.bytes)
            session.add(row)
            if key is not None:  # the answer, in the same transaction as the row
                session.flush()  # its created_at
                idempotency.remember(
                    session, project_seq=project.seq, route="files", key=key, digest=digest, response=file_object(row)
                )
            committing = True  # from here the row may exist even if commit() raises
            session.commit()
    except IntegrityError:
        staged.discard()
        return replayed(
            idempotency.replay_after_conflict(session, project_seq=project.seq, route="files", key=key, digest=digest)
        )
    except BaseException:
        if not committing:
            staged.discard()  # no file stored without its row
        # else the sweep decides, by whether the row exists: renamed into place, or deleted
        raise
    staged.publish()
    return JSON(file_object(row))


class _StagedLocal:
    """An upload validated into a staging name in the artifacts directory; its final name only once
    the row is committed, so that a process killed at any point leaves nothing a sweep cannot clean
    up (storage.sweep_uploads)."""

    def __init__(self, summary: UploadSummary, staged: Path, dest: Path) -> None:
        self.summary, self.staged, self.dest = summary, staged, dest

    def sha256(self) -> str:
        digest = hashlib.sha256()
        with open(self.staged, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
        return digest.hexdigest()

    def discard(self) -> None:
        self.staged.unlink(missing_ok=True)

    def publish(self) -> None:
        try:
            self.staged.replace(self.dest)
        except FileNotFoundError:  # a sweep made the rename first
            if not self.dest.exists():
                raise


def _stage_local(file: UploadFile, settings: Settings, rel: str, purpose: str) -> _StagedLocal:
    dest = confined(settings.artifacts_dir, rel)
    staged = staged_path(dest, Path(rel).stem)  # (the stem is the file's id)
    summary = store_jsonl(
        file.file,
        dest=staged,
        max_bytes=settings.max_upload_bytes,
        max_line_bytes=settings.max_line_bytes,
        purpose=purpose,
    )
    return _StagedLocal(summary, staged, dest)


class _StagedRemote:
    """An upload streamed into the object store as a multipart upload, validated as it goes: the
    object is whole before the row is committed; an upload cut off is aborted here, or by the sweep
    (``S3Store.sweep``) when the process was killed, and an object whose row never came is deleted by
    the sweep too."""

    def __init__(self, summary: UploadSummary, store: S3Store, rel: str, digest: str) -> None:
        self.summary, self.store, self.rel, self.digest = summary, store, rel, digest

    def sha256(self) -> str:
        return self.digest

    def discard(self) -> None:
        self.store.delete(self.rel)

    def publish(self) -> None:
        """Nothing left to do: the object was complete before its row."""


def _stage_remote(file: UploadFile, settings: Settings, store: S3Store, rel: str, purpose: str) -> _StagedRemote:
    upload = store.upload(rel)
    try:
        summary = copy_jsonl(
            file.file,
            upload,
            max_bytes=settings.max_upload_bytes,
            max_line_bytes=settings.max_line_bytes,
            purpose=purpose,
        )
        upload.complete()
    except BaseException:
        upload.abort()
        raise
    return _StagedRemote(summary, store, rel, upload.sha256())


@router.get("", summary="List files")
@ends_session
def list_files(session: SessionDep, project: ProjectDep, paging: FilePagingDep, purpose: str | None = None) -> JSON:
    scope = [File.project_seq == project.seq] + ([File.purpose == purpose] if purpose else [])
    rows, has_more = paging.apply(session, File, scope)
    return page([file_object(f) for f in rows], has_more)


def _get(session: SessionDep, project: ProjectDep, file_id: str) -> File:
    f = crud.get_file(session=session, project=project, file_id=file_id)
    if f is None:
        raise not_found("file", file_id)
    return f


@router.get("/{file_id}", summary="Retrieve a file")
@ends_session
def read_file(session: SessionDep, project: ProjectDep, file_id: str) -> JSON:
    return JSON(file_object(_get(session, project, file_id)))


@router.get("/{file_id}/content", summary="Download a file's content", response_class=FileResponse)
@ends_session
def read_file_content(session: SessionDep, project: ProjectDep, settings: SettingsDep, file_id: str) -> Response:
    f = _get(session, project, file_id)
    media_type = "text/csv" if f.path.endswith(".csv") else "application/jsonl"
    store = open_store(settings)
    if isinstance(store, S3Store):
        return _stream_object(store, f, media_type)
    path = confined(settings.artifacts_dir, f.path)
    if not path.is_file():
        raise _gone(file_id)
    return FileResponse(path, media_type=media_type, filename=f.filename)


def _gone(file_id: str) -> APIError:
    return APIError(410, f"The content of file '{file_id}' is gone from storage.", code="file_gone")


def _stream_object(store: S3Store, f: File, media_type: str) -> Response:
    """The stored object, read from the store as it is sent (nothing cached on the API's host)."""
    size = store.size(f.path)
    if size is None:
        raise _gone(f.id)
    quoted = quote(f.filename)
    disposition = (
        f"attachment; filename*=utf-8''{quoted}" if quoted != f.filename else f'attachment; filename="{f.filename}"'
    )
    headers = {"Content-Length": str(size), "Content-Disposition": disposition}
    return StreamingResponse(store.read(f.path), media_type=media_type, headers=headers)


@router.delete("/{file_id}", summary="Delete a file")
@ends_session
def delete_file(session: SessionDep, project: ProjectDep, settings: SettingsDep, file_id: str) -> JSON:
    f = _get(session, project, file_id)
    store, rel = open_store(settings), f.path
    store.local(rel)  # (a tampered row's path is refused before anything is deleted)
    with write_lock(session):  # against a job being created with it (crud.lock_files)
        if not crud.lock_files(session=session, project_seq=project.seq, file_ids=[f.id], for_delete=True):
            raise not_found("file", file_id)
        if lifecycle.file_in_use(session=session, file_id=f.id):
            session.rollback()
            raise APIError(
                409,
                f"File '{file_id}' is used by a job that has not finished; cancel the job first.",
                param="file_id",
                code="file_in_use",
            )
        session.delete(f)
        evaluations.cancel(
            session,
            Evaluation.file_id == f.id,
            Evaluation.project_seq == project.seq,
            code="file_deleted",
            message=f"The file {f.id} it read was deleted.",
        )
        session.commit()
    store.delete(rel)  # after the commit: a row never points at a missing file
    if isinstance(store, S3Store):
        store.local(rel).unlink(missing_ok=True)  # this host's cached copy
    return JSON({"id": file_id, "object": "file", "deleted": True})

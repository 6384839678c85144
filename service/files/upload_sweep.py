"""Artifacts on disk: the sweep of what interrupted uploads leave (and, with an object store, of
what they leave there: ``service.infra.artifacts``).

Every path that reaches the database is relative to the artifacts root; every path read back is
resolved and checked to lie inside that root, so a tampered row cannot point outside it.
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import Any

from service.core.identity import process_gone, writer_tag
from service.infra.artifacts import confined as confined  # (its home now, beside the store's keys)

# Leftovers of interrupted uploads ----------------------------------------------------------------
# An upload streams into ``.upload-<host>-<pid>-…``, is renamed to ``.staged-<file id>-<host>-<pid>``
# when every line is valid, and gets its final name ``<file id>.jsonl`` only after its row is
# committed. A process killed on the way leaves a name that says whose it was: the sweep deletes it,
# or, when the row was committed, finishes the rename. Nothing is ever left without a row.
ORPHAN_AGE_SECONDS = 3600.0  # a file of another host: its writer is surely done after an hour


def staged_path(dest: Path, file_id: str) -> Path:
    return dest.with_name(f".staged-{file_id}-{writer_tag()}")


def _abandoned(path: Path, host: str, pid: str) -> bool:
    if pid.isdigit() and process_gone(host, int(pid)):
        return True
    try:
        return time.time() - path.stat().st_mtime > ORPHAN_AGE_SECONDS
    except FileNotFoundError:
        return False


def _sweep_store(session: Any, counts: dict[str, int]) -> None:
    """The object store's part of the sweep, when there is one (``service.infra.artifacts``)."""
    from service.core.settings import get_settings  # (imported by service.infra.artifacts already)
    from service.infra.artifacts import sweep_store

    for name, n in sweep_store(session, get_settings(), older_than=ORPHAN_AGE_SECONDS).items():
        counts[name] = counts.get(name, 0) + n


def sweep_uploads(session: Any, artifacts_dir: Path) -> dict[str, int]:
    """Remove what killed uploads left under ``files/``, or finish their last rename (see above);
    with an object store, sweep it too (``service.infra.artifacts.sweep_store``, every few minutes)."""
    from sqlalchemy import select  # (imported by the caller's session already)

    from service.core.tables import File

    counts = {"removed": 0, "finished": 0}
    cutoff = time.time() - ORPHAN_AGE_SECONDS
    _sweep_store(session, counts)
    # Checkpoint downloads of earlier versions were copied to tmp*.tar in the artifacts root, and a
    # refused byte range left the copy behind; downloads are made while they are sent now.
    for path in artifacts_dir.glob("tmp*.tar"):
        with contextlib.suppress(FileNotFoundError):
            if path.stat().st_mtime < cutoff:
                path.unlink()
                counts["removed"] += 1
    root = artifacts_dir / "files"
    if not root.is_dir():
        return counts
    for path in root.glob("*/.upload-*"):
        host, pid = (path.name[len(".upload-") :].split("-") + ["", ""])[:2]
        if _abandoned(path, host, pid):
            path.unlink(missing_ok=True)
            counts["removed"] += 1
    for path in root.glob("*/.staged-*"):
        named, host, pid = (path.name.rsplit("-", 2) + ["", ""])[:3]
        file_id = named[len(".staged-") :]
        final = path.with_name(f"{file_id}.jsonl")
        row = session.scalar(select(File.path).where(File.id == file_id))
        if row is not None and row.endswith(final.name):
            # Committed: the last rename is due, whoever was to make it (no need to know if it lives).
            if final.exists():
                path.unlink(missing_ok=True)
            else:
                path.replace(final)
                counts["finished"] += 1
        elif _abandoned(path, host, pid):
            path.unlink(missing_ok=True)
            counts["removed"] += 1
    # A final name whose row is gone (deleted in the instant before its writer's rename): old ones
    # only. Stat first (a file younger than the age is left anyway), then one query a few hundred
    # files: every round of every worker's reconciler runs this, over every file ever uploaded.
    old: dict[str, Path] = {}
    for path in root.glob("*/file-*.jsonl"):
        try:
            if path.stat().st_mtime < cutoff:
                old[path.name[: -len(".jsonl")]] = path
        except FileNotFoundError:
            continue
    ids = list(old)
    for start in range(0, len(ids), 500):
        chunk = ids[start : start + 500]
        known = set(session.scalars(select(File.id).where(File.id.in_(chunk))))
        for file_id in chunk:
            if file_id not in known:
                old[file_id].unlink(missing_ok=True)
                counts["removed"] += 1
    if any(counts.values()):
        logging.getLogger("rloo.storage").warning("swept interrupted uploads: %s", counts)
    return counts

"""Where merged exports live (``<artifacts>/exports/<job id>/step-<N>``, with an object store that key
and this host's cache of it), and their removal with what they were made from: ``remove_export``
when ``keep_checkpoints`` prunes their checkpoint (the training worker), ``remove_job_exports`` when
the job's model is deleted (the API). A 7B base makes each ~28 GB: none may outlive its source. A
removed export is made again if a download asks for it while its checkpoints remain
(``service.registry.exports``)."""

from __future__ import annotations

import shutil
from pathlib import Path

from service.infra.artifacts import S3Store, Store


def export_key(job_dir: str, step: int) -> str:
    """Where the merged model of a job's checkpoint of ``step`` lives, relative to the artifacts root
    (``job_dir``: the name of the job's checkpoints directory, its id)."""
    return f"exports/{job_dir}/step-{step}"


def remove_export(store: Store, artifacts_dir: Path, key: str) -> None:
    """The export ``key`` gone: this host's directory (or cache), and the store's copy."""
    shutil.rmtree(artifacts_dir / key, ignore_errors=True)
    if isinstance(store, S3Store):
        shutil.rmtree(store.local(key), ignore_errors=True)
        store.remove_checkpoint(key)


def remove_job_exports(store: Store, artifacts_dir: Path, job_dir: str) -> None:
    """Every export of a job (its model was deleted)."""
    shutil.rmtree(artifacts_dir / "exports" / job_dir, ignore_errors=True)
    if isinstance(store, S3Store):
        shutil.rmtree(store.local(f"exports/{job_dir}"), ignore_errors=True)
        steps = {key.split("/")[2] for key, _, _ in store.listing(f"exports/{job_dir}") if key.count("/") >= 3}
        for step in sorted(steps):
            store.remove_checkpoint(f"exports/{job_dir}/{step}")

"""Where uploaded files and checkpoints are kept: the artifacts directory (the embedded default), or
an S3-compatible object store (``RLOO_ARTIFACTS_URL=s3://bucket/prefix``: AWS S3, MinIO, Ceph, R2;
``RLOO_S3_ENDPOINT_URL`` for a store that is not AWS's, boto3's own ``AWS_*`` settings for the
credentials), behind one small interface, ``open_store(settings)``.

Keys are always relative (``files/<project>/<file id>.jsonl``, ``checkpoints/<job>/step-N``), as the
rows store them, and confined: a key that is absolute or climbs out (``..``) is refused, like
``service.files.upload_sweep.confined``.

With a store, the artifacts directory is this host's cache of it, in the same layout:

* a file is downloaded once, on first use (its key holds its id and its content never changes);
* a checkpoint is a prefix of objects that counts only once its marker is there: ``<key>/.complete``,
  a JSON manifest of its files (size, mtime), written after every file is uploaded and deleted before
  a step written again is uploaded anew. Listings, downloads and fetches read the manifest, so a
  checkpoint whose upload was cut off is invisible; ``sweep`` deletes what such uploads leave.

boto3 is imported only when a store is configured: the API starts without it otherwise.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from service.core.identity import writer_tag
from service.core.settings import Settings

MARKER = ".complete"
"""The object that makes a checkpoint's prefix a checkpoint: written last, read first."""
PART_BYTES = 8 << 20
"""A multipart upload's part (S3's minimum is 5 MiB but for the last one)."""
CHUNK = 1 << 20

log = logging.getLogger("rloo.artifacts")


def confined(root: Path, relative: str | Path) -> Path:
    """``root / relative`` resolved, or ValueError if it escapes ``root`` (``..``, absolute, symlinks)."""
    root = root.resolve()
    rel = Path(relative)
    if rel.is_absolute():
        raise ValueError(f"'{relative}' is an absolute path; name it relative to {root}")
    path = (root / rel).resolve()
    if path != root and root not in path.parents:
        raise ValueError(f"'{relative}' points outside {root}")
    return path


def tree_bytes(directory: Path) -> int:
    """The bytes of the files under ``directory`` (a saved checkpoint or export: what a project stores)."""
    return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())


def relative_key(key: str | Path) -> str:
    """``key`` normalised (``a/b``), or ValueError if it is absolute, empty or climbs out (``..``)."""
    text = str(key).replace("\\", "/")
    path = PurePosixPath(text)
    if "\x00" in text or path.is_absolute() or not path.parts or ".." in path.parts:
        raise ValueError(f"'{key}' is no key relative to the artifacts root")
    return path.as_posix()


@dataclass(frozen=True)
class Member:
    """One file of a stored checkpoint, as a download reads it (``service.api.tarstream``)."""

    size: int
    mtime: float
    store: Any
    key: str

    def read(self, start: int, stop: int) -> Iterator[bytes]:
        return self.store.read(self.key, start, stop)  # type: ignore[no-any-return]


class LocalStore:
    """The artifacts directory itself: what is written there is stored; nothing to fetch or publish."""

    remote = False

    def __init__(self, root: Path) -> None:
        self.root = root

    def local(self, key: str | Path) -> Path:
        return confined(self.root, relative_key(key))

    def fetch_file(self, key: str) -> Path:
        return self.local(key)

    def fetch_checkpoint(self, key: str) -> Path:
        return self.local(key)

    def publish_checkpoint(self, key: str, directory: Path) -> None:
        """Nothing to do: ``worker.engine.checkpoints.save_checkpoint`` renamed it into place whole."""

    def remove_checkpoint(self, key: str) -> None:
        """Nothing to do: ``worker.engine.checkpoints.prune_checkpoints`` deleted the directory."""

    def put_bytes(self, key: str, data: bytes) -> None:
        dest = self.local(key)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
        tmp.write_bytes(data)
        tmp.replace(dest)

    def delete(self, key: str) -> None:
        self.local(key).unlink(missing_ok=True)


class S3Store:
    """An S3 bucket's prefix, through boto3; ``root`` is this host's cache of it."""

    remote = True

    def __init__(self, url: str, *, endpoint_url: str | None, root: Path) -> None:
        import boto3
        from botocore.config import Config

        bucket, _, prefix = url[len("s3://") :].partition("/")
        self.url, self.bucket, self.prefix, self.root = url, bucket, prefix.strip("/"), root
        style = {"addressing_style": "path"} if endpoint_url else {}  # MinIO and the like: no bucket DNS names
        config = Config(retries={"max_attempts": 5, "mode": "standard"}, s3=style)
        self.client = boto3.session.Session().client("s3", endpoint_url=endpoint_url, config=config)

    # Keys ----------------------------------------------------------------------------------------
    def object_key(self, key: str | Path) -> str:
        rel = relative_key(key)
        return f"{self.prefix}/{rel}" if self.prefix else rel

    def _relative(self, object_key: str) -> str:
        return object_key[len(self.prefix) + 1 :] if self.prefix else object_key

    def local(self, key: str | Path) -> Path:
        return confined(self.root, relative_key(key))

    # Objects -------------------------------------------------------------------------------------
    def size(self, key: str) -> int | None:
        """The object's bytes, or None when there is none."""
        try:
            head = self.client.head_object(Bucket=self.bucket, Key=self.object_key(key))
        except self.client.exceptions.ClientError as exc:
            if _missing(exc):
                return None
            raise
        return int(head["ContentLength"])

    def read(self, key: str, start: int = 0, stop: int | None = None) -> Iterator[bytes]:
        """The object's bytes ``[start, stop)``, in chunks of at most 1 MiB, fetched as they are read."""
        if stop is not None and stop <= start:
            return
        span = f"bytes={start}-{'' if stop is None else stop - 1}"
        body = self.client.get_object(Bucket=self.bucket, Key=self.object_key(key), Range=span)["Body"]
        try:
            yield from body.iter_chunks(CHUNK)
        finally:
            body.close()

    def put_bytes(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self.object_key(key), Body=data)

    def put_file(self, key: str, path: Path) -> None:
        """``path`` uploaded to ``key`` (boto3's transfer: multipart past 8 MiB, parts in parallel)."""
        self.client.upload_file(str(path), self.bucket, self.object_key(key))

    def delete(self, key: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self.object_key(key))

    def delete_many(self, keys: list[str]) -> None:
        for start in range(0, len(keys), 1000):  # DeleteObjects takes 1000 keys at most
            chunk = [{"Key": self.object_key(k)} for k in keys[start : start + 1000]]
            if chunk:
                self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": chunk, "Quiet": True})

    def listing(self, prefix: str) -> Iterator[tuple[str, int, float]]:
        """``(key, size, modified)`` of every object under ``prefix/``."""
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=self.object_key(prefix) + "/"
        )
        for page in pages:
            for obj in page.get("Contents", []):
                yield self._relative(obj["Key"]), int(obj["Size"]), obj["LastModified"].timestamp()

    def upload(self, key: str) -> MultipartUpload:
        """A multipart upload to ``key``: invisible until ``complete()``."""
        return MultipartUpload(self, key)

    # Files ---------------------------------------------------------------------------------------
    def fetch_file(self, key: str) -> Path:
        """The stored file's path in this host's cache, downloaded on first use (written aside, then
        renamed); FileNotFoundError when the store has no such object."""
        path = self.local(key)
        if path.is_file():
            return path  # a file's content never changes: its key holds its id
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".fetch-{path.name}-{writer_tag()}")
        try:
            self._download(key, tmp)
            tmp.replace(path)
        finally:
            tmp.unlink(missing_ok=True)
        return path

    def _download(self, key: str, dest: Path) -> None:
        try:
            self.client.download_file(self.bucket, self.object_key(key), str(dest))
        except self.client.exceptions.ClientError as exc:
            if _missing(exc):
                raise FileNotFoundError(f"{self.url}: no object {key}") from None
            raise

    # Checkpoints ---------------------------------------------------------------------------------
    def manifest(self, key: str) -> dict[str, dict[str, float]] | None:
        """A complete checkpoint's files (name -> size, mtime), or None when it is not complete."""
        try:
            body = self.client.get_object(Bucket=self.bucket, Key=self.object_key(f"{key}/{MARKER}"))["Body"]
        except self.client.exceptions.ClientError as exc:
            if _missing(exc):
                return None
            raise
        files: dict[str, dict[str, float]] = json.loads(body.read())["files"]
        for name in files:
            relative_key(name)  # a tampered manifest names nothing outside its checkpoint
        return files

    def members(self, key: str) -> dict[str, Member] | None:
        """A complete checkpoint's files as a download reads them, or None when it is not complete."""
        files = self.manifest(key)
        if files is None:
            return None
        return {n: Member(int(f["size"]), float(f["mtime"]), self, f"{key}/{n}") for n, f in sorted(files.items())}

    def complete_checkpoints(self, prefix: str) -> list[str]:
        """The keys of the complete checkpoints under ``prefix`` (those with a marker)."""
        ends = "/" + MARKER
        return sorted(key[: -len(ends)] for key, _, _ in self.listing(prefix) if key.endswith(ends))

    def publish_checkpoint(self, key: str, directory: Path) -> None:
        """Upload every file of ``directory`` under ``key``, then the marker: the checkpoint is
        visible only once whole. A step written again is hidden first (its marker deleted), and its
        objects that the new one lacks are deleted after."""
        self.delete(f"{key}/{MARKER}")
        files: dict[str, dict[str, float]] = {}
        for path in sorted(directory.rglob("*")):
            if path.is_file() and not path.is_symlink():
                name = path.relative_to(directory).as_posix()
                stat = path.stat()
                self.put_file(f"{key}/{name}", path)
                files[name] = {"size": stat.st_size, "mtime": stat.st_mtime}
        self.put_bytes(f"{key}/{MARKER}", json.dumps({"files": files}, sort_keys=True).encode())
        marker = f"{key}/{MARKER}"
        stale = [k for k, _, _ in self.listing(key) if k != marker and k[len(key) + 1 :] not in files]
        self.delete_many(stale)

    def remove_checkpoint(self, key: str) -> None:
        """The marker first (invisible at once), then every object under ``key``."""
        self.delete(f"{key}/{MARKER}")
        self.delete_many([k for k, _, _ in self.listing(key)])

    def fetch_checkpoint(self, key: str) -> Path:
        """The complete checkpoint ``key`` as a directory in this host's cache: kept when it holds
        every file of the manifest at its size, else downloaded aside and renamed into place.
        FileNotFoundError when the store holds no complete checkpoint there."""
        files = self.manifest(key)
        if files is None:
            raise FileNotFoundError(f"{self.url}: no complete checkpoint {key}")
        target = self.local(key)
        if _holds(target, files):
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".fetch-{target.name}-{writer_tag()}")
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            for name in files:
                dest = confined(tmp, name)
                dest.parent.mkdir(parents=True, exist_ok=True)
                self._download(f"{key}/{name}", dest)
            if target.exists():  # an older or partial copy
                shutil.rmtree(target)
            tmp.rename(target)
        except OSError:
            if not _holds(target, files):  # unless another process of this host fetched it meanwhile
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        log.info("fetched checkpoint %s (%d files) from %s", key, len(files), self.url)
        return target

    # The sweep -----------------------------------------------------------------------------------
    def sweep(self, session: Any, *, older_than: float) -> dict[str, int]:
        """What interrupted writes left, once older than ``older_than`` seconds: multipart uploads
        never completed (aborted), files whose row never came (an API process killed between the
        upload and the commit) and checkpoint objects without a marker (a worker killed while it
        uploaded them)."""
        from sqlalchemy import select

        from service.core.tables import File

        cutoff = time.time() - older_than
        counts = {"aborted": 0, "removed": 0}
        pages = self.client.get_paginator("list_multipart_uploads").paginate(
            Bucket=self.bucket, Prefix=self.object_key("files") + "/"
        )
        for page in pages:
            for upload in page.get("Uploads", []):
                if upload["Initiated"].timestamp() < cutoff:
                    self.client.abort_multipart_upload(
                        Bucket=self.bucket, Key=upload["Key"], UploadId=upload["UploadId"]
                    )
                    counts["aborted"] += 1
        old = {
            PurePosixPath(key).stem: key
            for key, _, modified in self.listing("files")
            if modified < cutoff and PurePosixPath(key).name.startswith("file-")
        }
        ids = list(old)
        for start in range(0, len(ids), 500):
            chunk = ids[start : start + 500]
            known = set(session.scalars(select(File.id).where(File.id.in_(chunk))))
            orphans = [old[i] for i in chunk if i not in known]
            self.delete_many(orphans)
            counts["removed"] += len(orphans)
        steps: dict[str, list[tuple[str, float]]] = {}
        for key, _, modified in self.listing("checkpoints"):
            parts = key.split("/")
            if len(parts) >= 4:  # checkpoints/<job>/step-N/<file>
                steps.setdefault("/".join(parts[:3]), []).append((key, modified))
        for objects in steps.values():
            if not any(k.endswith("/" + MARKER) for k, _ in objects) and max(m for _, m in objects) < cutoff:
                self.delete_many([k for k, _ in objects])
                counts["removed"] += len(objects)
        if any(counts.values()):
            log.warning("swept interrupted writes from %s: %s", self.url, counts)
        return counts


class MultipartUpload:
    """Bytes written a block at a time, sent as parts of ``PART_BYTES``: at most one part is held in
    memory. Their SHA-256 is kept as they pass (``sha256``)."""

    def __init__(self, store: S3Store, key: str) -> None:
        self.store, self.key = store, store.object_key(key)
        self.upload_id = store.client.create_multipart_upload(Bucket=store.bucket, Key=self.key)["UploadId"]
        self.buffer = bytearray()
        self.parts: list[dict[str, Any]] = []
        self.digest = hashlib.sha256()

    def write(self, data: bytes) -> int:
        self.buffer += data
        self.digest.update(data)
        while len(self.buffer) >= PART_BYTES:
            self._send(bytes(self.buffer[:PART_BYTES]))
            del self.buffer[:PART_BYTES]
        return len(data)

    def _send(self, data: bytes) -> None:
        number = len(self.parts) + 1
        answer = self.store.client.upload_part(
            Bucket=self.store.bucket, Key=self.key, UploadId=self.upload_id, PartNumber=number, Body=data
        )
        self.parts.append({"PartNumber": number, "ETag": answer["ETag"]})

    def sha256(self) -> str:
        return self.digest.hexdigest()

    def complete(self) -> None:
        """The object, whole: visible from now on."""
        if self.buffer or not self.parts:
            self._send(bytes(self.buffer))
            self.buffer.clear()
        self.store.client.complete_multipart_upload(
            Bucket=self.store.bucket, Key=self.key, UploadId=self.upload_id, MultipartUpload={"Parts": self.parts}
        )

    def abort(self) -> None:
        """The parts sent so far, deleted (the sweep aborts what a killed process could not)."""
        try:
            self.store.client.abort_multipart_upload(Bucket=self.store.bucket, Key=self.key, UploadId=self.upload_id)
        except Exception as exc:
            log.warning("could not abort the upload of %s: %s", self.key, exc)


def _missing(exc: Any) -> bool:
    return str(exc.response.get("Error", {}).get("Code")) in ("404", "NoSuchKey", "NotFound")


def _holds(directory: Path, files: dict[str, dict[str, float]]) -> bool:
    """``directory`` has every file of a manifest, at its size."""
    try:
        return all((directory / name).stat().st_size == int(f["size"]) for name, f in files.items())
    except OSError:
        return False


Store = LocalStore | S3Store
_open: dict[tuple[int, str, str | None, Path], S3Store] = {}


def open_store(settings: Settings, root: Path | None = None) -> Store:
    """The artifacts store ``settings`` name, with ``root`` (the settings' artifacts directory by
    default) as its directory or its cache. One S3 client a process (boto3's are thread-safe, not
    fork-safe)."""
    root = (root or settings.artifacts_dir).resolve()
    if not settings.artifacts_url:
        return LocalStore(root)
    key = (os.getpid(), settings.artifacts_url, settings.s3_endpoint_url, root)
    store = _open.get(key)
    if store is None:
        store = _open[key] = S3Store(settings.artifacts_url, endpoint_url=settings.s3_endpoint_url, root=root)
    return store


SWEEP_STORE_SECONDS = 300.0
"""How often a process sweeps the store (``storage.sweep_uploads`` runs every reconcile round)."""
_swept = {"at": 0.0}


def sweep_store(session: Any, settings: Settings, *, older_than: float) -> dict[str, int]:
    """The store's sweep (``S3Store.sweep``), at most every ``SWEEP_STORE_SECONDS`` in a process;
    nothing to do for the directory (``storage.sweep_uploads`` sweeps it)."""
    store = open_store(settings)
    if not isinstance(store, S3Store) or (_swept["at"] and time.monotonic() - _swept["at"] < SWEEP_STORE_SECONDS):
        return {}
    _swept["at"] = time.monotonic()
    try:
        return store.sweep(session, older_than=older_than)
    except Exception as exc:  # the store is away: the next round tries again
        log.warning("sweeping %s failed: %s", store.url, exc)
        return {}

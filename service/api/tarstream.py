"""A directory (or a checkpoint in the object store) as a tar archive made while it is sent: no copy
on disk, and byte ranges served.

The archive's layout (a 512-byte header, the file's bytes and their padding, per file; two zero
blocks and the padding to tar's 10240-byte record at the end) is computed from the files' sizes
before the first byte goes out, so its length is known (``Content-Length``) and any byte range of
it maps to parts of headers and files (``Range``, for a download resumed after a broken
connection). Nothing is written anywhere: nothing can be left behind, whatever the client does.
"""

from __future__ import annotations

import hashlib
import re
import tarfile
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

from starlette.responses import Response, StreamingResponse

BLOCK = tarfile.BLOCKSIZE
RECORD = tarfile.RECORDSIZE
CHUNK = 1 << 20


class Stored(Protocol):
    """A file kept elsewhere (an object store's, ``service.infra.artifacts.Member``): its size, its
    modification time and a reader of its byte ranges."""

    @property
    def size(self) -> int: ...

    @property
    def mtime(self) -> float: ...

    def read(self, start: int, stop: int) -> Iterator[bytes]: ...


@dataclass(frozen=True)
class _Part:
    offset: int
    length: int
    data: bytes | None = None  # a header or padding
    path: Path | None = None  # or a file's bytes
    stored: Stored | None = None  # or a stored file's


class TarLayout:
    def __init__(self, files: Sequence[tuple[str, Path | Stored]]) -> None:
        """``files``: (name in the archive, path or stored file), in archive order."""
        parts: list[_Part] = []
        offset = 0
        digest = hashlib.sha256()
        for name, source in files:
            if isinstance(source, Path):
                stat = source.stat()
                size, mtime, mtime_ns = stat.st_size, stat.st_mtime, stat.st_mtime_ns
                body = _Part(offset, size, path=source)
            else:
                size, mtime, mtime_ns = source.size, source.mtime, int(source.mtime * 1e9)
                body = _Part(offset, size, stored=source)
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = size, int(mtime), 0o644
            header = info.tobuf(format=tarfile.PAX_FORMAT, encoding="utf-8", errors="strict")
            padding = -size % BLOCK
            for part in (
                _Part(offset, len(header), data=header),
                replace(body, offset=offset + len(header)),
                _Part(offset + len(header) + size, padding, data=bytes(padding)),
            ):
                if part.length:
                    parts.append(part)
            offset += len(header) + size + padding
            digest.update(f"{name}\0{size}\0{mtime_ns}\0".encode())
        end = 2 * BLOCK
        end += -(offset + end) % RECORD
        parts.append(_Part(offset, end, data=bytes(end)))
        self.parts, self.size = parts, offset + end
        self.etag = f'"{digest.hexdigest()[:32]}"'

    def read(self, start: int, stop: int) -> Iterator[bytes]:
        """The archive's bytes ``[start, stop)``, in chunks of at most 1 MiB."""
        for part in self.parts:
            lo, hi = max(start, part.offset), min(stop, part.offset + part.length)
            if lo >= hi:
                continue
            if part.data is not None:
                yield part.data[lo - part.offset : hi - part.offset]
                continue
            if part.stored is not None:
                yield from _exactly(part.stored.read(lo - part.offset, hi - part.offset), hi - lo, name="a stored file")
                continue
            assert part.path is not None
            with open(part.path, "rb") as f:
                f.seek(lo - part.offset)
                left = hi - lo
                while left:
                    chunk = f.read(min(CHUNK, left))
                    if not chunk:  # the file shrank since the layout: end the response short
                        raise OSError(f"{part.path.name} changed while it was being sent")
                    left -= len(chunk)
                    yield chunk


def _exactly(chunks: Iterator[bytes], length: int, *, name: str) -> Iterator[bytes]:
    """``chunks``, which must add up to ``length`` bytes: a shorter read ends the response short."""
    left = length
    for chunk in chunks:
        left -= len(chunk)
        yield chunk
    if left:
        raise OSError(f"{name} changed while it was being sent")


_RANGE = re.compile(r"bytes=(\d{0,18})-(\d{0,18})", re.IGNORECASE)  # (a longer number is past any file)


def byte_range(header: str | None, size: int) -> tuple[int, int] | None | str:
    """``Range`` against an archive of ``size`` bytes: ``(start, stop)``, None to send it whole
    (no header, one we do not understand, several ranges: RFC 9110 lets a server ignore those),
    or ``"unsatisfiable"``."""
    match = _RANGE.fullmatch((header or "").strip())
    if match is None:
        return None
    first, last = match.groups()
    if not first and not last:
        return None
    if not first:  # the last N bytes
        n = int(last)
        return (max(0, size - n), size) if n else "unsatisfiable"
    start = int(first)
    if start >= size:
        return "unsatisfiable"
    stop = min(size, int(last) + 1) if last else size
    return (start, stop) if stop > start else None


def tar_response(layout: TarLayout, *, filename: str, range_header: str | None, if_range: str | None) -> Response:
    """The archive, or the byte range asked for (206; 416 past its end); ``If-Range`` naming
    another version of it gets it whole."""
    headers = {
        "Accept-Ranges": "bytes",
        "ETag": layout.etag,
        "Content-Disposition": f'attachment; filename="{filename}"',
    }
    wanted = byte_range(range_header, layout.size) if if_range in (None, layout.etag) else None
    if wanted == "unsatisfiable":
        return Response(status_code=416, headers={**headers, "Content-Range": f"bytes */{layout.size}"})
    start, stop = wanted if isinstance(wanted, tuple) else (0, layout.size)
    headers["Content-Length"] = str(stop - start)
    status = 200
    if isinstance(wanted, tuple):
        status = 206
        headers["Content-Range"] = f"bytes {start}-{stop - 1}/{layout.size}"
    return StreamingResponse(
        on_own_threads(layout.read(start, stop)), status_code=status, headers=headers, media_type="application/x-tar"
    )


DOWNLOAD_THREADS = 8
"""Threads reading downloads' chunks at once in an API process: downloads take turns among
themselves, never the threads that answer routes (42 downloads at once held every one of those)."""
_DOWNLOADS: Any = None


async def on_own_threads(chunks: Iterator[bytes]) -> AsyncIterator[bytes]:
    """``chunks`` (which read files or the object store) read on the downloads' own threads."""
    from anyio import CapacityLimiter, to_thread

    global _DOWNLOADS
    if _DOWNLOADS is None:
        _DOWNLOADS = CapacityLimiter(DOWNLOAD_THREADS)
    while True:
        chunk = await to_thread.run_sync(next, chunks, None, limiter=_DOWNLOADS)
        if chunk is None:
            return
        yield chunk

"""Checkpoint downloads: a tar archive made while it is sent (service/api/tarstream.py), byte ranges
served, and nothing written to disk on any path (a refused range once left a full copy behind)."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path
from typing import Any

import pytest

from service.api.tarstream import TarLayout, byte_range
from tests.helpers.api import assert_error, create_job, upload_ok
from tests.helpers.data import job_body

SIZES = {"empty.txt": 0, "one.bin": 1, "block.bin": 512, "over.bin": 513, "config.json": 100, "big.bin": 70_001}


def _files(root: Path) -> list[tuple[str, Path]]:
    root.mkdir(parents=True, exist_ok=True)
    out = []
    for name, size in SIZES.items():
        (root / name).write_bytes(os.urandom(size))
        out.append((f"ckpt/{name}", root / name))
    return out


def _members(archive: bytes) -> dict[str, bytes]:
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers()}  # type: ignore[union-attr]


def test_the_archive_is_a_tar_of_the_files_and_every_range_is_its_slice(tmp_path: Path) -> None:
    files = _files(tmp_path / "ckpt")
    layout = TarLayout(files)
    whole = b"".join(layout.read(0, layout.size))
    assert len(whole) == layout.size and layout.size % tarfile.RECORDSIZE == 0
    assert _members(whole) == {name: path.read_bytes() for name, path in files}
    for start, stop in [(0, 1), (511, 513), (512, 1536), (1000, 60_000), (layout.size - 5, layout.size), (7, 7)]:
        assert b"".join(layout.read(start, stop)) == whole[start:stop], (start, stop)


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        (None, None),
        ("", None),
        ("bytes=abc", None),
        ("items=0-5", None),
        ("bytes=0-1,4-5", None),
        ("bytes=0-99", (0, 100)),
        ("bytes=100-", (100, 1000)),
        ("bytes=-10", (990, 1000)),
        ("bytes=900-5000", (900, 1000)),
        ("bytes=-5000", (0, 1000)),
        ("bytes=999999999-", "unsatisfiable"),
        ("bytes=1000-", "unsatisfiable"),
        ("bytes=-0", "unsatisfiable"),
        ("bytes=50-10", None),
        ("BYTES=0-9", (0, 10)),
        ("bytes=0-" + "9" * 5000, None),
        ("bytes=" + "9" * 5000 + "-", None),
    ],
)
def test_range_headers(header: str | None, expected: Any) -> None:
    assert byte_range(header, 1000) == expected


def test_a_download_with_any_range_leaves_nothing_on_disk(client, auth, env) -> None:
    from service.core import crud
    from service.core.db import session_scope
    from service.core.settings import get_settings

    artifacts = get_settings().artifacts_dir
    job_id = create_job(client, auth, job_body(upload_ok(client, auth)["id"]))["id"]
    directory = artifacts / "checkpoints" / job_id / "step-1"
    files = _files(directory)
    (directory / "training_state.pt").write_bytes(b"optimizer")  # stays server-side
    with session_scope() as session:
        job = crud.get_job_by_id(session=session, job_id=job_id)
        ckpt = crud.add_checkpoint(
            session=session,
            job=job,
            step=1,
            path=str(directory.relative_to(artifacts)),
            name="tiny:ft:step-1",
            metrics={},
        )
        session.commit()
        ckpt_id = ckpt.id
    before = sorted(p for p in artifacts.rglob("*"))
    url = f"/v1/fine_tuning/jobs/{job_id}/checkpoints/{ckpt_id}/content"

    whole = client.get(url, headers=auth)
    assert whole.status_code == 200 and whole.headers["accept-ranges"] == "bytes"
    assert int(whole.headers["content-length"]) == len(whole.content)
    assert _members(whole.content) == {f"{ckpt_id}/{p.name}": p.read_bytes() for _, p in files}
    part = client.get(url, headers={**auth, "Range": "bytes=600-70000"})
    assert part.status_code == 206 and part.content == whole.content[600:70001]
    assert part.headers["content-range"] == f"bytes 600-70000/{len(whole.content)}"
    # A download resumed where it broke off: the rest, and the two halves make the archive.
    rest = client.get(url, headers={**auth, "Range": "bytes=70001-", "If-Range": whole.headers["etag"]})
    assert rest.status_code == 206 and whole.content[:70001] + rest.content == whole.content
    # If-Range naming another version of it: the whole archive.
    assert client.get(url, headers={**auth, "Range": "bytes=0-9", "If-Range": '"other"'}).status_code == 200
    past = client.get(url, headers={**auth, "Range": "bytes=999999999-"})
    assert past.status_code == 416 and past.headers["content-range"] == f"bytes */{len(whole.content)}"
    # A Range it does not understand is ignored, as RFC 9110 allows.
    assert client.get(url, headers={**auth, "Range": "bytes=abc"}).content == whole.content
    assert sorted(p for p in artifacts.rglob("*")) == before  # nothing written, on any of these paths
    assert_error(client.get(url.replace(ckpt_id, "ftckpt-nope"), headers=auth), 404)

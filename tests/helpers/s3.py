"""A real S3-compatible HTTP server for the tests: moto's standalone server (``python -m moto.server``)
as a child process on a free port, and the environment that points the service at a bucket of it."""

from __future__ import annotations

import contextlib
import secrets
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import httpx

from tests.helpers.live import free_port

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@contextlib.contextmanager
def moto_server() -> Iterator[str]:
    """The server's endpoint URL while it runs; stopped afterwards."""
    port = free_port()
    # Its log (a line a request) goes to a file: a pipe nobody reads fills after some hundred
    # requests, and the server then hangs in its next write (a module's tests reached that).
    log = tempfile.TemporaryFile()  # noqa: SIM115 (closed below, after the server)
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=log,
    )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(endpoint, timeout=1)
                break
            except httpx.TransportError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    raise RuntimeError(f"moto's server did not start: {log.read()[-2000:]!r}") from None
                time.sleep(0.2)
        yield endpoint
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        log.close()


def s3_client(endpoint: str) -> Any:
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        region_name=CREDENTIALS["AWS_DEFAULT_REGION"],
    )


def bucket_env(endpoint: str, prefix: str = "tenant-a") -> dict[str, str]:
    """A fresh bucket of the server, and the environment that stores artifacts under its ``prefix``."""
    bucket = f"rloo-{secrets.token_hex(6)}"
    s3_client(endpoint).create_bucket(Bucket=bucket)
    return {**CREDENTIALS, "RLOO_ARTIFACTS_URL": f"s3://{bucket}/{prefix}", "RLOO_S3_ENDPOINT_URL": endpoint}


def keys(endpoint: str, url: str, under: str = "") -> list[str]:
    """Every object key of the store ``url`` names (relative to its prefix), under ``under``."""
    bucket, _, prefix = url[len("s3://") :].partition("/")
    pages = s3_client(endpoint).get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"{prefix}/{under}")
    return sorted(obj["Key"][len(prefix) + 1 :] for page in pages for obj in page.get("Contents", []))


def multipart_uploads(endpoint: str, url: str) -> list[str]:
    bucket = url[len("s3://") :].partition("/")[0]
    answer = s3_client(endpoint).list_multipart_uploads(Bucket=bucket)
    return [u["Key"] for u in answer.get("Uploads", [])]

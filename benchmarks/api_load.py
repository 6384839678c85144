"""The API under load: job status reads, job list reads and job creation at 32 and 128 concurrent
connections, each against a bare endpoint (``/healthz``) of the same server in the same run.

The API runs as ``rloo api`` (one process, as ``rloo up`` starts it) on the embedded defaults (SQLite,
embedded Redis) in a fresh ``RLOO_HOME``, or on ``--database-url``/``--redis-url`` when given; no
worker, so created jobs stay queued. The load comes from ``benchmarks.loadgen`` in its own process
on loopback. The ratio to the bare endpoint is the figure; absolute numbers depend on the machine,
which the client shares. Prints one JSON object (``python -m benchmarks.api_load``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.common import DEMO_DATA, ROOT, build


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def load(
    url: str, *, path: str, connections: int, key: str, seconds: float, method: str = "GET", body: str = ""
) -> dict[str, Any]:
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.loadgen",
        url,
        "--method",
        method,
        "--path",
        path,
        "--connections",
        str(connections),
        "--seconds",
        str(seconds),
        "--header",
        f"Authorization: Bearer {key}",
    ]
    if body:
        cmd += ["--body", body]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser()
    ap.add_argument("--database-url")
    ap.add_argument("--redis-url")
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument(
        "--count-limits",
        action="store_true",
        help="Count every request against a per-key rate limit too high to refuse any (in Redis, as the "
        "default limit is counted): what counting costs.",
    )
    args = ap.parse_args(argv)

    home = Path(tempfile.mkdtemp(prefix="rloo-bench-api-"))
    for name in ("DATABASE_URL", "RLOO_DATABASE_URL", "REDIS_URL", "RLOO_REDIS_URL"):
        os.environ.pop(name, None)
    os.environ["RLOO_HOME"] = str(home)
    # The `rloo api` started below inherits this: throughput with one key is the figure here, and the
    # per-key rate limit (20/s by default) would measure itself instead.
    os.environ["RLOO_RATE_LIMIT"] = "1000000" if args.count_limits else "0"
    os.environ["RLOO_RATE_LIMIT_BURST"] = "1000000000"
    os.environ["RLOO_MAX_QUEUED_JOBS"] = "100000000"  # the creation case makes thousands of waiting jobs
    if args.database_url:
        os.environ["RLOO_DATABASE_URL"] = args.database_url
    if args.redis_url:
        os.environ["RLOO_REDIS_URL"] = args.redis_url
    import httpx

    from service.core.migrate import upgrade
    from service.core.settings import get_settings
    from service.infra import embedded_redis
    from worker.cli.stack import ensure_local_key, wait_until_ready

    settings = get_settings()
    build(settings.models_dir, "tiny")
    children: list[subprocess.Popen[bytes]] = []
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    try:
        upgrade()
        key = ensure_local_key()
        if settings.embedded_redis:
            proc = embedded_redis.start(settings, daemonize=False)
            if proc is not None:
                children.append(proc)
        children.append(
            subprocess.Popen(
                [sys.executable, "-m", "worker.cli", "api", "--port", str(port)],
                cwd=ROOT,
                stdout=open(home / "api.log", "wb"),  # noqa: SIM115
                stderr=subprocess.STDOUT,
            )
        )
        wait_until_ready(url)
        http = httpx.Client(base_url=url + "/v1", headers={"Authorization": f"Bearer {key}"}, timeout=30)
        file_id = http.post(
            "/files", files={"file": ("train.jsonl", DEMO_DATA.read_bytes())}, data={"purpose": "fine-tune"}
        ).json()["id"]
        job_body = json.dumps(
            {
                "model": "tiny",
                "training_file": file_id,
                "method": {
                    "type": "reinforcement",
                    "reinforcement": {
                        "grader": {
                            "type": "string_check",
                            "name": "a",
                            "input": "{{ sample.output_text }}",
                            "reference": "a",
                            "operation": "like",
                        }
                    },
                },
            }
        )
        jobs = [
            http.post("/fine_tuning/jobs", content=job_body, headers={"Content-Type": "application/json"})
            for _ in range(25)
        ]
        if any(r.status_code != 200 for r in jobs):
            raise RuntimeError(f"job creation failed: {jobs[0].text}")
        job_id = jobs[-1].json()["id"]
        cases = {
            "status_read": {"path": f"/v1/fine_tuning/jobs/{job_id}"},
            "list_read": {"path": "/v1/fine_tuning/jobs?limit=20"},
            "create": {"path": "/v1/fine_tuning/jobs", "method": "POST", "body": job_body},
        }
        out: dict[str, Any] = {
            "config": f"rloo api (1 process) on {settings.database_url.split(':')[0]} + "
            f"{'embedded ' if settings.embedded_redis else ''}Redis; loadgen in its own process; "
            f"{args.seconds} s a case after 1 s of warm-up",
        }
        for connections in (32, 128):
            for name, case in cases.items():
                print(f"{connections} connections: bare, then {name}", file=sys.stderr, flush=True)
                bare = load(url, path="/healthz", connections=connections, key=key, seconds=args.seconds)
                got = load(url, connections=connections, key=key, seconds=args.seconds, **case)
                got["ratio_to_bare"] = round(got["requests_per_s"] / bare["requests_per_s"], 2)
                out[f"{name}@{connections}"] = {"bare": bare, name: got}
        n_jobs = len(http.get("/fine_tuning/jobs", params={"limit": 100}).json()["data"])
        out["jobs_in_the_list_at_the_end"] = f">= {n_jobs}"
        return out
    finally:
        for child in reversed(children):
            child.terminate()
            try:
                child.wait(timeout=10)
            except subprocess.TimeoutExpired:
                child.kill()
        shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    print(json.dumps(main(), indent=2))

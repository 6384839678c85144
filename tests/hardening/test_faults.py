"""Faults, each with real processes: the broker restarted without its data, the API killed while
clients submit, the database cut off and back, a job that runs out of memory, a job whose worker
process keeps getting killed. After each: nothing lost, nothing done twice, the service carries on
without a restart.

Issue 6's other faults live in tests/e2e/test_e2e.py (a worker SIGKILLed mid-job, non-finite rewards,
two workers) and tests/workers/test_reconcile.py (the reconciler's rules on a real database).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from benchmarks.soak.proxy import TcpProxy
from tests.helpers.data import EXAMPLES, job_body
from tests.helpers.live import LiveStack, free_port, live_stack, upload_path, wait_for

FINAL = {"succeeded", "failed", "cancelled"}


def events_of(http: httpx.Client, job_id: str) -> list[str]:
    """A job's event messages, oldest first."""
    page = http.get(f"/fine_tuning/jobs/{job_id}/events", params={"limit": 100}).json()["data"]
    return [e["message"] for e in reversed(page)]


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def list_all(http: httpx.Client, url: str) -> list[dict[str, Any]]:
    """Every item of a list endpoint, page by page."""
    items: list[dict[str, Any]] = []
    params: dict[str, Any] = {"limit": 100}
    while True:
        page = http.get(url, params=params).json()
        items += page["data"]
        if not page["has_more"]:
            return items
        params["after"] = page["data"][-1]["id"]


def steps_of(http: httpx.Client, job_id: str) -> list[int]:
    return [m["step"] for m in http.get(f"/fine_tuning/jobs/{job_id}/metrics").json()["data"]]


def assert_succeeded_once(http: httpx.Client, job_id: str, steps: int, stack: LiveStack, timeout: float = 240) -> None:
    job = wait_for(http, job_id, FINAL, timeout, stack)
    assert job["status"] == "succeeded", (job["error"], stack.log_tail())
    assert steps_of(http, job_id) == list(range(1, steps + 1))  # every step's metrics exactly once


# The broker restarted without its data ------------------------------------------------------------
class RedisServer:
    """A real redis-server on a TCP port, with no persistence: killed, it comes back empty."""

    def __init__(self, port: int, logs: Path) -> None:
        self.port, self.logs = port, logs
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        from service.infra.embedded_redis import redis_executable

        binary = shutil.which("redis-server") or redis_executable()
        log = open(self.logs / "redis-server.log", "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        import redis

        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                if redis.Redis.from_url(self.url, socket_connect_timeout=0.5).ping():
                    return
            except redis.RedisError:
                time.sleep(0.05)
        raise AssertionError("redis-server did not start")

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)


def _embedded_redis_pid(stack: LiveStack) -> int:
    return int((Path(stack.env["RLOO_HOME"]) / "redis" / "redis.pid").read_text().strip())


@pytest.mark.parametrize("broker", ["embedded", "redis-server"])
def test_redis_restarted_without_its_data_loses_no_job(broker: str, tmp_path: Path, models_dir: Path) -> None:
    """One job running and two queued when Redis dies and comes back empty (the queued tasks and the
    running one's unacknowledged message are gone), a fourth submitted while it is down: all four
    succeed, each started once, every step recorded once. The embedded Redis is brought back by the
    worker's reconciler; a server Redis by its operator (here, the test)."""
    env = {"RLOO_RECONCILE_SECONDS": "1", "RLOO_STALE_SECONDS": "30"}
    server = None
    if broker == "redis-server":
        (tmp_path / "redis-logs").mkdir()
        server = RedisServer(free_port(), tmp_path / "redis-logs")
        server.start()
        env["REDIS_URL"] = server.url
    try:
        with live_stack("embedded", tmp_path, models_dir, env=env) as stack:
            http = stack.http
            file_id = upload_path(http, EXAMPLES / "demo" / "train.jsonl")
            running = http.post("/fine_tuning/jobs", json=job_body(file_id, hp={"max_steps": 12})).json()["id"]
            # Seen running first, then the queued ones (on a busy machine the two requests can take
            # longer than a short job's whole run).
            wait_for(http, running, {"running"}, 120, stack, min_step=1)
            queued = [
                http.post("/fine_tuning/jobs", json=job_body(file_id, hp={"max_steps": 2})).json()["id"] for _ in "ab"
            ]
            assert [http.get(f"/fine_tuning/jobs/{j}").json()["status"] for j in queued] == ["queued", "queued"]

            if server is not None:
                server.kill()
            else:
                home = Path(stack.env["RLOO_HOME"]) / "redis"
                os.kill(_embedded_redis_pid(stack), signal.SIGKILL)
                # Its append-only file would bring the tasks back; make the loss total.
                for leftover in home.iterdir():
                    if leftover.name.startswith("appendonly"):
                        shutil.rmtree(leftover) if leftover.is_dir() else leftover.unlink()
            r = http.post("/fine_tuning/jobs", json=job_body(file_id, hp={"max_steps": 2}))
            assert r.status_code == 200, r.text  # the job row is the truth; its task is sent later
            late = r.json()["id"]
            if server is not None:
                time.sleep(1)
                server.start()  # empty: nothing was persisted
            else:  # the worker's reconciler starts the embedded Redis again within a round
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline and http.get(stack.url + "/readyz").status_code != 200:
                    time.sleep(0.2)
                assert http.get(stack.url + "/readyz").status_code == 200, stack.log_tail()

            assert_succeeded_once(http, running, 12, stack)
            for job_id in [*queued, late]:
                assert_succeeded_once(http, job_id, 2, stack)
                started = [e for e in events_of(http, job_id) if e.startswith("Job started")]
                assert len(started) == 1, started
    finally:
        if server is not None and server.proc and server.proc.poll() is None:
            server.kill()


# The API killed while clients submit --------------------------------------------------------------
def test_api_killed_while_clients_submit_loses_no_answered_request(tmp_path: Path, models_dir: Path) -> None:
    """Clients create jobs and upload files as fast as they can, and the API is SIGKILLed while it
    writes a big upload to disk. After a restart every request that was answered 2xx has its job or
    file, whole; no job is half-created; nothing is left on disk without a row (the big upload's
    partial file is swept when the API starts again)."""
    # Three clients in tight loops with one key: past the per-key rate limit, not what this is about.
    with live_stack("embedded", tmp_path, models_dir, worker=False, env={"RLOO_RATE_LIMIT": "0"}) as stack:
        http = stack.http
        file_id = upload_path(http, EXAMPLES / "demo" / "train.jsonl")
        content = (EXAMPLES / "demo" / "train.jsonl").read_bytes()
        answered: dict[str, list[str]] = {"jobs": [], "files": []}
        failures: list[str] = []
        stop = threading.Event()
        lock = threading.Lock()

        def keep_posting(kind: str, post: Any) -> None:
            """Send requests until told to stop; keep the id of every one answered 2xx."""
            with httpx.Client(base_url=stack.url + "/v1", headers=http.headers, timeout=10) as c:
                while not stop.is_set():
                    try:
                        r = post(c)
                    except httpx.HTTPError as exc:  # the API is dead: a request without an answer
                        failures.append(type(exc).__name__)
                        time.sleep(0.05)
                        continue
                    assert r.status_code == 200, r.text
                    with lock:
                        answered[kind].append(r.json()["id"])

        def submit_jobs() -> None:
            keep_posting("jobs", lambda c: c.post("/fine_tuning/jobs", json=job_body(file_id, hp={"max_steps": 1})))

        def upload_files() -> None:
            files = {"file": ("t.jsonl", content)}
            keep_posting("files", lambda c: c.post("/files", files=files, data={"purpose": "fine-tune"}))

        big = content * (48 * 1024 * 1024 // len(content))  # ~48 MB: seconds to validate into place

        def big_upload() -> None:
            # Starlette takes in the whole multipart body first; then our handler validates it into
            # a temporary file, which is where the kill finds it.
            with contextlib.suppress(httpx.HTTPError):
                c = httpx.Client(base_url=stack.url + "/v1", headers=http.headers, timeout=60)
                c.post("/files", files={"file": ("big.jsonl", big)}, data={"purpose": "fine-tune"})

        work = (submit_jobs, submit_jobs, upload_files, big_upload)
        threads = [threading.Thread(target=f, daemon=True) for f in work]
        for t in threads:
            t.start()
        files_dir = Path(stack.env["RLOO_HOME"]) / "artifacts" / "files"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # until the big upload is half on disk and others were answered
            # The big upload's (the others' are one file long, and come and go).
            partial = [p for p in files_dir.glob("*/.upload-*") if _size(p) > 20 * len(content)]
            if partial and len(answered["jobs"]) >= 10 and len(answered["files"]) >= 3:
                break
            time.sleep(0.05)
        assert partial, "the big upload never reached the disk"
        stack.stop("api", signal.SIGKILL)
        time.sleep(0.5)
        stop.set()
        for t in threads[:3]:
            t.join(timeout=30)
        assert partial[0].exists()  # what the killed process left

        stack.start("api2", "api", "--port", str(stack.port))
        stack.wait_ready()
        with lock:
            jobs, files = list(answered["jobs"]), list(answered["files"])
        assert len(jobs) >= 10 and len(files) >= 3, (len(jobs), len(files), failures)

        listed = {j["id"]: j for j in list_all(http, "/fine_tuning/jobs")}
        assert set(jobs) <= set(listed)  # every answered creation has its job
        for job in listed.values():  # and no job is half-made: status, file, creation event
            assert job["status"] == "queued" and job["training_file"] == file_id, job
            assert any(e.startswith("Created fine-tuning job") for e in events_of(http, job["id"])), job["id"]

        listed_files = {f["id"] for f in list_all(http, "/files")}
        assert set(files) | {file_id} <= listed_files
        for f in files:
            assert http.get(f"/files/{f}/content").content == content
        on_disk = sorted(p.name for p in files_dir.rglob("*") if p.is_file())
        assert on_disk == sorted(f"{f}.jsonl" for f in listed_files), on_disk  # no partial, no orphan


# The database cut off, then back -------------------------------------------------------------------
def test_database_unreachable_gives_503_and_everything_recovers_without_a_restart(
    tmp_path: Path, models_dir: Path
) -> None:
    """PostgreSQL cut off for a few seconds while a job trains: the API answers 503 (readyz, and
    every /v1 request, in the error shape with Retry-After), the worker waits with its step's
    writes; when the database is back the same API process answers 200 again and the job finishes
    with every step recorded once."""
    if not os.environ.get("TEST_DATABASE_URL"):
        pytest.skip("TEST_DATABASE_URL not set (the CI sets it to a PostgreSQL server)")
    from sqlalchemy.engine import make_url

    server = make_url(os.environ["TEST_DATABASE_URL"])
    proxy = TcpProxy((server.host or "127.0.0.1", server.port or 5432))
    proxy.restore()

    def via_proxy(url: str) -> str:
        return make_url(url).set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)

    env = {"RLOO_RECONCILE_SECONDS": "1", "RLOO_STALE_SECONDS": "60"}
    try:
        with live_stack("production", tmp_path, models_dir, env=env, database_url=via_proxy) as stack:
            http = stack.http
            file_id = upload_path(http, EXAMPLES / "demo" / "train.jsonl")
            job_id = http.post("/fine_tuning/jobs", json=job_body(file_id, hp={"max_steps": 30})).json()["id"]
            wait_for(http, job_id, {"running"}, 120, stack, min_step=2)
            api_pid = stack.procs["api"].pid

            proxy.cut()
            time.sleep(0.5)
            ready = httpx.get(stack.url + "/readyz", timeout=30)
            assert ready.status_code == 503, ready.text
            assert ready.json()["checks"]["database"].startswith("unreachable")
            for method, url, body in (
                ("GET", f"/fine_tuning/jobs/{job_id}", None),
                ("GET", "/fine_tuning/jobs", None),
                ("POST", "/fine_tuning/jobs", job_body(file_id, hp={"max_steps": 2})),
            ):
                r = http.request(method, url, json=body)
                assert r.status_code == 503, (method, url, r.status_code, r.text)
                assert r.json()["error"]["code"] == "database_unavailable" and r.headers["retry-after"] == "2"
            time.sleep(4)  # the worker's step writes wait meanwhile
            proxy.restore()

            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and httpx.get(stack.url + "/readyz", timeout=30).status_code != 200:
                time.sleep(0.2)
            assert httpx.get(stack.url + "/readyz").status_code == 200
            assert stack.procs["api"].pid == api_pid and stack.procs["api"].poll() is None  # no restart
            later = http.post("/fine_tuning/jobs", json=job_body(file_id, hp={"max_steps": 2}))
            assert later.status_code == 200, later.text
            assert_succeeded_once(http, job_id, 30, stack)
            assert_succeeded_once(http, later.json()["id"], 2, stack)
            assert "database is unreachable" in (stack.logs / "worker.log").read_text()  # it did wait
    finally:
        proxy.cut()


# Out of memory, and a worker process killed again and again ----------------------------------------
@pytest.fixture(scope="module")
def crash_stack(tmp_path_factory: pytest.TempPathFactory, models_dir: Path) -> Iterator[LiveStack]:
    """One stack for the two tests below: a job memory cap (RLOO_JOB_MEMORY_MB), three crashes a job
    at most, and no help from the heartbeat rule (RLOO_STALE_SECONDS 120). Each test leaves the
    worker itself running and idle."""
    env = {"RLOO_JOB_MEMORY_MB": "2048", "RLOO_MAX_JOB_CRASHES": "3", "RLOO_STALE_SECONDS": "120"}
    with live_stack("embedded", tmp_path_factory.mktemp("crashes"), models_dir, env=env) as stack:
        yield stack


def test_a_job_out_of_memory_fails_clearly_and_the_worker_takes_the_next(crash_stack: LiveStack) -> None:
    """With the job memory cap (RLOO_JOB_MEMORY_MB), a job that asks for far more memory than it has
    fails with error.code out_of_memory and a message saying what to lower; the same worker then runs
    the next job to success."""
    stack = crash_stack
    http = stack.http
    file_id = upload_path(http, EXAMPLES / "demo" / "train.jsonl")
    # 32 prompts x 256 samples x 255 new tokens (all the context leaves): gigabytes of KV cache and logits.
    hungry = job_body(file_id, hp={"max_steps": 1, "batch_size": 32, "rloo_k": 256, "max_new_tokens": 255})
    bad = http.post("/fine_tuning/jobs", json=hungry)
    assert bad.status_code == 200, bad.text
    good = http.post("/fine_tuning/jobs", json=job_body(file_id, hp={"max_steps": 2})).json()["id"]
    failed = wait_for(http, bad.json()["id"], FINAL, 180, stack)
    assert failed["status"] == "failed" and failed["error"]["code"] == "out_of_memory", failed
    assert "batch_size" in failed["error"]["message"] and "max_new_tokens" in failed["error"]["message"]
    assert_succeeded_once(http, good, 2, stack)


def test_a_job_whose_worker_process_keeps_getting_killed_fails_worker_lost(crash_stack: LiveStack) -> None:
    """The pool process running a job is SIGKILLed (what the kernel's out-of-memory killer does) while
    the worker lives on: Celery hands the task back, the next pool process sees its predecessor is
    gone and continues the job at once from its checkpoint. Killed again before it saves another
    checkpoint, twice more: the third death fails the job (worker_lost) instead of looping for ever,
    and the worker takes the next job."""
    stack = crash_stack  # RLOO_MAX_JOB_CRASHES 3, RLOO_STALE_SECONDS 120: no help from the heartbeat rule
    http = stack.http
    file_id = upload_path(http, EXAMPLES / "demo" / "train.jsonl")
    body = job_body(file_id, hp={"n_epochs": 100, "checkpoint_interval": 4, "keep_checkpoints": 10})
    job_id = http.post("/fine_tuning/jobs", json=body).json()["id"]
    for crash in (1, 2, 3):
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            events = events_of(http, job_id)
            starts = [e for e in events if e.startswith("Job started")]
            resumed = [e for e in events if e.startswith("Resumed from the checkpoint")]
            saved = [e for e in events if e.startswith("Checkpoint saved")]
            # The first time once a checkpoint exists; then as soon as it has resumed from it.
            if len(starts) == crash and (len(resumed) == crash - 1 if crash > 1 else saved):
                break
            time.sleep(0.1)
        else:
            raise AssertionError(f"the job did not run again after crash {crash - 1}\n{stack.log_tail()}")
        # The operator's log names the process ("job … started on worker … (process host:pid)").
        log = (stack.logs / "worker.log").read_text()
        pid = int(re.findall(rf"job {job_id} started on worker \S+ \(process \S+:(\d+)\)", log)[-1])
        assert pid != stack.procs["worker"].pid  # a pool process, not the worker itself
        os.kill(pid, signal.SIGKILL)
    job = wait_for(http, job_id, FINAL, 120, stack)
    assert job["status"] == "failed" and job["error"]["code"] == "worker_lost", job
    events = events_of(http, job_id)
    assert sum("The worker process running the job was killed" in e for e in events) == 3, events
    resumed = [e for e in events if e.startswith("Resumed from the checkpoint")]
    assert len(resumed) == 2  # crashes 1 and 2 continued from the checkpoint, not from scratch
    assert len({e.split(" at step ")[1].split(";")[0] for e in resumed}) == 1, resumed  # the same one
    assert stack.procs["worker"].poll() is None  # the worker itself lives on
    nxt = http.post("/fine_tuning/jobs", json=job_body(file_id, hp={"max_steps": 2})).json()["id"]
    assert_succeeded_once(http, nxt, 2, stack)

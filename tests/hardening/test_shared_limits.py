"""Limits that hold across API processes: a key's request rate and its open streams are counted in
Redis (service.infra.limits), so two API processes give a key one limit, not two; with Redis gone
each process counts on its own, and /readyz says so.

Two apps built side by side are two processes' worth of state (each its own middleware, local
counters and Redis connection); two ``rloo api`` processes asked in turn are the real thing."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest

from tests.helpers.api import LOCAL, make_key
from tests.helpers.live import free_port, worker_process


def _app_client(monkeypatch: pytest.MonkeyPatch, **env_values: str) -> Any:
    from fastapi.testclient import TestClient

    from service.core.db import reset_caches
    from service.main import create_app

    for key, value in env_values.items():
        monkeypatch.setenv(key, value)
    reset_caches()
    return TestClient(create_app(), client=LOCAL)


def test_two_api_processes_give_a_key_one_rate(monkeypatch, env) -> None:
    from service.infra import limits

    now = [time.time()]
    monkeypatch.setattr(limits, "clock", lambda: now[0])  # the API's limits' clock, and Redis' counts'
    auth = {"Authorization": f"Bearer {make_key('alpha')}"}
    slow = {"RLOO_RATE_LIMIT": "0.5", "RLOO_RATE_LIMIT_BURST": "4"}
    with _app_client(monkeypatch, **slow) as one, _app_client(monkeypatch, **slow) as two:
        codes = [(one if i % 2 else two).get("/v1/files", headers=auth).status_code for i in range(8)]
        assert codes == [200] * 4 + [429] * 4  # one bucket of 4, not one of 4 in each process
        other = {"Authorization": f"Bearer {make_key('alpha')}"}
        assert two.get("/v1/files", headers=other).status_code == 200  # another key: its own bucket
        now[0] += 2.0  # one token back (0.5 a second), for the key in both processes
        assert [one.get("/v1/files", headers=auth).status_code, two.get("/v1/files", headers=auth).status_code] == [
            200,
            429,
        ]
        assert one.get("/readyz").json()["limits"] == {"limits": "shared"}
        conn, closed = one.app.state.limits._conn, []
        assert conn is not None
        let_go = conn.aclose
        conn.aclose = lambda: closed.append(True) or let_go()
    assert closed == [True] and one.app.state.limits._conn is None  # let go at shutdown


def test_with_redis_down_each_process_counts_alone_and_readyz_says_so(monkeypatch, env) -> None:
    auth = {"Authorization": f"Bearer {make_key('alpha')}"}
    down = {"REDIS_URL": "redis://127.0.0.1:9/0", "RLOO_RATE_LIMIT": "0.5", "RLOO_RATE_LIMIT_BURST": "2"}
    with _app_client(monkeypatch, **down) as one:
        assert [one.get("/v1/files", headers=auth).status_code for _ in range(3)] == [200, 200, 429]
        ready = one.get("/readyz").json()
        assert ready["limits"]["limits"] == "local" and "each API process" in ready["limits"]["why"]


def test_two_rloo_api_processes_give_a_key_one_rate_and_one_set_of_streams(env, tmp_path, client, auth) -> None:
    """Two `rloo api` processes (as on two hosts) on one database and Redis, asked in turn: a burst of
    6 lets 6 through in all, where counting in each process let 12; a key allowed one stream holds
    one, whichever process is asked for a second, and gets it back when the first ends."""
    from tests.helpers.api import create_job, upload_ok
    from tests.helpers.data import job_body

    job = create_job(client, auth, job_body(upload_ok(client, auth)["id"]))
    values = {
        **env,
        "RLOO_RATE_LIMIT": "0.2",
        "RLOO_RATE_LIMIT_BURST": "6",
        "RLOO_MAX_STREAMS_PER_KEY": "1",
        "PYTHONUNBUFFERED": "1",
    }
    rate_key, stream_key = make_key("alpha"), make_key("alpha")
    ports = [free_port(), free_port()]
    with (
        worker_process(values, tmp_path / "api-1.log", "api", "--port", str(ports[0])),
        worker_process(values, tmp_path / "api-2.log", "api", "--port", str(ports[1])),
    ):
        bases = [f"http://127.0.0.1:{port}" for port in ports]
        for base in bases:
            _wait_healthy(base, tmp_path)

        def on(i: int, key: str) -> httpx.Client:
            return httpx.Client(base_url=bases[i % 2], headers={"Authorization": f"Bearer {key}"}, timeout=10)

        codes = []
        for i in range(12):
            with on(i, rate_key) as http:
                codes.append(http.get("/v1/files").status_code)
        assert codes.count(200) <= 7 and codes[:6] == [200] * 6, codes  # 6, and one more if 5 s passed
        assert codes[-2:] == [429, 429], codes  # refused by both processes

        url = f"/v1/fine_tuning/jobs/{job['id']}/events?stream=true"
        with on(0, stream_key) as holder, holder.stream("GET", url) as held:
            assert held.status_code == 200
            with on(1, stream_key) as http:
                refused = http.get(url)
            assert refused.status_code == 429 and refused.json()["error"]["code"] == "too_many_streams"
        for _ in range(3):  # the first one's release reaches Redis as its process sees the close
            with on(1, stream_key) as http, http.stream("GET", url) as again:
                if again.status_code == 200:
                    break
            time.sleep(1)
        assert again.status_code == 200


def _wait_healthy(base: str, tmp_path: Any) -> None:
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(base + "/healthz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, [p.read_text()[-2000:] for p in tmp_path.glob("api-*.log")]
        time.sleep(0.2)

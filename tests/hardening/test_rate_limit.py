"""The per-key rate limit (RLOO_RATE_LIMIT requests a second, RLOO_RATE_LIMIT_BURST at once), in the
API's AuthMiddleware: 429 in OpenAI's error shape with Retry-After and retry-after-ms, x-ratelimit-*
headers on every /v1 answer, keys counted apart, ops endpoints never counted, and the unmodified
openai SDK riding through a 429 on its own retries. Runs on SQLite, and on PostgreSQL when
TEST_DATABASE_URL is set.

The limits here are small and slow (a token every 2 s), so no token comes back while a test sends
its burst, however slow the machine; waiting out a Retry-After costs a test about 2 s.
"""

from __future__ import annotations

import math
import time
from typing import Any

import openai
import pytest

from tests.helpers.api import LOCAL, make_key

LIMIT_HEADERS = ("x-ratelimit-limit-requests", "x-ratelimit-remaining-requests", "x-ratelimit-reset-requests")


def _client(monkeypatch: pytest.MonkeyPatch, **env_values: str) -> Any:
    """A TestClient on a new app built after setting ``env_values`` (settings are read at build time)."""
    from fastapi.testclient import TestClient

    from service.core.db import reset_caches
    from service.main import create_app

    for key, value in env_values.items():
        monkeypatch.setenv(key, value)
    reset_caches()
    return TestClient(create_app(), client=LOCAL)


def _auth(project: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {make_key(project)}"}


def assert_rate_limited(r: Any) -> float:
    """A 429 in OpenAI's shape with its retry headers; returns the wait it asks for, in seconds."""
    assert r.status_code == 429, (r.status_code, r.text)
    assert r.headers["content-type"] == "application/json"
    err = r.json()["error"]
    assert set(r.json()) == {"error"}
    assert err["type"] == "requests" and err["code"] == "rate_limit_exceeded" and err["param"] is None
    assert "Rate limit" in err["message"]
    wait_ms = int(r.headers["retry-after-ms"])
    wait_s = int(r.headers["retry-after"])  # whole seconds (RFC 9110), rounded up, at least 1
    assert 0 < wait_ms <= 2000 and wait_s == max(1, math.ceil(wait_ms / 1000))
    assert r.headers["x-ratelimit-remaining-requests"] == "0"
    return wait_ms / 1000


@pytest.mark.parametrize("auth_cache", ["5", "0"])  # a key trusted from the cache, and one read each time
def test_the_request_after_the_burst_is_429_for_that_key_only(monkeypatch, env, auth_cache: str) -> None:
    """The limits' clock stands still but where the test moves it: at 0.5 requests a second, a slow
    machine's requests would otherwise see the bucket refill between them."""
    from service.infra import limits as shared_limits

    now = [time.monotonic()]
    monkeypatch.setattr(shared_limits, "clock", lambda: now[0])
    alpha, alpha2, beta = _auth("alpha"), _auth("alpha"), _auth("beta")
    with _client(
        monkeypatch, RLOO_RATE_LIMIT="0.5", RLOO_RATE_LIMIT_BURST="3", RLOO_AUTH_CACHE_SECONDS=auth_cache
    ) as client:
        remaining = []
        for _ in range(3):
            r = client.get("/v1/files", headers=alpha)
            assert r.status_code == 200, r.text
            assert r.headers["x-ratelimit-limit-requests"] == "3"
            remaining.append(r.headers["x-ratelimit-remaining-requests"])
            assert r.headers["x-ratelimit-reset-requests"].endswith(("ms", "s"))
        assert remaining == ["2", "1", "0"]

        wait = assert_rate_limited(client.get("/v1/files", headers=alpha))
        # Refused before the handler: a refused upload stores nothing.
        refused = client.post(
            "/v1/files", headers=alpha, files={"file": ("a.jsonl", b'{"prompt": "p"}\n')}, data={"purpose": "fine-tune"}
        )
        assert_rate_limited(refused)

        # Another key of the same project, and a key of another project: their own buckets.
        for other in (alpha2, beta):
            r = client.get("/v1/files", headers=other)
            assert r.status_code == 200, r.text
            assert r.headers["x-ratelimit-remaining-requests"] == "2"
        assert client.get("/v1/files", headers=alpha2).json()["data"] == []

        # Ops endpoints are never limited nor counted.
        for path in ("/healthz", "/readyz", "/metrics", "/docs", "/openapi.json"):
            r = client.get(path, headers=alpha)
            assert r.status_code == 200, (path, r.text)
            assert not any(h in r.headers for h in LIMIT_HEADERS), path

        now[0] += wait  # what Retry-After asked for: one token is back
        r = client.get("/v1/files", headers=alpha)
        assert r.status_code == 200, r.text
        assert r.json()["data"] == []  # the refused upload was never stored
        assert_rate_limited(client.get("/v1/files", headers=alpha))  # and only one token


def test_every_v1_answer_carries_the_limit_headers(monkeypatch, env) -> None:
    auth = _auth("alpha")
    with _client(monkeypatch, RLOO_RATE_LIMIT="0.5", RLOO_RATE_LIMIT_BURST="10") as client:
        answers = [
            client.get("/v1/files", headers=auth),  # 200
            client.get("/v1/files/file-nope", headers=auth),  # 404 from the route
            client.get("/v1/fine_tuning/jobs", headers=auth, params={"limit": 0}),  # 400
            client.post(
                "/v1/fine_tuning/jobs", headers={**auth, "Content-Type": "application/json"}, content=b"{not json"
            ),  # 400 from the body's parsing
        ]
        assert [r.status_code for r in answers] == [200, 404, 400, 400]
        assert [r.headers["x-ratelimit-remaining-requests"] for r in answers] == ["9", "8", "7", "6"]
        # A refused key was never counted: no bucket, no headers.
        r = client.get("/v1/files", headers={"Authorization": "Bearer rloo-not-a-key"})
        assert r.status_code == 401 and not any(h in r.headers for h in LIMIT_HEADERS)


def test_a_rate_limit_of_0_turns_it_off(monkeypatch, env) -> None:
    auth = _auth("alpha")
    with _client(monkeypatch, RLOO_RATE_LIMIT="0", RLOO_RATE_LIMIT_BURST="1") as client:
        for _ in range(30):
            r = client.get("/v1/files", headers=auth)
            assert r.status_code == 200, r.text
            assert not any(h in r.headers for h in LIMIT_HEADERS)


def test_the_defaults_let_a_burst_of_100_through(monkeypatch, env) -> None:
    """20/s sustained, bursts of 100: a script that fires 100 requests at once is never refused."""
    monkeypatch.delenv("RLOO_RATE_LIMIT", raising=False)
    monkeypatch.delenv("RLOO_RATE_LIMIT_BURST", raising=False)
    auth = _auth("alpha")
    with _client(monkeypatch) as client:
        codes = [client.get("/v1/files", headers=auth).status_code for _ in range(100)]
        assert codes == [200] * 100
        r = client.get("/v1/files", headers=auth)
        assert r.headers["x-ratelimit-limit-requests"] == "100"
        # The 101st either found a token that came back meanwhile (20 a second) or is refused.
        assert r.status_code in (200, 429)


def test_the_limit_holds_and_the_api_answers_with_redis_down(monkeypatch, env) -> None:
    """Counted in the process, not in Redis: a dead broker changes nothing for reads and the limit."""
    auth = _auth("alpha")
    with _client(
        monkeypatch, REDIS_URL="redis://127.0.0.1:9/0", RLOO_RATE_LIMIT="0.5", RLOO_RATE_LIMIT_BURST="2"
    ) as client:
        assert [client.get("/v1/files", headers=auth).status_code for _ in range(2)] == [200, 200]
        assert_rate_limited(client.get("/v1/files", headers=auth))


def test_the_openai_sdk_retries_through_a_429_by_itself(monkeypatch, env) -> None:
    key = make_key("alpha")
    with _client(monkeypatch, RLOO_RATE_LIMIT="0.5", RLOO_RATE_LIMIT_BURST="1") as client:
        seen: list[tuple[int, str | None]] = []  # (status, retry-after-ms) of each answer the SDK got
        client.event_hooks["response"].append(lambda r: seen.append((r.status_code, r.headers.get("retry-after-ms"))))
        impatient = openai.OpenAI(base_url="http://testserver/v1", api_key=key, http_client=client, max_retries=0)
        sdk = openai.OpenAI(base_url="http://testserver/v1", api_key=key, http_client=client, max_retries=3)

        assert list(sdk.files.list()) == []  # the burst's one token
        with pytest.raises(openai.RateLimitError) as err:
            impatient.files.list()
        assert err.value.status_code == 429 and err.value.code == "rate_limit_exceeded"

        seen.clear()
        t0 = time.monotonic()
        assert list(sdk.files.list()) == []  # refused first, then let through on the SDK's own retry
        took = time.monotonic() - t0
        assert seen[0][0] == 429 and seen[-1][0] == 200, seen
        # It waited as told (retry-after-ms, about 2 s), not its own back-off (0.5 s at first).
        wait = int(seen[0][1] or 0) / 1000
        assert wait > 1 and took >= wait, (took, seen)


# The limiter itself, on a clock the test holds --------------------------------------------------------
def test_gcra_lets_the_sustained_rate_through_and_no_more() -> None:
    from service.api.middleware import RateLimiter

    rl = RateLimiter(rate=20, burst=100)
    t = 1000.0
    assert all(rl.take("k", t)[0] for _ in range(100))
    allowed, remaining, retry, reset = rl.take("k", t)
    assert (allowed, remaining) == (False, 0) and retry == pytest.approx(0.05) and reset == pytest.approx(5.0)
    # Ten seconds of a loop that tries every millisecond: 20 a second get through, the rest are refused.
    through = sum(rl.take("k", t + i / 1000)[0] for i in range(1, 10_001))
    assert through == pytest.approx(200, abs=1)
    # Idle for burst/rate seconds: the bucket is full again.
    assert rl.take("k", t + 10 + 5.0)[1] == 99


def test_the_bucket_map_is_bounded() -> None:
    from service.api.middleware import RateLimiter

    rl = RateLimiter(rate=1, burst=5, max_keys=1000)
    for i in range(50_000):
        assert rl.take(f"key-{i}", 0.0)[0]
        assert len(rl.tat) <= 1000
    # Full buckets are forgotten first: a busy key survives a flood of keys that have gone quiet.
    rl = RateLimiter(rate=1, burst=2, max_keys=100)
    for i in range(99):
        rl.take(f"quiet-{i}", 0.0)
    rl.take("busy", 50.0)
    rl.take("busy", 50.0)
    assert not rl.take("busy", 50.0)[0]
    for i in range(10):
        rl.take(f"new-{i}", 50.0)
    assert "busy" in rl.tat and not rl.take("busy", 50.0)[0]


def test_a_key_past_its_body_bytes_a_second_is_429_before_its_body_is_read(monkeypatch, env) -> None:
    """Four 8 MiB bodies at once, again and again, within the request rate, kept an API process busy
    reading and refusing them for every tenant. A key's request-body bytes have a rate of their own;
    uploads, which /v1/files bounds, do not count."""
    mib = 2**20
    c = _client(monkeypatch, RLOO_RATE_LIMIT_BODY_BYTES=str(mib // 2), RLOO_RATE_LIMIT_BODY_BYTES_BURST=str(8 * mib))
    ours, theirs = _auth("alpha"), _auth("beta")
    body = b'{"model": "m", "prompt": "' + b"x" * (5 * mib) + b'"}'
    headers = {**ours, "Content-Type": "application/json"}
    first = c.post("/v1/completions", content=body, headers=headers)
    assert first.status_code != 429, first.text  # the burst holds one
    second = c.post("/v1/completions", content=body, headers=headers)
    assert second.status_code == 429 and second.json()["error"]["code"] == "rate_limit_exceeded"
    assert "MiB of request bodies a second" in second.json()["error"]["message"]
    assert second.headers["connection"] == "close" and int(second.headers["retry-after"]) >= 1
    other = c.post("/v1/completions", content=body, headers={**theirs, "Content-Type": "application/json"})
    assert other.status_code != 429  # another key is not held up
    upload = c.post(
        "/v1/files",
        headers=ours,
        files={"file": ("t.jsonl", b'{"prompt": "a"}\n' * 1000)},
        data={"purpose": "fine-tune"},
    )
    assert upload.status_code == 200, upload.text
    assert c.get("/v1/files", headers=ours).status_code == 200  # bodiless requests are not held up


def test_gcra_takes_a_cost_in_units() -> None:
    from service.api.middleware import RateLimiter

    bytes_ = RateLimiter(1000.0, 4000)  # 1,000 a second, 4,000 at once
    assert bytes_.take("k", now=0.0, cost=3000)[0]
    assert not bytes_.take("k", now=0.0, cost=3000)[0]
    assert bytes_.take("k", now=2.0, cost=3000)[0]  # 2 s later: 2,000 more


def test_a_tinker_loop_s_requests_count_against_a_limit_of_their_own(monkeypatch, env) -> None:
    """A Tinker loop's many small requests (a sample and its polls, a step's calls, the SDK's beats)
    neither spend the key's other requests nor are held to their limit, and their own limit answers
    a 429 the Tinker SDK backs off; the protocol's other requests (runs, sessions, saves) count
    against the general limit, as the rest of the API's do."""
    from service.infra import limits as shared_limits

    now = [time.monotonic()]
    monkeypatch.setattr(shared_limits, "clock", lambda: now[0])
    auth = _auth("alpha")
    limits = {"RLOO_RATE_LIMIT": "0.5", "RLOO_RATE_LIMIT_BURST": "2"}

    def heartbeat(client: Any) -> Any:  # an unknown session: a 404, counted all the same
        return client.post("/api/v1/session_heartbeat", headers=auth, json={"session_id": "nope"})

    with _client(monkeypatch, **limits, RLOO_RATE_LIMIT_TINKER="0.5", RLOO_RATE_LIMIT_TINKER_BURST="5") as client:
        loop = [heartbeat(client) for _ in range(5)]
        assert [r.status_code for r in loop] == [404] * 5, loop[-1].text
        assert [r.headers["x-ratelimit-remaining-requests"] for r in loop] == ["4", "3", "2", "1", "0"]
        assert loop[0].headers["x-ratelimit-limit-requests"] == "5"
        refused = heartbeat(client)
        assert_rate_limited(refused)
        assert "of a Tinker loop's requests" in refused.json()["error"]["message"]
        others = [client.get("/v1/files", headers=auth), client.get("/api/v1/training_runs", headers=auth)]
        assert [r.status_code for r in others] == [200, 200]  # untouched by the loop's
        assert others[1].headers["x-ratelimit-limit-requests"] == "2"  # the general limit's
        assert_rate_limited(client.get("/api/v1/training_runs", headers=auth))
        assert_rate_limited(client.get("/v1/files", headers=auth))
    with _client(monkeypatch, **limits, RLOO_RATE_LIMIT_TINKER="0") as client:
        answers = [heartbeat(client) for _ in range(8)]
        assert [r.status_code for r in answers] == [404] * 8
        assert not any(h in answers[0].headers for h in LIMIT_HEADERS)

"""The http grader against real HTTP servers on loopback: a batch POSTed, scores read back; the
operator's allowlist; retries of a flaky endpoint; a dead or slow endpoint fails clearly and soon."""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from service.graders import GraderError, GraderUnavailable, Sample, grade_batch, grader_to_dict, parse_grader
from tests.helpers.scoring import Endpoint


@pytest.fixture
def serve(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    from service.core.db import reset_caches

    started: list[Endpoint] = []

    def start(behaviour: Any, port: int = 0) -> Endpoint:
        endpoint = Endpoint(behaviour, port)
        started.append(endpoint)
        monkeypatch.setenv("RLOO_HTTP_GRADER_URLS", json.dumps([f"http://127.0.0.1:{endpoint.server.server_port}/"]))
        reset_caches()
        return endpoint

    yield start
    for endpoint in started:
        endpoint.close()
    reset_caches()


def spec(url: str, **extra: Any) -> dict[str, Any]:
    return {"type": "http", "name": "remote", "url": url, **extra}


def length_scores(_: int, body: dict[str, Any]) -> tuple[int, Any]:
    return 200, {"scores": [len(s["sample"]["output_text"]) / s["item"]["n"] for s in body["samples"]]}


def test_the_batch_goes_in_one_post_and_scores_come_back_in_order(serve) -> None:
    endpoint = serve(length_scores)
    grader = parse_grader(spec(endpoint.url))
    assert grader_to_dict(grader) == spec(endpoint.url, timeout_seconds=10.0)
    result = grade_batch(grader, [Sample("ab"), Sample('{"k": 1}'), Sample("")], [{"n": 4}, {"n": 8}, {"n": 1}])
    assert result.rewards == [0.5, 1.0, 0.0]
    assert len(endpoint.calls) == 1
    assert endpoint.calls[0]["samples"][1] == {
        "sample": {"output_text": '{"k": 1}', "output_json": {"k": 1}},
        "item": {"n": 8},
    }


def test_null_scores_are_nan_and_counted(serve) -> None:
    endpoint = serve(lambda n, body: (200, {"scores": [1.0, None, "x"]}))
    result = grade_batch(parse_grader(spec(endpoint.url)), [Sample("a")] * 3, [{}] * 3)
    assert result.rewards[0] == 1.0 and math.isnan(result.rewards[1]) and math.isnan(result.rewards[2])
    assert result.errors == {"remote": 2}


@pytest.mark.parametrize(
    ("url", "allowed", "says"),
    [
        ("http://127.0.0.1:9/score", [], "http graders are off on this server"),
        ("http://evil.example/score", ["http://grader.example/"], "not on the operator's allowlist"),
        ("http://grader.example.evil.net/x", ["http://grader.example"], "not on the operator's allowlist"),
        ("http://grader.example/xy", ["http://grader.example/x"], "not on the operator's allowlist"),
        ("https://grader.example/x/y", ["http://grader.example/x"], "not on the operator's allowlist"),
        ("file:///etc/passwd", ["file:///"], "not on the operator's allowlist"),
        ("http://grader.example/x/../admin", ["http://grader.example/x"], "not on the operator's allowlist"),
        ("http://grader.example/x/%2e%2e/admin", ["http://grader.example/x"], "not on the operator's allowlist"),
        ("http://grader.example/x/\tscore", ["http://grader.example/x"], "not on the operator's allowlist"),
    ],
)
def test_only_allowlisted_urls(monkeypatch, url: str, allowed: list[str], says: str) -> None:
    from service.core.db import reset_caches

    monkeypatch.setenv("RLOO_HTTP_GRADER_URLS", json.dumps(allowed))
    reset_caches()
    with pytest.raises(GraderError) as info:
        parse_grader(spec(url))
    assert info.value.param == "grader.url" and says in info.value.message
    reset_caches()


def test_timeout_seconds_is_checked(serve) -> None:
    endpoint = serve(length_scores)
    for bad in (0, 121, "5", True):
        with pytest.raises(GraderError) as info:
            parse_grader(spec(endpoint.url, timeout_seconds=bad))
        assert info.value.param == "grader.timeout_seconds"


def test_a_flaky_endpoint_is_retried(serve) -> None:
    endpoint = serve(lambda n, body: (503, {"error": "busy"}) if n < 3 else length_scores(n, body))
    result = grade_batch(parse_grader(spec(endpoint.url)), [Sample("ab")], [{"n": 2}])
    assert result.rewards == [1.0] and len(endpoint.calls) == 3


def test_a_dead_endpoint_fails_clearly_and_soon(serve) -> None:
    endpoint = serve(length_scores)
    grader = parse_grader(spec(endpoint.url))
    endpoint.close()  # nothing listens there any more
    t0 = time.monotonic()
    with pytest.raises(GraderUnavailable) as info:
        grade_batch(grader, [Sample("a")], [{"n": 1}])
    assert time.monotonic() - t0 < 5
    assert endpoint.url in str(info.value) and "did not answer after 3 attempts" in str(info.value)


def test_a_hanging_endpoint_times_out(serve) -> None:
    endpoint = serve(lambda n, body: (200, None))  # never answers in time
    t0 = time.monotonic()
    with pytest.raises(GraderUnavailable, match="no answer within 0.3 s"):
        grade_batch(parse_grader(spec(endpoint.url, timeout_seconds=0.3)), [Sample("a")], [{"n": 1}])
    assert time.monotonic() - t0 < 4  # 3 attempts of 0.3 s and 1.5 s of backoff


@pytest.mark.parametrize(
    ("answer", "says"),
    [
        ((400, {"error": "bad"}), "answered HTTP 400"),
        ((200, {"score": [1]}), 'must answer {"scores": [...]}'),
        ((200, {"scores": [1, 2]}), "answered 2 scores for 1 samples"),
        ((200, {"scores": "1"}), "answered a string"),
    ],
)
def test_a_broken_answer_fails_clearly_without_retrying(serve, answer: tuple[int, Any], says: str) -> None:
    endpoint = serve(lambda n, body: answer)
    with pytest.raises(GraderUnavailable) as info:
        grade_batch(parse_grader(spec(endpoint.url)), [Sample("a")], [{"n": 1}])
    assert says in str(info.value) and len(endpoint.calls) == 1


def test_a_job_whose_http_grader_dies_fails_with_grader_unavailable(serve, tmp_path, models_dir) -> None:
    from tests.helpers.training import ListRecorder, config
    from worker.engine.errors import JobError
    from worker.engine.methods.rloo import train

    endpoint = serve(lambda n, body: (200, {"scores": [0.5] * len(body["samples"])}) if n <= 2 else (500, {}))
    rec = ListRecorder()
    with pytest.raises(JobError) as info:
        train(config(tmp_path, models_dir, spec(endpoint.url), max_steps=5), rec)
    assert info.value.code == "grader_unavailable" and "step 3" in info.value.message
    assert len(rec.steps) == 2


def test_dry_run_over_http_reports_a_dead_endpoint_as_502(serve, client, auth, dry_runs) -> None:
    endpoint = serve(length_scores, int(dry_runs["http_port"]))  # the port the graders worker allows
    url = "/v1/fine_tuning/alpha/graders/run"
    body = {"grader": spec(endpoint.url), "model_sample": "abcd", "item": {"n": 8}}
    resp = client.post(url, headers=auth, json=body)
    assert resp.status_code == 200 and resp.json()["reward"] == 0.5, resp.text
    endpoint.close()
    resp = client.post(url, headers=auth, json=body)
    assert resp.status_code == 502 and resp.json()["error"]["code"] == "grader_unavailable", resp.text


def test_a_huge_number_is_nan_not_a_crash(serve) -> None:
    endpoint = serve(lambda n, body: (200, {"scores": [10**400, 0.5]}))
    result = grade_batch(parse_grader(spec(endpoint.url)), [Sample("a"), Sample("b")], [{}, {}])
    assert math.isnan(result.rewards[0]) and result.rewards[1] == 0.5


@pytest.mark.parametrize("phase", ["status line", "body"])
def test_a_trickling_answer_is_cut_at_timeout_seconds(monkeypatch, phase: str) -> None:
    """httpx's timeouts are per read: an endpoint that sends a byte at a time would never time out.
    timeout_seconds bounds each attempt whole, its status line included."""
    import socket

    from service.core.db import reset_caches

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    port = server.getsockname()[1]

    def trickle() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            conn.recv(65536)
            head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
            try:
                if phase == "body":
                    conn.sendall(head)
                for byte in head if phase == "status line" else b" " * 1000:
                    conn.sendall(bytes([byte]))
                    time.sleep(0.05)
            except OSError:
                pass
            conn.close()

    threading.Thread(target=trickle, daemon=True).start()
    monkeypatch.setenv("RLOO_HTTP_GRADER_URLS", json.dumps([f"http://127.0.0.1:{port}/"]))
    reset_caches()
    try:
        t0 = time.monotonic()
        with pytest.raises(GraderUnavailable, match="no answer within 0.3 s"):
            grade_batch(parse_grader(spec(f"http://127.0.0.1:{port}/s", timeout_seconds=0.3)), [Sample("a")], [{}])
        assert time.monotonic() - t0 < 8  # 3 attempts of 0.3 s and 1.5 s of backoff (before: 50 s an attempt)
    finally:
        server.close()
        reset_caches()


def test_an_http_graders_job_scores_beside_the_reference_and_computes_the_same(
    serve, tmp_path, models_dir, monkeypatch
) -> None:
    """With a reference model (kl_coef > 0), an http grader scores on a thread while the reference
    forward runs; the same seed without the thread gives the same rewards, KL, loss and gradients."""
    from tests.helpers.training import ListRecorder, config
    from worker.engine import overlap
    from worker.engine.methods import rloo

    endpoint = serve(lambda _, body: (200, {"scores": [len(s["sample"]["output_text"]) / 4 for s in body["samples"]]}))
    keys = ("train_reward_mean", "kl", "loss", "grad_norm", "entropy")
    runs, flags = {}, []

    class Spy(overlap.Started):  # type: ignore[type-arg]
        def __init__(self, work, *, beside: bool) -> None:  # type: ignore[no-untyped-def]
            flags.append(beside)
            super().__init__(work, beside=beside)

    monkeypatch.setattr(rloo, "Started", Spy)
    for beside in (True, False):
        monkeypatch.setattr(rloo, "scored_elsewhere", lambda grader, on=beside: on)
        rec = ListRecorder()
        rloo.train(config(tmp_path / str(beside), models_dir, spec(endpoint.url), max_steps=3, kl_coef=0.05), rec)
        runs[beside] = [[m[k] for k in keys] for m in rec.steps]
    assert flags == [True] * 3 + [False] * 3
    assert runs[True] == runs[False]
    assert len({row[0] for row in runs[True]}) > 1  # the steps' rewards differ: the scores were used

"""Webhooks: OpenAI's endpoints API driven by the strict ``openai`` SDK, deliveries signed so that
the SDK's ``webhooks.unwrap`` verifies them, the URL rules, the outbox written with the change that
causes it, retries with back-off, and (on a live stack) a delivery that survives the receiver being
down and every process of the stack restarting, arriving once per ``webhook-id``."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import openai
import pytest

from service.infra import egress
from service.jobs import webhooks
from tests.helpers.api import assert_error, upload_ok
from tests.helpers.data import EXAMPLES, job_body
from tests.helpers.live import free_port, live_stack, upload_path, wait_for


class Receiver:
    """A webhook receiver on loopback: records each request's headers and body, answers
    ``status`` (a list is taken in turn, its last kept)."""

    def __init__(self, port: int = 0, status: int | list[int] = 200) -> None:
        self.got: list[tuple[dict[str, str], bytes]] = []
        self.statuses = status if isinstance(status, list) else [status]
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.got.append(({k.lower(): v for k, v in self.headers.items()}, body))
                code = receiver.statuses[0] if len(receiver.statuses) == 1 else receiver.statuses.pop(0)
                self.send_response(code)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/hooks"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver(monkeypatch: pytest.MonkeyPatch, env) -> Iterator[Receiver]:  # type: ignore[no-untyped-def]
    from service.core.db import reset_caches

    r = Receiver()
    monkeypatch.setenv("RLOO_WEBHOOK_URLS", json.dumps([f"http://127.0.0.1:{r.server.server_port}/"]))
    monkeypatch.setenv("RLOO_WEBHOOK_RETRY_BASE_SECONDS", "0.05")
    reset_caches()
    yield r
    r.close()


def _deliver() -> int:
    from service.core.db import session_scope
    from service.core.settings import get_settings

    with session_scope() as session:
        return webhooks.deliver_due(session, get_settings())


# Signatures and URL rules -------------------------------------------------------------------------
def test_a_delivery_is_signed_so_that_the_openai_sdk_verifies_it() -> None:
    secret = webhooks.new_secret()
    payload = webhooks.event("fine_tuning.job.succeeded", "ftjob-abc")
    body = webhooks.body_of(payload)

    class Endpoint:
        old_secret, old_secret_until = None, None

    endpoint = Endpoint()
    endpoint.secret = secret  # type: ignore[attr-defined]
    headers = webhooks.headers_for(endpoint, "msg_1", body, int(time.time()))  # type: ignore[arg-type]
    client = openai.OpenAI(api_key="unused")
    event = client.webhooks.unwrap(body, headers, secret=secret)
    assert event.type == "fine_tuning.job.succeeded" and event.data.id == "ftjob-abc" and event.id == payload["id"]
    with pytest.raises(openai.InvalidWebhookSignatureError):
        client.webhooks.unwrap(body.replace(b"abc", b"abd"), headers, secret=secret)  # tampered
    with pytest.raises(openai.InvalidWebhookSignatureError):
        client.webhooks.unwrap(body, headers, secret=webhooks.new_secret())  # another secret
    # A rotation that keeps the old secret active signs under both: either verifies.
    endpoint.old_secret, endpoint.old_secret_until = secret, int(time.time()) + 60  # type: ignore[assignment]
    endpoint.secret = webhooks.new_secret()  # type: ignore[attr-defined]
    both = webhooks.headers_for(endpoint, "msg_2", body, int(time.time()))  # type: ignore[arg-type]
    assert len(both["webhook-signature"].split()) == 2
    client.webhooks.verify_signature(body, both, secret=secret)
    client.webhooks.verify_signature(body, both, secret=endpoint.secret)  # type: ignore[attr-defined]


def _resolver(mapping: dict[str, str]) -> Any:
    def resolve(host: str, port: int) -> list[str]:
        if host not in mapping:
            raise OSError("unknown host")
        return [mapping[host]]

    return resolve


@pytest.mark.parametrize(
    ("url", "allowed", "says"),
    [
        ("http://hooks.example.com/x", [], "must be https"),
        ("https://internal.example.com/x", [], "private, loopback or link-local"),  # 10.0.0.7
        ("https://metadata.example.com/x", [], "private, loopback or link-local"),  # 169.254.169.254
        ("https://loop6.example.com/x", [], "private, loopback or link-local"),  # ::1
        ("https://nowhere.example.com/x", [], "does not resolve"),
        ("https://user:pw@hooks.example.com/x", [], "credentials"),
        ("https://hooks.example.com/a/../admin", [], "'..'"),
        ("http://127.0.0.1:9/other", ["http://127.0.0.1:9/hooks"], "must be https"),  # outside the prefix
    ],
)
def test_webhook_urls_outside_the_rules_are_refused_naming_the_rule(url: str, allowed: list[str], says: str) -> None:
    resolve = _resolver(
        {
            "hooks.example.com": "93.184.216.34",
            "internal.example.com": "10.0.0.7",
            "metadata.example.com": "169.254.169.254",
            "loop6.example.com": "::1",
        }
    )
    with pytest.raises(egress.RefusedURL, match=says):
        egress.check_url(url, allowed, resolve=resolve)


def test_webhook_urls_inside_the_rules_are_admitted() -> None:
    resolve = _resolver({"hooks.example.com": "93.184.216.34"})
    egress.check_url("https://hooks.example.com/x", [], resolve=resolve)
    egress.check_url("http://127.0.0.1:9/hooks/a", ["http://127.0.0.1:9/hooks"], resolve=resolve)  # the operator's


# The API, through the SDK -------------------------------------------------------------------------
def test_the_sdk_manages_endpoints_in_strict_mode(sdk: openai.OpenAI, receiver: Receiver, client, other_auth) -> None:  # type: ignore[no-untyped-def]
    made = sdk.webhooks.create(name="ci", url=receiver.url, event_types=["fine_tuning.job.succeeded"])
    assert made.signing_secret.startswith("whsec_") and made.object == "webhook_endpoint"
    assert made.signing_secret_hint == webhooks.hint(made.signing_secret)
    got = sdk.webhooks.retrieve(made.id)
    assert got.url == receiver.url and not hasattr(got, "signing_secret")
    assert [e.id for e in sdk.webhooks.list()] == [made.id]
    updated = sdk.webhooks.update(made.id, event_types=["fine_tuning.job.failed", "fine_tuning.job.cancelled"])
    assert updated.event_types == ["fine_tuning.job.failed", "fine_tuning.job.cancelled"]
    rotated = sdk.webhooks.rotate_secret(made.id, keep_old_secret_active_for_24_hours=True)
    assert rotated.signing_secret != made.signing_secret
    tested = sdk.webhooks.test(made.id, event_type="fine_tuning.job.failed")
    assert tested.status_code == 200 and tested.success
    headers, body = receiver.got[-1]
    sdk.webhooks.verify_signature(body, headers, secret=rotated.signing_secret)
    sdk.webhooks.verify_signature(body, headers, secret=made.signing_secret)  # kept active a day
    path = f"/v1/webhook_endpoints/{made.id}"
    assert_error(client.get(path, headers=other_auth), 404)  # another project's
    assert sdk.webhooks.delete(made.id).deleted is True
    with pytest.raises(openai.NotFoundError):
        sdk.webhooks.retrieve(made.id)


def test_bad_endpoints_are_400s_naming_the_field(client, auth, receiver: Receiver) -> None:  # type: ignore[no-untyped-def]
    def create(**body: Any) -> Any:
        return client.post("/v1/webhook_endpoints", headers=auth, json={"name": "x", "url": receiver.url, **body})

    assert_error(create(url="http://example.com/x", event_types=["fine_tuning.job.failed"]), 400, param="url")
    assert_error(create(event_types=["batch.completed"]), 400, param="event_types.0")
    assert_error(create(event_types=[]), 400, param="event_types")


@pytest.mark.parametrize("status", [302, 500, 404])
def test_a_test_event_succeeds_only_on_a_2xx(client, auth, receiver: Receiver, status: int) -> None:  # type: ignore[no-untyped-def]
    body = {"name": "t", "url": receiver.url, "event_types": ["fine_tuning.job.succeeded"]}
    made = client.post("/v1/webhook_endpoints", headers=auth, json=body).json()
    receiver.statuses = [status]
    r = client.post(f"/v1/webhook_endpoints/{made['id']}/test", headers=auth, json={})
    assert r.status_code == 200 and (r.json()["status_code"], r.json()["success"]) == (status, False), r.text


def test_a_test_event_to_a_trickling_receiver_ends_at_the_deadline_and_a_project_sends_two_at_once(
    client, auth, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    """The status line a byte every 0.3 s held the request ~150 s (httpx's time-out is per read); now
    the test event has RLOO_WEBHOOK_TIMEOUT_SECONDS in all, and a project's third at once is a 429."""
    import socket

    from service.core.db import reset_caches

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    port = server.getsockname()[1]

    def trickle(conn: Any) -> None:
        try:
            conn.recv(65536)
            for byte in b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n":
                conn.sendall(bytes([byte]))
                time.sleep(0.3)
        except OSError:
            pass
        conn.close()

    def accept() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=trickle, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    monkeypatch.setenv("RLOO_WEBHOOK_URLS", json.dumps([f"http://127.0.0.1:{port}/"]))
    monkeypatch.setenv("RLOO_WEBHOOK_TIMEOUT_SECONDS", "1")
    reset_caches()
    try:
        body = {"name": "t", "url": f"http://127.0.0.1:{port}/h", "event_types": ["fine_tuning.job.succeeded"]}
        made = client.post("/v1/webhook_endpoints", headers=auth, json=body).json()
        answers: list[tuple[int, str, float]] = []

        def send() -> None:
            t0 = time.monotonic()
            r = client.post(f"/v1/webhook_endpoints/{made['id']}/test", headers=auth, json={})
            answers.append((r.status_code, r.json()["error"]["code"], time.monotonic() - t0))

        threads = [threading.Thread(target=send) for _ in range(5)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
        codes = sorted((status, code) for status, code, _ in answers)
        assert codes == [(429, "rate_limit_exceeded")] * 3 + [(502, "webhook_unreachable")] * 2, answers
        assert max(took for *_, took in answers) < 5, answers  # before: ~11 s, the status line trickled whole
    finally:
        server.close()
        reset_caches()


# The outbox and its sender ------------------------------------------------------------------------
def test_a_state_change_writes_its_delivery_and_the_sender_retries_until_it_is_taken(
    sdk: openai.OpenAI, client, auth, receiver: Receiver
) -> None:  # type: ignore[no-untyped-def]
    """Cancelling a job writes one delivery with the cancel; a 503 and a 500 are tried again after
    a back-off, a 200 delivers it, and nothing is sent twice after that."""
    made = sdk.webhooks.create(name="ci", url=receiver.url, event_types=["fine_tuning.job.cancelled"])
    other = sdk.webhooks.create(name="no", url=receiver.url, event_types=["fine_tuning.job.succeeded"])
    receiver.statuses = [503, 500, 200]
    job = client.post("/v1/fine_tuning/jobs", headers=auth, json=job_body(upload_ok(client, auth)["id"])).json()
    assert client.post(f"/v1/fine_tuning/jobs/{job['id']}/cancel", headers=auth).status_code == 200
    deliveries = client.get(f"/v1/webhook_endpoints/{made.id}/deliveries", headers=auth).json()["data"]
    assert [(d["status"], d["event"]["type"], d["event"]["data"]["id"]) for d in deliveries] == [
        ("pending", "fine_tuning.job.cancelled", job["id"])
    ]
    assert client.get(f"/v1/webhook_endpoints/{other.id}/deliveries", headers=auth).json()["data"] == []
    deadline = time.monotonic() + 10
    while len(receiver.got) < 3 and time.monotonic() < deadline:
        _deliver()
        time.sleep(0.05)
    assert _deliver() == 0 and len(receiver.got) == 3
    (d,) = client.get(f"/v1/webhook_endpoints/{made.id}/deliveries", headers=auth).json()["data"]
    assert (d["status"], d["attempts"], d["last_status_code"]) == ("delivered", 3, 200)
    ids = {h["webhook-id"] for h, _ in receiver.got}
    assert ids == {d["id"]}  # one webhook-id on every attempt: a receiver can drop repeats
    event = sdk.webhooks.unwrap(receiver.got[-1][1], receiver.got[-1][0], secret=made.signing_secret)
    assert event.type == "fine_tuning.job.cancelled" and event.data.id == job["id"]


def test_a_receiver_that_refuses_fails_the_delivery_without_retrying(
    sdk: openai.OpenAI, client, auth, receiver: Receiver
) -> None:  # type: ignore[no-untyped-def]
    made = sdk.webhooks.create(name="ci", url=receiver.url, event_types=["fine_tuning.job.cancelled"])
    receiver.statuses = [410]
    job = client.post("/v1/fine_tuning/jobs", headers=auth, json=job_body(upload_ok(client, auth)["id"])).json()
    client.post(f"/v1/fine_tuning/jobs/{job['id']}/cancel", headers=auth)
    assert _deliver() == 1 and _deliver() == 0
    (d,) = client.get(f"/v1/webhook_endpoints/{made.id}/deliveries", headers=auth).json()["data"]
    assert (d["status"], d["attempts"], d["last_status_code"]) == ("failed", 1, 410)


class Silent:
    """A receiver on loopback that takes connections and never answers; counts them at once."""

    def __init__(self) -> None:
        import socket

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/hooks"
        self.open = self.most = 0
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._hold, args=(conn,), daemon=True).start()

    def _hold(self, conn: Any) -> None:
        with self.lock:
            self.open += 1
            self.most = max(self.most, self.open)
        try:
            while conn.recv(65536):  # read what comes, answer nothing, until the sender hangs up
                pass
        except OSError:
            pass
        finally:
            conn.close()
            with self.lock:
                self.open -= 1

    def close(self) -> None:
        self.sock.close()


def test_one_projects_stuck_receivers_hold_two_senders_and_others_deliver_at_once(
    client, auth, other_auth, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    """A project whose receivers never answer, with many deliveries due before another project's:
    it holds at most half the senders (one attempt at a time an endpoint), the other project's
    deliveries go out at once, and no delivery is claimed twice while its attempt is in flight."""
    from service.core.db import reset_caches, session_scope
    from service.core.tables import WebhookDelivery, WebhookEndpoint

    stuck, fine = Silent(), Receiver()
    allowed = [stuck.url.rsplit("/", 1)[0] + "/", fine.url.rsplit("/", 1)[0] + "/"]
    monkeypatch.setenv("RLOO_WEBHOOK_URLS", json.dumps(allowed))
    monkeypatch.setenv("RLOO_WEBHOOK_TIMEOUT_SECONDS", "3")
    reset_caches()
    made = {}
    for name, headers, url in [
        ("a1", auth, stuck.url),
        ("a2", auth, stuck.url),
        ("a3", auth, stuck.url),
        ("b", other_auth, fine.url),
    ]:
        body = {"name": name, "url": url, "event_types": ["fine_tuning.job.succeeded"]}
        r = client.post("/v1/webhook_endpoints", headers=headers, json=body)
        assert r.status_code == 200, r.text
        made[name] = r.json()["id"]
    with session_scope() as session:
        seqs = {e.id: e.seq for e in session.query(WebhookEndpoint)}
        t = time.time()
        for i, name in enumerate(["a1", "a2", "a3"] * 4 + ["b"] * 3):  # the stuck project's are due first
            payload = webhooks.event("fine_tuning.job.succeeded", f"ftjob-{i}")
            session.add(
                WebhookDelivery(
                    endpoint_seq=seqs[made[name]],
                    event_type=payload["type"],
                    payload=payload,
                    next_attempt_at=t - 100 + i,
                )
            )
        session.commit()

    # Attempts in flight to the stuck project's receivers, counted where they are made: the receiver
    # sees a closed connection only when its thread next runs, so on a loaded machine its own count
    # can overlap a finished attempt with the next one (3 seen where the senders held 2).
    real_send, lock, sending = webhooks.send, threading.Lock(), {"now": 0, "most": 0}

    def counted_send(endpoint: Any, *args: Any, **kwargs: Any) -> Any:
        if endpoint.url != stuck.url:
            return real_send(endpoint, *args, **kwargs)
        with lock:
            sending["now"] += 1
            sending["most"] = max(sending["most"], sending["now"])
        try:
            return real_send(endpoint, *args, **kwargs)
        finally:
            with lock:
                sending["now"] -= 1

    monkeypatch.setattr(webhooks, "send", counted_send)
    going = True

    def sender() -> None:
        from service.core.settings import get_settings

        while going:
            with session_scope() as session:
                if not webhooks.deliver_due(session, get_settings(), limit=1):
                    time.sleep(0.05)

    threads = [threading.Thread(target=sender, daemon=True) for _ in range(webhooks.SENDERS)]
    try:
        t0 = time.monotonic()
        for thread in threads:
            thread.start()
        while len(fine.got) < 3 and time.monotonic() - t0 < 10:
            time.sleep(0.02)
        took = time.monotonic() - t0
        assert len(fine.got) == 3 and took < 4.0, took  # before: behind 12 attempts of 3 s of the stuck ones (9 s)
        time.sleep(3.5)
        assert 1 <= sending["most"] <= webhooks.SENDERS // 2 and stuck.most >= 1  # (the receiver saw them)
        with session_scope() as session:
            attempts = [
                d.attempts
                for d in session.query(WebhookDelivery).where(WebhookDelivery.endpoint_seq != seqs[made["b"]])
            ]
        assert max(attempts) <= 1 and sum(attempts) >= 2  # retried later (back-off), never while in flight
    finally:
        going = False
        for thread in threads:
            thread.join(timeout=10)
        stuck.close()
        fine.close()
        reset_caches()


# Durable, through restarts ------------------------------------------------------------------------
@pytest.mark.e2e
@pytest.mark.parametrize("kind", ["embedded", "production"])
def test_a_delivery_survives_a_dead_receiver_and_a_restart_of_every_process(
    kind: str, tmp_path: Path, models_dir: Path
) -> None:
    port = free_port()  # nothing listens: connection refused
    url = f"http://127.0.0.1:{port}/hooks"
    env = {"RLOO_WEBHOOK_URLS": json.dumps([f"http://127.0.0.1:{port}/"]), "RLOO_WEBHOOK_RETRY_BASE_SECONDS": "0.5"}
    with live_stack(kind, tmp_path, models_dir, env=env) as stack:
        http = stack.http
        made = http.post(
            "/webhook_endpoints",
            json={
                "name": "ci",
                "url": url,
                "event_types": ["fine_tuning.job.succeeded", "fine_tuning.job.checkpoint.created"],
            },
        ).json()
        file_id = upload_path(http, EXAMPLES / "demo" / "train.jsonl")
        job_id = http.post("/fine_tuning/jobs", json=job_body(file_id, hp={"max_steps": 2})).json()["id"]
        assert wait_for(http, job_id, {"succeeded", "failed"}, 180, stack)["status"] == "succeeded"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # attempts made and refused
            rows = http.get(f"/webhook_endpoints/{made['id']}/deliveries").json()["data"]
            if len(rows) == 2 and all(d["last_error"] for d in rows):  # (claimed and sent: answered)
                break
            time.sleep(0.2)
        assert all(d["status"] == "pending" and "could not connect" in (d["last_error"] or "") for d in rows), rows
        for name in list(stack.procs):  # every process of the stack, the embedded Redis with them
            stack.stop(name)
        if kind == "embedded":
            from service.core.settings import Settings
            from service.infra import embedded_redis

            embedded_redis.stop_daemon(Settings(home=tmp_path / "var"))
        receiver = Receiver(port)
        try:
            stack.start("api", "api", "--port", str(stack.port))
            stack.start("worker", "worker", "--loglevel", "INFO")
            stack.wait_ready()
            deadline = time.monotonic() + 60
            while len(receiver.got) < 2 and time.monotonic() < deadline:
                time.sleep(0.2)
            time.sleep(2)  # room for a duplicate to show, were there one
        finally:
            receiver.close()
        got = [json.loads(body) for _, body in receiver.got]
        assert sorted(e["type"] for e in got) == ["fine_tuning.job.checkpoint.created", "fine_tuning.job.succeeded"]
        assert len({h["webhook-id"] for h, _ in receiver.got}) == len(receiver.got) == 2, stack.log_tail()
        sdk = openai.OpenAI(api_key="unused")
        for headers, body in receiver.got:
            sdk.webhooks.verify_signature(body, headers, secret=made["signing_secret"])
        rows = http.get(f"/webhook_endpoints/{made['id']}/deliveries").json()["data"]
        assert {d["status"] for d in rows} == {"delivered"}


@pytest.mark.parametrize("url", ["https://a.io:99999/x", "https://a.io:abc/x", "https://[::1/x", "https://a..b/x"])
def test_a_url_that_does_not_parse_is_refused_not_a_crash(url: str) -> None:
    with pytest.raises(egress.RefusedURL):
        egress.check_url(url, [])

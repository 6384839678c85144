"""What a hostile tenant tried against the API, each refused at the door with a 400 that
says where, and nothing stored: values JSON cannot hold, names the file system refuses, nesting
without end, races between two requests, and a project taking every place in the queue."""

from __future__ import annotations

import json
import math
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from tests.helpers.api import assert_error, create_job, each, make_key, upload, upload_ok
from tests.helpers.data import JOB_JSON, STRING_CHECK, job_body

JOBS = "/v1/fine_tuning/jobs"


def _raw(client: Any, auth: dict[str, str], url: str, text: str) -> Any:
    """POST ``text`` as it is: json.dumps cannot write NaN into valid JSON the way an attacker can."""
    return client.post(url, headers={**auth, "Content-Type": "application/json"}, content=text.encode())


def _job_text(file_id: str, hp_extra: str = "", **replace: str) -> str:
    text = json.dumps(job_body(file_id))
    for old, new in replace.items():
        text = text.replace(old, new)
    if hp_extra:
        text = text.replace('"hyperparameters": {', '"hyperparameters": {' + hp_extra + ", ")
    return text


def test_values_json_cannot_hold_are_refused_and_no_job_is_made(client, auth) -> None:
    file_id = upload_ok(client, auth)["id"]
    grader = JOB_JSON["method"]["reinforcement"]["grader"]["name"]
    deep = "[" * 300 + "]" * 300
    cases = {
        "metadata.k": _job_text(file_id).replace('"seed"', '"metadata": {"k": "\\udfff"}, "seed"'),
        "method.reinforcement.grader.name": _job_text(file_id, **{f'"name": "{grader}"': '"name": "a\\ud800"'}),
        "method.reinforcement.hyperparameters.reward_clip": _job_text(file_id, '"reward_clip": 1e309'),
        "method.reinforcement.hyperparameters.max_grad_norm": _job_text(file_id, '"max_grad_norm": Infinity'),
        "method.reinforcement.hyperparameters.learning_rate_multiplier": _job_text(
            file_id, '"learning_rate_multiplier": NaN'
        ),
        "integrations": _job_text(file_id).replace('"seed"', f'"integrations": {deep}, "seed"'),
    }

    def check(param: str) -> None:
        resp = _raw(client, auth, JOBS, cases[param])
        err = assert_error(resp, 400, code="invalid_value")
        if param != "integrations":  # too deep is found where it goes too deep
            assert err["param"] == param, err
        assert "not valid JSON" in err["message"], err

    each(list(cases), check)
    assert client.get(JOBS, headers=auth).json()["data"] == []  # none was made, none breaks the list


def test_a_body_that_is_not_utf8_cannot_smuggle_them_past(client, auth) -> None:
    """json.loads(bytes) reads UTF-16, and UTF-8 with encoded surrogates: the door decodes strictly."""
    file_id = upload_ok(client, auth)["id"]
    text = json.dumps(job_body(file_id)).replace('"seed"', '"metadata": {"k": "X"}, "seed"')
    cases = {
        "utf-16, a NUL escape": text.replace("X", "\\u0000").encode("utf-16"),
        "utf-16, a surrogate escape": text.replace("X", "\\ud800").encode("utf-16"),
        "an encoded surrogate": text.replace("X", "\ud800").encode("utf-8", "surrogatepass"),
    }

    def check(name: str) -> None:
        resp = client.post(JOBS, headers={**auth, "Content-Type": "application/json"}, content=cases[name])
        assert_error(resp, 400, contains="not UTF-8")

    each(list(cases), check)
    assert client.get(JOBS, headers=auth).json()["data"] == []


def test_grader_dry_runs_and_validation_refuse_them_too(client, auth) -> None:
    cases = [
        (
            "/v1/fine_tuning/alpha/graders/run",
            json.dumps({"grader": {**STRING_CHECK, "name": "X"}, "model_sample": "a"}).replace('"X"', '"\\ud800"'),
            "grader.name",
        ),
        (
            "/v1/fine_tuning/alpha/graders/validate",
            json.dumps({"grader": {**STRING_CHECK, "X": 1}}).replace('"X"', '"\\ud800"'),
            "grader.\\ud800",
        ),
        (
            "/v1/fine_tuning/alpha/graders/run",
            '{"grader": ' + json.dumps(STRING_CHECK) + ', "model_sample": "a", '
            '"item": {"x": ' + "[" * 500 + "]" * 500 + "}}",
            None,
        ),
    ]

    def check(url: str, text: str, param: str | None) -> None:
        err = assert_error(_raw(client, auth, url, text), 400)
        assert param is None or err["param"] == param, err

    each(cases, check)


def test_an_item_deeper_or_larger_than_a_training_line_is_refused(client, auth, monkeypatch) -> None:
    from service.core.db import reset_caches

    url = "/v1/fine_tuning/alpha/graders/run"
    nested: Any = "x"
    for _ in range(101):
        nested = [nested]
    resp = client.post(url, headers=auth, json={"grader": STRING_CHECK, "model_sample": "a", "item": {"x": nested}})
    assert_error(resp, 400, param="item", contains="100 levels")
    monkeypatch.setenv("RLOO_MAX_LINE_BYTES", "1000")
    reset_caches()
    resp = client.post(url, headers=auth, json={"grader": STRING_CHECK, "model_sample": "a", "item": {"x": "y" * 2000}})
    assert_error(resp, 400, param="item", contains="RLOO_MAX_LINE_BYTES")


@pytest.mark.parametrize(
    ("line", "says"),
    [
        (b'{"prompt": "a\\ud800"}', "lone surrogate (\\ud800)"),
        (b'{"prompt": "a", "answer": NaN}', "NaN is not a finite number"),
        (b'{"prompt": "a", "answer": 1e999}', "1e999 is not a finite number"),
        (b'{"prompt": "a", "meta": {"k": [1, -Infinity]}}', "(at meta.k[1])"),
        (b'{"prompt": "a", "answer": "x\\u0000"}', "NUL character"),
    ],
)
def test_an_upload_with_such_a_line_is_refused_naming_it(client, auth, line: bytes, says: str) -> None:
    resp = upload(client, auth, b'{"prompt": "fine"}\n' + line + b"\n")
    err = assert_error(resp, 400, param="file")
    assert "Line 2" in err["message"] and says in err["message"], err
    assert client.get("/v1/files", headers=auth).json()["data"] == []


def test_a_stored_row_that_cannot_be_rendered_never_breaks_a_page(client, auth, env) -> None:
    """Rows stored before the door was shut: a lone surrogate and a NaN in a job, listed with others."""
    from sqlalchemy import text

    from service.core.db import session_scope

    if not env["DATABASE_URL"].startswith("sqlite"):
        pytest.skip("PostgreSQL never stored such a value (its json refuses NaN)")
    file_id = upload_ok(client, auth)["id"]
    bad, good = (create_job(client, auth, job_body(file_id, seed=i))["id"] for i in range(2))
    with session_scope() as session:
        session.execute(
            text("UPDATE jobs SET metadata = :m, hyperparameters = :h WHERE id = :id"),
            {"m": '{"k": "\\udfff"}', "h": '{"reward_clip": NaN}', "id": bad},
        )
        session.commit()
    page = client.get(JOBS, headers=auth)
    assert page.status_code == 200, page.text
    assert [j["id"] for j in page.json()["data"]] == [good, bad]
    one = client.get(f"{JOBS}/{bad}", headers=auth).json()
    assert one["metadata"] == {"k": "\udfff"} and one["hyperparameters"]["reward_clip"] is None
    assert client.post(f"{JOBS}/{bad}/cancel", headers=auth).status_code == 200


def test_a_model_name_the_file_system_refuses_is_a_400(client, auth) -> None:
    file_id = upload_ok(client, auth)["id"]
    reward_model = {"type": "reward_model", "name": "rm", "model": "r" * 300}
    body = job_body(file_id)
    body["method"]["reinforcement"]["grader"] = reward_model
    cases = [
        ("model", job_body(file_id, model="m" * 300)),
        ("method.reinforcement.grader.model", body),
        ("model", job_body(file_id, model="a/" + "b" * 256 + "/c")),
    ]

    def check(param: str, job: dict[str, Any]) -> None:
        assert_error(client.post(JOBS, headers=auth, json=job), 400, param=param, contains="255 bytes")

    each(cases, check)


def test_metrics_answer_loopback_or_the_operators_token(env, monkeypatch) -> None:
    from tests.helpers.api import fresh_client

    with fresh_client(monkeypatch) as local:  # conftest's LOCAL address
        assert local.get("/metrics").status_code == 200
    from fastapi.testclient import TestClient

    from service.main import create_app

    with TestClient(create_app(), client=("203.0.113.7", 4000)) as remote:
        assert_error(remote.get("/metrics"), 403, code="metrics_forbidden", contains="RLOO_METRICS_TOKEN")
    monkeypatch.setenv("RLOO_METRICS_TOKEN", "s3cret")
    from service.core.db import reset_caches

    reset_caches()
    with TestClient(create_app(), client=("203.0.113.7", 4000)) as remote:
        assert_error(remote.get("/metrics"), 401)
        assert_error(remote.get("/metrics", headers={"Authorization": "Bearer wrong"}), 401)
        resp = remote.get("/metrics", headers={"Authorization": "Bearer s3cret"})
        assert resp.status_code == 200 and "rloo_jobs" in resp.text


def test_a_project_has_a_cap_of_waiting_jobs(client, auth, monkeypatch) -> None:
    from service.core.db import reset_caches

    monkeypatch.setenv("RLOO_MAX_QUEUED_JOBS", "2")
    reset_caches()
    file_id = upload_ok(client, auth)["id"]
    jobs = [create_job(client, auth, job_body(file_id, seed=i)) for i in range(2)]
    err = assert_error(client.post(JOBS, headers=auth, json=job_body(file_id)), 429, code="too_many_queued_jobs")
    assert "RLOO_MAX_QUEUED_JOBS=2" in err["message"]
    # Another project is not held up by this one.
    beta = {"Authorization": f"Bearer {make_key('beta')}"}
    create_job(client, beta, job_body(upload_ok(client, beta)["id"]))
    client.post(f"{JOBS}/{jobs[0]['id']}/cancel", headers=auth)
    create_job(client, auth, job_body(file_id))  # a place came free


def test_resuming_counts_against_the_cap_of_waiting_jobs(client, auth, monkeypatch) -> None:
    """Create answered 429 at the cap while resume answered 200: pause and resume cycles made the cap
    unbounded. A resumed job waits for a worker as a new one does."""
    from service.core.db import reset_caches, session_scope
    from service.core.tables import Job

    monkeypatch.setenv("RLOO_MAX_QUEUED_JOBS", "2")
    reset_caches()
    file_id = upload_ok(client, auth)["id"]
    paused = create_job(client, auth, job_body(file_id))["id"]
    with session_scope() as session:  # it ran, was paused, and its worker let go
        session.query(Job).filter(Job.id == paused).update({"status": "paused", "worker": None})
        session.commit()
    waiting = [create_job(client, auth, job_body(file_id, seed=i))["id"] for i in range(2)]
    err = assert_error(client.post(f"{JOBS}/{paused}/resume", headers=auth), 429, code="too_many_queued_jobs")
    assert "RLOO_MAX_QUEUED_JOBS=2" in err["message"] and "resume" in err["message"]
    assert client.get(f"{JOBS}/{paused}", headers=auth).json()["status"] == "paused"  # nothing changed
    client.post(f"{JOBS}/{waiting[0]}/cancel", headers=auth)
    resp = client.post(f"{JOBS}/{paused}/resume", headers=auth)
    assert resp.status_code == 200 and resp.json()["status"] == "queued", resp.text


def test_a_file_deleted_while_a_job_using_it_is_created_one_of_the_two_loses(env, auth, monkeypatch) -> None:
    """Both at once, 31 times: never a job on a deleted file (it would fail later with file_not_found)."""
    from tests.helpers.api import fresh_client

    with fresh_client(monkeypatch, RLOO_RATE_LIMIT="0") as client, ThreadPoolExecutor(2) as pool:
        for _ in range(31):
            file_id = upload_ok(client, auth)["id"]
            create = pool.submit(client.post, JOBS, headers=auth, json=job_body(file_id))
            delete = pool.submit(client.delete, f"/v1/files/{file_id}", headers=auth)
            made, deleted = create.result(), delete.result()
            assert (made.status_code, deleted.status_code) in ((200, 409), (400, 200)), (made.text, deleted.text)
            if made.status_code == 200:
                client.post(f"{JOBS}/{made.json()['id']}/cancel", headers=auth)
            else:
                assert made.json()["error"]["code"] == "file_not_found"


def test_fuzzy_match_reads_at_most_the_cap_of_each_string(monkeypatch) -> None:
    """Every metric reads SIMILARITY_MAX_CHARS of each string (fuzzy_match read everything: a 2M
    character sample took minutes): strings equal up to the cap score as equal."""
    from service.graders import similarity

    monkeypatch.setattr(similarity, "SIMILARITY_MAX_CHARS", 300)
    head = "the same words in the same order " * 10  # 330 characters
    for name, metric in similarity.TEXT_SIMILARITY_METRICS.items():
        score = metric(head + "tail one " * 50, head + "quite another ending " * 50)
        assert math.isclose(score, 1.0, abs_tol=1e-3), (name, score)


# Work a body makes on the event loop ---------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "says"),
    [
        ('{"x": [' + ",".join(["{}"] * 2_700_000) + "]}", "more than 100,000 arrays and objects"),
        ('{"model": "m", "prompt": [' + ",".join(["0"] * 1_500_000) + "]}", "more than 1,000,000 values"),
    ],
    ids=["2.7M empty objects", "1.5M numbers"],
)
def test_a_body_of_millions_of_values_is_a_413_before_it_is_parsed_and_the_loop_stays_free(
    client, auth, text: str, says: str
) -> None:
    """2.7M empty objects held the event loop 18.6 s (one request) while strictjson walked them: every
    route of every tenant, /healthz included, stalled. Now they are counted in the raw text first."""
    import threading
    import time

    latencies: list[float] = []
    done = threading.Event()

    def poll() -> None:
        while not done.is_set():
            t0 = time.monotonic()
            assert client.get("/healthz").status_code == 200
            latencies.append(time.monotonic() - t0)
            time.sleep(0.01)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        answers = []
        with ThreadPoolExecutor(4) as pool:
            for resp in pool.map(lambda _: _raw(client, auth, "/v1/completions", text), range(4)):
                answers.append(resp)
    finally:
        done.set()
        poller.join()
    for resp in answers:
        err = assert_error(resp, 413, code="request_too_large")
        assert says in err["message"] and "uploaded file" in err["message"], err
    assert latencies and max(latencies) < 5.0, max(latencies)  # before: 6 s a body here, 95 s for four elsewhere


def test_brackets_and_commas_inside_strings_are_text_not_structure(client, auth, monkeypatch) -> None:
    """The raw count is a bound; a body past it is counted again with its strings left out."""
    from service.core.db import reset_caches

    monkeypatch.setenv("RLOO_INFERENCE_MAX_TOKENS_IN_FLIGHT", str(10**7))  # its prompt's tokens are not the point
    reset_caches()
    content = "f(x[i], y[j]) {a, b} " * 40_000  # 120,000 brackets and 80,000 commas inside one string
    body = {"model": "no-such-model", "messages": [{"role": "user", "content": content}]}
    resp = client.post("/v1/chat/completions", headers=auth, json=body)
    assert resp.status_code == 404, resp.text  # read whole: the model is what is wrong


def _request_bodies(spec: dict[str, Any]) -> list[str]:
    names = []
    for ops in spec["paths"].values():
        for op in ops.values():
            for content in (op.get("requestBody") or {}).get("content", {}).values():
                text = json.dumps(content["schema"])
                names += [ref.split("/")[-1] for ref in _refs(text)]
    return sorted(set(names))


def _refs(text: str) -> list[str]:
    import re

    return re.findall(r"#/components/schemas/([A-Za-z0-9_.\-]+)", text)


def test_every_list_and_typed_map_a_request_body_holds_is_bounded(app) -> None:
    """A list of a million invalid items is a million validation errors made on the event loop (1.2 s
    for 100,000 prompts before this bound): every array in every request body's schema has a
    maxItems, and every object whose values are typed a maxProperties (free-form objects are not
    validated value by value). New routes inherit the rule."""
    spec = app.openapi()
    schemas = spec["components"]["schemas"]
    unbounded: list[str] = []
    seen: set[str] = set()
    todo = _request_bodies(spec)
    while todo:
        name = todo.pop()
        if name in seen or name not in schemas:
            continue
        seen.add(name)
        stack: list[tuple[Any, str]] = [(schemas[name], name)]
        while stack:
            node, path = stack.pop()
            if isinstance(node, dict):
                if node.get("type") == "array" and "maxItems" not in node:
                    unbounded.append(path)
                extra, names = node.get("additionalProperties"), node.get("propertyNames") or {}
                few_names = "const" in names or "enum" in names  # a map of a few named keys is bounded
                if (
                    node.get("type") == "object"
                    and isinstance(extra, dict)
                    and extra
                    and not few_names
                    and ("maxProperties" not in node)
                ):
                    unbounded.append(path)
                stack += [(v, f"{path}.{k}") for k, v in node.items()]
            elif isinstance(node, list):
                stack += [(v, f"{path}[{i}]") for i, v in enumerate(node)]
        todo += _refs(json.dumps(schemas[name]))
    assert len(seen) > 10 and unbounded == [], unbounded


def test_a_job_keeps_at_most_the_servers_cap_of_checkpoints(client, auth, monkeypatch) -> None:
    """A checkpoint every step of a long job, all kept, would fill any disk (and each merged export
    of a 7B base is ~28 GB): refused at creation past RLOO_MAX_KEPT_CHECKPOINTS, saying what to change."""
    from service.core.db import reset_caches

    monkeypatch.setenv("RLOO_MAX_KEPT_CHECKPOINTS", "5")
    reset_caches()
    file_id = upload_ok(client, auth)["id"]
    hp = "method.reinforcement.hyperparameters"
    every_step = job_body(file_id, hp={"max_steps": 10, "checkpoint_interval": 1})
    err = assert_error(client.post(JOBS, headers=auth, json=every_step), 400, param=f"{hp}.checkpoint_interval")
    assert "keep 11 checkpoints" in err["message"] and "RLOO_MAX_KEPT_CHECKPOINTS" in err["message"]
    too_many = job_body(file_id, hp={"max_steps": 10, "checkpoint_interval": 1, "keep_checkpoints": 6})
    assert_error(client.post(JOBS, headers=auth, json=too_many), 400, param=f"{hp}.keep_checkpoints")
    create_job(client, auth, job_body(file_id, hp={"max_steps": 10, "checkpoint_interval": 1, "keep_checkpoints": 5}))
    create_job(client, auth, job_body(file_id, hp={"max_steps": 10, "checkpoint_interval": 3}))  # 4 in all


def test_the_count_between_strings_is_linear_whatever_the_quotes() -> None:
    """A string scanner that restarts at each quote (a regex over string literals) took minutes on
    180 KB of unmatched escaped quotes past the bracket bound, holding the interpreter's lock (and so
    every tenant's event loop) all along."""
    import time

    from service.core import strictjson

    for text in ('"' + '\\"' * 40_000 + "{" * 100_001, "{" * 10 + '"a", ' * 30_000 + '\\"' * 40_000 + "[" * 100_001):
        t0 = time.monotonic()
        with pytest.raises((strictjson.InvalidJSON, json.JSONDecodeError)):
            strictjson.loads(text)
        assert time.monotonic() - t0 < 1.0

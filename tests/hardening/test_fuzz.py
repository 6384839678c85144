"""Property-based fuzzing of the whole OpenAPI schema with schemathesis, against the real app and a
real database (SQLite, and PostgreSQL when TEST_DATABASE_URL is set).

Every operation the schema lists gets a fixed, derandomized budget of generated requests: the
examples and coverage phases (boundary values, wrong types, NUL bytes, missing and extra fields),
then the fuzzing phase (positive and negative data). Each request carries a valid key of project
'alpha' so that it reaches the handlers; a quarter of them is also sent without a key or with a
wrong one. To get past the lookups, half of the ids in paths are real ones and half of the valid
bodies get what the schema cannot express (a JSONL file, an existing model, a grader that parses);
a fifth of the cases get a NUL in a path or query parameter. The properties: no response is a 5xx,
every 4xx is in OpenAI's error shape, and a 2xx conforms to the schema where schemathesis can
check it (its ``{}`` bodies say little; pages are checked here). Every choice is a hash of the
generated case, so a run is the same every time.

Jobs go to a per-test queue that no worker consumes (the ``env`` fixture), so no fuzzed job trains.
"""

from __future__ import annotations

import json
import os
import zlib
from collections import Counter
from collections.abc import Mapping
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from service.api import route_scopes as scopes
from service.api.openapi import INFERENCE
from tests.helpers.api import ERROR_TYPES, assert_error, create_job, each, make_key, upload_ok
from tests.helpers.data import JOB_JSON, TRAIN_JSONL, job_body

# The fuzzing phase's budget per operation (the examples and coverage phases add a fixed set of
# cases derived from the schema, about 2000 requests in all). Small enough that the file runs in
# well under a minute per database on 2 cores; RLOO_FUZZ_EXAMPLES=300 makes a longer hunt.
MAX_EXAMPLES = int(os.environ.get("RLOO_FUZZ_EXAMPLES", "50"))

WRONG_KEY = "Bearer rloo-fuzz-not-a-real-key"

STREAM_CUT = 3.0
"""Seconds after which a request of an operation that may answer an event stream is cut, keeping the
events sent so far (schemathesis' way with a stream; its default, 10 s, was most of this file's time):
a stream on the fuzz's job never ends by itself, as no worker takes the job. Every other answer of
these operations comes in well under a second."""


def _openapi() -> dict[str, Any]:
    """The app's schema, built at collection without a database (create_app reads settings and
    connects nowhere); the settings it cached are dropped, so no later test sees them."""
    from service.core.settings import get_settings
    from service.main import create_app

    try:
        return create_app().openapi()
    finally:
        get_settings.cache_clear()


CONFIG = schemathesis.Config.from_dict(
    {
        # Fixed, so schemathesis' own choices are reproducible too (hypothesis' are, by derandomize).
        "seed": 20240601,
        "checks": {
            # Schema-valid is not valid here: a grader is a free-form object, a model must exist under
            # the models root, a file id must name an uploaded file. Those are rightly refused with 400.
            "positive_data_acceptance": {"enabled": False},
            # A body over the JSON limit (8 MiB) is refused with 413 before it is parsed, which is a
            # rejection too (schemathesis' default list lacks 413).
            "negative_data_rejection": {
                "expected-statuses": ["400", "401", "404", "405", "409", "413"],
            },
        },
    }
)

schema = schemathesis.openapi.from_dict(_openapi(), config=CONFIG)

STATS: Counter[str] = Counter()


@pytest.fixture
def app(env: dict[str, str], monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """conftest's app, with the per-key rate limit off: the fuzzer sends hundreds of requests a second
    with one key, and a 429 would stop them short of the handlers."""
    from service.core.settings import get_settings
    from service.main import create_app

    monkeypatch.setenv("RLOO_RATE_LIMIT", "0")
    monkeypatch.setenv("RLOO_MAX_QUEUED_JOBS", "100000")  # the fuzzer creates hundreds of jobs
    get_settings.cache_clear()
    yield create_app()
    # schemathesis starts an app's lifespan on its first request and keeps it for the process.
    from schemathesis.python.asgi import shutdown_lifespans

    shutdown_lifespans()


@pytest.fixture
def operator_auth(env: dict[str, str]) -> dict[str, str]:
    """An operator's key of the auth fixture's project (alpha), for the operator's routes."""
    return {"Authorization": f"Bearer {make_key('alpha', operator=True)}"}


@pytest.fixture
def fuzz_ids(client, auth: dict[str, str], dry_runs: dict[str, str]) -> dict[str, list[str]]:
    """Real ids for the fuzzer to hit: a file used by a queued job (no worker takes it; deleting the
    file is a 409), a spare file (deleted by the first DELETE that picks it), the job."""
    used = upload_ok(client, auth)
    spare = upload_ok(client, auth, TRAIN_JSONL, filename="spare.jsonl")
    job = create_job(client, auth, job_body(used["id"]))
    return {"file_id": [used["id"], spare["id"]], "job_id": [job["id"]]}


def _stable(value: Any) -> str:
    """The case's data as text that is the same in every run (a repr would hold ``<NotSet object at
    0x7f…>``, an address, for an absent body)."""

    def default(o: Any) -> Any:
        if isinstance(o, bytes):
            return o.hex()
        return dict(o) if isinstance(o, Mapping) else type(o).__name__  # headers: a CaseInsensitiveDict

    return json.dumps(value, sort_keys=True, default=default)


def _bucket(text: str, n: int) -> int:
    """A stable hash of ``text`` mod ``n``: the same case always makes the same choice (shrinking
    replays cases, so the choice must not depend on the order they come in)."""
    return zlib.crc32(text.encode("utf-8", "surrogatepass")) % n


# Rule graders (their dry runs go to the session's graders worker, ``dry_runs``): a schema-valid but
# random grader object is refused at parse time, so half of the valid cases get one of these, and the
# fuzzed rest of the body reaches the grading code (templates over a fuzzed item, the text metrics
# over fuzzed text).
RULE_GRADERS = [
    {
        "type": "string_check",
        "name": f"check_{op}",
        "input": "{{ sample.output_text }}",
        "reference": "{{ item.answer }}",
        "operation": op,
    }
    for op in ("eq", "ne", "like", "ilike")
] + [
    {
        "type": "text_similarity",
        "name": f"sim_{metric}",
        "input": "{{ sample.output_text }}",
        "reference": "{{ item.reference_answer }}",
        "evaluation_metric": metric,
    }
    for metric in ("fuzzy_match", "bleu", "gleu", "meteor", "rouge_1", "rouge_l")
]


def deepen(case: Any, ids: dict[str, list[str]], choice: int) -> None:
    """Make a schema-valid case valid for the API too where the schema cannot say what that takes
    (a JSONL upload, an existing model and file, a grader that parses), keeping everything else fuzzed.
    Negative cases are left as generated."""
    meta = case.meta
    if meta is None or meta.generation.mode.is_negative or not isinstance(case.body, dict):
        return
    body = dict(case.body)
    route = (case.method.upper(), case.path)
    if route == ("POST", "/v1/files"):
        # As text: schemathesis re-validates an edited body, and bytes are no JSON string to it.
        body.update(file=TRAIN_JSONL.decode(), purpose="fine-tune")  # the Idempotency-Key header stays fuzzed
    elif route == ("POST", "/v1/fine_tuning/jobs") and isinstance(body.get("method"), dict):
        kind = body["method"].get("type")
        if kind not in ("reinforcement", "rloo"):
            return
        config = body["method"].get(kind)
        grader = JOB_JSON["method"]["reinforcement"]["grader"]
        config = {**(config if isinstance(config, dict) else {}), "grader": grader}
        if isinstance(config.get("hyperparameters"), dict):
            # Its rule (1 to 4 strings of 1 to 256 characters) is not in the schema: most fuzzed lists break it.
            config["hyperparameters"] = {k: v for k, v in config["hyperparameters"].items() if k != "stop"}
        body.update(model="tiny-policy", training_file=ids["file_id"][0], method={"type": kind, kind: config})
    elif route in (("POST", "/v1/fine_tuning/alpha/graders/run"), ("POST", "/v1/fine_tuning/alpha/graders/validate")):
        body["grader"] = RULE_GRADERS[choice % len(RULE_GRADERS)]
    else:
        return
    case.body = body


def add_nul(case: Any, choice: int) -> None:
    """Put a NUL into one string of the URL (a path or query parameter): PostgreSQL refuses NUL in
    text, and schemathesis almost never generates one there (2 in 300 query strings, none in paths)."""
    targets = [
        (container, name, encoded)
        for container, encoded in ((case.path_parameters, True), (case.query, False))
        if container
        for name, value in container.items()
        if isinstance(value, str)
    ]
    if targets:
        container, name, encoded = targets[choice % len(targets)]
        value = container[name]
        # Path parameters are kept percent-encoded by schemathesis; query values are encoded on sending.
        half = len(value) // 2
        changed = {**container, name: value[:half] + ("%00" if encoded else "\x00") + value[half:]}
        if encoded:
            case.path_parameters = changed
        else:
            case.query = changed


def may_stream(case: Any) -> bool:
    """Whether the case's operation may answer an event stream (its 200 lists text/event-stream)."""
    ok = case.operation.definition.raw.get("responses", {}).get("200", {})
    return "text/event-stream" in ok.get("content", {})


def header(response: Any, name: str) -> str:
    """A header of schemathesis' Response (its headers map lower-case names to lists of values)."""
    values = response.headers.get(name.lower()) or [""]
    return str(values[0])


def is_json(response: Any) -> bool:
    return header(response, "content-type").split(";")[0].strip() == "application/json"  # not .../jsonl


def assert_error_shape(response: Any, where: str) -> None:
    """OpenAI's error body: {"error": {"message": non-empty str, "type": str, "param": str|null, "code": str|null}}."""
    status = response.status_code
    what = f"{where} -> {status}: {response.text[:600]!r}"
    assert is_json(response), f"content-type {header(response, 'content-type')!r}; {what}"
    body = response.json()
    assert isinstance(body, dict) and set(body) == {"error"}, what
    err = body["error"]
    assert isinstance(err, dict) and set(err) == {"message", "type", "param", "code"}, what
    assert isinstance(err["message"], str) and err["message"].strip(), what
    assert isinstance(err["type"], str) and err["type"] == ERROR_TYPES.get(status, err["type"]), what
    assert err["param"] is None or isinstance(err["param"], str), what
    assert err["code"] is None or isinstance(err["code"], str), what


def check_response(response: Any, where: str, label: str) -> None:
    STATS["requests"] += 1
    STATS[f"status {response.status_code}"] += 1
    STATS[f"{label} -> {response.status_code}"] += 1
    assert response.status_code < 500, f"server error: {where} -> {response.status_code}: {response.text[:800]!r}"
    if 400 <= response.status_code < 500:
        assert_error_shape(response, where)
    elif is_json(response):
        # The schema's 2xx bodies are free-form ({}), so schemathesis checks little more than that they
        # parse; a page is checked here.
        body = response.json()
        if isinstance(body, dict) and body.get("object") == "list":
            assert isinstance(body.get("data"), list) and isinstance(body.get("has_more"), bool), where


@schema.parametrize()
@settings(
    max_examples=MAX_EXAMPLES,
    derandomize=True,
    database=None,  # no example database (.hypothesis/ gets only hypothesis' caches, which it git-ignores)
    deadline=None,  # a request's time depends on the machine, not on the input
    # The fixtures are set up once for all the examples of one operation, on purpose (one database).
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.filter_too_much],
)
def test_fuzz_operation(case, app, auth, operator_auth, fuzz_ids) -> None:  # type: ignore[no-untyped-def]
    # The coverage phase's cases are the same objects in the sqlite and the postgresql run: the edits
    # below assign new containers, and the generated ones are put back after.
    generated = (case.path_parameters, case.query, case.body)
    try:
        fuzz_one(case, app, auth, operator_auth, fuzz_ids)
    finally:
        case.path_parameters, case.query, case.body = generated


def fuzz_one(
    case: Any, app: Any, auth: dict[str, str], operator_auth: dict[str, str], fuzz_ids: dict[str, list[str]]
) -> None:
    fingerprint = _stable([case.method, case.path_parameters, case.query, case.headers, case.body])
    # Half of the cases with an id in the path get a real one, so the fuzzer reaches the code after the lookup.
    for name, ids in fuzz_ids.items():
        if case.path_parameters and name in case.path_parameters and _bucket(fingerprint, 2):
            case.path_parameters = {**case.path_parameters, name: ids[_bucket(fingerprint, 3) % len(ids)]}
    if _bucket(fingerprint, 2):
        deepen(case, fuzz_ids, _bucket(fingerprint, 997))
    if _bucket(fingerprint, 5) == 1:
        add_nul(case, _bucket(fingerprint, 991))
    where, label = f"{case.method} {case.formatted_path}", f"{case.method} {case.path}"
    if scopes.needed(case.method, case.path) == (case.path, scopes.OPERATOR):
        auth = operator_auth  # the operator's routes: so that it reaches their handlers
    # A new dict each call: schemathesis adds its own headers to the one it is given.
    cut = {"timeout": STREAM_CUT} if may_stream(case) else {}
    response = case.call(headers=dict(auth), app=app, **cut)
    check_response(response, where, label)
    # schemathesis' own checks: not a 5xx, content type, 2xx bodies against their schemas, negative
    # data rejected, 405 for an unsupported method (with an Allow header), and so on.
    case.validate_response(response, headers=dict(auth), transport_kwargs={"app": app, "headers": dict(auth), **cut})

    if case.path.startswith("/v1/") and _bucket(fingerprint, 4) == 0:
        # The same request without a key, or with a wrong one: a 401 in the error shape, whatever it holds.
        no_key = _bucket(fingerprint, 8) == 0
        headers = {} if no_key else {"Authorization": WRONG_KEY}
        response = case.call(headers=headers, app=app, **cut)
        check_response(response, f"{where} ({'no key' if no_key else 'wrong key'})", label)
        assert response.status_code == 401, f"{where} without a valid key -> {response.status_code}"
        assert response.json()["error"]["code"] == ("missing_api_key" if no_key else "invalid_api_key")


@pytest.fixture(scope="module", autouse=True)
def _report_counts():  # type: ignore[no-untyped-def]
    yield
    # Seen with `pytest -s`: how many requests the fuzzing made, by status (and by operation).
    totals = {k: v for k, v in STATS.items() if " -> " not in k}
    print(f"\ntest_fuzz: {dict(sorted(totals.items()))}")
    if os.environ.get("RLOO_FUZZ_STATS"):
        print("\n".join(f"  {k}: {v}" for k, v in sorted(STATS.items()) if " -> " in k))


# Regressions: what the fuzzing found, pinned as plain tests (both backends) ---------------------------
def test_405_allow_header_lists_every_method_of_the_path(client, auth: dict[str, str]) -> None:
    """Starlette's 405 named only the first route whose path matched: ``Allow: POST`` on /v1/files,
    which has GET too (found by schemathesis' unsupported-method check)."""
    file_id = upload_ok(client, auth)["id"]
    cases = [
        ("OPTIONS", "/v1/files", "GET, POST"),
        ("PUT", "/v1/files", "GET, POST"),
        ("PATCH", f"/v1/files/{file_id}", "GET, DELETE"),
        ("POST", f"/v1/files/{file_id}/content", "GET"),
        ("DELETE", "/v1/fine_tuning/jobs", "GET, POST"),
        ("GET", "/v1/fine_tuning/jobs/ftjob-x/cancel", "POST"),
        ("GET", "/v1/fine_tuning/alpha/graders/run", "POST"),
        ("POST", "/healthz", "GET"),
    ]

    def check(method: str, url: str, allow: str) -> None:
        resp = client.request(method, url, headers=auth)
        assert_error(resp, 405, param=None)
        assert resp.headers.get("allow") == allow, (method, url, resp.headers.get("allow"))

    each(cases, check)


def test_nul_in_a_path_or_query_parameter_is_a_400(client, auth: dict[str, str]) -> None:
    """A NUL (%00) in an id, a cursor or a filter reached the database: PostgreSQL refuses NUL in text
    (a 500), SQLite matched nothing (a 404, or an empty list). Now a 400 naming the parameter, on both."""
    file_id = upload_ok(client, auth)["id"]
    job_id = create_job(client, auth, job_body(file_id))["id"]
    cases = [
        ("GET", "/v1/files/file-%00abc", "file_id"),
        ("DELETE", "/v1/files/a%00b", "file_id"),
        ("GET", "/v1/files/a%00b/content", "file_id"),
        ("GET", "/v1/files?after=file-%00x", "after"),
        ("GET", "/v1/files?purpose=fine%00tune", "purpose"),
        ("GET", "/v1/files?x%00=1", "x"),  # even in the name of a parameter the API does not read
        ("GET", "/v1/fine_tuning/jobs/ftjob-%00", "job_id"),
        ("GET", "/v1/fine_tuning/jobs?after=%00", "after"),
        ("POST", "/v1/fine_tuning/jobs/x%00/cancel", "job_id"),
        ("POST", "/v1/fine_tuning/jobs/x%00/pause", "job_id"),
        ("POST", "/v1/fine_tuning/jobs/x%00/resume", "job_id"),
        ("GET", f"/v1/fine_tuning/jobs/{job_id}/events?after=%00", "after"),
        ("GET", f"/v1/fine_tuning/jobs/{job_id}/checkpoints?after=ck%00", "after"),
        ("GET", f"/v1/fine_tuning/jobs/{job_id}/checkpoints/ck%00/content", "checkpoint_id"),
        ("GET", "/v1/fine_tuning/jobs/a%00/metrics", "job_id"),
    ]

    def check(method: str, url: str, param: str) -> None:
        assert_error(client.request(method, url, headers=auth), 400, param=param, code="invalid_value")

    each(cases, check)
    # The same URLs without the NUL are answered as before (the check is on the NUL, not the parameter).
    assert client.get(f"/v1/files?purpose=fine-tune&after={file_id}", headers=auth).status_code == 200
    assert client.get(f"/v1/fine_tuning/jobs/{job_id}", headers=auth).status_code == 200


def test_nul_in_a_job_text_field_is_a_400(client, auth: dict[str, str]) -> None:
    """model, training_file, validation_file and suffix are text columns (and lookups): a NUL in one
    was a 500 on PostgreSQL. Now a 400 naming the field, anywhere in the body (service.core.strictjson)."""
    file_id = upload_ok(client, auth)["id"]
    cases = {
        "suffix": job_body(file_id, suffix="a\x00b"),
        "training_file": job_body("file-\x00"),
        "validation_file": job_body(file_id, validation_file=f"{file_id}\x00"),
        "model": job_body(file_id, model="tiny\x00policy"),
    }

    def check(param: str) -> None:
        resp = client.post("/v1/fine_tuning/jobs", headers=auth, json=cases[param])
        assert_error(resp, 400, param=param, code="invalid_value", contains="NUL")

    each(list(cases), check)
    resp = client.post("/v1/fine_tuning/jobs", headers=auth, json=job_body(file_id, metadata={"note": "a\x00b"}))
    assert_error(resp, 400, param="metadata.note", code="invalid_value", contains="NUL")


def test_nul_in_an_upload_filename_is_replaced(client, auth: dict[str, str]) -> None:
    """A multipart filename with a NUL went into files.filename: a 500 on PostgreSQL. It is now
    cleaned like a path separator is."""
    boundary = "rloo-fuzz-boundary"
    body = (
        (
            f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nfine-tune\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="a\x00b/c.jsonl"\r\n'
            "Content-Type: application/jsonl\r\n\r\n"
        ).encode()
        + TRAIN_JSONL
        + f"\r\n--{boundary}--\r\n".encode()
    )
    headers = {**auth, "Content-Type": f"multipart/form-data; boundary={boundary}"}
    resp = client.post("/v1/files", headers=headers, content=body)
    assert resp.status_code == 200, resp.text
    assert resp.json()["filename"] == "a_b_c.jsonl"
    assert client.get(f"/v1/files/{resp.json()['id']}", headers=auth).json()["filename"] == "a_b_c.jsonl"


def test_the_schema_documents_the_errors_the_api_answers(client) -> None:
    """/openapi.json says what the API does: no FastAPI 422 anywhere (validation errors are 400s),
    and every /v1 operation lists its errors in the one error shape (schemathesis' status-code
    check above holds the API to it)."""
    doc = client.get("/openapi.json").json()
    assert "HTTPValidationError" not in doc["components"]["schemas"]
    error_ref = {"$ref": "#/components/schemas/Error"}
    for path, item in doc["paths"].items():
        for method, op in item.items():
            assert "422" not in op["responses"], (method, path)
            if not path.startswith("/v1/"):
                continue
            for status in ("400", "401", "403", "429", "503"):
                assert op["responses"][status]["content"]["application/json"]["schema"] == error_ref
            assert ("404" in op["responses"]) == (
                "{" in path or any(p["name"] == "after" for p in op.get("parameters", [])) or path in INFERENCE
            ), (method, path)  # a completion's 404: its model
    job_ops = doc["paths"]["/v1/fine_tuning/jobs/{job_id}/cancel"]["post"]["responses"]
    assert {"404", "409", "413"} <= set(job_ops)
    assert {"502", "504"} <= set(doc["paths"]["/v1/fine_tuning/alpha/graders/run"]["post"]["responses"])

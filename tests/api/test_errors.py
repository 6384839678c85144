"""The domain's one family of errors and the one place it becomes HTTP: every kind has its status,
a kind of a kind answers as its ancestor, retry hints become Retry-After, and a domain error raised
under a route is answered in OpenAI's shape (never a 500)."""

from __future__ import annotations

import inspect

import pytest

from service.api import errors as http
from service.core import errors
from service.core.errors import DomainError
from service.graders import GraderError
from worker.engine.errors import JobError
from worker.engine.standalone import SpecError

KINDS = [
    cls
    for _, cls in inspect.getmembers(errors, inspect.isclass)
    if issubclass(cls, DomainError) and cls is not DomainError and cls.__module__ == errors.__name__
]


def test_every_kind_of_domain_error_has_its_own_status() -> None:
    assert len(KINDS) >= 10  # the scan finds them
    missing = [k.__name__ for k in KINDS if k not in http.STATUS]
    assert missing == []
    statuses = [http.STATUS[k] for k in KINDS]
    assert len(set(statuses)) == len(statuses)  # two kinds never mean the same answer


@pytest.mark.parametrize(
    ("error", "status", "code"),
    [
        (errors.bad_request("bad", "x"), 400, "invalid_value"),
        (errors.not_found("file", "file-1"), 404, "not_found"),
        (errors.model_not_found("m"), 404, "model_not_found"),
        (errors.operator_only("GET /v1/workers"), 403, "insufficient_permissions"),
        (errors.Conflict("finished"), 409, "invalid_state"),
        (GraderError("no such operation", param="method.reinforcement.grader.operation"), 400, None),
        (SpecError("spec.json: bad"), 400, "invalid_value"),
        (http.APIError(418, "a teapot", code="teapot"), 418, "teapot"),
    ],
)
def test_a_kind_answers_as_its_nearest_listed_ancestor(error: DomainError, status: int, code: str | None) -> None:
    assert http.status_of(error) == status
    assert error.code == code
    response = http.answer(error)
    assert response.status_code == status
    body = response.body.decode()
    assert error.message.replace('"', '\\"') in body and '"type":' in body


def test_a_retry_hint_becomes_retry_after_and_an_api_errors_headers_stay() -> None:
    assert http.headers_of(errors.no_inference_worker("A merge")) == {"Retry-After": "5"}
    assert http.headers_of(errors.LimitReached("busy", retry_after=0.5)) == {"Retry-After": "1"}  # whole seconds
    assert http.headers_of(errors.bad_request("bad")) is None
    auth = http.APIError(401, "no key", headers={"WWW-Authenticate": "Bearer"})
    assert http.headers_of(auth) == {"WWW-Authenticate": "Bearer"}


def test_a_jobs_failure_is_of_the_same_family_with_its_code() -> None:
    failure = JobError("model_load_failed", "could not load model 'x'")
    assert isinstance(failure, DomainError)
    assert (failure.code, failure.message, str(failure)) == (
        "model_load_failed",
        "could not load model 'x'",
        failure.message,
    )


def test_a_domain_error_under_a_route_is_openais_shape_not_a_500(client, auth) -> None:
    """An unknown job id: the route raises ``NotFound`` and the app's one handler answers it."""
    r = client.get("/v1/fine_tuning/jobs/ftjob-nope", headers=auth)
    assert r.status_code == 404
    assert r.json()["error"] == {
        "message": "No fine-tuning job with id 'ftjob-nope' in this project.",
        "type": "invalid_request_error",
        "param": None,
        "code": "not_found",
    }


def test_the_inference_bus_reads_a_workers_status_as_the_kind_the_api_answers_with_it() -> None:
    """A worker's error answer (a merge that raised, a worker that died) reaches the user with the
    status the worker gave: each wire status's kind maps back to that status."""
    from service.infra import inference_bus

    assert {status: http.STATUS[kind] for status, kind in inference_bus.WIRE_KINDS.items()} == {
        status: status for status in inference_bus.WIRE_KINDS
    }
    unsupported = inference_bus.error_of(inference_bus.error_message(400, "unsupported", "not served here"))
    assert isinstance(unsupported, errors.Invalid) and http.status_of(unsupported) == 400
    assert http.status_of(inference_bus.error_of(inference_bus.lost_message())) == 503
    assert http.status_of(inference_bus.error_of(inference_bus.error_message(500, "export_failed", "x"))) == 500

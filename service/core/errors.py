"""The one family of errors the domain code raises: ``DomainError(message, param=, code=)`` and its
kinds, each saying what went wrong in a user's terms (the request is invalid, the thing is not
there, its state forbids the change, a limit is reached, a part it needs is down), the field at
fault as a dotted ``param`` and a stable ``code``.

No HTTP here: ``service.api.errors`` is the one place that maps each kind to a status and answers it
in OpenAI's shape. So ``rloo train`` checks a spec with the API's code and messages without loading
FastAPI, and a worker's job fails with the same family (``worker.engine.errors.JobError``)."""

from __future__ import annotations

from typing import ClassVar


class DomainError(Exception):
    """A mistake or a state a user can act on; the message says what to change.

    ``retry_after``: seconds after which the same request may succeed (a limit, a part that is
    down), or None when only a change will."""

    default_code: ClassVar[str | None] = None

    def __init__(
        self, message: str, *, param: str | None = None, code: str | None = None, retry_after: float | None = None
    ) -> None:
        super().__init__(message)
        self.message, self.param = message, param
        self.code = code if code is not None else self.default_code
        self.retry_after = retry_after


class Invalid(DomainError):
    """The request is wrong: a value, a file's content, a combination. Change it and send it again."""

    default_code: ClassVar[str | None] = "invalid_value"


class Unauthenticated(DomainError):
    """No key, or one that is not (or no longer) valid."""

    default_code = "invalid_api_key"


class Forbidden(DomainError):
    """A valid key that may not do this (an operator's route, say)."""

    default_code = "insufficient_permissions"


class NotFound(DomainError):
    """No such thing in this project (another project's is as good as none)."""

    default_code = "not_found"


class Conflict(DomainError):
    """The thing's state forbids the change now (a finished job cancelled, a key reused)."""

    default_code = "invalid_state"


class Gone(DomainError):
    """It existed, and its content is gone (a checkpoint pruned, a file's bytes lost)."""

    default_code = "gone"


class TooLarge(DomainError):
    """More than a limit allows in one request."""

    default_code = "too_large"


class LimitReached(DomainError):
    """A project's or a key's limit is reached; wait, or finish something first."""

    default_code = "rate_limit_exceeded"


class Failed(DomainError):
    """The service failed doing it (a merge on an inference worker raised): not the user's mistake."""

    default_code = "internal_error"


class UpstreamFailed(DomainError):
    """A part the user chose failed (their grader's endpoint, their reward model)."""

    default_code = "upstream_failed"


class Unavailable(DomainError):
    """A part it needs is down or busy (Redis, the inference workers); retry."""

    default_code = "unavailable"


class TimedOut(DomainError):
    """It took longer than the deadline it had."""

    default_code = "timeout"


def bad_request(message: str, param: str | None = None, code: str | None = "invalid_value") -> Invalid:
    return Invalid(message, param=param, code=code)


def not_found(what: str, id_: str, param: str | None = None) -> NotFound:
    return NotFound(f"No {what} with id '{id_}' in this project.", param=param)


def model_not_found(model_id: str) -> NotFound:
    """OpenAI's 404 for a model: unknown, another project's, or deleted."""
    return NotFound(
        f"The model '{model_id}' does not exist or you do not have access to it (GET /v1/models lists yours).",
        param="model",
        code="model_not_found",
    )


def operator_only(what: str) -> Forbidden:
    """For a project's key on an operator's route (``deps.OperatorDep``)."""
    return Forbidden(
        f"{what} is the operator's, over every project: ask with an operator key "
        "(`rloo keys create --project NAME --operator`)."
    )


def no_inference_worker(needed_for: str) -> Unavailable:
    """Work for an inference worker finds none running: what it was needed for, how to start one."""
    return Unavailable(
        f"{needed_for}: start one with `rloo worker --serve` (`rloo up` starts one).",
        code="no_inference_worker",
        retry_after=5,
    )


def queue_unreachable(exc: BaseException) -> Unavailable:
    """Redis (the queue, the inference bus) did not answer."""
    return Unavailable(
        f"The queue (Redis) is unreachable ({type(exc).__name__}); retry in a few seconds.",
        code="queue_unavailable",
        retry_after=2,
    )


def insufficient_scope(route: str, needed: tuple[str, ...]) -> Forbidden:
    """For a key that lacks the scope a route needs (``service.api.route_scopes``)."""
    which = " or ".join(f"'{s}'" for s in needed)
    return Forbidden(
        f"This API key lacks the scope {which} that {route} needs: ask your project's admin for a key "
        f"with it (`rloo keys create --scope {needed[0]}`, or POST /v1/keys).",
        code="insufficient_scope",
    )

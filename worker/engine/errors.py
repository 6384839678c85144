"""How a run fails: ``JobError``, the service's ``DomainError`` with the code a user reads on the job
(``error.code``: ``invalid_grader``, ``model_load_failed``, ``resume_failed``...) and a message that
says what to change. Anything else a run raises is the service's fault (``internal_error``)."""

from __future__ import annotations

from service.core.errors import DomainError


class JobError(DomainError):
    """A failure with a code users can act on (``error.code`` on the job)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message, code=code)
        self.code: str = code

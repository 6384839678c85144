"""What goes wrong with tools: a spec a job cannot use (``ToolSpecError``: a 400 naming the field),
and a call that fails (``ToolFailed``: the model reads the message, the rollout goes on)."""

from __future__ import annotations

from service.core.errors import Invalid


class ToolSpecError(Invalid):
    """A job's ``tools`` or ``multi_turn`` that cannot be used; ``param`` names the field."""


class ToolFailed(Exception):
    """A call that gave no result: the text says why, and the model reads it as the tool's error.
    ``kind`` is what the metrics count it as: ``error``, ``timeout`` or ``malformed``."""

    def __init__(self, message: str, *, kind: str = "error") -> None:
        super().__init__(message)
        self.message, self.kind = message, kind

"""The request bodies of ``/v1/webhook_endpoints``: create, update, rotate a secret, send a test event."""

from __future__ import annotations

from pydantic import Field

from service.core.validation import Strict


class WebhookCreate(Strict):
    """OpenAI's ``POST /webhook_endpoints``."""

    name: str = Field(min_length=1, max_length=200)
    url: str = Field(min_length=1, max_length=2048)
    event_types: list[str] = Field(min_length=1, max_length=16)


class WebhookUpdate(Strict):
    name: str | None = Field(None, min_length=1, max_length=200)
    url: str | None = Field(None, min_length=1, max_length=2048)
    event_types: list[str] | None = Field(None, min_length=1, max_length=16)


class WebhookRotate(Strict):
    keep_old_secret_active_for_24_hours: bool = False


class WebhookTest(Strict):
    event_type: str = "fine_tuning.job.succeeded"

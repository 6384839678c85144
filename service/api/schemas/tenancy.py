"""The request bodies of ``/v1/keys`` and the operator's ``/v1/projects``."""

from __future__ import annotations

from pydantic import Field

from service.core.validation import Strict


class KeyCreate(Strict):
    """A new key of the project: a name, its scopes (all of them where left out; only ones the
    creating key holds), an expiry in seconds (``expires_in``: never where left out) and ``tinker``
    for a key the tinker SDK accepts (it starts with ``tml-``)."""

    name: str = Field("", max_length=200)
    scopes: list[str] | None = Field(None, max_length=32)
    expires_in: int | None = Field(None, strict=True, description="Seconds the key lives (none: for ever).")
    tinker: bool = False


class ProjectCreate(Strict):
    name: str = Field(min_length=1, max_length=200)
    quotas: dict[str, float | None] | None = Field(None, max_length=16, description="service.tenancy.quotas.QUOTAS")


class ProjectUpdate(Strict):
    """The operator's change to a project: its quotas (a number each; null unsets one)."""

    quotas: dict[str, float | None] = Field(max_length=16, description="service.tenancy.quotas.QUOTAS")
